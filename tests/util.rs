//! Shared test helpers: the model file, temp dirs, running the `trace` binary, recording in-process.

use candle_trace::format::{read_trace, Trace};
use candle_trace::generate::GenConfig;
use candle_trace::recorder::{record, RecordOptions};
use candle_trace::tracer::Perturb;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub const SMOLLM2: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");

/// Path of the SmolLM2 model file. A test that needs it fails when it is missing (never a
/// silent pass), with a message naming `tools/fetch-models.sh`.
pub fn smollm2_path() -> PathBuf {
    let path = PathBuf::from(SMOLLM2);
    assert!(path.is_file(), "model file {} is missing: run tools/fetch-models.sh first (the README's test command does)", path.display());
    path
}

pub const GEMMA3: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/models/gemma3/gemma-3-270m-q4_k_m.gguf");

/// Path of the Gemma 3 270M Q4_K_M file (fails, naming `tools/fetch-models.sh`, when missing).
pub fn gemma3_path() -> PathBuf {
    let path = PathBuf::from(GEMMA3);
    assert!(path.is_file(), "model file {} is missing: run tools/fetch-models.sh first (the README's test command does)", path.display());
    path
}

/// A fresh temporary directory, removed when dropped.
pub fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("temp dir")
}

/// Runs the `trace` binary.
pub fn trace(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_trace")).args(args).output().expect("run trace")
}

