//! The cost of `--numerics invariant`: SmolLM2-135M and Gemma 3 270M untraced, a 128-token prompt
//! then 64 decode steps, on the batch-invariant kernels against the default ones, in one process.
//!
//! Run: `cargo bench --bench invariant` (needs `tools/fetch-models.sh`; without the file it says
//! "skipped"; `BENCH_MODELS=gemma3` times one model). For each model and dtype (as quantized in
//! the file: SmolLM2 Q4_1, Gemma 3 Q4_K_M; and f32 dequantized) the model is loaded once;
//! each round times, for the default and then the invariant numerics, `generate` with one token
//! (the prefill) and with 65 (the prefill and 64 decode steps); the decode time is the
//! difference, per generated token. Rounds are interleaved, `BENCH_RUNS` of them (default 5),
//! after one untimed round (the invariant kernels pack dense weights on first use), and the
//! medians are compared. Two lines per model and dtype, the second:
//!
//! `smollm2 q4_1: invariant/default prefill ratio 1.23x, decode ratio 1.04x`
//!
//! candle's CPU thread count is pinned first, as `trace record` pins it.

use candle_core::Device;
use candle_trace::generate::{generate, GenConfig};
use candle_trace::models::{gguf, LoadedModel, WeightDtype};
use candle_trace::numerics::Numerics;
use candle_trace::tracer::Tracer;
use std::path::PathBuf;
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Seconds of one untraced `generate` of `max_tokens` under `numerics`, and the tokens made.
fn time(m: &mut LoadedModel, ids: &[u32], max_tokens: usize, numerics: Numerics) -> (f64, usize) {
    let mut tr = Tracer::untraced().with_numerics(numerics);
    let cfg = GenConfig { max_tokens, ..GenConfig::default() };
    let t = Instant::now();
    let g = generate(&mut m.model, &m.tokenizer, ids, &cfg, &mut tr).expect("generate");
    (t.elapsed().as_secs_f64(), g.tokens[0].len())
}

/// Times `name` in each of `dtypes` (`(label, dtype)`), printing two lines per dtype.
fn bench(name: &str, path: &std::path::Path, dtypes: &[(&str, WeightDtype)], rounds: usize) {
    for &(label, dtype) in dtypes {
        let mut m = gguf::load(path, dtype, &Device::Cpu).expect(name);
        let long = "The history of physics is the story of how people came to understand motion, light, heat and matter. ".repeat(8);
        let ids: Vec<u32> = m.tokenizer.encode(&long).expect("encode").into_iter().take(128).collect();
        let modes = [Numerics::Fixed, Numerics::Invariant];
        let (mut prefill, mut decode) = ([Vec::new(), Vec::new()], [Vec::new(), Vec::new()]);
        for round in 0..=rounds {
            for (i, &n) in modes.iter().enumerate() {
                let (p, _) = time(&mut m, &ids, 1, n);
                let (all, made) = time(&mut m, &ids, 65, n);
                if round > 0 {
                    prefill[i].push(p);
                    decode[i].push((all - p) / made.saturating_sub(1).max(1) as f64);
                }
            }
        }
        let [pd, pi] = prefill.map(median);
        let [dd, di] = decode.map(median);
        println!("{name} {label}: prefill default {:.1} ms, invariant {:.1} ms; decode default {:.2} ms/token, invariant {:.2} ms/token", pd * 1e3, pi * 1e3, dd * 1e3, di * 1e3);
        println!("{name} {label}: invariant/default prefill ratio {:.2}x, decode ratio {:.2}x", pi / pd, di / dd);
    }
}

fn main() {
    let threads = candle_trace::env::pin_candle_threads();
    let rounds = std::env::var("BENCH_RUNS").ok().and_then(|v| v.parse().ok()).filter(|&n| n > 0).unwrap_or(5);
    println!("threads: {threads}, rounds: {rounds}");
    let f32 = WeightDtype::Dense(candle_core::DType::F32);
    let models = [("smollm2", "models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "q4_1"), ("gemma3", "models/gemma3/gemma-3-270m-q4_k_m.gguf", "q4_k_m")];
    // BENCH_MODELS=gemma3 (comma-separated names) times only those.
    let only = std::env::var("BENCH_MODELS").ok();
    for (name, file, q) in models {
        if only.as_deref().is_some_and(|o| !o.split(',').any(|n| n == name)) {
            continue;
        }
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(file);
        if !path.is_file() {
            println!("{name}: skipped (run tools/fetch-models.sh)");
            continue;
        }
        bench(name, &path, &[(q, WeightDtype::Quantized), ("f32", f32)], rounds);
    }
}
