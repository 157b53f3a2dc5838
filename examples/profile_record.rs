//! The builtin model's generation run again and again, traced and untraced, for profilers
//! (`perf record`, `valgrind --tool=callgrind`) and for timing one build against another
//! (docs/performance.md, "Records filled in place").
//!
//! `cargo run --release --example profile_record -- MODE RUNS [TOKENS [PROMPT_TOKENS]]`:
//! - `MODE`: `traced`, `untraced`, or `both` (alternating, untraced first);
//! - `RUNS` (default 50) runs of `TOKENS` generated tokens (default 64) after a prompt of
//!   `PROMPT_TOKENS` (default: the README's prompt, 30 tokens; more repeat it).
//!
//! `PROFILE_LEVEL=layers` (or `logits`) records at that level (`--level`; default `ops`).
//!
//! `PROFILE_MODEL=path.gguf` runs that GGUF model (quantized weights, chat template applied to
//! the README's prompt) instead of the builtin one.
//!
//! Each run writes its trace to a temporary file, as `trace record` does (frames compressed and
//! written on the writer's thread). With `both`, one line a run on stdout: `0` or `1` (traced),
//! the generation's wall time, the time `finish` took (the last frames and the fsync), and the
//! forward pass thread's CPU time, in ms. A summary line goes to stderr.

use candle_core::Device;
use candle_trace::format::TraceWriter;
use candle_trace::generate::{generate, GenConfig};
use candle_trace::models::{builtin, gguf, WeightDtype};
use candle_trace::record::{Footer, Header};
use candle_trace::site::Level;
use candle_trace::tracer::Tracer;

fn main() {
    let arg = |i: usize| std::env::args().nth(i);
    let mode = arg(1).unwrap_or_else(|| "traced".into());
    let runs: usize = arg(2).and_then(|s| s.parse().ok()).unwrap_or(50);
    let tokens: usize = arg(3).and_then(|s| s.parse().ok()).unwrap_or(64);
    candle_trace::env::pin_candle_threads();
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("profile.trace");
    let question = "Tell me about Richard Feynman.";
    let (mut m, text) = match std::env::var_os("PROFILE_MODEL") {
        Some(path) => {
            let m = gguf::load(std::path::Path::new(&path), WeightDtype::Quantized, &Device::Cpu).expect("model");
            let text = m.tokenizer.apply_chat_template(question).expect("chat template");
            (m, text)
        }
        None => (builtin::load(WeightDtype::Dense(candle_core::DType::F32), &Device::Cpu).expect("builtin"), question.to_string()),
    };
    let mut prompt = m.tokenizer.encode(&text).expect("encode");
    if let Some(n) = arg(4).and_then(|s| s.parse::<usize>().ok()) {
        prompt = prompt.iter().copied().cycle().take(n).collect();
    }
    let cfg = GenConfig { max_tokens: tokens, ..GenConfig::default() };
    let level = std::env::var("PROFILE_LEVEL").map_or(Level::Ops, |l| Level::parse(&l).expect("PROFILE_LEVEL: ops, layers or logits"));
    let (mut gen, mut fin) = (0.0, 0.0);
    for i in 0..runs {
        let traced = match mode.as_str() {
            "untraced" => false,
            "traced" => true,
            _ => i % 2 == 1,
        };
        let mut tr = if traced { Tracer::new(Box::new(TraceWriter::create(&out, &Header::default(), None).expect("create"))) } else { Tracer::untraced() };
        tr = tr.with_level(level).expect("level");
        let cpu = thread_cpu();
        let t = std::time::Instant::now();
        generate(&mut m.model, &m.tokenizer, &prompt, &cfg, &mut tr).expect("generate");
        let (g, cpu) = (t.elapsed().as_secs_f64(), thread_cpu() - cpu);
        tr.finish(&Footer { op_records: tr.op_records(), forward_passes: tr.forward_passes(), ..Footer::default() }).expect("finish");
        let f = t.elapsed().as_secs_f64() - g;
        if mode == "both" {
            println!("{} {:.3} {:.3} {:.3}", u8::from(traced), g * 1e3, f * 1e3, cpu * 1e3);
        }
        (gen, fin) = (gen + g, fin + f);
    }
    eprintln!("{:.3} ms generating, {:.3} ms finishing, a run", gen * 1e3 / runs as f64, fin * 1e3 / runs as f64);
}

/// This thread's CPU time, in seconds.
fn thread_cpu() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes into the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}
