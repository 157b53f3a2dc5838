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
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
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
/// on first use. Fails as [`smollm2_path`] does when the GGUF file is missing.
pub fn smollm2_hf_path() -> PathBuf {
    static MADE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    let gguf = smollm2_path();
    MADE.get_or_init(|| {
        let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/models/smollm2-hf"));
        if !dir.join("model.safetensors").is_file() || !dir.join("tokenizer.json").is_file() {
            candle_trace::models::export::gguf_to_hf(&gguf, &dir).expect("gguf_to_hf");
        }
        dir
    })
    .clone()
}

/// Parses a command's JSON output (`--format json`).
pub fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("not JSON ({e}):\n{s}"))
}

/// Held by the tests that run SmolLM2 `--causal` (a minute of 2-thread re-runs each): two at
/// once on a 2-core machine oversubscribe rayon's spinning workers and take several times longer.
pub fn heavy() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
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
