//! `trace bisect` throughput and peak memory on two synthetic traces of `BENCH_RECORDS`
//! (default 5 000 000) op records each, from the generator below: a decoder-shaped stream of
//! forward passes (30 layers × 20 ops, one token each, every op reading the one before), where
//! run b's numbers part from a's at 90% of the stream (`BENCH_PART`, a percentage) and stay
//! apart, so bisect reads both traces whole.
//!
//! Run: `cargo bench --bench bisect`. Prints the trace sizes, then the `trace bisect` CLI's
//! wall time, records compared a second (records of one trace / seconds) and its peak resident
//! memory (the child's `ru_maxrss`).

use candle_trace::format::TraceWriter;
use candle_trace::record::{Footer, Forward, Header, InputRef, Item, OpRecord, Phase, Reads, Stats, TokenAxis, TokenStat};
use std::path::Path;
use std::time::Instant;

const LAYERS: u32 = 30;
const OPS: u32 = 20;

/// SplitMix64: the generator's deterministic values.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Writes a trace of `n` op records; records from `part` on get other values (`salt`).
fn generate(path: &Path, n: u64, part: u64, salt: u64) -> u64 {
    let mut w = TraceWriter::create(path, &Header::default(), None).expect("create");
    for s in 0..LAYERS * OPS {
        w.push(Item::Site { id: s, path: format!("layers.{}.op{}", s / OPS, s % OPS), op: "add".into() }).expect("site");
    }
    let per_pass = (LAYERS * OPS) as u64;
    let mut seq = 0u64;
    let mut step = 0u32;
    while seq < n {
        w.push(Item::Forward(Forward { step, phase: if step == 0 { Phase::Prefill } else { Phase::Decode }, index_pos: step, seq_len: 1, batch: 1, ids: vec![step % 250] })).expect("forward");
        for k in 0..per_pass.min(n - seq) {
            let v = mix(seq ^ if seq >= part { salt } else { 0 });
            let x = (v >> 40) as f32 / (1u64 << 24) as f32;
            let samples = [x, x * 0.5, -x, x * 2.0];
            let stats = Stats { count: 576, sum: x as f64 * 3.0, min: -x as f64, max: 2.0 * x as f64, abs_max: 2.0 * x as f64, l2: x as f64 * 7.0, nan: 0, pos_inf: 0, neg_inf: 0 };
            let token = TokenStat { row: 0, pos: step, digest: mix(v), sum: stats.sum, abs_max: stats.abs_max, nonfinite: 0, samples };
            let r = OpRecord {
                seq,
                step,
                site: k as u32,
                inputs: if k == 0 { Vec::new() } else { vec![InputRef { seq: seq - 1, reads: Reads::Same }] },
                dtype: "f32".into(),
                shape: vec![1, 1, 576],
                digest: ((mix(v ^ 1) as u128) << 64) | v as u128,
                stats,
                samples: samples.to_vec(),
                tokens: vec![token],
                axis: Some(TokenAxis { seq_dim: Some(1), first_pos: step, keep_from: 0, causal: false }),
                kernel: None,
                operands: Vec::new(),
                perturbed: false,
            };
            w.push(Item::Op(r)).expect("op");
            seq += 1;
        }
        w.flush().expect("flush");
        step += 1;
    }
    w.finish(&Footer { op_records: n, forward_passes: step, stop: "max_tokens".into(), ..Footer::default() }).expect("finish");
    std::fs::metadata(path).expect("size").len()
}

/// Peak resident memory of finished children, in bytes.
fn children_peak_rss() -> u64 {
    // SAFETY: getrusage writes into the zeroed struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut u) };
    u.ru_maxrss as u64 * 1024
}

fn main() {
    let n: u64 = std::env::var("BENCH_RECORDS").ok().and_then(|v| v.parse().ok()).unwrap_or(5_000_000);
    let dir = tempfile::tempdir().expect("temp dir");
    // BENCH_DIR keeps the two traces there (for profiling the CLI on them).
    let keep = std::env::var_os("BENCH_DIR").map(std::path::PathBuf::from);
    let at = keep.as_deref().unwrap_or(dir.path());
    let (a, b) = (at.join("a.trace"), at.join("b.trace"));
    let t = Instant::now();
    let sa = generate(&a, n, u64::MAX, 0);
    // BENCH_PART: the percentage of the stream run b shares with run a (default 90).
    let part: u64 = std::env::var("BENCH_PART").ok().and_then(|v| v.parse().ok()).unwrap_or(90).min(100);
    let sb = generate(&b, n, n / 100 * part, 0xDEAD_BEEF);
    println!("generated 2 × {n} records in {:.1} s: {sa} and {sb} bytes ({:.1} B/record)", t.elapsed().as_secs_f64(), sa as f64 / n as f64);
    let t = Instant::now();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_trace")).args(["bisect", "--format", "json"]).arg(&a).arg(&b).output().expect("run trace bisect");
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(out.status.code(), Some(1), "bisect should find the divergence: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    println!("first divergence: {} @ {}", v["first_divergence"]["path"], v["first_divergence"]["position"]);
    println!("bisect: {secs:.2} s, {:.2} M records/s, peak RSS {} MB", n as f64 / secs / 1e6, children_peak_rss() >> 20);
}
