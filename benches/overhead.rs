//! Overhead benchmark: traced vs untraced generation time (same code path, same tokens), on the
//! builtin model and, when `models/` has it, on SmolLM2-135M Q4_1 (decode-dominated run).
//!
//! Run: `cargo bench --bench overhead` (release build). Prints the median of 5 runs each and the
//! ratio traced / untraced. Target for issue 2: ≤ 1.25×.

use candle_trace::generate::GenConfig;
use candle_trace::recorder::{record, RecordOptions};
use std::path::PathBuf;
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn time(opts: &RecordOptions) -> f64 {
    let t = Instant::now();
    record(opts).expect("record");
    t.elapsed().as_secs_f64()
}

fn bench(name: &str, model: Option<PathBuf>, prompt: &str, chat: bool, max_tokens: usize) {
    let dir = tempfile::tempdir().expect("temp dir");
    let traced = RecordOptions {
        model,
        prompt: prompt.into(),
        chat,
        gen: GenConfig { max_tokens, ..GenConfig::default() },
        threads: candle_core::utils::get_num_threads(),
        out: Some(dir.path().join("bench.trace")),
        ..RecordOptions::default()
    };
    let untraced = RecordOptions { out: None, ..traced.clone() };
    time(&untraced); // warm-up: page cache, allocator
    let (mut t, mut u) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        u.push(time(&untraced));
        t.push(time(&traced));
    }
    let (mt, mu) = (median(t), median(u));
    let size = std::fs::metadata(dir.path().join("bench.trace")).map(|m| m.len()).unwrap_or(0);
    println!(
        "{name}: {max_tokens} tokens, untraced {:.1} ms, traced {:.1} ms, ratio {:.3}x, trace {} bytes",
        mu * 1e3,
        mt * 1e3,
        mt / mu,
        size
    );
}

fn main() {
    bench("builtin", None, "Tell me about Richard Feynman.", false, 64);
    let smol = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"));
    if smol.is_file() {
        bench("smollm2-q4_1 decode", Some(smol), "Tell me about Richard Feynman.", true, 48);
    } else {
        println!("smollm2: skipped (run tools/fetch-models.sh)");
    }
}
