//! The op vocabulary of the instrumented models.
//!
//! Every op a model runs goes through one function here: it executes the candle op exactly as the
//! candle-transformers model does (same function, same order of operations, so the numbers are the
//! same bits) and records the output through the [`Tracer`]. Data movement that does not change
//! values (reshape, transpose, repeat_kv) is not recorded; the next recorded op names the recorded
//! producer as its input.

use crate::kernel::{Kernel, Operand};
use crate::tracer::{Node, Tok, Tracer};
use candle_core::quantized::QMatMul;
use candle_core::{DType, Tensor};
use candle_trace_format::error::Result;
use candle_trace_format::record::Reads;
pub use candle_trace_format::site::{Op, Site};

/// A projection weight: quantized as in a GGUF file, or dense in the compute dtype.
#[derive(Debug, Clone)]
pub enum Weight {
    /// `[out, in]` quantized, and an `[out]` f32 bias added after the matmul (qwen2's q/k/v);
    /// input must be f32 and contiguous.
    Quantized(QMatMul, Option<Tensor>),
    /// `[out, in]` dense, with an optional `[out]` bias.
    Dense(candle_nn::Linear),
}

impl Weight {
    /// The op this weight runs as.
    pub fn op(&self) -> Op {
        match self {
            Weight::Quantized(..) => Op::QMatMul,
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

/// [`rms_norm`] over the head dim of `[b, heads, s, head_dim]` (Gemma 3's and Qwen 3's q/k
/// norms), `x_heads` contiguous so the fused kernel runs, as upstream runs it.
pub fn rms_norm_heads(tr: &mut Tracer, site: &Site, x: &Node, x_heads: &Tensor, norm: &candle_nn::RmsNorm) -> Result<Node> {
    let (k, ops) = norm_operands(x_heads, norm);
    tr.run(site, k, &ops, &[(x, Reads::Same)], Tok::Seq(2))
}

/// `x * mul + add` (candle's `affine`), `[b, s, n]`: Gemma 3's embedding scale.
pub fn affine(tr: &mut Tracer, site: &Site, x: &Node, mul: f64, add: f64) -> Result<Node> {
    tr.run(site, Kernel::Affine { mul, add }, &[t(&x.t)], &[(x, Reads::Same)], Tok::Seq(1))
}

/// [`rms_norm`] of the last position only, `[b, 1, hidden]` (mistral norms after selecting it).
pub fn rms_norm_last(tr: &mut Tracer, site: &Site, x: &Node, norm: &candle_nn::RmsNorm) -> Result<Node> {
    let (k, ops) = norm_operands(&x.t, norm);
    tr.run(site, k, &ops, &[(x, Reads::Same)], Tok::Last)
}

/// The kernel and operands of `x @ Wᵀ (+ b)`.
fn weight_operands(w: &Weight, x: &Tensor) -> (Kernel, Vec<Operand>) {
    match w {
        Weight::Quantized(q, bias) => (Kernel::QMatMul, std::iter::once(t(x)).chain(std::iter::once(Operand::Q(q.clone()))).chain(bias.iter().map(t)).collect()),
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

/// Dtype conversion of a `[b, heads, s, d]` attention output.
pub fn to_dtype_heads(tr: &mut Tracer, site: &Site, x: &Node, dtype: DType) -> Result<Node> {
    tr.run(site, Kernel::ToDtype { dtype: dtype.as_str().into() }, &[t(&x.t)], &[(x, Reads::Same)], Tok::Seq(2))
}

/// The five recorded ops of one attention core, under a module path `P` (`layers.3.self_attn`,
/// `encoder.layer.3.attention.self`): `P.scores`, `P.scale`, `P.<mask>`, `P.softmax`,
/// `P.attn_v`.
#[derive(Clone, Debug)]
pub struct AttentionSites {
    /// `q @ k^T` (matmul).
    pub scores: Site,
    /// Division by `sqrt(head_dim)`.
    pub scale: Site,
    /// The mask ([`AttnMask`]); its op is [`Op::WhereCond`] or [`Op::MaskAdd`].
    pub mask: Site,
    /// Softmax over the keys.
    pub softmax: Site,
    /// `probs @ v` (matmul).
    pub attn_v: Site,
}

impl AttentionSites {
    /// The sites under `prefix`, the mask's named `prefix.mask_name` with op `mask_op`.
    pub fn new(prefix: &str, mask_name: &str, mask_op: Op) -> Self {
        AttentionSites {
            scores: Site::new(format!("{prefix}.scores"), Op::Matmul),
            scale: Site::new(format!("{prefix}.scale"), Op::Scale),
            mask: Site::new(format!("{prefix}.{mask_name}"), mask_op),
            softmax: Site::new(format!("{prefix}.softmax"), Op::Softmax),
            attn_v: Site::new(format!("{prefix}.attn_v"), Op::Matmul),
        }
    }

    /// The sites in the order the ops run.
    pub fn all(&self) -> [&Site; 5] {
        [&self.scores, &self.scale, &self.mask, &self.softmax, &self.attn_v]
    }
}

/// Which keys a query reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keys {
    /// Decoders: query `p` reads the KV cache's positions `0..=p` ([`Reads::Prefix`]); scores
    /// and probabilities are summarised per query over those keys ([`Tok::Causal`]).
    Causal,
    /// Encoders: every query reads every key of its row ([`Reads::All`], [`Tok::Keys`]).
    All,
}

/// The mask applied to the scaled scores `[b, h, q, kv]`.
#[derive(Clone, Copy, Debug)]
pub enum AttnMask<'a> {
    /// No mask (a single-token decode step sees every cached key).
    None,
    /// `where(mask, fill, x)` with `mask` u8 `[q, kv]` (1 = hidden) and `fill` a scalar −inf:
    /// candle-transformers' llama and quantized_llama.
    Fill {
        /// u8 `[q, kv]` or `[b, 1, q, kv]`.
        mask: &'a Tensor,
        /// Scalar fill value in the scores' dtype.
        fill: &'a Tensor,
    },
    /// `x + mask`, `mask` `[b|1, 1, q, kv]` (0 or a large negative) broadcast over heads: qwen2,
    /// mistral, BERT. `input` is the recorded node the mask was built from (BERT's attention
    /// mask), listed as an input of the op; `None` when the mask comes from positions alone.
    Add {
        /// The additive mask in the scores' dtype.
        mask: &'a Tensor,
        /// The recorded attention-mask input, read over every key of the row.
        input: Option<&'a Node>,
    },
}

/// How an attention core runs: which keys, which mask, which softmax, and the head size.
#[derive(Clone, Copy, Debug)]
pub struct Attention<'a> {
    /// Causal (decoders) or bidirectional (encoders).
    pub keys: Keys,
    /// The mask after scaling.
    pub mask: AttnMask<'a>,
    /// `candle_nn::ops::softmax_last_dim` (fused kernel, decoders) or `candle_nn::ops::softmax`
    /// over the last dim (exp / sum, as candle-transformers' BERT).
    pub fused_softmax: bool,
    /// Scores in f16 or bf16 go through a softmax computed in f32 and rounded once
    /// ([`Kernel::SoftmaxWide`], the model's definition in transformers), not candle's, which
    /// sums the exponentials in the half dtype.
    pub softmax_f32: bool,
    /// Scores are divided by `sqrt(head_dim)`.
    pub head_dim: usize,
}

/// Scaled dot-product attention, each op recorded at its site: scores `q @ k^T`
/// (`[b, h, q, d] x [b, h, kv, d]` → `[b, h, q, kv]`), `/ sqrt(head_dim)`, the mask, softmax
/// over the keys, then `probs @ v` → `[b, h, q, d]`. Each of `q`, `k`, `v` is the recorded node
/// the values come from and the tensor the kernel reads (heads split, repeated to `h` heads,
/// possibly upcast), so the trace links each op to the projection or cache that produced it.
///
/// # Errors
/// Candle errors (shape mismatches); sink errors.
pub fn attention(tr: &mut Tracer, s: &AttentionSites, a: &Attention, q: (&Node, &Tensor), k: (&Node, &Tensor), v: (&Node, &Tensor)) -> Result<Node> {
    let (reads, tok) = match a.keys {
        Keys::Causal => (Reads::Prefix, Tok::Causal),
        Keys::All => (Reads::All, Tok::Keys),
    };
    let att = tr.run(&s.scores, Kernel::Matmul { rhs_t: true }, &[t(q.1), t(k.1)], &[(q.0, Reads::Same), (k.0, reads)], tok)?;
    // candle computes `x / d` as `x * (1/d)`: also qwen2's and mistral's `x * (1/sqrt(d))`.
    let att = tr.run(&s.scale, Kernel::Scale { divisor: (a.head_dim as f64).sqrt() }, &[t(&att.t)], &[(&att, Reads::Same)], tok)?;
    let att = match a.mask {
        AttnMask::None => att,
        AttnMask::Fill { mask, fill } => tr.run(&s.mask, Kernel::WhereCond, &[t(&att.t), t(mask), t(fill)], &[(&att, Reads::Same)], tok)?,
        AttnMask::Add { mask, input } => {
            let inputs: Vec<(&Node, Reads)> = std::iter::once((&att, Reads::Same)).chain(input.map(|m| (m, Reads::All))).collect();
            tr.run(&s.mask, Kernel::BroadcastAdd, &[t(&att.t), t(mask)], &inputs, tok)?
        }
    };
    let kernel = match att.t.dtype() {
        DType::F16 | DType::BF16 if a.softmax_f32 => Kernel::SoftmaxWide,
        _ => Kernel::Softmax { fused: a.fused_softmax },
    };
    let probs = tr.run(&s.softmax, kernel, &[t(&att.t)], &[(&att, Reads::Same)], tok)?;
    tr.run(&s.attn_v, Kernel::Matmul { rhs_t: false }, &[t(&probs.t), t(v.1)], &[(&probs, Reads::Same), (v.0, reads)], Tok::Seq(2))
}

/// Fused attention by candle_nn's CPU flash kernels ([`Kernel::FlashAttn`]): `q` `(1, S, H, D)`,
/// `k`, `v` the whole KV cache `(1, KV, H_kv, D)` (each the recorded node it comes from and the
/// tensor in that layout) → `[1, H, S, D]`; queries read the cache's prefix up to their
/// position.
///
/// # Errors
/// Candle errors (shapes, dtype other than f32, a device other than the CPU); sink errors.
pub fn flash_attention(tr: &mut Tracer, site: &Site, scale: f32, q: (&Node, &Tensor), k: (&Node, &Tensor), v: (&Node, &Tensor)) -> Result<Node> {
    tr.run(site, Kernel::FlashAttn { scale }, &[t(q.1), t(k.1), t(v.1)], &[(q.0, Reads::Same), (k.0, Reads::Prefix), (v.0, Reads::Prefix)], Tok::Seq(2))
}

/// SiLU, elementwise, `[b, s, n]`.
pub fn silu(tr: &mut Tracer, site: &Site, x: &Node) -> Result<Node> {
    tr.run(site, Kernel::Silu, &[t(&x.t)], &[(x, Reads::Same)], Tok::Seq(1))
}

/// GELU with the tanh approximation (candle's `gelu`, PyTorch's `gelu(approximate="tanh")`),
/// `[b, s, n]`.
pub fn gelu_tanh(tr: &mut Tracer, site: &Site, x: &Node) -> Result<Node> {
    tr.run(site, Kernel::Gelu { erf: false }, &[t(&x.t)], &[(x, Reads::Same)], Tok::Seq(1))
}

/// Elementwise product `a * b`, `[b, s, n]`.
pub fn mul(tr: &mut Tracer, site: &Site, a: &Node, b: &Node) -> Result<Node> {
    tr.run(site, Kernel::Mul, &[t(&a.t), t(&b.t)], &[(a, Reads::Same), (b, Reads::Same)], Tok::Seq(1))
}

/// Elementwise sum `a + b` (residual connections), `[b, s, n]`.
pub fn add(tr: &mut Tracer, site: &Site, a: &Node, b: &Node) -> Result<Node> {
    tr.run(site, Kernel::Add, &[t(&a.t), t(&b.t)], &[(a, Reads::Same), (b, Reads::Same)], Tok::Seq(1))
}
