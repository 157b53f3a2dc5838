//! `trace import`: a reference run's exchange into a trace.
//!
//! The reference recorder (`python/candle_trace_ref`, docs/reference.md) runs a transformers
//! model with hooks and writes a folder holding `exchange.json` (the run's model, settings and
//! environment, its forward passes with each recorded op's module path, op name, token layout
//! and value key, its tokens) and `values.safetensors` (each op's output). This module reads
//! both, checks every count, key and shape against the forward pass it belongs to, and writes a
//! trace through the same [`Tracer`] a candle run records with, every value dumped: the trace
//! format keeps one implementation, and `trace bisect --tolerance` compares the two by value.

use crate::tracer::{Tok, Tracer};
use candle_core::{DType, Device, Tensor};
use candle_trace_format::dump::DumpSpec;
use candle_trace_format::error::{Error, Result};
use candle_trace_format::format::TraceWriter;
use candle_trace_format::limits;
use candle_trace_format::record::{BuildInfo, Choice, EnvInfo, Footer, Header, ModelInfo, Phase, RunInfo, TokenEvent};
use candle_trace_format::site::{Op, Site};
use serde::Deserialize;
use std::collections::HashMap;
use std::path::Path;

/// The exchange version this build reads.
pub const EXCHANGE_VERSION: u32 = 1;
/// Largest `exchange.json` read (the values live in the safetensors file).
const MAX_JSON_BYTES: u64 = 1 << 30;

#[derive(Deserialize)]
struct Exchange {
    format: String,
    version: u32,
    model: ExModel,
    run: ExRun,
    env: ExEnv,
    forwards: Vec<ExForward>,
    #[serde(default)]
    tokens: Vec<ExToken>,
    #[serde(default)]
    embeddings: Vec<Vec<f32>>,
    #[serde(default)]
    not_covered: Vec<String>,
}

#[derive(Deserialize)]
struct ExModel {
    name: String,
    size: u64,
    sha256: String,
    architecture: String,
    n_layers: u32,
    vocab_size: u32,
    #[serde(default)]
    config: serde_json::Map<String, serde_json::Value>,
}

#[derive(Deserialize)]
struct ExRun {
    dtype: String,
    #[serde(default)]
    prompt: String,
    #[serde(default)]
    prompt_tokens: Vec<u32>,
    #[serde(default)]
    max_tokens: u32,
    #[serde(default)]
    texts: Vec<String>,
    #[serde(default)]
    pooling: String,
}

#[derive(Deserialize)]
struct ExEnv {
    implementation: String,
    libraries: std::collections::BTreeMap<String, String>,
    os: String,
    arch: String,
    cpu: String,
    threads: u32,
    device: String,
}

#[derive(Deserialize)]
struct ExForward {
    phase: String,
    index_pos: u32,
    ids: Vec<Vec<u32>>,
    ops: Vec<ExOp>,
}

#[derive(Deserialize)]
struct ExOp {
    path: String,
    op: String,
    value: String,
    tok: String,
}

#[derive(Deserialize)]
struct ExToken {
    step: u32,
    index: u32,
    pos: u32,
    token: u32,
    text: String,
    top: Vec<(u32, f32)>,
}

/// What an import wrote.
#[derive(Debug)]
pub struct Imported {
    /// Forward passes.
    pub forward_passes: u32,
    /// Op records.
    pub op_records: u64,
    /// Generated tokens (row 0).
    pub tokens: usize,
    /// The reference implementation and its libraries, e.g. `transformers (torch 2.15.0, …)`.
    pub implementation: String,
    /// What the reference recorder says it does not cover (see docs/reference.md).
    pub not_covered: Vec<String>,
}

