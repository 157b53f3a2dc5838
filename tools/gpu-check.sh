#!/usr/bin/env bash
# The GPU check (docs/gpu.md): on a machine with an NVIDIA GPU, build with --features cuda (or
# take binaries built elsewhere) and show what the GPU does to the numbers. Writes its results as
# markdown to OUT (default gpu-check/results.md), traces and logs beside it. Steps:
#   1. the device digest equals the host digest, bit for bit (unit test on the GPU);
#   2. per model (the builtin seeded model always; SmolLM2 and Gemma 3 when their files are
#      there or can be fetched): `trace check --device cuda` run to run, batch 1 vs 2, 4, 8,
#      prefill whole vs chunked; CPU vs CUDA bisected (first op, class "device");
#   3. per model: traced/untraced whole-process time on the GPU (interleaved, median of 3);
#   4. replay on the GPU of an op dumped on the CPU (the builtin model's first q_proj).
# Exit 0 when every step ran (whatever the verdicts), 2 when there is no GPU or a step failed.
#
#   tools/gpu-check.sh [OUT.md]                 build here (cargo, nvcc) and check
#   tools/gpu-check.sh --build DIR              build only, no GPU needed: DIR gets `trace` and
#                                               `digest-test` (the instrumentation crate's unit tests)
#   tools/gpu-check.sh --prebuilt DIR [OUT.md]  check with DIR's binaries: a GPU machine with no
#                                               Rust toolchain or network (models/ as it is)
#
# Building needs nvcc on PATH or PyPI (tools/setup-cuda.sh installs it). The nvcc must not be
# newer than the driver that runs the kernels (candle loads them as PTX): CUDA_RELEASE=13.0
# builds for a CUDA 13.0 driver (580), the default 13.5 for 13.5's. With a GPU here, the release
# is picked from the driver. A prebuilt `trace` loads the CUDA libraries (cudart, cuBLAS,
# cuRAND, NVRTC) of this machine: those on the loader's path, else NVIDIA's Python wheels or
# /usr/local/cuda, found below.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
step() { echo "gpu-check: $*" >&2; }
have_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; }

# build DIR: the release binary and the run crate's test binary, with --features cuda.
build() {
  local dir="$1"
  if have_gpu && [ -z "${CUDA_RELEASE:-}" ]; then
    local drv
    drv="$(nvidia-smi | grep -oE 'CUDA Version: [0-9]+\.[0-9]+' | grep -oE '[0-9]+\.[0-9]+' || true)"
    case "$drv" in 13.[0-4]) export CUDA_RELEASE=13.0 ;; esac
    export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d ' .')}"
  fi
  local venv=.venv-cuda
  [ "${CUDA_RELEASE:-13.5}" = 13.5 ] || venv=".venv-cuda-$CUDA_RELEASE"
  if ! command -v nvcc >/dev/null 2>&1; then
    tools/setup-cuda.sh
    # shellcheck disable=SC1090
    . "$venv/env.sh"
  fi
  export CARGO_TARGET_DIR="$root/target/cuda-${CUDA_RELEASE:-13.5}"
  step "building with --features cuda ($(nvcc --version | grep release), compute capability ${CUDA_COMPUTE_CAP:-90})"
  cargo build --release --features cuda --bin trace
  local test_bin
  test_bin="$(cargo test --release --features cuda -p candle-trace-instrument --lib --no-run --message-format json 2>/dev/null \
    | grep -o '"executable":"[^"]*"' | tail -n 1 | cut -d'"' -f4)"
  [ -x "$test_bin" ] || { echo "gpu-check: no test binary built" >&2; exit 2; }
  mkdir -p "$dir"
  cp "$CARGO_TARGET_DIR/release/trace" "$dir/trace"
  cp "$test_bin" "$dir/digest-test"
  step "built: $dir/trace, $dir/digest-test"
}

prebuilt=""
case "${1:-}" in
  --build) build "${2:?--build DIR}"; exit 0 ;;
  --prebuilt) prebuilt="$(cd "${2:?--prebuilt DIR}" && pwd)"; shift 2 ;;
esac
out="${1:-$root/gpu-check/results.md}"
dir="$(dirname "$out")"
if ! have_gpu; then
  echo "gpu-check: no NVIDIA GPU on this machine (nvidia-smi is missing or lists no GPU); nothing to check" >&2
  exit 2
