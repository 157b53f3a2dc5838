//! Sentence encoders: loading a Hugging Face sentence-transformers folder (BERT architecture) and
//! embedding texts through the instrumented [`Bert`] forward pass.
//!
//! A folder holds `config.json` (`model_type: "bert"`), `model.safetensors`, `tokenizer.json` and,
//! for sentence-transformers models, `modules.json` naming the pooling module (its
//! `config.json`, e.g. `1_Pooling/config.json`, says `pooling_mode_mean_tokens` or
//! `pooling_mode_cls_token`) and optionally a `Normalize` module; `sentence_bert_config.json` may
//! set `max_seq_length`. A folder without `modules.json` (a plain Hugging Face BERT) gets mean
//! pooling without normalisation, which is what sentence-transformers itself falls back to.
//!
//! Tokenization follows sentence-transformers, not the padding and truncation stored in
//! `tokenizer.json` (all-MiniLM-L6-v2's pads every text to 128 tokens): the texts of a call form
//! one batch padded to the longest (padding hidden by the attention mask), truncated at
//! `max_seq_length` (or `max_position_embeddings` without it, and never beyond).

use crate::models::bert::{Bert, BertConfig, BertLayerWeights, BertWeights, HiddenAct};
use crate::models::folder::{read_json, Folder};
use crate::tracer::Tracer;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_trace_format::error::{Error, Result};
use candle_trace_format::record::{ModelInfo, Phase};
use serde_json::Value;
use std::path::{Path, PathBuf};
use tokenizers::{PaddingDirection, PaddingParams, PaddingStrategy, Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy};

/// How token embeddings become one sentence embedding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    /// Masked mean over the tokens.
    Mean,
    /// Masked mean, then L2 normalisation.
    MeanNormalize,
    /// The first (`[CLS]`) token.
    Cls,
    /// The first token, then L2 normalisation.
    ClsNormalize,
}

impl Pooling {
    /// The name written in trace headers.
    pub fn as_str(self) -> &'static str {
        match self {
            Pooling::Mean => "mean",
            Pooling::MeanNormalize => "mean+normalize",
            Pooling::Cls => "cls",
            Pooling::ClsNormalize => "cls+normalize",
        }
    }
    fn cls(self) -> bool {
        matches!(self, Pooling::Cls | Pooling::ClsNormalize)
    }
    fn normalize(self) -> bool {
        matches!(self, Pooling::MeanNormalize | Pooling::ClsNormalize)
    }
}

