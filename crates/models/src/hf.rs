//! Loads Hugging Face model folders (config.json, model.safetensors or a sharded
//! model.safetensors.index.json, tokenizer.json, tokenizer_config.json) into the instrumented
//! decoder, for the architectures candle-transformers implements as `models::llama`,
//! `models::qwen2` and `models::mistral`. Hyper-parameters, tensor names, tied embeddings and
//! rotary tables follow those implementations; [`Flavour`] carries their numeric differences.
//! BERT folders are encoders and load through the run crate's `encoder`.

use crate::folder::Folder;
use crate::llama::{BlockWeights, Flavour, GateUpProj, Llama, LlamaConfig, LlamaWeights, QkvProj, RopeSpec, MAX_SEQ_LEN};
use crate::tokenizer::TextTokenizer;
use crate::LoadedModel;
use candle_core::{DType, Device, Tensor};
use candle_trace_format::error::{Error, Result};
use candle_trace_format::record::ModelInfo;
use candle_trace_instrument::ops::Weight;
use serde::Deserialize;
use std::path::Path;

/// Architectures a folder may hold (`model_type` in config.json).
pub const SUPPORTED: &[&str] = &["llama", "qwen2", "mistral", "bert"];

/// The fields of config.json the decoders read (a serde mirror; unknown fields are ignored).
#[derive(Debug, Clone, Deserialize)]
pub struct HfConfig {
    /// `model_type` (`llama`, `qwen2`, `mistral`). Not read by the loader: [`architecture`]
    /// reads it from config.json directly.
    pub model_type: Option<String>,
    /// `architectures` (e.g. `Qwen2ForCausalLM`); empty when absent. Not read by the loader:
    /// [`architecture`] falls back to its first entry without `model_type`.
    #[serde(default)]
    pub architectures: Vec<String>,
    /// `hidden_size` (required): the residual stream is `[batch, seq, hidden_size]`.
    pub hidden_size: usize,
    /// `intermediate_size` (required): output width of `mlp.gate_proj` and `mlp.up_proj`.
    pub intermediate_size: usize,
    /// `num_hidden_layers` (required): decoder blocks.
    pub num_hidden_layers: usize,
    /// `num_attention_heads` (required, non-zero): query heads per layer.
    pub num_attention_heads: usize,
    /// `num_key_value_heads`: GQA heads, a divisor of `num_attention_heads`; absent:
    /// `num_attention_heads` (no grouping).
    pub num_key_value_heads: Option<usize>,
    /// `head_dim`, read for mistral only; absent (and always for llama and qwen2):
    /// `hidden_size / num_attention_heads`.
    pub head_dim: Option<usize>,
    /// `rms_norm_eps` (required): epsilon of every RMSNorm.
    pub rms_norm_eps: f64,
    /// `rope_theta`: the rotary base; absent: 10000.
    pub rope_theta: Option<f64>,
    /// `vocab_size` (required), in tokens: rows of `embed_tokens` and `lm_head`.
    pub vocab_size: usize,
    /// `tie_word_embeddings`: llama uses `embed_tokens` as `lm_head` when true (absent: false);
    /// qwen2 ties when the weights have no `lm_head.weight`, mistral never.
    pub tie_word_embeddings: Option<bool>,
    /// `sliding_window`, in positions: qwen2's window (absent: `usize::MAX / 2`, no window in
    /// practice) and mistral's (absent: none); llama ignores it.
    pub sliding_window: Option<usize>,
    /// `use_sliding_window` (qwen2): whether transformers applies the window at all (absent:
    /// false); candle-transformers applies it regardless.
    pub use_sliding_window: Option<bool>,
    /// `max_window_layers` (qwen2): the window applies from this layer on (absent: 28).
    pub max_window_layers: Option<usize>,
    /// `bos_token_id`: a number, or a list whose first entry is used; the tokenizer's
    /// beginning-of-sequence id, none when absent or not a number.
    pub bos_token_id: Option<serde_json::Value>,
    /// `eos_token_id`: a number, or a list whose first entry is used; the id that ends
    /// generation, none when absent or not a number.
    pub eos_token_id: Option<serde_json::Value>,
    /// `rope_scaling`; absent: no scaling. Only llama3 (or `default`) scaling of a llama model
    /// loads; any other is an [`Error::Model`].
    pub rope_scaling: Option<RopeScaling>,
    /// `hidden_act`; absent: SiLU. Any value other than `silu` is an [`Error::Model`].
    pub hidden_act: Option<String>,
    /// `torch_dtype` (e.g. `bfloat16`): written as the trace header's [`ModelInfo::weights`];
    /// absent: `safetensors`. It does not set the compute dtype.
    pub torch_dtype: Option<String>,
}

