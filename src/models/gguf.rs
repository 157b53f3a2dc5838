//! Loads llama-architecture GGUF files (layout: the GGUF spec of ggml, as read by candle's
//! `quantized::gguf_file`) into the instrumented [`Llama`], with the hyper-parameters, tensor
//! names and rope convention candle-transformers' `quantized_llama::ModelWeights::from_gguf` uses.

use super::llama::{BlockWeights, Flavour, Llama, LlamaConfig, LlamaWeights, RopeSpec};
use super::{LoadedModel, WeightDtype};
use crate::error::{Error, Result};
use crate::ops::Weight;
use crate::record::ModelInfo;
use crate::tokenizer::TextTokenizer;
use candle_core::quantized::{gguf_file, QMatMul, QTensor};
use candle_core::Device;
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// Architectures this loader runs.
pub const SUPPORTED: &[&str] = &["llama"];

/// Hex sha256 and size of a file.
///
/// # Errors
/// [`Error::Io`] when the file cannot be read.
pub fn sha256_file(path: &Path) -> Result<(String, u64)> {
    let mut f = File::open(path).map_err(|e| Error::io(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        size += n as u64;
        h.update(&buf[..n]);
    }
    Ok((crate::text::hex(&h.finalize()), size))
}

/// The `{arch}.*` metadata as (key, value) pairs for the header, sorted: strings only under
/// keys that change numerics, as for folders.
fn public_config(ct: &gguf_file::Content, arch: &str) -> Vec<(String, String)> {
    let prefix = format!("{arch}.");
    let mut c: Vec<(String, String)> = ct
        .metadata
        .iter()
        .filter(|(k, _)| k.starts_with(&prefix))
        .map(|(k, v)| (k.clone(), format!("{v:?}")))
        .filter(|(k, v)| !v.contains("String(") || super::config_entry_is_public(k, &v.replace("String(", "\"")))
        .collect();
    c.sort();
    c
}

/// Loads a GGUF file.
///
/// # Errors
/// [`Error::Io`] when the file cannot be opened; [`Error::Model`] when it is not a GGUF file, its
/// architecture is not in [`SUPPORTED`], a hyper-parameter or tensor is missing, or its tokenizer
/// metadata is unusable.
pub fn load(path: &Path, dtype: WeightDtype, device: &Device) -> Result<LoadedModel> {
    if path.is_dir() {
        return Err(Error::model(path, "is a directory; expected a GGUF file"));
    }
    let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
    let mut magic = [0u8; 4];
    let is_gguf = file.read_exact(&mut magic).is_ok() && &magic == b"GGUF";
    if !is_gguf {
        return Err(Error::model(path, "not a GGUF file (no GGUF magic bytes)"));
    }
    file.seek(SeekFrom::Start(0)).map_err(|e| Error::io(path, e))?;
    let ct = gguf_file::Content::read(&mut file)
        .map_err(|e| Error::model(path, format!("unreadable GGUF: {e}")))?;
    let md = |k: &str| ct.metadata.get(k).ok_or_else(|| Error::model(path, format!("GGUF metadata has no {k}")));
    let arch = md("general.architecture")?
        .to_string()
        .map_err(|e| Error::model(path, format!("general.architecture: {e}")))?
        .clone();
    if !SUPPORTED.contains(&arch.as_str()) {
        return Err(Error::model(
            path,
            format!("unsupported architecture '{arch}' (supported: {})", SUPPORTED.join(", ")),
        ));
    }
    let u = |k: &str| -> Result<usize> {
        md(k)?.to_u32().map(|v| v as usize).map_err(|e| Error::model(path, format!("{k}: {e}")))
    };
    let hidden = u("llama.embedding_length")?;
    let n_head = u("llama.attention.head_count")?;
    let n_kv_head = u("llama.attention.head_count_kv")?;
    let n_layer = u("llama.block_count")?;
    let rope_dim = u("llama.rope.dimension_count")?;
    let rms_eps = md("llama.attention.layer_norm_rms_epsilon")?
        .to_f32()
        .map_err(|e| Error::model(path, format!("layer_norm_rms_epsilon: {e}")))? as f64;
    let rope_base = ct.metadata.get("llama.rope.freq_base").and_then(|v| v.to_f32().ok()).unwrap_or(10000.0);
    if ct.metadata.get("llama.expert_count").and_then(|v| v.to_u32().ok()).unwrap_or(0) > 1 {
        return Err(Error::model(path, "mixture-of-experts llama files are not supported yet"));
    }
    if n_head == 0 || n_kv_head == 0 || hidden % n_head != 0 || n_head % n_kv_head != 0 {
        return Err(Error::model(path, "inconsistent head counts in GGUF metadata"));
    }
    let tokenizer = TextTokenizer::from_gguf_metadata(&ct.metadata).map_err(|e| Error::model(path, e))?;

    let mut tensor = |name: &str| -> Result<QTensor> {
        ct.tensor(&mut file, name, device).map_err(|e| Error::model(path, format!("tensor {name}: {e}")))
    };
    let act = dtype.activations();
    let weight = |q: QTensor| -> Result<Weight> {
        Ok(match dtype {
            WeightDtype::Quantized => Weight::Quantized(QMatMul::from_qtensor(q)?),
            WeightDtype::Dense(d) => Weight::Dense(candle_nn::Linear::new(q.dequantize(device)?.to_dtype(d)?, None)),
        })
    };
    let norm = |q: QTensor| -> Result<candle_nn::RmsNorm> {
        Ok(candle_nn::RmsNorm::new(q.dequantize(device)?.to_dtype(act)?, rms_eps))
    };
    let embed_q = tensor("token_embd.weight")?;
    let quant_name = format!("{:?}", embed_q.dtype()).to_lowercase();
    let vocab = embed_q.shape().dims()[0];
    let embed_tokens = embed_q.dequantize(device)?.to_dtype(act)?;
    let final_norm = norm(tensor("output_norm.weight")?)?;
    let lm_head = match tensor("output.weight") {
        Ok(t) => t,
        Err(_) => tensor("token_embd.weight")?,
    };
    let mut weights_kind = String::new();
    if n_layer > super::MAX_LAYERS {
        return Err(Error::model(path, format!("llama.block_count {n_layer} is over the {} this tool takes", super::MAX_LAYERS)));
    }
    let mut blocks = Vec::new();
    for i in 0..n_layer {
        let p = format!("blk.{i}");
        let q = tensor(&format!("{p}.attn_q.weight"))?;
        if weights_kind.is_empty() {
            weights_kind = format!("{:?}", q.dtype()).to_lowercase();
        }
        blocks.push(BlockWeights {
            q_proj: weight(q)?,
            k_proj: weight(tensor(&format!("{p}.attn_k.weight"))?)?,
            v_proj: weight(tensor(&format!("{p}.attn_v.weight"))?)?,
            o_proj: weight(tensor(&format!("{p}.attn_output.weight"))?)?,
            gate_proj: weight(tensor(&format!("{p}.ffn_gate.weight"))?)?,
            up_proj: weight(tensor(&format!("{p}.ffn_up.weight"))?)?,
            down_proj: weight(tensor(&format!("{p}.ffn_down.weight"))?)?,
            input_layernorm: norm(tensor(&format!("{p}.attn_norm.weight"))?)?,
            post_attention_layernorm: norm(tensor(&format!("{p}.ffn_norm.weight"))?)?,
        });
    }
    let lm_head = weight(lm_head)?;
    let cfg = LlamaConfig {
        flavour: Flavour::QuantizedLlama,
        n_layer,
        n_head,
        n_kv_head,
        hidden,
        rope_dim,
        rope_base,
        rms_eps,
        vocab,
        rope_neox: false,
        head_dim: hidden / n_head,
        sliding_window: None,
    };
    let rope = RopeSpec::standard(rope_dim, rope_base);
    let weights = LlamaWeights { embed_tokens, blocks, norm: final_norm, lm_head };
    let model = Llama::new(cfg, weights, &rope, act, device)?;
    let (sha256, size) = sha256_file(path)?;
    let info = ModelInfo {
        name: path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        size,
        sha256,
        architecture: arch.clone(),
        n_layers: n_layer as u32,
        vocab_size: vocab as u32,
        weights: if weights_kind.is_empty() { quant_name } else { weights_kind },
        config: public_config(&ct, &arch),
    };
    Ok(LoadedModel { model, tokenizer, info })
}
