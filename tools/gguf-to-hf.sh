#!/usr/bin/env bash
# Make a Hugging Face llama folder (f32 safetensors, config.json, tokenizer.json) from a llama
# GGUF file, so the safetensors path of `trace record --model DIR` runs on real weights.
# Default: SmolLM2-135M-Instruct from tools/fetch-models.sh -> models/smollm2-hf/.
# Idempotent: does nothing when the folder already has model.safetensors.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
gguf="${1:-$root/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}"
out="${2:-$root/models/smollm2-hf}"
if [ -f "$out/model.safetensors" ] && [ -f "$out/tokenizer.json" ]; then
  echo "ok: $out"
  exit 0
fi
cd "$root"
cargo run --quiet --release --example gguf_to_hf -- "$gguf" "$out"