fi
mkdir -p "$dir"
if [ -z "$prebuilt" ]; then
  prebuilt="$root/target/gpu-check-bin"
  build "$prebuilt"
fi
trace="$prebuilt/trace"

# The CUDA libraries a prebuilt binary needs, where the loader does not find them.
missing="$(ldd "$trace" | awk '/not found/ { print $1 }')"
if [ -n "$missing" ]; then
  for lib in $missing; do
    found="$(find /usr/local /usr/lib /usr/lib64 /opt -name "$lib" \( -path '*nvidia*' -o -path '*cuda*' \) 2>/dev/null | head -n 1)"
    [ -n "$found" ] && export LD_LIBRARY_PATH="$(dirname "$found")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  done
  still="$(ldd "$trace" | awk '/not found/ { print $1 }')"
  [ -z "$still" ] || { echo "gpu-check: libraries not found: $still" >&2; exit 2; }
fi

{
  echo "# GPU check"
  echo
  echo "- GPU: $(nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader | head -n 1)"
  echo "- driver's CUDA: $(nvidia-smi | grep -oE 'CUDA Version: [0-9.]+' || echo unknown)"
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "- binaries: $prebuilt"
  echo
} > "$out"

step "device digest vs host digest"
if CANDLE_TRACE_GPU_CHECK=1 "$prebuilt/digest-test" digest::device > "$dir/digest-test.log" 2>&1; then
  echo "## Device digest: equal to the host digest (f32, f16, bf16, f64; token axes, causal, padded rows)" >> "$out"
  grep -E '^test result|passed|skipped' "$dir/digest-test.log" | sed 's/^/    /' >> "$out" || true
else
  echo "## Device digest: DIFFERS from the host digest (see digest-test.log)" >> "$out"
  tail -n 40 "$dir/digest-test.log" >&2
  exit 2
fi

[ -n "${GPU_CHECK_NO_FETCH:-}" ] || tools/fetch-models.sh >&2 || step "model files could not be fetched: the models present are checked"
models=("builtin:")
[ -f models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] && models+=("smollm2:models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
[ -f models/gemma3/gemma-3-270m-q4_k_m.gguf ] && models+=("gemma3:models/gemma3/gemma-3-270m-q4_k_m.gguf")
failed=0
for entry in "${models[@]}"; do
  name="${entry%%:*}" model="${entry#*:}"
  args=(--prompt "Tell me about Richard Feynman." --max-tokens 16)
  [ -n "$model" ] && args+=(--model "$model" --chat)
  step "$name: run to run, batch, prefill chunk on cuda"
  echo -e "\n## $name on CUDA: \`trace check --vary batch,prefill-chunk --runs 2\`\n" >> "$out"
  "$trace" check "${args[@]}" --device cuda --runs 2 --vary batch,prefill-chunk --out "$dir/$name-check" --format markdown --quiet >> "$out" 2> "$dir/$name-check.log" || [ $? -eq 1 ] || { failed=1; tail -n 5 "$dir/$name-check.log" >&2; }
  step "$name: CPU vs CUDA"
  if "$trace" record "${args[@]}" --device cpu --quiet -o "$dir/$name-cpu.trace" && "$trace" record "${args[@]}" --device cuda --quiet -o "$dir/$name-cuda.trace"; then
    echo -e "\n## $name: CPU vs CUDA (\`trace bisect\`, first lines)\n\n\`\`\`text" >> "$out"
    { "$trace" bisect "$dir/$name-cpu.trace" "$dir/$name-cuda.trace" || true; } | head -n 30 >> "$out"
    echo '```' >> "$out"
  else
    failed=1
  fi
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

step "replay on cuda of an op dumped on the cpu"
if "$trace" record --max-tokens 1 --dump layers.0.self_attn.q_proj --quiet -o "$dir/dump-cpu.trace"; then
  echo -e "\n## Replay on CUDA of layers.0.self_attn.q_proj dumped on the CPU (builtin)\n\n\`\`\`text" >> "$out"
  { "$trace" replay "$dir/dump-cpu.trace" --device cuda 2>&1 || true; } | head -n 20 >> "$out"
  echo '```' >> "$out"
else
  failed=1
fi
step "done: $out"
exit $((failed * 2))
