//! Overhead benchmark: traced vs untraced generation time (same code path, same tokens), on the
//! builtin model and, when `models/` has it, on SmolLM2-135M Q4_1 (a decode-dominated run: a
//! 38-token ChatML prompt, then 48 decode steps).
//!
//! Run: `cargo bench --bench overhead` (release build). The model is loaded once; each run times
//! `generate` alone (prefill + decode; tracing, summarising, compressing and writing the trace
//! for the traced run). Prints the median of 5 runs each and the ratio traced / untraced.
//! Target for issue 2: ≤ 1.25×.

use candle_core::Device;
use candle_trace::format::TraceWriter;
use candle_trace::generate::{generate, GenConfig};
use candle_trace::models::{builtin, gguf, LoadedModel, WeightDtype};
use candle_trace::record::Header;
use candle_trace::tracer::Tracer;
use std::path::{Path, PathBuf};
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn bench(name: &str, mut m: LoadedModel, prompt: &str, chat: bool, max_tokens: usize, out: &Path) {
    let text = if chat { m.tokenizer.apply_chat_template(prompt).expect("template") } else { prompt.to_string() };
    let ids = m.tokenizer.encode(&text).expect("encode");
    let cfg = GenConfig { max_tokens, ..GenConfig::default() };
    let mut run = |traced: bool| -> f64 {
        let mut tr = if std::env::var("BENCH_MEMORY_SINK").is_ok() && traced {
            Tracer::new(Box::new(candle_trace::tracer::MemorySink::default()))
        } else if traced {
            Tracer::new(Box::new(TraceWriter::create(out, &Header::default()).expect("create trace")))
        } else {
            Tracer::untraced()
        };
        let t = Instant::now();
        generate(&mut m.model, &m.tokenizer, &ids, &cfg, &mut tr).expect("generate");
        tr.finish(&Default::default()).expect("finish");
        t.elapsed().as_secs_f64()
    };
    run(false); // warm-up
    let (mut t, mut u) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        u.push(run(false));
        t.push(run(true));
    }
    let (mt, mu) = (median(t), median(u));
    let size = std::fs::metadata(out).map(|m| m.len()).unwrap_or(0);
    println!(
        "{name}: {} prompt tokens + {max_tokens} generated, untraced {:.1} ms, traced {:.1} ms, ratio {:.3}x, trace {} bytes",
        ids.len(),
        mu * 1e3,
        mt * 1e3,
        mt / mu,
        size
    );
}

fn main() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("bench.trace");
    let dev = Device::Cpu;
    println!("threads: {}", candle_core::utils::get_num_threads());
    let b = builtin::load(WeightDtype::Dense(candle_core::DType::F32), &dev).expect("builtin");
    bench("builtin", b, "Tell me about Richard Feynman.", false, 64, &out);
    let smol = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"));
    if smol.is_file() {
        let m = gguf::load(&smol, WeightDtype::Quantized, &dev).expect("smollm2");
        bench("smollm2-q4_1", m, "Tell me about Richard Feynman.", true, 48, &out);
    } else {
        println!("smollm2: skipped (run tools/fetch-models.sh)");
    }
}