/// Llama 3 rope scaling (`rope_scaling` with `rope_type: "llama3"`), as candle-transformers'
/// llama applies it.
#[derive(Debug, Clone, Deserialize)]
pub struct RopeScaling {
    /// `rope_type`: `llama3` applies the scaling below, `default` loads unscaled (`type`, the
    /// older key, counts the same when `rope_type` is absent).
    pub rope_type: Option<String>,
    /// Older configs name the scaling kind `type`.
    #[serde(rename = "type")]
    pub kind: Option<String>,
    /// `factor` (absent: 1): what long-wavelength rotary frequencies are divided by.
    pub factor: Option<f32>,
    /// `low_freq_factor` (absent: 1): frequencies whose wavelength exceeds
    /// `original_max_position_embeddings / low_freq_factor` are divided by `factor`.
    pub low_freq_factor: Option<f32>,
    /// `high_freq_factor` (absent: 4): frequencies whose wavelength is under
    /// `original_max_position_embeddings / high_freq_factor` are kept; those between interpolate.
    pub high_freq_factor: Option<f32>,
    /// `original_max_position_embeddings` (absent: 8192), in positions: the context length both
    /// wavelength thresholds are fractions of.
    pub original_max_position_embeddings: Option<usize>,
}

fn first_id(v: &Option<serde_json::Value>) -> Option<u32> {
    match v.as_ref()? {
        serde_json::Value::Number(n) => n.as_u64().map(|x| x as u32),
        serde_json::Value::Array(a) => a.first()?.as_u64().map(|x| x as u32),
        _ => None,
    }
}

/// The architecture a folder holds: config.json's `model_type` (or its `architectures` entry).
///
/// # Errors
/// [`Error::Model`] when the folder or its config.json is missing or unreadable, or names no
/// supported architecture (the message lists the supported ones).
pub fn architecture(dir: &Path) -> Result<String> {
    let folder = Folder::open(dir)?;
    let arch = folder.architecture(&["qwen2", "mistral", "llama", "bert"]);
    if !SUPPORTED.contains(&arch.as_str()) {
        return Err(Error::model(&folder.config_path, format!("unsupported architecture '{arch}' (supported: {}, and GGUF llama)", SUPPORTED.join(", "))));
    }
    Ok(arch)
}

/// Reads and checks config.json.
///
/// # Errors
/// [`Error::Model`] for a missing/unparseable config or inconsistent head counts.
pub fn read_config(folder: &Folder) -> Result<HfConfig> {
    let path = &folder.config_path;
    let cfg = HfConfig::deserialize(&folder.config).map_err(|e| Error::model(path, format!("{e}")))?;
    let kv = cfg.num_key_value_heads.unwrap_or(cfg.num_attention_heads);
    if cfg.num_attention_heads == 0 || kv == 0 || !cfg.num_attention_heads.is_multiple_of(kv) {
        return Err(Error::model(path, "inconsistent head counts"));
    }
    if cfg.num_hidden_layers > super::MAX_LAYERS {
        return Err(Error::model(path, format!("num_hidden_layers {} is over the {} this tool takes", cfg.num_hidden_layers, super::MAX_LAYERS)));
    }
    Ok(cfg)
}

/// Inverse rotary frequencies of an architecture, as its candle-transformers model computes them.
fn rope_spec(arch: &str, cfg: &HfConfig, head_dim: usize) -> RopeSpec {
    let theta = cfg.rope_theta.unwrap_or(10_000.0);
    match arch {
        "qwen2" => RopeSpec::f64_powers(head_dim, theta, None),
        "llama" => {
            let mut spec = RopeSpec::standard(head_dim, theta as f32);
            if let Some(rs) = cfg.rope_scaling.as_ref().filter(|r| r.rope_type.as_deref().or(r.kind.as_deref()) == Some("llama3")) {
                let (factor, lo, hi) = (rs.factor.unwrap_or(1.0), rs.low_freq_factor.unwrap_or(1.0), rs.high_freq_factor.unwrap_or(4.0));
                let orig = rs.original_max_position_embeddings.unwrap_or(8192) as f32;
                let (lo_wavelen, hi_wavelen) = (orig / lo, orig / hi);
                spec.inv_freq = spec
                    .inv_freq
                    .into_iter()
                    .map(|freq| {
                        let wavelen = 2. * std::f32::consts::PI / freq;
                        if wavelen < hi_wavelen {
                            freq
                        } else if wavelen > lo_wavelen {
                            freq / factor
                        } else {
                            let smooth = (orig / wavelen - lo) / (hi - lo);
                            (1. - smooth) * freq / factor + smooth * freq
                        }
                    })
                    .collect();
            }
            spec
        }
        _ => RopeSpec::standard(head_dim, theta as f32),
    }
}

