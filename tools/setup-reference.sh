#!/usr/bin/env bash
# Install the Python reference recorder (python/, `candle-trace-ref`) and its pinned
# dependencies (python/requirements.txt: torch, transformers, gguf, sentence-transformers) into
# .venv-ref/ at the repository root, where the tests look for it. Idempotent: a venv that
# already imports every pinned version is left alone. Needs python3 with venv and pip, and
# PyPI (torch and its dependencies are about 6 GB on disk; --no-cache-dir keeps pip from
# holding a second copy of the wheels in its cache).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv-ref"
# .venv-ref may be a link into the build cache (tools/ci-cache.sh): the venv is made and named
# by its real path, so its scripts keep working from any checkout that links to it.
[ -d "$venv" ] && venv="$(cd "$venv" && pwd -P)"
py="$venv/bin/python"
check() {
  "$py" - "$root/python/requirements.txt" "$root" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if not line:
        continue
    name, want = line.split("==")
    if version(name).split("+")[0] != want:
        sys.exit(1)
import os, candle_trace_ref  # installed from this checkout, not from another that shares the venv
want = os.path.realpath(os.path.join(sys.argv[2], "python", "candle_trace_ref"))
sys.exit(os.path.dirname(os.path.realpath(candle_trace_ref.__file__)) != want)
PY
}
if [ -x "$py" ] && check; then
  echo "ok: $venv (reference recorder and pinned dependencies present)"
  exit 0
fi
[ -x "$py" ] || python3 -m venv "$venv"
"$py" -m pip install --quiet --no-cache-dir --disable-pip-version-check -r "$root/python/requirements.txt"
"$py" -m pip install --quiet --no-cache-dir --disable-pip-version-check --no-deps -e "$root/python"
check || { echo "error: $venv: the pinned packages did not install" >&2; exit 2; }
echo "ok: $venv"
