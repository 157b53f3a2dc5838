//! The order a run keeps each attention head's query and key dims in, so that a comparison by
//! value compares like with like.
//!
//! llama.cpp's converter (`convert_hf_to_gguf.py`, `LlamaModel.permute`) stores the q and k
//! projection rows of llama-architecture GGUF files permuted within each head: the rotary pair
//! (`i`, `i + d/2`) of the Hugging Face checkpoint becomes the adjacent pair (`2i`, `2i + 1`), so
//! that the interleaved rotary embedding (candle's `rope_i`, as `quantized_llama` applies it)
//! rotates the right pairs. A run of such a file computes q_proj, k_proj, the rotary outputs and
//! the K cache in that order; transformers, and a Hugging Face folder run by candle-trace, in the
//! checkpoint's. The values are the same up to rounding, element `2i + s` of one holding element
//! `s·d/2 + i` of the other. Other GGUF architectures this tool loads (qwen2, qwen3, phi3,
//! gemma3) are converted unpermuted and rotated with the half-split rope.

use candle_trace_format::record::Header;

/// The module-path leaves whose values hold head dims in the projection's row order: the
/// projections, the rotary outputs (`[b, heads, s, d]`) and the K cache.
const LEAVES: [&str; 5] = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.rope_q", "self_attn.rope_k", "self_attn.k_cache"];

/// The head size when run `h` computes queries and keys in llama.cpp's interleaved GGUF order (a
/// llama-architecture GGUF file: its header carries the GGUF `llama.*` metadata); `None` when it
/// computes them in the checkpoint's order.
pub fn interleaved_head_dim(h: &Header) -> Option<usize> {
    let m = &h.run.model;
    if m.architecture != "llama" {
        return None;
    }
    // GGUF metadata values are written as `U32(576)`.
    let get = |k: &str| -> Option<usize> {
        let v = &m.config.iter().find(|(key, _)| key == k)?.1;
        v.trim_end_matches(')').rsplit('(').next()?.parse().ok()
    };
    let (hidden, heads) = (get("llama.embedding_length")?, get("llama.attention.head_count")?);
    (heads > 0 && hidden.is_multiple_of(heads) && (hidden / heads).is_multiple_of(2)).then_some(hidden / heads)
}

/// Whether the op at `path` holds head dims in the projection's row order.
pub fn holds_head_dims(path: &str) -> bool {
    LEAVES.iter().any(|l| path.strip_suffix(l).is_some_and(|p| p.is_empty() || p.ends_with('.')))
}

/// Puts `values` (a whole number of heads of `d` values each, one after the other along the last
/// dim) from the interleaved order into the checkpoint's: element `s·d/2 + i` of each head takes
/// element `2i + s`. `None` when `values` does not hold whole heads.
pub fn to_checkpoint_order(values: &[f64], d: usize) -> Option<Vec<f64>> {
    if d < 2 || !d.is_multiple_of(2) || !values.len().is_multiple_of(d) {
        return None;
    }
    let half = d / 2;
    let mut out = vec![0.0; values.len()];
    for (src, dst) in values.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        for i in 0..half {
            dst[i] = src[2 * i];
            dst[half + i] = src[2 * i + 1];
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(arch: &str, config: &[(&str, &str)]) -> Header {
        let mut h = Header::default();
        h.run.model.architecture = arch.into();
        h.run.model.config = config.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        h
    }

    /// Which runs compute in the interleaved order: a llama GGUF file does; its Hugging Face
    /// folder, and the other GGUF architectures this tool loads, do not (their loaders rotate
    /// with the half-split rope; tests/gguf_archs.rs pins each loader's rope against upstream).
    #[test]
    fn llama_gguf_files_are_interleaved() {
        let gguf = [("llama.attention.head_count", "U32(9)"), ("llama.embedding_length", "U32(576)")];
        assert_eq!(interleaved_head_dim(&header("llama", &gguf)), Some(64));
        assert_eq!(interleaved_head_dim(&header("llama", &[("num_attention_heads", "9"), ("hidden_size", "576")])), None, "a Hugging Face folder");
        for arch in ["qwen2", "qwen3", "phi3", "gemma3"] {
            let cfg: Vec<(String, &str)> = [("attention.head_count", "U32(8)"), ("embedding_length", "U32(512)")].iter().map(|(k, v)| (format!("{arch}.{k}"), *v)).collect();
            let cfg: Vec<(&str, &str)> = cfg.iter().map(|(k, v)| (k.as_str(), *v)).collect();
            assert_eq!(interleaved_head_dim(&header(arch, &cfg)), None, "{arch}");
        }
    }

    #[test]
    fn paths_and_the_permutation() {
        assert!(holds_head_dims("layers.3.self_attn.q_proj") && holds_head_dims("layers.0.self_attn.k_cache") && holds_head_dims("layers.12.self_attn.rope_k"));
        assert!(!holds_head_dims("layers.3.self_attn.v_proj") && !holds_head_dims("layers.3.self_attn.scores") && !holds_head_dims("layers.3.xself_attn.q_proj"));
        // Two heads of 4: interleaved (a0 b0 a1 b1) becomes (a0 a1 b0 b1).
        let v = [0.0, 10.0, 1.0, 11.0, 2.0, 12.0, 3.0, 13.0];
        assert_eq!(to_checkpoint_order(&v, 4).unwrap(), [0.0, 1.0, 10.0, 11.0, 2.0, 3.0, 12.0, 13.0]);
        assert!(to_checkpoint_order(&v[..6], 4).is_none());
    }
}