impl std::fmt::Display for Pooling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An encoder ready to run: the instrumented model, its tokenizer (padding and truncation set as
/// described in the module docs), its description and its pooling.
pub struct LoadedEncoder {
    /// The instrumented BERT forward pass, weights in the dtype asked of [`load_folder`].
    pub model: Bert,
    /// `tokenizer.json`, set to pad right to the batch's longest text and truncate at
    /// `max_seq_length` tokens.
    pub tokenizer: Tokenizer,
    /// The model section of the trace header: file name, size in bytes, sha256, config.
    pub info: ModelInfo,
    /// From `modules.json` and its pooling module's config; [`Pooling::Mean`] without
    /// `modules.json`.
    pub pooling: Pooling,
}

/// Model types [`load_folder`] runs.
pub const SUPPORTED: &[&str] = &["bert"];

/// Loads a Hugging Face sentence-transformers folder (see the module docs) with weights converted
/// to `dtype` (f32, f16 or bf16) on `device`.
///
/// # Errors
/// [`Error::Model`], one line naming the folder or file: not a folder, no `config.json`, invalid
/// or unsupported config (`model_type` other than `bert`, unknown `hidden_act`), no or unreadable
/// `tokenizer.json`, unsupported pooling, no `model.safetensors`, a tensor missing or of the wrong
/// shape, a dtype the file cannot give (`dtype` not a float type, or tensors stored as integers).
/// [`Error::Io`] when a file cannot be read.
pub fn load_folder(dir: &Path, dtype: DType, device: &Device) -> Result<LoadedEncoder> {
    let folder = Folder::open(dir)?;
    let (config_path, config) = (&folder.config_path, &folder.config);
    let cfg = parse_config(config_path, config)?;

    let tokenizer_path = dir.join("tokenizer.json");
    if !tokenizer_path.is_file() {
        return Err(Error::model(&tokenizer_path, "missing; the model folder needs its tokenizer.json"));
    }
    let mut tokenizer = Tokenizer::from_file(&tokenizer_path).map_err(|e| Error::model(&tokenizer_path, format!("unreadable tokenizer: {e}")))?;
    let max_len = max_seq_length(dir, &cfg)?;
    configure_tokenizer(&mut tokenizer, &tokenizer_path, config, max_len)?;

    let pooling = read_pooling(dir)?;

    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Err(Error::model(dir, format!("cannot run in dtype {}; BERT runs in f32, f16 or bf16", dtype.as_str())));
    }
    let st = folder.weights()?;
    let prefix = if st.contains("embeddings.word_embeddings.weight") {
        ""
    } else if st.contains("bert.embeddings.word_embeddings.weight") {
        "bert."
    } else {
        return Err(Error::model(&st.origin, "missing tensor embeddings.word_embeddings.weight"));
    };
    for alternatives in &required_tensors(&cfg) {
        let found = alternatives.iter().find_map(|n| Some((n, st.stored_dtype(&format!("{prefix}{n}"))?)));
        let Some((name, stored)) = found else {
            return Err(Error::model(&st.origin, format!("missing tensor {prefix}{}", alternatives[0])));
        };
        if !matches!(stored, safetensors::Dtype::F32 | safetensors::Dtype::F16 | safetensors::Dtype::BF16 | safetensors::Dtype::F64) {
            return Err(Error::model(&st.origin, format!("tensor {prefix}{name} is stored as {stored:?}, which cannot give {}", dtype.as_str())));
        }
    }
    let stored = st.stored_dtype(&format!("{prefix}embeddings.word_embeddings.weight")).map_or("?".into(), |d| format!("{d:?}").to_ascii_lowercase());
    let info = st.info(&folder, "bert", cfg.num_hidden_layers, cfg.vocab_size, stored)?;
    let origin = st.origin.clone();
    let vb = st.into_var_builder(dtype, device);
    let vb = if prefix.is_empty() { vb } else { vb.pp("bert") };
    let weights = load_weights(&vb, &cfg).map_err(|e| Error::model(&origin, e.to_string()))?;
    let model = Bert::new(cfg, weights, dtype, device)?;
    Ok(LoadedEncoder { model, tokenizer, info, pooling })
}

/// A tokenized batch, padded to its longest text.
#[derive(Clone, Debug)]
pub struct Batch {
    /// `[batch, seq]` u32.
    pub input_ids: Tensor,
    /// `[batch, seq]` u32.
    pub token_type_ids: Tensor,
    /// `[batch, seq]` u32, 1 = token, 0 = padding.
    pub attention_mask: Tensor,
    /// Each text's token ids without padding.
    pub tokens: Vec<Vec<u32>>,
}

/// Tokenizes `texts` as one batch (see the module docs).
///
/// # Errors
/// [`Error::Usage`] when there is no text, the tokenizer fails, or a text gives no token.
pub fn tokenize(enc: &LoadedEncoder, texts: &[String]) -> Result<Batch> {
    if texts.is_empty() {
        return Err(Error::usage("no text to embed"));
    }
    let encodings = enc.tokenizer.encode_batch(texts.to_vec(), true).map_err(|e| Error::usage(format!("the tokenizer refused the text: {e}")))?;
    let b = encodings.len();
    let seq = encodings.iter().map(|e| e.get_ids().len()).max().unwrap_or(0);
    let (mut ids, mut types, mut mask, mut tokens) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (i, e) in encodings.iter().enumerate() {
        if e.get_ids().len() != seq {
            return Err(Error::usage("the tokenizer did not pad the batch to one length"));
        }
        let row: Vec<u32> = e.get_ids().iter().zip(e.get_attention_mask()).filter(|(_, &m)| m != 0).map(|(&t, _)| t).collect();
        if row.is_empty() {
            return Err(Error::usage(format!("text {} ({:?}) gives no token", i + 1, texts[i])));
        }
        tokens.push(row);
        ids.extend_from_slice(e.get_ids());
        types.extend_from_slice(e.get_type_ids());
        mask.extend_from_slice(e.get_attention_mask());
    }
    let device = enc.model.device();
    Ok(Batch { input_ids: Tensor::from_vec(ids, (b, seq), device)?, token_type_ids: Tensor::from_vec(types, (b, seq), device)?, attention_mask: Tensor::from_vec(mask, (b, seq), device)?, tokens })
}

