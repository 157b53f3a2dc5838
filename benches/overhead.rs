//! Overhead benchmark: traced vs untraced generation, measured side by side in one process.
//!
//! Run: `cargo bench --bench overhead` (release build). Each model is loaded once; each run
//! times `generate` alone (prefill + decode; for the traced run also summarising, compressing
//! and writing the trace). Runs are interleaved (untraced, traced, traced writing frames here,
//! traced with the summary worker, untraced, …) and the median of `BENCH_RUNS` (default 5) of
//! each is reported with the ratios to untraced: `ratio` as `trace record` runs (summarising on
//! the forward pass's thread, frames compressed and written on the writer's thread), `here`
//! also writing frames on the forward pass's thread ([`TraceWriter::create_here`]), `worker`
//! summarising on the summary worker ([`Tracer::with_summary_worker`]). `BENCH_ONLY=smollm2` runs only the lines whose name
//! holds that text. Lines:
//! - `builtin`: the builtin model, 64 generated tokens;
//! - `builtin-hNNN`: seeded models of the builtin's architecture at three widths (how cost grows
//!   with model size), and `builtin-prompt-N`: two prompt lengths (how it grows with sequence);
//! - `smollm2-q4_1`: SmolLM2-135M Q4_1, a 38-token ChatML prompt then 48 decode steps (the
//!   decode-dominated headline), and `smollm2-prefill`: a 128-token prompt, 1 token generated;
//! - `whole process`: the `trace record` CLI timed from outside, model load included, traced vs
//!   `--untraced` (median of 3 each): the diluted ratio to quote beside the headline.
//!
//! SmolLM2 lines need `tools/fetch-models.sh`; without the file they say "skipped".
//!
//! candle's CPU thread count is pinned first, as `trace record` pins it
//! ([`candle_trace::env::pin_candle_threads`]): unpinned, candle 0.11 parses `/proc/cpuinfo` at
//! every f32 matmul, which was 80-90% of an untraced builtin run on a 2-core VM and hid the
//! tracing cost in the ratios. `BENCH_UNPINNED=1` times it unpinned (figures before
//! 2026-12-03, evening).

use candle_core::Device;
use candle_trace::format::TraceWriter;
use candle_trace::generate::{generate, GenConfig};
use candle_trace::models::llama::LlamaConfig;
use candle_trace::models::{builtin, gguf, LoadedModel, WeightDtype};
use candle_trace::record::Header;
use candle_trace::site::Level;
use candle_trace::tracer::Tracer;
use std::path::{Path, PathBuf};
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn runs() -> usize {
    std::env::var("BENCH_RUNS").ok().and_then(|v| v.parse().ok()).filter(|&n| n > 0).unwrap_or(5)
}

/// Times `generate` traced and untraced on `ids`; prints one line.
fn bench(name: &str, m: &mut LoadedModel, ids: &[u32], max_tokens: usize, out: &Path) {
    bench_at(name, m, ids, max_tokens, out, Level::Ops);
}

/// [`bench`] recording at `level` (`--level`).
fn bench_at(name: &str, m: &mut LoadedModel, ids: &[u32], max_tokens: usize, out: &Path, level: Level) {
    let cfg = GenConfig { max_tokens, ..GenConfig::default() };
    if !wanted(name) {
        return;
    }
    // How each run records: untraced, traced (frames written on the writer's thread), traced
    // writing frames on the forward pass's thread, traced summarising on the summary worker.
    #[derive(Clone, Copy, PartialEq)]
    enum How {
        Untraced,
        Traced,
        Here,
        Worker,
    }
    let mut run = |how: How| -> f64 {
        let mut tr = match how {
            How::Untraced => Tracer::untraced(),
            How::Here => Tracer::new(Box::new(TraceWriter::create_here(out, &Header::default(), None).expect("create trace"))),
            How::Traced | How::Worker => Tracer::new(Box::new(TraceWriter::create(out, &Header::default(), None).expect("create trace"))),
        };
        tr = tr.with_level(level).expect("level").with_summary_worker(how == How::Worker).expect("worker");
        let t = Instant::now();
        generate(&mut m.model, &m.tokenizer, ids, &cfg, &mut tr).expect("generate");
        let footer = candle_trace::record::Footer { op_records: tr.op_records(), forward_passes: tr.forward_passes(), ..Default::default() };
        tr.finish(&footer).expect("finish");
        t.elapsed().as_secs_f64()
    };
    run(How::Untraced); // warm-up
    let (mut t, mut u, mut h, mut w) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..runs() {
        u.push(run(How::Untraced));
        t.push(run(How::Traced));
        h.push(run(How::Here));
        w.push(run(How::Worker));
    }
    let (mt, mu, mh, mw) = (median(t), median(u), median(h), median(w));
    let trace = candle_trace::format::read_trace(out).expect("read back");
    let records = trace.items.iter().filter(|i| matches!(i, candle_trace::record::Item::Op(_))).count();
    let size = std::fs::metadata(out).map(|m| m.len()).unwrap_or(0);
    println!(
        "{name}: {} prompt tokens + {max_tokens} generated, untraced {:.1} ms, traced {:.1} ms, ratio {:.3}x, here {:.3}x, worker {:.3}x, trace {size} bytes, {records} records, {:.1} B/record, {:.2} us/record traced cost",
        ids.len(),
        mu * 1e3,
        mt * 1e3,
        mt / mu,
        mh / mu,
        mw / mu,
        size as f64 / records.max(1) as f64,
        (mt - mu) * 1e6 / records.max(1) as f64,
    );
}