/// Reads the exchange in `dir` and writes it as a trace to `out`, the values of the ops `dump`
/// selects kept in full (`DumpSpec::All` for a comparison of every op; a pattern such as
/// `layers.0.mlp.*` for a trace small enough to attach to a report).
///
/// # Errors
/// [`Error::Trace`] naming the exchange file for a missing or malformed file, an unknown version,
/// a count past the format's limits, a value key missing from `values.safetensors`, a token
/// layout that does not fit its tensor or forward pass, an op name the format does not know;
/// [`Error::Io`] when `out` cannot be written.
pub fn import(dir: &Path, out: &Path, dump: &DumpSpec) -> Result<Imported> {
    let json = dir.join("exchange.json");
    let ex = read_exchange(&json)?;
    let values_path = dir.join("values.safetensors");
    if !values_path.is_file() {
        return Err(Error::trace(&values_path, "no such file (the reference recorder writes it beside exchange.json)"));
    }
    let mut values = candle_core::safetensors::load(&values_path, &Device::Cpu).map_err(|e| Error::trace(&values_path, format!("not a safetensors file: {e}")))?;
    let header = header(&ex, dump);
    let writer = TraceWriter::create(out, &header, Some(&build(&ex)))?;
    let mut tr = Tracer::new(Box::new(writer)).with_dump(dump.clone());
    let mut by_step: HashMap<u32, Vec<&ExToken>> = HashMap::new();
    for t in &ex.tokens {
        by_step.entry(t.step).or_default().push(t);
    }
    let mut caches = Caches::default();
    for (step, f) in ex.forwards.iter().enumerate() {
        write_forward(&mut tr, f, step, (&mut values, &mut caches), &json, &values_path)?;
        for t in by_step.remove(&(step as u32)).unwrap_or_default() {
            let margin = match t.top.as_slice() {
                [a, b, ..] => a.1 - b.1,
                _ => 0.0,
            };
            let tie = matches!(t.top.as_slice(), [a, b, ..] if a.1 == b.1);
            let choice = Choice { row: 0, token: t.token, text: t.text.clone(), top: t.top.clone(), margin, tie };
            tr.token(TokenEvent { step: t.step, index: t.index, pos: t.pos, rows: vec![choice] })?;
        }
    }
    if !by_step.is_empty() {
        return Err(Error::trace(&json, "a token names a forward pass the exchange does not hold"));
    }
    if !ex.embeddings.is_empty() {
        tr.embeddings(ex.embeddings.clone())?;
    }
    let text: String = ex.tokens.iter().map(|t| t.text.as_str()).collect();
    let stop = if !ex.embeddings.is_empty() {
        "done"
    } else if (ex.tokens.len() as u32) < ex.run.max_tokens {
        "eos"
    } else {
        "max_tokens"
    };
    let footer = Footer { items: 0, op_records: tr.op_records(), forward_passes: tr.forward_passes(), tokens_generated: ex.tokens.len() as u32, texts: vec![text], stop: stop.into() };
    tr.finish(&footer)?;
    let mut not_covered = ex.not_covered.clone();
    if caches.rolled > 0 {
        not_covered
            .push(format!("the keys its rolling window cache dropped ({} cache records restored from its earlier passes; attention over them is compared over the keys it held)", caches.rolled));
    }
    Ok(Imported { forward_passes: tr.forward_passes(), op_records: tr.op_records(), tokens: ex.tokens.len(), implementation: implementation(&ex.env), not_covered })
}

fn read_exchange(json: &Path) -> Result<Exchange> {
    let len = std::fs::metadata(json).map_err(|e| Error::io(json, e))?.len();
    if len > MAX_JSON_BYTES {
        return Err(Error::trace(json, format!("{len} bytes: larger than the {MAX_JSON_BYTES} an exchange may hold")));
    }
    let bytes = std::fs::read(json).map_err(|e| Error::io(json, e))?;
    let ex: Exchange = serde_json::from_slice(&bytes).map_err(|e| Error::trace(json, format!("not a reference exchange: {e}")))?;
    if ex.format != "candle-trace-exchange" {
        return Err(Error::trace(json, format!("format {:?}: expected \"candle-trace-exchange\"", ex.format)));
    }
    if ex.version != EXCHANGE_VERSION {
        return Err(Error::trace(json, format!("exchange version {}: this build reads version {EXCHANGE_VERSION}", ex.version)));
    }
    let too_many = |what: &str, n: usize, max: usize| (n > max).then(|| Error::trace(json, format!("{n} {what}: more than the {max} a trace holds")));
    let ids: usize = ex.forwards.iter().map(|f| f.ids.iter().map(Vec::len).sum::<usize>()).sum();
    let checks = [
        too_many("token ids", ids + ex.run.prompt_tokens.len(), limits::MAX_TOKEN_IDS),
        too_many("embeddings", ex.embeddings.len(), limits::MAX_ROWS),
        too_many("texts", ex.run.texts.len(), limits::MAX_ROWS),
        too_many("config entries", ex.model.config.len(), limits::MAX_CONFIG_ENTRIES),
        too_many("forward passes", ex.forwards.len(), u32::MAX as usize),
    ];
    if let Some(e) = checks.into_iter().flatten().next() {
        return Err(e);
    }
    if let Some(e) = ex.embeddings.iter().find(|e| e.len() > limits::MAX_EMBEDDING_DIM) {
        return Err(Error::trace(json, format!("an embedding of {} dims: more than {}", e.len(), limits::MAX_EMBEDDING_DIM)));
    }
    if let Some(t) = ex.tokens.iter().find(|t| t.top.len() > limits::MAX_TOP) {
        return Err(Error::trace(json, format!("token {}: {} top entries, more than {}", t.index, t.top.len(), limits::MAX_TOP)));
    }
    Ok(ex)
}