/// Refuses what the llama-family forward pass does not compute: an activation other than SiLU,
/// rope scaling other than llama3's on a llama model (as candle-transformers).
fn check_supported(dir: &Path, arch: &str, cfg: &HfConfig) -> Result<()> {
    if let Some(act) = cfg.hidden_act.as_deref().filter(|a| *a != "silu") {
        return Err(Error::model(&dir.join("config.json"), format!("hidden_act '{act}' is not supported (only silu)")));
    }
    if let Some(rs) = &cfg.rope_scaling {
        let kind = rs.rope_type.clone().or_else(|| rs.kind.clone()).unwrap_or_default();
        if !(arch == "llama" && (kind == "llama3" || kind == "default")) {
            return Err(Error::model(&dir.join("config.json"), format!("rope_scaling '{kind}' is not supported (only llama3 scaling of llama models, as candle-transformers)")));
        }
    }
    Ok(())
}

/// The forward pass's flavour for architecture `arch`, its sliding window as upstream applies it
/// (qwen2 always has one, as candle-transformers; mistral when config.json gives one), and as
/// the model defines it (mistral's when given; qwen2's only with `use_sliding_window`, which
/// transformers applies from layer `max_window_layers` on: refused when such a window could hide
/// a key within [`MAX_SEQ_LEN`]).
fn flavour_of(arch: &str, cfg: &HfConfig, path: &Path) -> Result<(Flavour, Option<usize>, Option<usize>)> {
    let flavour = match arch {
        "llama" => Flavour::Llama,
        "qwen2" => Flavour::Qwen2,
        _ => Flavour::Mistral,
    };
    let sliding_window = match arch {
        "qwen2" => Some(cfg.sliding_window.unwrap_or(usize::MAX / 2)),
        "mistral" => cfg.sliding_window,
        _ => None,
    };
    let window = match arch {
        "mistral" => cfg.sliding_window,
        "qwen2" if cfg.use_sliding_window == Some(true) => {
            let w = cfg.sliding_window.unwrap_or(4096);
            let per_layer = cfg.max_window_layers.unwrap_or(28) < cfg.num_hidden_layers;
            if w < MAX_SEQ_LEN && per_layer {
                return Err(Error::model(path, format!("qwen2 with use_sliding_window and a window of {w} positions: windows on some layers only (from max_window_layers) are not supported")));
            }
            None
        }
        _ => None,
    };
    Ok((flavour, sliding_window, window))
}

