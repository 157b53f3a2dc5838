#!/usr/bin/env bash
# Links this checkout's build and download folders to keyed folders of a cache kept outside it,
# so that a fresh clone on a machine where an earlier run built and downloaded them reuses them
# (`.ci/run` calls it first). The cache is `$CANDLE_TRACE_CACHE`, by default
# `$HOME/.cache/candle-trace/`. Each folder is keyed by a hash of what decides its contents, so a
# stale one is never used; a changed input makes a new key, which starts empty:
#
#   link in the checkout   cache folder          keyed by
#   target/release         target-KEY/release    Cargo.lock, `rustc -vV`, `cargo -V`
#   target/doc             target-KEY/doc        (the same key)
#   target/candle-repro    target-KEY/candle-repro  (the same key: tools/check-candle-repro.sh's builds)
#   target/cuda            cuda-KEY              Cargo.lock, `rustc -vV`, `cargo -V`, tools/setup-cuda.sh (the nvcc pins)
#   models                 models-KEY            tools/fetch-models.sh (the files' pins and sha256)
#   .venv-ref              venv-ref-KEY          python/requirements.txt, `python3 --version`
#   .venv-cuda             venv-cuda-KEY         tools/setup-cuda.sh, `python3 --version`
#   target/tmp/reference   reference-KEY         as .venv-ref (the reference recorder's runs, each
#                                                also keyed by its inputs: tests/reference.rs)
#
# Only the registry crates' artifacts are reused from the cargo folders: a fresh clone's sources
# are newer than any cached output, so cargo rebuilds the workspace crates (and our CUDA kernel,
# by its build script's rerun-if-changed); candle's kernels are decided by Cargo.lock. The rest of
# target/tmp (the tests' fixture cache, recordings of this build's `trace`) stays in the checkout.
#
# Pruning keeps the disk bounded: for each kind, the two keys used last are kept and older ones
# removed; a cargo folder over $CANDLE_TRACE_CACHE_MAX_GB (default 30) is emptied before use. A
# machine with no cache passes as well: the first run fills it.
#
# Usage: tools/ci-cache.sh            link (creating empty keyed folders where missing), prune
#        tools/ci-cache.sh --keys     print each kind's key and exit
# A link's place already holding a real folder is left alone (said on stderr): the checkout's
# own build is never thrown away.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${CANDLE_TRACE_CACHE:-${HOME:-/tmp}/.cache/candle-trace}"
max_gb="${CANDLE_TRACE_CACHE_MAX_GB:-30}"

# key FILE_OR_TEXT...: the first 16 hex digits of the sha256 of the arguments (files by content,
# other arguments as text).
key() {
  local a
  for a in "$@"; do
    if [ -f "$root/$a" ]; then
      printf '%s\n' "$a"
      cat "$root/$a"
    else
      printf '%s\n' "$a"
    fi
  done | sha256sum | cut -c1-16
}
toolchain="$(rustc -vV; cargo -V)"
python="$(python3 --version 2>&1)"
k_target="$(key Cargo.lock "$toolchain")"
k_cuda="$(key Cargo.lock "$toolchain" tools/setup-cuda.sh)"
k_models="$(key tools/fetch-models.sh)"
k_ref="$(key python/requirements.txt "$python")"
k_vcuda="$(key tools/setup-cuda.sh "$python")"

if [ "${1:-}" = "--keys" ]; then
  printf 'target %s\ncuda %s\nmodels %s\nvenv-ref %s\nvenv-cuda %s\n' "$k_target" "$k_cuda" "$k_models" "$k_ref" "$k_vcuda"
  exit 0
fi
[ $# -eq 0 ] || { echo "error: tools/ci-cache.sh: unknown argument '$1' (none, or --keys)" >&2; exit 2; }
mkdir -p "$cache"

# use KIND KEY: creates the keyed folder, marks it used now, prunes the kind's other keys but
# the one used last before it; prints the folder.
use() {
  local kind="$1" k="$2" dir="$cache/$1-$2"
  mkdir -p "$dir"
  touch "$dir/.used"
  local old
  # Newest first by the .used stamp; keep this key and the one used last before it.
  ls -1dt "$cache/$kind"-*/.used 2>/dev/null | while IFS= read -r stamp; do
    old="$(dirname "$stamp")"
    [ "$old" = "$dir" ] && continue
    if [ -n "${kept:-}" ]; then
      echo "cache: removing $old (an older key of $kind)" >&2
      rm -rf "$old"
    fi
    kept=1
  done
  echo "$dir"
}

# bounded DIR: empties DIR when it holds more than max_gb.
bounded() {
  local kb
  kb="$(du -sk "$1" | cut -f1)"
  if [ "$kb" -gt $((max_gb * 1048576)) ]; then
    echo "cache: emptying $1 ($((kb / 1048576)) GiB, over $max_gb)" >&2
    find "$1" -mindepth 1 -maxdepth 1 ! -name .used -exec rm -rf {} +
  fi
}

# link PLACE DIR: PLACE (relative to the checkout) becomes a symlink to DIR.
link() {
  local place="$root/$1" dir="$2"
  if [ -L "$place" ]; then
    ln -sfn "$dir" "$place"
  elif [ -e "$place" ]; then
    echo "cache: $1 is a folder of this checkout; left alone, not cached" >&2
    return
  else
    mkdir -p "$(dirname "$place")"
    ln -s "$dir" "$place"
  fi
  echo "cache: $1 -> $dir" >&2
}

t="$(use target "$k_target")"
bounded "$t"
mkdir -p "$t/release" "$t/doc" "$t/candle-repro"
link target/release "$t/release"
link target/doc "$t/doc"
link target/candle-repro "$t/candle-repro"
c="$(use cuda "$k_cuda")"
bounded "$c"
link target/cuda "$c"
link models "$(use models "$k_models")"
link .venv-ref "$(use venv-ref "$k_ref")"
link target/tmp/reference "$(use reference "$k_ref")"
link .venv-cuda "$(use venv-cuda "$k_vcuda")"
