#!/usr/bin/env bash
# Screenshots of `trace report` pages for docs/bug-reports.md, by headless Chromium at 1300 px:
# the README walkthrough pair (SmolLM2 Q4_1, whole prompt vs prefill chunks of 18) and a padded
# batch (the prompt alone vs between two other requests). Needs tools/fetch-models.sh first.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cargo build --release
T=./target/release/trace
M=models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
P="Tell me about Richard Feynman."
$T record --model $M --chat --prompt "$P" --max-tokens 16 -o "$d/whole.trace" > /dev/null
$T record --model $M --chat --prompt "$P" --max-tokens 16 --prefill-chunk 18 -o "$d/chunk18.trace" > /dev/null
$T record --model $M --chat --prompt "Hi!" --prompt "$P" --prompt "Write a short poem about the sea, the wind and the boats coming home at night." --max-tokens 16 -o "$d/batch.trace" > /dev/null
$T report "$d/whole.trace" "$d/chunk18.trace" -o "$d/walkthrough.html" || true
$T report "$d/whole.trace" "$d/batch.trace" -o "$d/padded.html" || true
mkdir -p docs/images
for n in walkthrough padded; do
  chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1300,2600 --screenshot="docs/images/report-$n.png" "file://$d/$n.html" 2> /dev/null
done
ls -l docs/images/report-*.png