/// Loads the decoder of a llama/qwen2/mistral folder in `dtype`, without its tokenizer.
///
/// # Errors
/// [`Error::Model`] naming the folder or file: missing config.json or weights, unsupported
/// architecture, a tensor missing from the safetensors, an activation other than SiLU.
pub fn load_decoder(dir: &Path, dtype: DType, device: &Device) -> Result<(Llama, HfConfig, ModelInfo)> {
    let arch = architecture(dir)?;
    if arch == "bert" {
        return Err(Error::model(dir, "a BERT folder is an encoder: record it with --text"));
    }
    let folder = Folder::open(dir)?;
    let cfg = read_config(&folder)?;
    check_supported(dir, &arch, &cfg)?;
    let weights = folder.weights()?;
    let info = weights.info(&folder, &arch, cfg.num_hidden_layers, cfg.vocab_size, cfg.torch_dtype.clone().unwrap_or_else(|| "safetensors".into()))?;
    let vb = weights.into_var_builder(dtype, device);
    let get = |shape: (usize, usize), name: &str| -> Result<Tensor> { vb.get(shape, name).map_err(|e| Error::model(dir, format!("tensor {name}: {e}"))) };
    let get1 = |n: usize, name: &str| -> Result<Tensor> { vb.get(n, name).map_err(|e| Error::model(dir, format!("tensor {name}: {e}"))) };
    let n_head = cfg.num_attention_heads;
    let n_kv = cfg.num_key_value_heads.unwrap_or(n_head);
    let head_dim = match arch.as_str() {
        "mistral" => cfg.head_dim.unwrap_or(cfg.hidden_size / n_head),
        _ => cfg.hidden_size / n_head,
    };
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let bias = arch == "qwen2";
    let lin = |out: usize, inp: usize, name: &str, with_bias: bool| -> Result<Weight> {
        let w = get((out, inp), &format!("{name}.weight"))?;
        let b = if with_bias { Some(get1(out, &format!("{name}.bias"))?) } else { None };
        Ok(Weight::Dense(candle_nn::Linear::new(w, b)))
    };
    let norm = |name: &str| -> Result<candle_nn::RmsNorm> { Ok(candle_nn::RmsNorm::new(get1(h, &format!("{name}.weight"))?, cfg.rms_norm_eps)) };
    let embed_tokens = get((cfg.vocab_size, h), "model.embed_tokens.weight")?;
    let mut blocks = Vec::new();
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        blocks.push(BlockWeights {
            qkv: QkvProj::Split {
                q: lin(n_head * head_dim, h, &format!("{p}.self_attn.q_proj"), bias)?,
                k: lin(n_kv * head_dim, h, &format!("{p}.self_attn.k_proj"), bias)?,
                v: lin(n_kv * head_dim, h, &format!("{p}.self_attn.v_proj"), bias)?,
            },
            o_proj: lin(h, n_head * head_dim, &format!("{p}.self_attn.o_proj"), false)?,
            gate_up: GateUpProj::Split { gate: lin(i, h, &format!("{p}.mlp.gate_proj"), false)?, up: lin(i, h, &format!("{p}.mlp.up_proj"), false)? },
            down_proj: lin(h, i, &format!("{p}.mlp.down_proj"), false)?,
            input_layernorm: norm(&format!("{p}.input_layernorm"))?,
            post_attention_layernorm: norm(&format!("{p}.post_attention_layernorm"))?,
            qk_norm: None,
        });
    }
    let tied = match arch.as_str() {
        "llama" => cfg.tie_word_embeddings.unwrap_or(false),
        "qwen2" => !vb.contains_tensor("lm_head.weight"),
        _ => false,
    };
    let lm_head = if tied { Weight::Dense(candle_nn::Linear::new(embed_tokens.clone(), None)) } else { lin(cfg.vocab_size, h, "lm_head", false)? };
    let (flavour, sliding_window, window) = flavour_of(&arch, &cfg, &dir.join("config.json"))?;
    let lcfg = LlamaConfig {
        flavour,
        n_layer: cfg.num_hidden_layers,
        n_head,
        n_kv_head: n_kv,
        hidden: h,
        rope_dim: head_dim,
        rope_base: cfg.rope_theta.unwrap_or(10_000.0) as f32,
        rms_eps: cfg.rms_norm_eps,
        vocab: cfg.vocab_size,
        rope_neox: true,
        head_dim,
        sliding_window,
        window,
    };
    let rope = rope_spec(&arch, &cfg, head_dim);
    let weights = LlamaWeights { embed_tokens, blocks, norm: norm("model.norm")?, lm_head };
    let model = Llama::new(lcfg, weights, &rope, dtype, device)?;
    Ok((model, cfg, info))
}

/// Loads a decoder folder with its tokenizer (tokenizer.json; the chat template from
/// tokenizer_config.json when present).
///
/// # Errors
/// As [`load_decoder`]; [`Error::Model`] when tokenizer.json is missing or unreadable.
pub fn load(dir: &Path, dtype: DType, device: &Device) -> Result<LoadedModel> {
    let (model, cfg, info) = load_decoder(dir, dtype, device)?;
    let tok_path = dir.join("tokenizer.json");
    if !tok_path.is_file() {
        return Err(Error::model(dir, "folder has no tokenizer.json"));
    }
    let tc_path = dir.join("tokenizer_config.json");
    // Optional: absent, or not JSON, means no chat template; anything but a regular file of
    // bounded size is refused by read_json.
    let chat_template = if tc_path.exists() {
        match super::folder::read_json(&tc_path) {
            Ok(v) => v["chat_template"].as_str().map(str::to_string),
            Err(Error::Model { .. }) if tc_path.is_file() => None,
            Err(e) => return Err(e),
        }
    } else {
        None
    };
    let tokenizer = TextTokenizer::from_tokenizer_json(&tok_path, first_id(&cfg.bos_token_id), first_id(&cfg.eos_token_id), chat_template).map_err(|e| Error::model(&tok_path, e))?;
    Ok(LoadedModel { model: super::Decoder::Llama(model), tokenizer, info })
}
