#!/usr/bin/env bash
# The candle-only repro end to end, on two pairs: the builtin model's whole prompt vs one-token
# prefill (root: a linear), and the README walkthrough's SmolLM2 pair, whole prompt vs prefill
# chunks of 18 (root: layers.17.self_attn.softmax; needs tools/fetch-models.sh). Each is recorded
# with a --dump covering its root, extracted with `--candle DIR`, and that Cargo project (candle
# alone, no candle-trace) is built and run: it must print "same bits as the recording", and that
# b's op on b's operands differs from a's at the first position whose digests differ.
# .ci/run runs this after the tests; a cold candle build takes a few minutes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cargo build --release -q
T=$PWD/target/release/trace
root=$PWD
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
check() { # name, dump pattern, then record arguments shared by both runs; b adds --prefill-chunk $CHUNK
  local name=$1 dump=$2; shift 2
  $T record "$@" --dump "$dump" -o "$d/$name-a.trace" > /dev/null
  $T record "$@" --prefill-chunk "$CHUNK" --dump "$dump" -o "$d/$name-b.trace" > /dev/null
  $T extract "$d/$name-a.trace" "$d/$name-b.trace" -o "$d/$name-repro.trace" --candle "$d/$name"
  # Its own target folder (a separate workspace), kept between runs beside this one's.
  local out
  out=$(cd "$d/$name" && CARGO_TARGET_DIR="$root/target/candle-repro" cargo run --release -q)
  echo "$out"
  grep -q "same bits as the recording" <<< "$out"
  # Both runs dumped the op: the program also runs b's op and finds the difference in candle alone.
  grep -Eq "a's and b's outputs differ in [1-9][0-9]* of" <<< "$out"
}
CHUNK=1 check builtin 'layers.0.*' --max-tokens 4
M=models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f "$M" ]; then
  CHUNK=18 check walkthrough layers.17.self_attn.softmax --model "$M" --chat --prompt "Tell me about Richard Feynman." --max-tokens 16
elif [ -n "${CI:-}" ]; then
  echo "check-candle-repro: $M is missing (run tools/fetch-models.sh)" >&2
  exit 1
else
  echo "check-candle-repro: SKIPPED the walkthrough pair: $M is missing"
fi
echo "check-candle-repro: ok"