/// Embeds `texts` in one forward pass: tokenizes them as one batch ([`tokenize`]), calls
/// `tr.begin_forward(Phase::Prefill, 0, &input_ids)`, runs the instrumented forward pass and the
/// pooling, calls `tr.end_forward()`, and returns one f32 vector per text, in order. The
/// embeddings are not recorded here: the caller records them (`tr.embeddings`).
///
/// # Errors
/// See [`tokenize`]; [`Error::Usage`] for a batch longer than the model's positions; candle
/// errors; sink errors.
pub fn embed(enc: &mut LoadedEncoder, texts: &[String], tr: &mut Tracer) -> Result<Vec<Vec<f32>>> {
    let batch = tokenize(enc, texts)?;
    tr.begin_forward(Phase::Prefill, 0, &batch.input_ids)?;
    // Right padding: row r's tokens are positions 0 .. len_r; padding stays out of the per-token
    // records, and attention digests cover only the keys the mask lets the row see.
    let seq = batch.input_ids.dim(1)? as u32;
    let lens: Vec<u32> = batch.tokens.iter().map(|t| t.len() as u32).collect();
    tr.set_rows(if lens.iter().all(|&l| l == seq) { Vec::new() } else { lens.iter().map(|&l| (0, l)).collect() });
    let out = enc.model.forward(tr, &batch.input_ids, &batch.token_type_ids, &batch.attention_mask)?;
    let pooled = enc.model.pool(tr, &out, enc.pooling.cls(), enc.pooling.normalize())?;
    let vectors = pooled.t.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    tr.end_forward()?;
    Ok(vectors)
}

fn parse_config(path: &Path, v: &Value) -> Result<BertConfig> {
    let model_type = v.get("model_type").and_then(Value::as_str);
    match model_type {
        Some(t) if SUPPORTED.contains(&t) => {}
        Some(t) => {
            return Err(Error::model(path, format!("unsupported model_type '{t}' (supported: {})", SUPPORTED.join(", "))));
        }
        None => return Err(Error::model(path, format!("no model_type (supported: {})", SUPPORTED.join(", ")))),
    }
    let usize_of = |k: &str, default: Option<usize>| -> Result<usize> {
        match v.get(k) {
            Some(x) => x.as_u64().filter(|&n| n > 0).map(|n| n as usize).ok_or_else(|| Error::model(path, format!("{k} is not a positive whole number"))),
            None => default.ok_or_else(|| Error::model(path, format!("no {k}"))),
        }
    };
    let hidden_act = match v.get("hidden_act").and_then(Value::as_str).unwrap_or("gelu") {
        "gelu" => HiddenAct::GeluErf,
        "gelu_new" | "gelu_pytorch_tanh" => HiddenAct::GeluTanh,
        other => {
            return Err(Error::model(path, format!("unsupported hidden_act '{other}' (supported: gelu, gelu_new, gelu_pytorch_tanh)")));
        }
    };
    if let Some(p) = v.get("position_embedding_type").and_then(Value::as_str) {
        if p != "absolute" {
            return Err(Error::model(path, format!("unsupported position_embedding_type '{p}' (supported: absolute)")));
        }
    }
    let layer_norm_eps = match v.get("layer_norm_eps") {
        None => 1e-12,
        Some(x) => x.as_f64().ok_or_else(|| Error::model(path, "layer_norm_eps is not a number"))?,
    };
    let cfg = BertConfig {
        vocab_size: usize_of("vocab_size", None)?,
        hidden_size: usize_of("hidden_size", None)?,
        num_hidden_layers: usize_of("num_hidden_layers", None)?,
        num_attention_heads: usize_of("num_attention_heads", None)?,
        intermediate_size: usize_of("intermediate_size", None)?,
        hidden_act,
        max_position_embeddings: usize_of("max_position_embeddings", Some(512))?,
        type_vocab_size: usize_of("type_vocab_size", Some(2))?,
        layer_norm_eps,
    };
    if cfg.num_hidden_layers > crate::models::MAX_LAYERS {
        return Err(Error::model(path, format!("num_hidden_layers {} is over the {} this tool takes", cfg.num_hidden_layers, crate::models::MAX_LAYERS)));
    }
    if !cfg.hidden_size.is_multiple_of(cfg.num_attention_heads) {
        return Err(Error::model(path, format!("hidden_size {} is not a multiple of num_attention_heads {}", cfg.hidden_size, cfg.num_attention_heads)));
    }
    Ok(cfg)
}