/// `--dump all` on the builtin model: every op output and operand stored in full; prints the
/// bytes written a second of generation (median of 3).
fn dump_all(m: &mut LoadedModel, ids: &[u32], out: &Path) {
    let cfg = GenConfig { max_tokens: 16, ..GenConfig::default() };
    let mut secs = Vec::new();
    for _ in 0..3 {
        let mut tr = Tracer::new(Box::new(TraceWriter::create(out, &Header::default(), None).expect("create trace"))).with_dump(candle_trace::dump::DumpSpec::All);
        let t = Instant::now();
        generate(&mut m.model, &m.tokenizer, ids, &cfg, &mut tr).expect("generate");
        let footer = candle_trace::record::Footer { op_records: tr.op_records(), forward_passes: tr.forward_passes(), ..Default::default() };
        tr.finish(&footer).expect("finish");
        secs.push(t.elapsed().as_secs_f64());
    }
    let size = std::fs::metadata(out).map(|m| m.len()).unwrap_or(0);
    let s = median(secs);
    println!("builtin --dump all: {} prompt tokens + 16 generated, {:.1} ms, trace {size} bytes, {:.1} MB/s written", ids.len(), s * 1e3, size as f64 / s / 1e6);
}

/// The whole CLI, traced vs untraced, model load included (median of 3, interleaved).
fn whole_process(name: &str, args: &[&str], out: &Path) {
    whole_process_at(name, args, out, &[]);
}

/// [`whole_process`] with `extra` arguments on the traced runs (`--level layers`).
fn whole_process_at(name: &str, args: &[&str], out: &Path, extra_traced: &[&str]) {
    if !wanted(name) {
        return;
    }
    let exe = env!("CARGO_BIN_EXE_trace");
    let time = |extra: &[&str]| -> f64 {
        let t = Instant::now();
        let st = std::process::Command::new(exe).args(args).args(extra).arg("--quiet").stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).status().expect("run trace");
        assert!(st.success(), "trace record failed");
        t.elapsed().as_secs_f64()
    };
    let o = out.to_str().expect("utf-8 path");
    let (mut t, mut u) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        u.push(time(&["--untraced"]));
        t.push(time(&[&["-o", o][..], extra_traced].concat()));
    }
    let (mt, mu) = (median(t), median(u));
    println!("{name} whole process: untraced {:.0} ms, traced {:.0} ms, ratio {:.3}x", mu * 1e3, mt * 1e3, mt / mu);
}

/// Whether the line `name` is run (`BENCH_ONLY` unset, or `name` holds its text).
fn wanted(name: &str) -> bool {
    std::env::var("BENCH_ONLY").map_or(true, |only| name.contains(&only))
}

fn main() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("bench.trace");
    let dev = Device::Cpu;
    // As `trace record` does: candle's thread count computed once, not at every matmul
    // (`env::pin_candle_threads`). BENCH_UNPINNED=1 leaves candle to compute it at every matmul,
    // as the figures before 2026-12-03 (evening) were taken.
    let pinned = std::env::var_os("BENCH_UNPINNED").is_none();
    let threads = if pinned { candle_trace::env::pin_candle_threads() } else { candle_core::utils::get_num_threads() };
    println!("threads: {threads} ({})", if pinned { "pinned: RAYON_NUM_THREADS set once" } else { "unpinned: candle computes the count at every matmul" });
    let f32w = WeightDtype::Dense(candle_core::DType::F32);
    let mut b = builtin::load(f32w, &dev).expect("builtin");
    let prompt = b.tokenizer.encode("Tell me about Richard Feynman.").expect("encode");
    bench("builtin", &mut b, &prompt, 64, &out);
    for long in [32usize, 256] {
        let ids: Vec<u32> = prompt.iter().copied().cycle().take(long).collect();
        bench(&format!("builtin-prompt-{long}"), &mut b, &ids, 16, &out);
        bench_at(&format!("builtin-prompt-{long} --level layers"), &mut b, &ids, 16, &out, Level::Layers);
    }
    for hidden in [64usize, 256, 1024] {
        let c = LlamaConfig { hidden, n_head: hidden / 16, n_kv_head: hidden / 32, ..builtin::CONFIG };
        let mut m = builtin::load_shaped(c, hidden * 11 / 4, f32w, &dev).expect("shaped builtin");
        bench(&format!("builtin-h{hidden}"), &mut m, &prompt, 32, &out);
    }
    if wanted("builtin --dump all") {
        dump_all(&mut b, &prompt, &out);
    }
    whole_process("builtin", &["record", "--prompt", "Tell me about Richard Feynman.", "--max-tokens", "64"], &out);
    let smol = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"));
    if !smol.is_file() {
        println!("smollm2: skipped (run tools/fetch-models.sh)");
        return;
    }
    let mut m = gguf::load(&smol, WeightDtype::Quantized, &dev).expect("smollm2");
    let text = m.tokenizer.apply_chat_template("Tell me about Richard Feynman.").expect("template");
    let ids = m.tokenizer.encode(&text).expect("encode");
    bench("smollm2-q4_1", &mut m, &ids, 48, &out);
    bench_at("smollm2-q4_1 --level layers", &mut m, &ids, 48, &out, Level::Layers);
    let long = "The history of physics is the story of how people came to understand motion, light, heat and matter. ".repeat(8);
    let ids: Vec<u32> = m.tokenizer.encode(&long).expect("encode").into_iter().take(128).collect();
    bench("smollm2-prefill", &mut m, &ids, 1, &out);
    let model = smol.to_str().expect("utf-8 path");
    let args = ["record", "--model", model, "--prompt", "Tell me about Richard Feynman.", "--chat", "--max-tokens", "48"];
    whole_process("smollm2-q4_1", &args, &out);
    whole_process_at("smollm2-q4_1 --level layers", &args, &out, &["--level", "layers"]);
}
