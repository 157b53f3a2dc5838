//! Instrumented models and their loaders. Models ([`llama`]) know nothing of files; loaders
//! ([`gguf`], [`builtin`]) turn a file or a seed into weights, a tokenizer and a [`ModelInfo`].

pub mod builtin;
pub mod bert;
pub mod export;
pub mod gguf;
pub mod hf;
pub mod llama;

use crate::error::{Error, Result};
use crate::record::ModelInfo;
use crate::tokenizer::TextTokenizer;
use candle_core::DType;

/// A model ready to run: the instrumented forward pass, its tokenizer and its description.
pub struct LoadedModel {
    pub model: llama::Llama,
    pub tokenizer: TextTokenizer,
    pub info: ModelInfo,
}

/// The `--dtype` choices: weights as quantized in the file, or dense in a float type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDtype {
    /// Keep GGUF quantized weights (activations in f32).
    Quantized,
    Dense(DType),
}

impl WeightDtype {
    /// Parses `q`, `f32`, `f16` or `bf16`.
    ///
    /// # Errors
    /// [`Error::Usage`] for any other value.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "q" => Ok(WeightDtype::Quantized),
            "f32" => Ok(WeightDtype::Dense(DType::F32)),
            "f16" => Ok(WeightDtype::Dense(DType::F16)),
            "bf16" => Ok(WeightDtype::Dense(DType::BF16)),
            other => Err(Error::usage(format!("--dtype {other}: expected q, f32, f16 or bf16"))),
        }
    }
    /// The name written in trace headers.
    pub fn as_str(&self) -> &'static str {
        match self {
            WeightDtype::Quantized => "q",
            WeightDtype::Dense(d) => d.as_str(),
        }
    }
    /// Activation dtype.
    pub fn activations(&self) -> DType {
        match self {
            WeightDtype::Quantized => DType::F32,
            WeightDtype::Dense(d) => *d,
        }
    }
}

/// The name a model folder gets in a trace header: its architecture and the first 12 hex digits
/// of its weights' sha256 (`llama-3f1a2b3c4d5e`). The folder's own name is not used: it may
/// carry a user name or a project's name, and traces are public attachments (`--model-name`
/// sets another).
pub fn folder_name(arch: &str, sha256: &str) -> String {
    format!("{arch}-{}", sha256.get(..12).unwrap_or(sha256))
}

/// Keys whose string values change numerics and are kept: activations, dtypes, the model type
/// and architectures, rotary and position-embedding variants, per-layer attention kinds.
const STRING_KEYS: &[&str] = &[
    "activation_function",
    "architectures",
    "dtype",
    "hidden_act",
    "hidden_activation",
    "layer_types",
    "model_type",
    "position_embedding_type",
    "rope_type",
    "torch_dtype",
    "type",
];

/// True when a config entry is kept in a trace header: numbers, booleans and null (and lists of
/// them), and strings only under the keys in `STRING_KEYS` that do not look like a path or an
/// address. Nothing under a key starting with `_` (`_name_or_path`, which `save_pretrained`
/// sets to the folder's absolute path), nothing over 64 characters. Free text (an `owner`, a
/// user's note) never reaches a trace.
pub fn config_entry_is_public(key: &str, json_value: &str) -> bool {
    if key.split('.').any(|k| k.starts_with('_')) || json_value.chars().count() > 64 {
        return false;
    }
    let has_string = json_value.contains('"');
    if !has_string {
        return true;
    }
    let last = key.rsplit('.').next().unwrap_or(key);
    STRING_KEYS.contains(&last) && !json_value.contains(['/', '\\', '~', ':'])
}

/// Flattens a JSON object into sorted (key, JSON value) pairs, nested objects as `a.b`
/// (the form of [`crate::record::ModelInfo::config`]), keeping only the entries
/// [`config_entry_is_public`] allows.
pub fn flatten_config(v: &serde_json::Value) -> Vec<(String, String)> {
    fn walk(prefix: &str, v: &serde_json::Value, out: &mut Vec<(String, String)>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, x) in m {
                    let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                    walk(&key, x, out);
                }
            }
            other => out.push((prefix.to_string(), other.to_string())),
        }
    }
    let mut out = Vec::new();
    walk("", v, &mut out);
    out.retain(|(k, v)| config_entry_is_public(k, v));
    out.sort();
    out
}
