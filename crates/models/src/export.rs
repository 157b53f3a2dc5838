//! Writes a Hugging Face llama folder from a llama GGUF file: every tensor dequantized to f32
//! safetensors under its checkpoint name, config.json from the GGUF hyper-parameters,
//! tokenizer.json from the GGUF tokenizer, tokenizer_config.json with its chat template.
//!
//! GGUF llama files store `attn_q`/`attn_k` rows permuted for the interleaved rotary embedding
//! (llama.cpp's converter reshapes each head `(2, d/2) -> (d/2, 2)`); the folder gets them back
//! in Hugging Face order, for the NeoX-style rotary embedding `models::llama` applies. So the
//! folder computes the same function as the file, with dense f32 weights.

use crate::gguf::SUPPORTED;
use crate::tokenizer::TextTokenizer;
use candle_core::{Device, Tensor};
use candle_trace_format::error::{Error, Result};
use std::collections::HashMap;
use std::path::Path;

/// GGUF tensor name → Hugging Face name, for the tensors of one block and the top level.
fn hf_name(gguf: &str) -> Option<String> {
    let top = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(t) = top {
        return Some(t.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, name) = rest.split_once('.')?;
    let module = match name {
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        "attn_norm.weight" => "input_layernorm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{module}"))
}

/// Undoes the GGUF q/k row permutation: `[heads * d, dim]` viewed as `(heads, d/2, 2, dim)` →
/// `(heads, 2, d/2, dim)`.
fn unpermute(w: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let (rows, dim) = w.dims2()?;
    let hd = rows / heads;
    w.reshape((heads, hd / 2, 2, dim))?.transpose(1, 2)?.contiguous()?.reshape((rows, dim))
}

/// Converts `gguf` (llama architecture) into a Hugging Face folder at `out` (created; an existing
/// folder is replaced only when the conversion succeeds).
///
/// # Errors
/// [`Error::Model`] for a file that is not a llama GGUF; [`Error::Io`] when `out` cannot be
/// written.
pub fn gguf_to_hf(gguf: &Path, out: &Path) -> Result<()> {
    let dev = Device::Cpu;
    let (ct, mut file) = super::gguf::open(gguf)?;
    let md = |k: &str| ct.metadata.get(k).ok_or_else(|| Error::model(gguf, format!("GGUF metadata has no {k}")));
    let arch = md("general.architecture")?.to_string().map_err(|e| Error::model(gguf, e.to_string()))?.clone();
    if !SUPPORTED.contains(&arch.as_str()) {
        return Err(Error::model(gguf, format!("unsupported architecture '{arch}' (supported: {})", SUPPORTED.join(", "))));
    }
    let u = |k: &str| -> Result<usize> { Ok(md(k)?.to_u32().map_err(|e| Error::model(gguf, e.to_string()))? as usize) };
    let (hidden, heads, kv_heads, layers) = (u("llama.embedding_length")?, u("llama.attention.head_count")?, u("llama.attention.head_count_kv")?, u("llama.block_count")?);
    let eps = md("llama.attention.layer_norm_rms_epsilon")?.to_f32().map_err(|e| Error::model(gguf, e.to_string()))?;
    let theta = ct.metadata.get("llama.rope.freq_base").and_then(|v| v.to_f32().ok()).unwrap_or(10000.0);
    let ctx = ct.metadata.get("llama.context_length").and_then(|v| v.to_u32().ok()).unwrap_or(4096);
    let tokenizer = TextTokenizer::from_gguf_metadata(&ct.metadata).map_err(|e| Error::model(gguf, e))?;

    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    let names: Vec<String> = ct.tensor_infos.keys().cloned().collect();
    for name in &names {
        let Some(hf) = hf_name(name) else {
            return Err(Error::model(gguf, format!("unexpected tensor {name}")));
        };
        let q = ct.tensor(&mut file, name, &dev).map_err(|e| Error::model(gguf, format!("tensor {name}: {e}")))?;
        let mut t = q.dequantize(&dev)?;
        if name.ends_with("attn_q.weight") {
            t = unpermute(&t, heads)?;
        } else if name.ends_with("attn_k.weight") {
            t = unpermute(&t, kv_heads)?;
        }
        tensors.insert(hf, t);
    }
    let tied = !tensors.contains_key("lm_head.weight");
    let vocab = tensors["model.embed_tokens.weight"].dim(0)?;
    let inter = tensors["model.layers.0.mlp.up_proj.weight"].dim(0)?;
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "max_position_embeddings": ctx,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "bos_token_id": tokenizer.bos_id(),
        "eos_token_id": tokenizer.eos_id(),
        "torch_dtype": "float32",
    });
    let tmp = out.with_extension("partial");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let write = |name: &str, text: String| -> Result<()> {
        let p = tmp.join(name);
        std::fs::write(&p, text).map_err(|e| Error::io(&p, e))
    };
    candle_core::safetensors::save(&tensors, tmp.join("model.safetensors")).map_err(|e| Error::model(&tmp.join("model.safetensors"), e.to_string()))?;
    write("config.json", serde_json::to_string_pretty(&config).expect("json"))?;
    let hf_tok = tokenizer.hf_tokenizer().ok_or_else(|| Error::model(gguf, "tokenizer cannot be exported"))?;
    write("tokenizer.json", hf_tok.to_string(true).map_err(|e| Error::model(gguf, format!("tokenizer: {e}")))?)?;
    let tc = serde_json::json!({ "chat_template": tokenizer.chat_template() });
    write("tokenizer_config.json", serde_json::to_string_pretty(&tc).expect("json"))?;
    let _ = std::fs::remove_dir_all(out);
    std::fs::rename(&tmp, out).map_err(|e| Error::io(out, e))
}
