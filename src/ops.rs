//! The op vocabulary of the instrumented models.
//!
//! Every op a model runs goes through one function here: it executes the candle op exactly as the
//! candle-transformers model does (same function, same order of operations, so the numbers are the
//! same bits) and records the output through the [`Tracer`]. Data movement that does not change
//! values (reshape, transpose, repeat_kv) is not recorded; the next recorded op names the recorded
//! producer as its input.

use crate::error::Result;
use crate::record::Reads;
use crate::kernel::{Kernel, Operand};
use crate::tracer::{Node, Tok, Tracer};
pub use crate::site::{Op, Site};
use candle_core::quantized::QMatMul;
use candle_core::{DType, Tensor};

/// A projection weight: quantized as in a GGUF file, or dense in the compute dtype.
#[derive(Debug, Clone)]
pub enum Weight {
    /// `[out, in]` quantized; input must be f32 and contiguous.
    Quantized(QMatMul),
    /// `[out, in]` dense, with an optional `[out]` bias.
    Dense(candle_nn::Linear),
}

impl Weight {
    /// The op this weight runs as.
    pub fn op(&self) -> Op {
        match self {
            Weight::Quantized(_) => Op::QMatMul,
            Weight::Dense(_) => Op::Linear,
        }
    }
}

fn t(x: &Tensor) -> Operand {
    Operand::T(x.clone())
}

/// Records token ids `[batch, seq]` as the source of a forward pass.
pub fn input(tr: &mut Tracer, site: &Site, ids: &Tensor) -> Result<Node> {
    tr.run(site, Kernel::Input, &[t(ids)], &[], Tok::Seq(1))
}

/// Embedding lookup: `[b, s]` u32 → `[b, s, hidden]`.
pub fn embedding(tr: &mut Tracer, site: &Site, emb: &candle_nn::Embedding, ids: &Node) -> Result<Node> {
    tr.run(site, Kernel::Embedding, &[t(&ids.t), t(emb.embeddings())], &[(ids, Reads::Same)], Tok::Seq(1))
}

fn norm_operands(x: &Tensor, norm: &candle_nn::RmsNorm) -> (Kernel, [Operand; 2]) {
    (Kernel::RmsNorm { eps: norm.eps() }, [t(x), t(norm.weight())])
}

/// RMS norm over the last dim, `[b, s, hidden]`, as candle_nn's `RmsNorm` module runs it: the
/// fused kernel on contiguous input, the unfused (`_slow`) formula otherwise.
pub fn rms_norm(tr: &mut Tracer, site: &Site, x: &Node, norm: &candle_nn::RmsNorm) -> Result<Node> {
    let (k, ops) = norm_operands(&x.t, norm);
    tr.run(site, k, &ops, &[(x, Reads::Same)], Tok::Seq(1))
}

/// [`rms_norm`] of the last position only, `[b, 1, hidden]` (mistral norms after selecting it).
pub fn rms_norm_last(tr: &mut Tracer, site: &Site, x: &Node, norm: &candle_nn::RmsNorm) -> Result<Node> {
    let (k, ops) = norm_operands(&x.t, norm);
    tr.run(site, k, &ops, &[(x, Reads::Same)], Tok::Last)
}

/// The kernel and operands of `x @ Wᵀ (+ b)`.
fn weight_operands(w: &Weight, x: &Tensor) -> (Kernel, Vec<Operand>) {
    match w {
        Weight::Quantized(q) => (Kernel::QMatMul, vec![t(x), Operand::Q(q.clone())]),
        Weight::Dense(l) => {
            let mut ops = vec![t(x), t(l.weight())];
            if let Some(b) = l.bias() {
                ops.push(t(b));
            }
            (Kernel::Linear, ops)
        }
    }
}

/// `x @ W^T`: `[b, s, in]` → `[b, s, out]`.
pub fn linear(tr: &mut Tracer, site: &Site, w: &Weight, x: &Node) -> Result<Node> {
    let (k, ops) = weight_operands(w, &x.t);
    tr.run(site, k, &ops, &[(x, Reads::Same)], Tok::Seq(1))
}

/// Projection of the last position's hidden state: `[b, in]` → logits `[b, out]`.
pub fn linear_last(tr: &mut Tracer, site: &Site, w: &Weight, x: &Node, x_last: &Tensor) -> Result<Node> {
    let (k, ops) = weight_operands(w, x_last);
    tr.run(site, k, &ops, &[(x, Reads::Same)], Tok::Last)
}

/// Dtype conversion of the logits `[b, vocab]`.
pub fn to_dtype_last(tr: &mut Tracer, site: &Site, x: &Node, dtype: DType) -> Result<Node> {
    tr.run(site, Kernel::ToDtype { dtype: dtype.as_str().into() }, &[t(&x.t)], &[(x, Reads::Same)], Tok::Last)
}