/// Runs `trace` and returns (exit code, stdout, stderr).
pub fn trace_s(args: &[&str]) -> (i32, String, String) {
    let o = trace(args);
    (o.status.code().unwrap_or(-1), String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

/// Records in-process with the builtin model (or `model`) into `out` and reads the trace back.
pub fn record_builtin(out: &Path, prompt: &str, gen: GenConfig, perturb: Option<&str>, model: Option<&Path>) -> Trace {
    let opts = RecordOptions {
        model: model.map(Path::to_path_buf),
        prompt: prompt.to_string(),
        gen,
        threads: 1,
        perturb: perturb.into_iter().flat_map(|p| p.split(',')).map(|p| p.parse::<Perturb>().expect("perturb spec")).collect(),
        out: Some(out.to_path_buf()),
        ..RecordOptions::default()
    };
    record(&opts).expect("record");
    read_trace(out).expect("read trace")
}

pub fn p(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// The Hugging Face llama folder made from the SmolLM2 GGUF (as tools/gguf-to-hf.sh does), created
/// on first use under `target/tmp/`, not `models/`: it is this build's exporter's output, and
/// `models/` may be a cache shared between checkouts (tools/ci-cache.sh). Fails as
/// [`smollm2_path`] does when the GGUF file is missing.
pub fn smollm2_hf_path() -> PathBuf {
    static MADE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    let gguf = smollm2_path();
    MADE.get_or_init(|| {
        let dir = PathBuf::from(concat!(env!("CARGO_TARGET_TMPDIR"), "/smollm2-hf"));
        if !dir.join("model.safetensors").is_file() || !dir.join("tokenizer.json").is_file() {
            candle_trace::models::export::gguf_to_hf(&gguf, &dir).expect("gguf_to_hf");
        }
        dir
    })
    .clone()
}

/// The largest absolute difference between two equally long logit rows.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Parses a command's JSON output (`--format json`).
pub fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("not JSON ({e}):\n{s}"))
}

/// Splits `dir/model.safetensors` into two shards (`model-00001-of-00002.safetensors`, …)
/// with the `model.safetensors.index.json` that `save_pretrained` writes, and removes the
/// single file. Tensors alternate between the shards in name order.
pub fn shard_folder(dir: &Path) {
    let single = dir.join("model.safetensors");
    let all = candle_core::safetensors::load(&single, &candle_core::Device::Cpu).unwrap();
    let mut names: Vec<&String> = all.keys().collect();
    names.sort();
    let mut shards = [std::collections::HashMap::new(), std::collections::HashMap::new()];
    let mut map = serde_json::Map::new();
    for (i, n) in names.iter().enumerate() {
        shards[i % 2].insert((*n).clone(), all[*n].clone());
        map.insert((*n).clone(), serde_json::json!(format!("model-0000{}-of-00002.safetensors", i % 2 + 1)));
    }
    for (i, s) in shards.iter().enumerate() {
        candle_core::safetensors::save(s, dir.join(format!("model-0000{}-of-00002.safetensors", i + 1))).unwrap();
    }
    std::fs::write(dir.join("model.safetensors.index.json"), serde_json::json!({"metadata": {}, "weight_map": map}).to_string()).unwrap();
    std::fs::remove_file(single).unwrap();
}

/// A command's result kept in the shared fixture cache: the folder it ran in (its output files),
/// its exit code and output.
pub struct Fixture {
    /// The folder the commands ran in; their relative output paths land here. Read-only by
    /// convention: a test that changes a file copies it first.
    pub dir: PathBuf,
    /// Exit code, stdout and stderr of each command, in order.
    pub runs: Vec<(i32, String, String)>,
}

impl Fixture {
    /// A file the commands wrote.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
    /// Exit code, stdout and stderr of command `i`.
    pub fn run(&self, i: usize) -> (i32, &str, &str) {
        let (c, o, e) = &self.runs[i];
        (*c, o, e)
    }
}

/// The fixture cache's folder for this build of `trace`: `target/tmp/fixtures/<binary hash>/`.
/// Folders of other builds are removed the first time it is asked for.
fn fixture_root() -> &'static Path {
    static ROOT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    ROOT.get_or_init(|| {
        let bin = std::fs::read(env!("CARGO_BIN_EXE_trace")).expect("read the trace binary");
        let id = format!("{:016x}", candle_trace::hash::xxh3_64(&bin));
        let base = PathBuf::from(concat!(env!("CARGO_TARGET_TMPDIR"), "/fixtures"));
        if let Ok(entries) = std::fs::read_dir(&base) {
            for e in entries.flatten() {
                if e.file_name().to_str() != Some(id.as_str()) {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        let root = base.join(id);
        std::fs::create_dir_all(&root).expect("fixture folder");
        root
    })
}

/// Runs the `trace` commands `cmds` in order, in one folder, once per build of the binary: a
/// later call with the same commands (from this test process or a later one) gets the kept
/// result without running anything. Commands name their outputs by relative paths (`-o
/// a.trace`), which land in [`Fixture::dir`]; an argument naming an existing file by an absolute
/// path (a model) is keyed by its size and modification time too, so a re-fetched model records
/// again. A run where a command crashed is not kept.
///
/// This is how the suite records a run once and shares it: tests that need the same run call
/// `fixture` with the same commands. Runs made by other fixtures are referred to by their
/// [`Fixture::path`].
pub fn fixture(cmds: &[&[&str]]) -> Fixture {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};
    let mut key = String::new();
    for c in cmds {
        for a in *c {
            key.push_str(a);
            // A file named by an absolute path (a model) is keyed by its size and mtime too;
            // relative paths name the fixture's own outputs.
            let meta = Some(Path::new(a)).filter(|p| p.is_absolute()).and_then(|p| std::fs::metadata(p).ok());
            if let Some(m) = meta {
                if m.is_file() {
                    let t = m.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map_or(0, |d| d.as_nanos());
                    key.push_str(&format!("\u{1}{}:{t}", m.len()));
                }
            }
            key.push('\0');
        }
        key.push('\n');
    }
    let id = format!("{:016x}", candle_trace::hash::xxh3_64(key.as_bytes()));
    // One in-process lock per key: two tests asking for the same run wait for one recording.
    static LOCKS: OnceLock<Mutex<HashMap<String, Arc<Mutex<()>>>>> = OnceLock::new();
    let lock = LOCKS.get_or_init(Default::default).lock().unwrap_or_else(std::sync::PoisonError::into_inner).entry(id.clone()).or_default().clone();
    let _held = lock.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = fixture_root().join(&id);
    let results = dir.join("results.json");
    if let Ok(s) = std::fs::read_to_string(&results) {
        if let Ok(runs) = serde_json::from_str::<Vec<(i32, String, String)>>(&s) {
            return Fixture { dir, runs };
        }
    }
    // Run in a fresh folder, then rename it into place: a process killed half-way leaves no
    // fixture behind, and two test processes racing (nextest) both end with a complete one.
    let work = fixture_root().join(format!("{id}.{}.tmp", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).expect("fixture work folder");
    let mut runs = Vec::new();
    for c in cmds {
        let o = Command::new(env!("CARGO_BIN_EXE_trace")).args(*c).current_dir(&work).output().expect("run trace");
        runs.push((o.status.code().unwrap_or(-1), String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned()));
    }
    // A command that crashed or was killed (no exit code 0, 1 or 2) is not kept: the next
    // test run tries again instead of inheriting the failure.
    if runs.iter().any(|r| !(0..=2).contains(&r.0)) {
        return Fixture { dir: work, runs };
    }
    std::fs::write(work.join("results.json"), serde_json::to_string(&runs).expect("json")).expect("write results");
    if std::fs::rename(&work, &dir).is_err() {
        // Another process finished the same fixture first: use its copy.
        let _ = std::fs::remove_dir_all(&work);
    }
    Fixture { dir, runs }
}

/// The README walkthrough's SmolLM2 runs, recorded once and shared: ChatML prompt "Tell me about
/// Richard Feynman.", 16 greedy tokens, the whole prompt in one prefill pass (`whole.trace`) and
/// in chunks of 18 tokens (`chunk18.trace`); then `bisect` of the two (command 2) and `bisect
/// --causal` writing `patched.trace` (command 3).
pub fn smollm2_walkthrough() -> Fixture {
    let m = smollm2_path();
    let m = m.to_str().expect("utf-8 path");
    let base = ["record", "--model", m, "--chat", "--prompt", "Tell me about Richard Feynman.", "--max-tokens", "16"];
    fixture(&[
        &[&base[..], &["-o", "whole.trace"]].concat(),
        &[&base[..], &["--prefill-chunk", "18", "-o", "chunk18.trace"]].concat(),
        &["bisect", "whole.trace", "chunk18.trace"],
        &["bisect", "whole.trace", "chunk18.trace", "--causal", "--model", m, "--causal-out", "patched.trace"],
    ])
}

/// The README's `trace check` of SmolLM2 (shared fixture): ChatML prompt "Tell me about Richard
/// Feynman.", 16 tokens, 2 runs per condition, threads and prefill chunk varied, traces kept
/// under `check/` (`check/baseline.trace`, `check/threads-1-1.trace`, …).
pub fn smollm2_check() -> Fixture {
    let m = smollm2_path();
    let m = m.to_str().expect("utf-8 path");
    fixture(&[&["check", "--model", m, "--chat", "--prompt", "Tell me about Richard Feynman.", "--max-tokens", "16", "--runs", "2", "--vary", "threads,prefill-chunk", "--out", "check"]])
}

/// `trace bisect A B --tolerance auto --format json`: exit code (0 or 1, asserted) and report.
pub fn across(a: &Path, b: &Path) -> (i32, serde_json::Value) {
    let (code, out, err) = trace_s(&["bisect", p(a), p(b), "--tolerance", "auto", "--format", "json"]);
    assert!(code == 0 || code == 1, "{err}");
    (code, json(&out))
}

/// The largest relative error over the layers of an `across` report.
pub fn worst_layer(rep: &serde_json::Value) -> f64 {
    rep["layers"].as_array().unwrap().iter().map(|l| l[1].as_f64().unwrap()).fold(0.0, f64::max)
}

/// Each dumped op output of `t` with the module path of its op record, in file order.
pub fn dumps_with_paths(t: &Trace) -> Vec<(String, &candle_trace::record::Dump)> {
    let mut sites = Vec::new();
    let mut path_of = std::collections::HashMap::new();
    let mut out = Vec::new();
    for item in &t.items {
        match item {
            candle_trace::record::Item::Site { path, .. } => sites.push(path.clone()),
            candle_trace::record::Item::Op(r) => {
                path_of.insert(r.seq, sites[r.site as usize].clone());
            }
            candle_trace::record::Item::Dump(d) => out.push((path_of[&d.seq].clone(), d)),
            _ => {}
        }
    }
    out
}