/// The token layout named in the exchange (`seq:D`, `causal`, `keys`, `cache`, `last`, `whole`).
fn parse_tok(s: &str) -> Option<Tok> {
    Some(match s {
        "causal" => Tok::Causal,
        "keys" => Tok::Keys,
        "cache" => Tok::Cache,
        "last" => Tok::Last,
        "whole" => Tok::Whole,
        _ => Tok::Seq(s.strip_prefix("seq:")?.parse().ok()?),
    })
}

/// Why `t`'s dims do not fit layout `tok` in a pass of `batch` rows of `seq_len` positions from
/// `index_pos`, if they do not.
fn misfit(tok: Tok, dims: &[usize], batch: usize, seq_len: usize, index_pos: usize) -> Option<String> {
    let rank = dims.len();
    let need = |d: usize, want: usize, what: &str| (dims.get(d) != Some(&want)).then(|| format!("dims {dims:?}: dim {d} should hold the pass's {want} {what}"));
    // Dim 0 holds the batch rows, or one row every row shares (position embeddings).
    let rows = |b: usize| if dims.first() == Some(&1) { None } else { need(0, b, "rows") };
    if rank == 0 || rank > limits::MAX_RANK {
        return Some(format!("rank {rank}: expected 1 to {}", limits::MAX_RANK));
    }
    match tok {
        Tok::Whole => None,
        Tok::Last => rows(batch),
        Tok::Seq(d) => rows(batch).or_else(|| need(d, seq_len, "positions")),
        Tok::Causal | Tok::Keys => rows(batch).or_else(|| if rank < 2 { Some(format!("dims {dims:?}: attention needs [b, heads, q, kv]")) } else { need(rank - 2, seq_len, "queries") }),
        Tok::Cache => rows(batch).or_else(|| need(2, index_pos + seq_len, "cached positions")),
    }
}

/// Each cache path's positions so far (`[b, kv_heads, kv, head_dim]`), and how many records of
/// a rolling cache were restored from them.
#[derive(Default)]
struct Caches {
    full: HashMap<String, Tensor>,
    rolled: usize,
}

impl Caches {
    /// A cache record `t` of a pass over `seq_len` positions from `index_pos`, whole: as it is
    /// when it holds every position; when it holds only the latest ones (a rolling window cache,
    /// transformers' `DynamicSlidingWindowLayer`), the pass's new positions appended to the
    /// path's previous record. Anything else is returned as it is, for [`misfit`] to refuse.
    fn restore(&mut self, path: &str, t: Tensor, seq_len: usize, index_pos: usize) -> Result<Tensor> {
        let held = t.dims().get(2).copied().unwrap_or(0);
        let prev = self.full.get(path).filter(|p| p.dims().get(2) == Some(&index_pos) && p.dtype() == t.dtype());
        let t = match prev {
            Some(prev) if t.rank() == 4 && (seq_len..index_pos + seq_len).contains(&held) => {
                self.rolled += 1;
                Tensor::cat(&[prev, &t.narrow(2, held - seq_len, seq_len)?], 2)?
            }
            _ => t,
        };
        if t.dims().get(2) == Some(&(index_pos + seq_len)) {
            self.full.insert(path.to_string(), t.clone());
        }
        Ok(t)
    }
}

fn write_forward(tr: &mut Tracer, f: &ExForward, step: usize, (values, caches): (&mut HashMap<String, Tensor>, &mut Caches), json: &Path, values_path: &Path) -> Result<()> {
    let at = |what: String| Error::trace(json, format!("forward pass {step}: {what}"));
    let phase = match f.phase.as_str() {
        "prefill" => Phase::Prefill,
        "decode" => Phase::Decode,
        p => return Err(at(format!("phase {p:?}: expected prefill or decode"))),
    };
    let seq_len = f.ids.first().map_or(0, Vec::len);
    if f.ids.is_empty() || seq_len == 0 || f.ids.iter().any(|r| r.len() != seq_len) || f.ids.len() > limits::MAX_ROWS {
        return Err(at(format!("ids: expected 1 to {} rows of one non-zero length", limits::MAX_ROWS)));
    }
    let flat: Vec<u32> = f.ids.iter().flatten().copied().collect();
    let ids = Tensor::from_vec(flat, (f.ids.len(), seq_len), &Device::Cpu)?;
    tr.begin_forward(phase, f.index_pos as usize, &ids)?;
    for op in &f.ops {
        let kind = Op::parse(&op.op).ok_or_else(|| at(format!("{}: op {:?} is not one of the format's op names", op.path, op.op)))?;
        if op.path.is_empty() || op.path.len() > 1024 {
            return Err(at(format!("a module path of {} bytes", op.path.len())));
        }
        let tok = parse_tok(&op.tok).ok_or_else(|| at(format!("{}: token layout {:?} (expected seq:D, causal, keys, cache, last or whole)", op.path, op.tok)))?;
        let t = values.remove(&op.value).ok_or_else(|| Error::trace(values_path, format!("no tensor {:?} (op {} of forward pass {step})", op.value, op.path)))?;
        let t = if tok == Tok::Cache { caches.restore(&op.path, t, seq_len, f.index_pos as usize)? } else { t };
        if let Some(why) = misfit(tok, t.dims(), f.ids.len(), seq_len, f.index_pos as usize) {
            return Err(at(format!("{}: {why}", op.path)));
        }
        let t = match (kind, t.dtype()) {
            (Op::Input, DType::I64 | DType::U8 | DType::U32) => t.to_dtype(DType::U32)?,
            (_, DType::F32 | DType::F16 | DType::BF16 | DType::F64) => t,
            (_, d) => return Err(at(format!("{}: dtype {d:?} is not a float type", op.path))),
        };
        tr.record_value(&Site::new(op.path.clone(), kind), t, tok)?;
    }
    tr.end_forward()
}