/// `sentence_bert_config.json`'s `max_seq_length`, capped at the model's positions.
fn max_seq_length(dir: &Path, cfg: &BertConfig) -> Result<usize> {
    let path = dir.join("sentence_bert_config.json");
    if !path.is_file() {
        return Ok(cfg.max_position_embeddings);
    }
    let v = read_json(&path)?;
    match v.get("max_seq_length") {
        None | Some(Value::Null) => Ok(cfg.max_position_embeddings),
        Some(x) => {
            let n = x.as_u64().filter(|&n| n > 0).ok_or_else(|| Error::model(&path, "max_seq_length is not a positive whole number"))?;
            Ok((n as usize).min(cfg.max_position_embeddings))
        }
    }
}

/// Pads to the batch's longest text and truncates at `max_len`, whatever `tokenizer.json` says.
fn configure_tokenizer(tok: &mut Tokenizer, path: &Path, config: &Value, max_len: usize) -> Result<()> {
    let (pad_id, pad_token) = match tok.get_padding() {
        Some(p) => (p.pad_id, p.pad_token.clone()),
        None => match tok.token_to_id("[PAD]") {
            Some(id) => (id, "[PAD]".to_string()),
            None => {
                let id = config.get("pad_token_id").and_then(Value::as_u64).unwrap_or(0) as u32;
                (id, tok.id_to_token(id).unwrap_or_default())
            }
        },
    };
    tok.with_padding(Some(PaddingParams { strategy: PaddingStrategy::BatchLongest, direction: PaddingDirection::Right, pad_to_multiple_of: None, pad_id, pad_type_id: 0, pad_token }));
    tok.with_truncation(Some(TruncationParams { direction: TruncationDirection::Right, max_length: max_len, strategy: TruncationStrategy::LongestFirst, stride: 0 }))
        .map_err(|e| Error::model(path, format!("cannot truncate at {max_len} tokens: {e}")))?;
    Ok(())
}

/// The pooling `modules.json` asks for; mean without normalisation when there is no modules.json.
fn read_pooling(dir: &Path) -> Result<Pooling> {
    let modules_path = dir.join("modules.json");
    if !modules_path.is_file() {
        return Ok(Pooling::Mean);
    }
    let modules = read_json(&modules_path)?;
    let modules = modules.as_array().ok_or_else(|| Error::model(&modules_path, "not a list of modules"))?;
    let type_of = |m: &Value| m.get("type").and_then(Value::as_str).unwrap_or("").to_string();
    let normalize = modules.iter().any(|m| type_of(m).ends_with("models.Normalize"));
    let pool_module = modules.iter().find(|m| type_of(m).ends_with("models.Pooling"));
    let Some(pool_module) = pool_module else {
        return Err(Error::model(&modules_path, "no sentence_transformers.models.Pooling module"));
    };
    let sub = pool_module.get("path").and_then(Value::as_str).unwrap_or("");
    // A module is a subfolder of the model folder: no absolute path, no `..`.
    if !std::path::Path::new(sub).components().all(|c| matches!(c, std::path::Component::Normal(_) | std::path::Component::CurDir)) {
        return Err(Error::model(&modules_path, format!("module path {sub:?} is not a subfolder of the model folder")));
    }
    let pool_path: PathBuf = dir.join(sub).join("config.json");
    if !pool_path.is_file() {
        return Err(Error::model(&pool_path, "missing; modules.json names this pooling config"));
    }
    let pc = read_json(&pool_path)?;
    let flag = |k: &str| pc.get(k).and_then(Value::as_bool).unwrap_or(false);
    let mode = pc.get("pooling_mode").and_then(Value::as_str);
    let on: Vec<&str> =
        ["pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken"]
            .into_iter()
            .filter(|k| flag(k))
            .collect();
    let cls = match (on.as_slice(), mode) {
        (["pooling_mode_cls_token"], _) | ([], Some("cls")) => true,
        (["pooling_mode_mean_tokens"], _) | ([], Some("mean")) => false,
        ([], None) => return Err(Error::model(&pool_path, "no pooling mode set")),
        ([], Some(m)) => return Err(Error::model(&pool_path, format!("unsupported pooling mode '{m}' (supported: mean, cls)"))),
        (modes, _) => {
            return Err(Error::model(&pool_path, format!("unsupported pooling {} (supported: mean or cls alone)", modes.join(" + "))));
        }
    };
    Ok(match (cls, normalize) {
        (false, false) => Pooling::Mean,
        (false, true) => Pooling::MeanNormalize,
        (true, false) => Pooling::Cls,
        (true, true) => Pooling::ClsNormalize,
    })
}

