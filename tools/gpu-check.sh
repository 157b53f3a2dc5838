#!/usr/bin/env bash
# The GPU check (docs/gpu.md): on a machine with an NVIDIA GPU, build with --features cuda and
# show what the GPU does to the numbers. Writes its results as markdown to OUT (default
# gpu-check/results.md), traces beside it. Steps:
#   1. the device digest equals the host digest, bit for bit (unit test on the GPU);
#   2. per model (SmolLM2, Gemma 3): `trace check --device cuda` run to run, batch 1 vs 8 (and
#      2, 4), prefill whole vs chunked; CPU vs CUDA bisected (first op, class "device");
#   3. per model: traced/untraced whole-process time on the GPU (interleaved, median of 3).
# Exit 0 when every step ran (whatever the verdicts), 2 when there is no GPU or a step failed.
# Needs: nvidia-smi and the driver; nvcc on PATH or PyPI (tools/setup-cuda.sh installs it);
# the model files (tools/fetch-models.sh) or network to fetch them.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root/gpu-check/results.md}"
dir="$(dirname "$out")"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "gpu-check: no NVIDIA GPU on this machine (nvidia-smi is missing or lists no GPU); nothing to check" >&2
  exit 2
fi
cd "$root"
mkdir -p "$dir"
cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d ' .')"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-$cap}"
if ! command -v nvcc >/dev/null 2>&1; then
  tools/setup-cuda.sh
  # shellcheck disable=SC1091
  . .venv-cuda/env.sh
fi
export CARGO_TARGET_DIR="$root/target/cuda"
trace="$CARGO_TARGET_DIR/release/trace"
step() { echo "gpu-check: $*" >&2; }

step "building with --features cuda (compute capability $CUDA_COMPUTE_CAP)"
cargo build --release --features cuda
{
  echo "# GPU check"
  echo
  echo "- GPU: $(nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader | head -n 1)"
  echo "- nvcc: $(nvcc --version | grep release)"
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo
} > "$out"

step "device digest vs host digest"
if CANDLE_TRACE_GPU_CHECK=1 cargo test --release --features cuda -p candle-trace-run --lib digest::device > "$dir/digest-test.log" 2>&1; then
  echo "## Device digest: equal to the host digest (f32, f16, bf16, f64; token axes, causal, padded rows)" >> "$out"
else
  echo "## Device digest: DIFFERS from the host digest (see digest-test.log)" >> "$out"
  tail -n 20 "$dir/digest-test.log" >&2
  exit 2
fi

tools/fetch-models.sh >&2
models=("smollm2:models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "gemma3:models/gemma3/gemma-3-270m-q4_k_m.gguf")
for entry in "${models[@]}"; do
  name="${entry%%:*}" model="${entry#*:}"
  args=(--model "$model" --chat --prompt "Tell me about Richard Feynman." --max-tokens 16)
  step "$name: run to run, batch, prefill chunk on cuda"
  echo -e "\n## $name on CUDA: \`trace check --vary batch,prefill-chunk --runs 2\`\n" >> "$out"
  "$trace" check "${args[@]}" --device cuda --runs 2 --vary batch,prefill-chunk --out "$dir/$name-check" --format markdown --quiet >> "$out" || true
  step "$name: CPU vs CUDA"
  "$trace" record "${args[@]}" --device cpu --quiet -o "$dir/$name-cpu.trace"
  "$trace" record "${args[@]}" --device cuda --quiet -o "$dir/$name-cuda.trace"
  echo -e "\n## $name: CPU vs CUDA (\`trace bisect\`, first lines)\n\n\`\`\`text" >> "$out"
  { "$trace" bisect "$dir/$name-cpu.trace" "$dir/$name-cuda.trace" || true; } | head -n 25 >> "$out"
  echo '```' >> "$out"
  step "$name: traced/untraced on cuda"
  ratios=()
  for i in 1 2 3; do
    s0=$(date +%s.%N); "$trace" record "${args[@]}" --device cuda --untraced > /dev/null; s1=$(date +%s.%N)
    "$trace" record "${args[@]}" --device cuda --quiet -o "$dir/$name-timed.trace"; s2=$(date +%s.%N)
    ratios+=("$(awk -v a="$s0" -v b="$s1" -v c="$s2" 'BEGIN { printf "%.4f", (c - b) / (b - a) }')")
  done
  median="$(printf '%s\n' "${ratios[@]}" | sort -g | sed -n 2p)"
  printf '\n## %s: traced/untraced on CUDA, whole process\n\nmedian of 3 interleaved pairs: %.3f× (%s)\n' "$name" "$median" "$(printf '%.3f ' "${ratios[@]}")" >> "$out"
done
step "done: $out"