/// Rotary embedding of `[b, heads, s, head_dim]` with `cos`/`sin` `[s, head_dim/2]`; `neox`
/// selects the non-interleaved variant (candle_nn::rotary_emb::rope) over the interleaved one
/// (rope_i). The input is made contiguous first, as candle-transformers does.
pub fn rope(tr: &mut Tracer, site: &Site, x: &Node, x_heads: &Tensor, cos: &Tensor, sin: &Tensor, neox: bool) -> Result<Node> {
    let k = Kernel::Rope { interleaved: !neox };
    tr.run(site, k, &[t(x_heads), t(cos), t(sin)], &[(x, Reads::Same)], Tok::Seq(2))
}

/// KV-cache append along the sequence dim: `cat([cache, new], 2)`, `[b, kv_heads, kv, head_dim]`.
/// Only the positions this pass wrote are summarised; `cache = None` starts a new cache.
pub fn cache_append(tr: &mut Tracer, site: &Site, cache: Option<&Tensor>, new: &Node) -> Result<Node> {
    let ops: Vec<Operand> = match cache {
        None => vec![t(&new.t)],
        Some(c) => vec![t(c), t(&new.t)],
    };
    tr.run(site, Kernel::Cat { dim: 2 }, &ops, &[(new, Reads::Same)], Tok::Cache)
}

/// Attention scores `q @ k^T`: `[b, h, q, d] x [b, h, kv, d]` → `[b, h, q, kv]`. `q_t` is the
/// query node's tensor (possibly upcast), `k_rep` the KV cache repeated to `h` heads.
pub fn scores(tr: &mut Tracer, site: &Site, q: &Node, q_t: &Tensor, k: &Node, k_rep: &Tensor) -> Result<Node> {
    tr.run(site, Kernel::Matmul { rhs_t: true }, &[t(q_t), t(k_rep)], &[(q, Reads::Same), (k, Reads::Prefix)], Tok::Causal)
}

/// Scores divided by `divisor` (`x / divisor`; candle computes it as `x * (1/divisor)`, so this is
/// also qwen2's and mistral's `x * (1/sqrt(d))`).
pub fn scale(tr: &mut Tracer, site: &Site, x: &Node, divisor: f64) -> Result<Node> {
    tr.run(site, Kernel::Scale { divisor }, &[t(&x.t)], &[(x, Reads::Same)], Tok::Causal)
}

/// Causal masking: where `mask` (u8 `[q, kv]`, 1 = hidden) is set, `fill` (a scalar, −inf).
pub fn mask_fill(tr: &mut Tracer, site: &Site, x: &Node, mask: &Tensor, fill: &Tensor) -> Result<Node> {
    tr.run(site, Kernel::WhereCond, &[t(&x.t), t(mask), t(fill)], &[(x, Reads::Same)], Tok::Causal)
}

/// Additive masking: `x + mask` with `mask` `[b|1, 1, q, kv]` (0 / -inf) broadcast over heads.
pub fn mask_add(tr: &mut Tracer, site: &Site, x: &Node, mask: &Tensor) -> Result<Node> {
    tr.run(site, Kernel::BroadcastAdd, &[t(&x.t), t(mask)], &[(x, Reads::Same)], Tok::Causal)
}

/// Dtype conversion of a `[b, heads, s, d]` attention output.
pub fn to_dtype_heads(tr: &mut Tracer, site: &Site, x: &Node, dtype: DType) -> Result<Node> {
    tr.run(site, Kernel::ToDtype { dtype: dtype.as_str().into() }, &[t(&x.t)], &[(x, Reads::Same)], Tok::Seq(2))
}

/// Softmax over the last dim (candle_nn::ops::softmax_last_dim).
pub fn softmax(tr: &mut Tracer, site: &Site, x: &Node) -> Result<Node> {
    tr.run(site, Kernel::Softmax { fused: true }, &[t(&x.t)], &[(x, Reads::Same)], Tok::Causal)
}

/// Attention output `probs @ v`: `[b, h, q, kv] x [b, h, kv, d]` → `[b, h, q, d]`. `v_rep` is the
/// V cache repeated to `h` heads.
pub fn attend(tr: &mut Tracer, site: &Site, probs: &Node, v: &Node, v_rep: &Tensor) -> Result<Node> {
    tr.run(site, Kernel::Matmul { rhs_t: false }, &[t(&probs.t), t(v_rep)], &[(probs, Reads::Same), (v, Reads::Prefix)], Tok::Seq(2))
}

/// SiLU, elementwise, `[b, s, n]`.
pub fn silu(tr: &mut Tracer, site: &Site, x: &Node) -> Result<Node> {
    tr.run(site, Kernel::Silu, &[t(&x.t)], &[(x, Reads::Same)], Tok::Seq(1))
}

/// Elementwise product `a * b`, `[b, s, n]`.
pub fn mul(tr: &mut Tracer, site: &Site, a: &Node, b: &Node) -> Result<Node> {
    tr.run(site, Kernel::Mul, &[t(&a.t), t(&b.t)], &[(a, Reads::Same), (b, Reads::Same)], Tok::Seq(1))
}

/// Elementwise sum `a + b` (residual connections), `[b, s, n]`.
pub fn add(tr: &mut Tracer, site: &Site, a: &Node, b: &Node) -> Result<Node> {
    tr.run(site, Kernel::Add, &[t(&a.t), t(&b.t)], &[(a, Reads::Same), (b, Reads::Same)], Tok::Seq(1))
}