/// Every tensor the model reads (without the `bert.` prefix); a LayerNorm may use the old
/// `gamma`/`beta` names, as candle_nn accepts.
fn required_tensors(cfg: &BertConfig) -> Vec<Vec<String>> {
    let mut out: Vec<Vec<String>> = Vec::new();
    let linear = |out: &mut Vec<Vec<String>>, p: &str| {
        out.push(vec![format!("{p}.weight")]);
        out.push(vec![format!("{p}.bias")]);
    };
    let norm = |out: &mut Vec<Vec<String>>, p: &str| {
        out.push(vec![format!("{p}.weight"), format!("{p}.gamma")]);
        out.push(vec![format!("{p}.bias"), format!("{p}.beta")]);
    };
    for e in ["word_embeddings", "position_embeddings", "token_type_embeddings"] {
        out.push(vec![format!("embeddings.{e}.weight")]);
    }
    norm(&mut out, "embeddings.LayerNorm");
    for i in 0..cfg.num_hidden_layers {
        let l = format!("encoder.layer.{i}");
        for m in ["attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense", "intermediate.dense", "output.dense"] {
            linear(&mut out, &format!("{l}.{m}"));
        }
        norm(&mut out, &format!("{l}.attention.output.LayerNorm"));
        norm(&mut out, &format!("{l}.output.LayerNorm"));
    }
    out
}

/// Loads the weights with the candle_nn builders candle-transformers' BERT uses.
fn load_weights(vb: &VarBuilder, cfg: &BertConfig) -> candle_core::Result<BertWeights> {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let eps = cfg.layer_norm_eps;
    let e = vb.pp("embeddings");
    let word = candle_nn::embedding(cfg.vocab_size, h, e.pp("word_embeddings"))?;
    let position = candle_nn::embedding(cfg.max_position_embeddings, h, e.pp("position_embeddings"))?;
    let token_type = candle_nn::embedding(cfg.type_vocab_size, h, e.pp("token_type_embeddings"))?;
    let embeddings_layer_norm = candle_nn::layer_norm(h, eps, e.pp("LayerNorm"))?;
    let mut layers = Vec::new();
    for n in 0..cfg.num_hidden_layers {
        let l = vb.pp(format!("encoder.layer.{n}"));
        let a = l.pp("attention");
        layers.push(BertLayerWeights {
            query: candle_nn::linear(h, h, a.pp("self").pp("query"))?,
            key: candle_nn::linear(h, h, a.pp("self").pp("key"))?,
            value: candle_nn::linear(h, h, a.pp("self").pp("value"))?,
            attention_output: candle_nn::linear(h, h, a.pp("output").pp("dense"))?,
            attention_layer_norm: candle_nn::layer_norm(h, eps, a.pp("output").pp("LayerNorm"))?,
            intermediate: candle_nn::linear(h, i, l.pp("intermediate").pp("dense"))?,
            output: candle_nn::linear(i, h, l.pp("output").pp("dense"))?,
            output_layer_norm: candle_nn::layer_norm(h, eps, l.pp("output").pp("LayerNorm"))?,
        });
    }
    Ok(BertWeights {
        word_embeddings: word.embeddings().clone(),
        position_embeddings: position.embeddings().clone(),
        token_type_embeddings: token_type.embeddings().clone(),
        embeddings_layer_norm,
        layers,
    })
}
