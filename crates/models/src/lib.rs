//! Instrumented models and their loaders, over the instrumentation crate
//! (`candle_trace_instrument`): every op a forward pass runs goes through its tracer. Models
//! ([`llama`], [`gemma3`], [`bert`]) know nothing of files; loaders ([`gguf`], [`hf`] over
//! [`folder`], [`builtin`]) turn a file or a seed into weights, a tokenizer and a
//! [`ModelInfo`]. [`Decoder`] is any of the decoders. [`tokenizer`] builds the text tokenizer
//! from GGUF metadata ([`spm`] for SentencePiece vocabularies) or a folder's tokenizer.json,
//! and renders chat templates ([`chat`]). [`export`] writes a llama GGUF file as a Hugging Face folder;
//! [`positioned`] is a file reader that keeps its own position, for fast GGUF loading.
//!
//! BERT folders (sentence-transformers) are loaded by the run crate's `encoder`, which pads and
//! truncates a batch of sentences; generation, the recorder and what runs a model from end to
//! end are in the run crate (`candle_trace_run`).

#![deny(missing_docs)]

pub mod bert;
pub mod builtin;
pub mod export;
pub mod folder;
pub mod gemma3;
pub mod gguf;
pub mod hf;
pub mod llama;
pub mod positioned;

pub mod chat;
pub mod spm;
pub mod tokenizer;

use crate::tokenizer::TextTokenizer;
use candle_core::DType;
use candle_trace_format::error::{Error, Result};
use candle_trace_format::record::ModelInfo;

/// The most layers a model file or config may declare (the largest open models have about 130):
/// a count read from a file is checked against it before anything is sized by it.
pub const MAX_LAYERS: usize = 4096;

/// An instrumented decoder of any architecture this crate runs.
pub enum Decoder {
    /// Llama, Qwen 2/3, Mistral and Phi-3 (GGUF; Llama, Qwen 2 and Mistral also as Hugging Face
    /// folders) and the builtin model.
    Llama(llama::Llama),
    /// Gemma 3 (GGUF).
    Gemma3(gemma3::Gemma3),
}

impl Decoder {
    /// One forward pass over token ids `[batch, seq_len]` (u32) at positions `index_pos ..`,
    /// appending to the KV cache; the last position's logits, `[batch, vocab]` f32.
    ///
    /// # Errors
    /// As [`llama::Llama::forward`].
    pub fn forward(&mut self, tr: &mut candle_trace_instrument::tracer::Tracer, ids: &candle_core::Tensor, index_pos: usize, phase: candle_trace_format::record::Phase) -> Result<candle_core::Tensor> {
        match self {
            Decoder::Llama(m) => m.forward(tr, ids, index_pos, phase),
            Decoder::Gemma3(m) => m.forward(tr, ids, index_pos, phase),
        }
    }

    /// Empties the KV cache.
    pub fn clear_kv_cache(&mut self) {
        match self {
            Decoder::Llama(m) => m.clear_kv_cache(),
            Decoder::Gemma3(m) => m.clear_kv_cache(),
        }
    }

    /// Sets each batch row's left padding (empty: none).
    pub fn set_padding(&mut self, pads: Vec<usize>) {
        match self {
            Decoder::Llama(m) => m.set_padding(pads),
            Decoder::Gemma3(m) => m.set_padding(pads),
        }
    }

    /// The device of the weights and KV cache.
    pub fn device(&self) -> &candle_core::Device {
        match self {
            Decoder::Llama(m) => m.device(),
            Decoder::Gemma3(m) => m.device(),
        }
    }

    /// Every op site, in execution order of one forward pass.
    pub fn sites(&self) -> Box<dyn Iterator<Item = &candle_trace_format::site::Site> + '_> {
        match self {
            Decoder::Llama(m) => Box::new(m.sites()),
            Decoder::Gemma3(m) => Box::new(m.sites()),
        }
    }
}

/// A model ready to run: the instrumented forward pass, its tokenizer and its description.
pub struct LoadedModel {
    /// The instrumented decoder, its weights already on the load device.
    pub model: Decoder,
    /// From tokenizer.json (folders), the `tokenizer.ggml.*` metadata (GGUF) or byte-level
    /// (builtin model).
    pub tokenizer: TextTokenizer,
    /// The model section of the trace header: file name, size in bytes, sha256, config.
    pub info: ModelInfo,
}

/// The `--dtype` choices: weights as quantized in the file, or dense in a float type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDtype {
    /// Keep GGUF quantized weights (activations in f32).
    Quantized,
    /// Weights dequantized (GGUF) or converted (safetensors) to this dtype (f32, f16 or bf16),
    /// which is also the activation dtype.
    Dense(DType),
}

impl WeightDtype {
    /// Parses `q`, `f32`, `f16` or `bf16`.
    ///
    /// # Errors
    /// [`Error::Usage`] for any other value.
    pub fn parse(s: &str) -> Result<Self> {
        match (s, s.parse::<DType>()) {
            ("q", _) => Ok(WeightDtype::Quantized),
            (_, Ok(d @ (DType::F32 | DType::F16 | DType::BF16))) => Ok(WeightDtype::Dense(d)),
            _ => Err(Error::usage(format!("--dtype {s}: expected q, f32, f16 or bf16"))),
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
const STRING_KEYS: &[&str] =
    &["activation_function", "architectures", "dtype", "hidden_act", "hidden_activation", "layer_types", "model_type", "position_embedding_type", "rope_type", "torch_dtype", "type"];

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
/// (the form of [`candle_trace_format::record::ModelInfo::config`]), keeping only the entries
/// [`config_entry_is_public`] allows.
pub fn flatten_config(v: &serde_json::Value) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = candle_trace_compare::text::flatten_json(v).into_iter().map(|(k, x)| (k, x.to_string())).collect();
    out.retain(|(k, v)| config_entry_is_public(k, v));
    out.sort();
    out
}