fn implementation(env: &ExEnv) -> String {
    let libs: Vec<String> = env.libraries.iter().map(|(k, v)| format!("{k} {v}")).collect();
    format!("{} ({})", env.implementation, libs.join(", "))
}

fn header(ex: &Exchange, dump: &DumpSpec) -> Header {
    let mut config: Vec<(String, String)> = ex.model.config.iter().map(|(k, v)| (k.clone(), v.to_string())).collect();
    config.sort();
    let m = &ex.model;
    let model = ModelInfo {
        name: m.name.clone(),
        size: m.size,
        sha256: m.sha256.clone(),
        architecture: m.architecture.clone(),
        n_layers: m.n_layers,
        vocab_size: m.vocab_size,
        weights: format!("{} (as the reference loads them)", ex.run.dtype),
        config,
    };
    let batch = ex.forwards.first().map_or(1, |f| f.ids.len() as u32);
    let run = RunInfo {
        model,
        dtype: ex.run.dtype.clone(),
        prompt: ex.run.prompt.clone(),
        prompt_tokens: ex.run.prompt_tokens.clone(),
        max_tokens: ex.run.max_tokens,
        batch,
        threads: ex.env.threads,
        dump: dump.to_arg(),
        texts: ex.run.texts.clone(),
        pooling: ex.run.pooling.clone(),
        ..RunInfo::default()
    };
    let env = EnvInfo {
        crate_version: format!("reference recorder, imported by candle-trace {}", env!("CARGO_PKG_VERSION")),
        candle_version: format!("none: {}", implementation(&ex.env)),
        rustc: "none".into(),
        os: ex.env.os.clone(),
        arch: ex.env.arch.clone(),
        cpu: ex.env.cpu.clone(),
        simd: Vec::new(),
        threads: ex.env.threads,
        device: ex.env.device.clone(),
        env_vars: Vec::new(),
    };
    Header { run, env }
}

fn build(ex: &Exchange) -> BuildInfo {
    BuildInfo {
        target_features: Vec::new(),
        target_cpu: String::new(),
        features: vec![format!("reference:{}", ex.env.implementation)],
        crates: ex.env.libraries.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_parse_and_misfits_are_named() {
        assert_eq!(parse_tok("seq:2"), Some(Tok::Seq(2)));
        assert_eq!(parse_tok("cache"), Some(Tok::Cache));
        assert_eq!(parse_tok("seq:x"), None);
        assert_eq!(parse_tok("rows"), None);
        assert!(misfit(Tok::Seq(1), &[1, 6, 576], 1, 6, 0).is_none());
        assert!(misfit(Tok::Seq(1), &[1, 5, 576], 1, 6, 0).unwrap().contains("dim 1"));
        assert!(misfit(Tok::Seq(7), &[1, 6], 1, 6, 0).is_some());
        assert!(misfit(Tok::Causal, &[1, 9, 6, 6], 1, 6, 0).is_none());
        assert!(misfit(Tok::Cache, &[1, 3, 7, 64], 1, 1, 6).is_none());
        assert!(misfit(Tok::Cache, &[1, 3, 6, 64], 1, 1, 6).is_some());
        assert!(misfit(Tok::Last, &[2, 49152], 1, 1, 6).is_some());
        assert!(misfit(Tok::Seq(1), &[1, 9, 384], 2, 9, 0).is_none(), "one row shared by every row");
        assert!(misfit(Tok::Seq(1), &[3, 9, 384], 2, 9, 0).is_some());
        assert!(misfit(Tok::Whole, &[], 1, 1, 0).is_some());
    }
}
