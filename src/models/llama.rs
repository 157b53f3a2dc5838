//! Instrumented llama-family decoder: the architecture of candle-transformers'
//! `models::quantized_llama` (GGUF files), `models::llama`, `models::qwen2` and `models::mistral`
//! (Hugging Face folders). The four differ in small numeric details — rotary convention and table
//! dtype, attention dtype, scaling by division or multiplication, where-mask or additive mask,
//! where the last position is taken — and [`Flavour`] selects which, so each matches its upstream
//! bit for bit.
//!
//! Per layer: `x = x + o_proj(attn(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))` with
//! `n = input_layernorm(x)`, then `x = x + down_proj(silu(gate_proj(m)) * up_proj(m))` with
//! `m = post_attention_layernorm(x)`; attention is causal softmax(q k^T / sqrt(head_dim)) v with
//! grouped KV heads repeated to the query heads. Each flavour follows its upstream `forward` op
//! for op (parity tests compare logits bit for bit), with one fix for GGUF: the last position's
//! hidden state is made contiguous before the output projection, so batch > 1 works (upstream
//! `quantized_llama` fails there with "input tensor is not contiguous").
//!
//! Module paths follow Hugging Face checkpoint names: `embed_tokens`, `layers.{i}.input_layernorm`,
//! `layers.{i}.self_attn.{q,k,v,o}_proj`, `layers.{i}.mlp.{gate,up,down}_proj`, `norm`, `lm_head`;
//! ops inside a module get their own names (`layers.{i}.self_attn.softmax`).
//! The model knows nothing of files: loaders build it from weights ([`LlamaWeights`]).

use crate::error::Result;
use crate::ops::{self, Attention, AttentionSites, AttnMask, Keys, Op, Site, Weight};
use crate::record::Phase;
use crate::tracer::{Node, Tracer};
use candle_core::{DType, Device, IndexOp, Tensor};
use std::collections::HashMap;

/// Rotary tables are precomputed for this many positions (as upstream).
pub const MAX_SEQ_LEN: usize = 4096;

/// Which upstream implementation's numerics to follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavour {
    /// `quantized_llama`: interleaved rope, where-mask, `/ sqrt(d)`, last position then norm'd
    /// rows selected with `i((.., last, ..))`.
    QuantizedLlama,
    /// `llama`: NeoX rope, attention computed in f32, where-mask, `/ sqrt(d)`.
    Llama,
    /// `qwen2`: NeoX rope with tables computed in the model dtype, additive mask with sliding
    /// window, `* (1/sqrt(d))`, norm over all positions then `narrow` to the last.
    Qwen2,
    /// `mistral`: NeoX rope, additive mask with optional sliding window, `* (1/sqrt(d))`,
    /// `narrow` to the last position before the final norm.
    Mistral,
}

/// Hyper-parameters of a llama-family model.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Which upstream implementation's numerics the forward pass follows.
    pub flavour: Flavour,
    /// Decoder blocks (`num_hidden_layers`; GGUF `llama.block_count`).
    pub n_layer: usize,
    /// Query heads per layer.
    pub n_head: usize,
    /// Key/value heads (GQA heads); divides `n_head`, each repeated to `n_head / n_kv_head`
    /// query heads.
    pub n_kv_head: usize,
    /// Hidden size: the residual stream is `[batch, seq, hidden]`.
    pub hidden: usize,
    /// Rotary dimension (usually `hidden / n_head`).
    pub rope_dim: usize,
    /// Rotary base theta (`rope_theta`; GGUF `llama.rope.freq_base`). The rotary tables come from
    /// the [`RopeSpec`] given to [`Llama::new`], not from this field.
    pub rope_base: f32,
    /// RMSNorm epsilon (`rms_norm_eps`); the norms use the eps their [`candle_nn::RmsNorm`] carries.
    pub rms_eps: f64,
    /// Vocabulary size, in tokens: the last dimension of the logits.
    pub vocab: usize,
    /// Non-interleaved (NeoX) rotary embedding; false = interleaved (llama GGUF).
    pub rope_neox: bool,
    /// Per-head dimension (usually `hidden / n_head`).
    pub head_dim: usize,
    /// Keys further back than this are masked (qwen2, mistral); `None` = no window.
    pub sliding_window: Option<usize>,
}

impl LlamaConfig {
    /// Per-head dimension (the `head_dim` field).
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
}

/// How the rotary tables are computed: inverse frequencies `[rope_dim/2]` (from the
/// architecture's formula, scaling applied), multiplied by positions in f32 and then converted to
/// the model dtype, or (qwen2) converted first and multiplied in the model dtype.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeSpec {
    /// Inverse frequencies, `rope_dim / 2` of them, any rope scaling already applied.
    pub inv_freq: Vec<f32>,
    /// True (qwen2): positions and frequencies are converted to the model dtype, then
    /// multiplied; false: multiplied in f32, then converted.
    pub in_model_dtype: bool,
}

impl RopeSpec {
    /// `1 / base^(i/dim)` for even `i < dim`, in f32 (llama, quantized_llama, mistral).
    pub fn standard(dim: usize, base: f32) -> Self {
        let inv_freq = (0..dim).step_by(2).map(|i| 1f32 / base.powf(i as f32 / dim as f32)).collect();
        RopeSpec { inv_freq, in_model_dtype: false }
    }
}

/// Weights of one block. Norms carry dense `[hidden]` weights in the compute dtype and eps.
#[derive(Debug, Clone)]
pub struct BlockWeights {
    /// `self_attn.q_proj`, `[n_head * head_dim, hidden]`, dense or GGUF-quantized; bias only for
    /// qwen2.
    pub q_proj: Weight,
    /// `self_attn.k_proj`, `[n_kv_head * head_dim, hidden]`; bias only for qwen2.
    pub k_proj: Weight,
    /// `self_attn.v_proj`, `[n_kv_head * head_dim, hidden]`; bias only for qwen2.
    pub v_proj: Weight,
    /// `self_attn.o_proj`, `[hidden, n_head * head_dim]`, no bias.
    pub o_proj: Weight,
    /// `mlp.gate_proj`, `[intermediate, hidden]`: its SiLU multiplies `up_proj`'s output.
    pub gate_proj: Weight,
    /// `mlp.up_proj`, `[intermediate, hidden]`.
    pub up_proj: Weight,
    /// `mlp.down_proj`, `[hidden, intermediate]`.
    pub down_proj: Weight,
    /// RMSNorm before attention.
    pub input_layernorm: candle_nn::RmsNorm,
    /// RMSNorm before the MLP.
    pub post_attention_layernorm: candle_nn::RmsNorm,
}

/// All weights of a model, as a loader hands them over.
#[derive(Debug, Clone)]
pub struct LlamaWeights {
    /// `[vocab, hidden]` in the compute dtype.
    pub embed_tokens: Tensor,
    /// One per layer, in order (`layers.{i}`).
    pub blocks: Vec<BlockWeights>,
    /// Final RMSNorm (`norm`), applied before `lm_head`.
    pub norm: candle_nn::RmsNorm,
    /// Output projection to the logits, `[vocab, hidden]`; the embedding matrix when the
    /// embeddings are tied.
    pub lm_head: Weight,
}

struct BlockSites {
    input_layernorm: Site,
    q_proj: Site,
    k_proj: Site,
    v_proj: Site,
    rope_q: Site,
    rope_k: Site,
    k_cache: Site,
    v_cache: Site,
    attn: AttentionSites,
    attn_cast: Site,
    o_proj: Site,
    attn_residual: Site,
    post_attention_layernorm: Site,
    gate_proj: Site,
    up_proj: Site,
    act: Site,
    mul: Site,
    down_proj: Site,
    mlp_residual: Site,
}

impl BlockSites {
    fn new(i: usize, w: &BlockWeights, flavour: Flavour) -> Self {
        let mask_op = match flavour {
            Flavour::QuantizedLlama | Flavour::Llama => Op::WhereCond,
            Flavour::Qwen2 | Flavour::Mistral => Op::MaskAdd,
        };
        let l = format!("layers.{i}");
        let a = format!("{l}.self_attn");
        let m = format!("{l}.mlp");
        BlockSites {
            input_layernorm: Site::new(format!("{l}.input_layernorm"), Op::RmsNorm),
            q_proj: Site::new(format!("{a}.q_proj"), w.q_proj.op()),
            k_proj: Site::new(format!("{a}.k_proj"), w.k_proj.op()),
            v_proj: Site::new(format!("{a}.v_proj"), w.v_proj.op()),
            rope_q: Site::new(format!("{a}.rope_q"), Op::Rope),
            rope_k: Site::new(format!("{a}.rope_k"), Op::Rope),
            k_cache: Site::new(format!("{a}.k_cache"), Op::Cat),
            v_cache: Site::new(format!("{a}.v_cache"), Op::Cat),
            attn: AttentionSites::new(&a, "mask", mask_op),
            attn_cast: Site::new(format!("{a}.attn_cast"), Op::ToDtype),
            o_proj: Site::new(format!("{a}.o_proj"), w.o_proj.op()),
            attn_residual: Site::new(format!("{l}.attn_residual"), Op::Add),
            post_attention_layernorm: Site::new(format!("{l}.post_attention_layernorm"), Op::RmsNorm),
            gate_proj: Site::new(format!("{m}.gate_proj"), w.gate_proj.op()),
            up_proj: Site::new(format!("{m}.up_proj"), w.up_proj.op()),
            act: Site::new(format!("{m}.act"), Op::Silu),
            mul: Site::new(format!("{m}.mul"), Op::Mul),
            down_proj: Site::new(format!("{m}.down_proj"), w.down_proj.op()),
            mlp_residual: Site::new(format!("{l}.mlp_residual"), Op::Add),
        }
    }
}

struct Block {
    w: BlockWeights,
    sites: BlockSites,
    kv_cache: Option<(Tensor, Tensor)>,
}

/// An instrumented llama-family decoder with a KV cache.
pub struct Llama {
    cfg: LlamaConfig,
    /// Activation dtype.
    dtype: DType,
    device: Device,
    embed: candle_nn::Embedding,
    blocks: Vec<Block>,
    norm: candle_nn::RmsNorm,
    lm_head: Weight,
    cos: Tensor,
    sin: Tensor,
    neg_inf: Tensor,
    /// Masks by (batch, seq_len, kv_len).
    masks: HashMap<(usize, usize, usize), Tensor>,
    /// Left padding of each batch row (empty: none): row `r`'s first `pads[r]` positions are
    /// padding, hidden from attention, and its positions count from its own first token.
    pads: Vec<usize>,
    site_input: Site,
    site_embed: Site,
    site_norm: Site,
    site_lm_head: Site,
    site_logits: Site,
}

/// Rotary tables `(cos, sin)`, `[MAX_SEQ_LEN, rope_dim/2]` in `dtype`, computed as upstream does.
pub(crate) fn rope_tables(spec: &RopeSpec, dtype: DType, device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
    let n = spec.inv_freq.len();
    let inv = Tensor::from_vec(spec.inv_freq.clone(), (1, n), device)?;
    let pos = Tensor::arange(0u32, MAX_SEQ_LEN as u32, device)?;
    if spec.in_model_dtype {
        let freqs = pos.to_dtype(dtype)?.reshape((MAX_SEQ_LEN, 1))?.matmul(&inv.to_dtype(dtype)?)?;
        Ok((freqs.cos()?, freqs.sin()?))
    } else {
        let freqs = pos.to_dtype(DType::F32)?.reshape((MAX_SEQ_LEN, 1))?.matmul(&inv)?;
        Ok((freqs.cos()?.to_dtype(dtype)?, freqs.sin()?.to_dtype(dtype)?))
    }
}

/// Whether a left-padded row (its first `pad` positions padding) hides key `j` from the query at
/// absolute position `q`: a later key, a padding key, or one more than `window` positions back.
/// A padding query (q < pad) would see no key at all, and a softmax over nothing but −∞ is NaN,
/// which then reaches real queries through 0 · NaN in probs @ V: it sees itself only. Its output
/// is never used; real queries never see a padding key.
pub(crate) fn key_hidden(pad: usize, q: usize, j: usize, window: Option<usize>) -> bool {
    if q < pad {
        return j != q;
    }
    j > q || j < pad || window.is_some_and(|w| j + w < q)
}

/// Rotary tables `(cos, sin)` `[MAX_SEQ_LEN, d]` gathered at each left-padded row's own positions
/// `index_pos + i - pads[r]` (padding positions at 0; they are masked): `[b, seq_len, d]`.
pub(crate) fn padded_tables((cos, sin): (&Tensor, &Tensor), pads: &[usize], seq_len: usize, index_pos: usize) -> Result<(Tensor, Tensor)> {
    let idx: Vec<u32> = pads.iter().flat_map(|&p| (0..seq_len).map(move |i| (index_pos + i).saturating_sub(p) as u32)).collect();
    let b = pads.len();
    let idx = Tensor::from_vec(idx, b * seq_len, cos.device())?;
    let gather = |t: &Tensor| -> Result<Tensor> { Ok(t.index_select(&idx, 0)?.reshape((b, seq_len, t.dim(1)?))?.contiguous()?) };
    Ok((gather(cos)?, gather(sin)?))
}

impl Llama {
    /// Builds the model. `dtype` is the activation dtype (f32 for quantized weights).
    ///
    /// # Errors
    /// Candle errors when the rotary tables cannot be built.
    pub fn new(cfg: LlamaConfig, w: LlamaWeights, rope: &RopeSpec, dtype: DType, device: &Device) -> Result<Self> {
        let (cos, sin) = rope_tables(rope, dtype, device)?;
        // The where-mask fill value: quantized_llama keeps it in the model dtype, llama in f32
        // (its attention runs in f32).
        let neg_inf = match cfg.flavour {
            Flavour::Llama => Tensor::new(f32::NEG_INFINITY, device)?,
            _ => Tensor::new(f32::NEG_INFINITY, device)?.to_dtype(dtype)?,
        };
        let blocks = w
            .blocks
            .into_iter()
            .enumerate()
            .map(|(i, b)| Block { sites: BlockSites::new(i, &b, cfg.flavour), w: b, kv_cache: None })
            .collect();
        let site_lm_head = Site::new("lm_head", w.lm_head.op());
        Ok(Llama {
            embed: candle_nn::Embedding::new(w.embed_tokens, cfg.hidden),
            cfg,
            dtype,
            device: device.clone(),
            blocks,
            norm: w.norm,
            lm_head: w.lm_head,
            cos,
            sin,
            neg_inf,
            masks: HashMap::new(),
            pads: Vec::new(),
            site_input: Site::new("input_ids", Op::Input),
            site_embed: Site::new("embed_tokens", Op::Embedding),
            site_norm: Site::new("norm", Op::RmsNorm),
            site_lm_head,
            site_logits: Site::new("logits", Op::ToDtype),
        })
    }

    /// Switches the rotary layout (NeoX halves when `neox`, else interleaved pairs): what a
    /// converter that mislabels a file's rope convention does to a model. Tests use it to
    /// reproduce that bug; runs never call it.
    pub fn set_rope_neox(&mut self, neox: bool) {
        self.cfg.rope_neox = neox;
    }

    /// The hyper-parameters it was built with.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// Activation dtype (f32 with quantized weights).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device of its weights, KV cache and masks; token ids passed to [`Llama::forward`]
    /// must be on it.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Module paths of every op site, in execution order of one forward pass (`attn_cast` and
    /// `logits` conversions only run for non-f32 activations).
    pub fn site_paths(&self) -> impl Iterator<Item = &str> {
        let top = [&self.site_input, &self.site_embed];
        let blocks = self.blocks.iter().flat_map(|b| {
            let s = &b.sites;
            let before = [&s.input_layernorm, &s.q_proj, &s.k_proj, &s.v_proj, &s.rope_q, &s.rope_k, &s.k_cache, &s.v_cache];
            let after = [
                &s.attn_cast, &s.o_proj, &s.attn_residual, &s.post_attention_layernorm, &s.gate_proj, &s.up_proj, &s.act, &s.mul,
                &s.down_proj, &s.mlp_residual,
            ];
            before.into_iter().chain(s.attn.all()).chain(after)
        });
        let tail = [&self.site_norm, &self.site_lm_head, &self.site_logits];
        top.into_iter().chain(blocks).chain(tail).map(|s| s.path.as_str())
    }

    /// Sets the left padding of each batch row for the next forward passes (empty: none): the
    /// attention mask hides each row's padding keys, and the rotary embedding uses each row's
    /// own positions (`absolute - pads[r]`), as Hugging Face's `generate` does with an attention
    /// mask and position ids. Clears the cached masks.
    pub fn set_padding(&mut self, pads: Vec<usize>) {
        self.pads = pads;
        self.masks.clear();
    }

    /// The mask of a pass over a left-padded batch, `[b, 1, q, kv]`: a key is hidden from query
    /// `i` (absolute position `index_pos + i`) when it is later than the query, before the row's
    /// first real token, or (qwen2, mistral) further back than the sliding window; a padding
    /// query sees only itself. u8 (1 =
    /// hidden) for where-mask flavours, additive (0 / -inf) in the model dtype for the others.
    fn padded_mask(&self, seq_len: usize, index_pos: usize) -> Result<Tensor> {
        let kv_len = index_pos + seq_len;
        let window = self.cfg.sliding_window;
        let hidden = |pad: usize, i: usize, j: usize| key_hidden(pad, index_pos + i, j, window);
        let b = self.pads.len();
        let dev = &self.device;
        Ok(match self.cfg.flavour {
            Flavour::QuantizedLlama | Flavour::Llama => {
                let v: Vec<u8> = self.pads.iter().flat_map(|&p| (0..seq_len).flat_map(move |i| (0..kv_len).map(move |j| u8::from(hidden(p, i, j))))).collect();
                Tensor::from_vec(v, (b, 1, seq_len, kv_len), dev)?
            }
            Flavour::Qwen2 | Flavour::Mistral => {
                let v: Vec<f32> = self
                    .pads
                    .iter()
                    .flat_map(|&p| (0..seq_len).flat_map(move |i| (0..kv_len).map(move |j| if hidden(p, i, j) { f32::NEG_INFINITY } else { 0.0 })))
                    .collect();
                Tensor::from_vec(v, (b, 1, seq_len, kv_len), dev)?.to_dtype(self.dtype)?
            }
        })
    }

    /// Rotary tables for a left-padded batch: `[b, seq_len, rope_dim/2]`, row `r` at its own
    /// positions `index_pos + i - pads[r]` (padding positions at 0; they are masked).
    fn padded_rope(&self, seq_len: usize, index_pos: usize) -> Result<(Tensor, Tensor)> {
        padded_tables((&self.cos, &self.sin), &self.pads, seq_len, index_pos)
    }

    /// Empties the KV cache of every layer.
    pub fn clear_kv_cache(&mut self) {
        for b in &mut self.blocks {
            b.kv_cache = None;
        }
    }

    /// The causal mask of a pass: u8 `[q, kv]` (1 = hidden) for where-mask flavours, or an
    /// additive `[b|1, 1, q, kv]` mask (0 / -inf) in the model dtype for qwen2 and mistral, built
    /// as upstream builds it.
    fn mask(&mut self, b_sz: usize, seq_len: usize, index_pos: usize) -> Result<Tensor> {
        let kv_len = index_pos + seq_len;
        let key = (b_sz, seq_len, kv_len);
        if let Some(m) = self.masks.get(&key) {
            return Ok(m.clone());
        }
        let dev = &self.device;
        let m = match self.cfg.flavour {
            Flavour::QuantizedLlama | Flavour::Llama => candle_transformers::utils::build_causal_mask(seq_len, index_pos, dev)?,
            Flavour::Qwen2 | Flavour::Mistral => {
                let window = self.cfg.sliding_window.unwrap_or(seq_len + 1);
                let vals: Vec<f32> = (0..seq_len)
                    .flat_map(|i| (0..seq_len).map(move |j| if i < j || j + window < i { f32::NEG_INFINITY } else { 0.0 }))
                    .collect();
                let m = Tensor::from_slice(&vals, (seq_len, seq_len), dev)?;
                let m = if index_pos > 0 {
                    let zeros = Tensor::zeros((seq_len, index_pos), DType::F32, dev)?;
                    Tensor::cat(&[&zeros, &m], 1)?
                } else {
                    m
                };
                let rows = if self.cfg.flavour == Flavour::Qwen2 { b_sz } else { 1 };
                m.expand((rows, 1, seq_len, kv_len))?.to_dtype(self.dtype)?
            }
        };
        self.masks.insert(key, m.clone());
        Ok(m)
    }

    /// One forward pass over token ids `[batch, seq_len]` (u32) at absolute positions
    /// `index_pos .. index_pos + seq_len`, appending to the KV cache.
    ///
    /// Returns the logits of the last position, `[batch, vocab]` f32.
    ///
    /// # Errors
    /// Candle errors (shape mismatch, positions past [`MAX_SEQ_LEN`]) and sink errors.
    pub fn forward(&mut self, tr: &mut Tracer, ids: &Tensor, index_pos: usize, phase: Phase) -> Result<Tensor> {
        let seq_len = ids.dim(1)?;
        if index_pos + seq_len > MAX_SEQ_LEN {
            return Err(crate::Error::usage(format!(
                "sequence of {} tokens is longer than the {MAX_SEQ_LEN} positions supported",
                index_pos + seq_len
            )));
        }
        tr.begin_forward(phase, index_pos, ids)?;
        let b_sz = ids.dim(0)?;
        let padded = !self.pads.is_empty();
        if padded && self.pads.len() != b_sz {
            return Err(crate::Error::usage(format!("padding set for {} rows, the batch has {b_sz}", self.pads.len())));
        }
        let mask = if padded {
            Some(self.padded_mask(seq_len, index_pos)?)
        } else if seq_len == 1 {
            None
        } else {
            Some(self.mask(b_sz, seq_len, index_pos)?)
        };
        let ids = ops::input(tr, &self.site_input, ids)?;
        let mut x = ops::embedding(tr, &self.site_embed, &self.embed, &ids)?;
        let (cos, sin) = if padded {
            self.padded_rope(seq_len, index_pos)?
        } else {
            (self.cos.narrow(0, index_pos, seq_len)?, self.sin.narrow(0, index_pos, seq_len)?)
        };
        let cfg = &self.cfg;
        for block in &mut self.blocks {
            x = block_forward(tr, cfg, self.dtype, block, &x, mask.as_ref(), &self.neg_inf, &cos, &sin)?;
        }
        let logits = match cfg.flavour {
            Flavour::QuantizedLlama | Flavour::Llama => {
                let x = ops::rms_norm(tr, &self.site_norm, &x, &self.norm)?;
                let last = x.t.i((.., seq_len - 1, ..))?.contiguous()?;
                ops::linear_last(tr, &self.site_lm_head, &self.lm_head, &x, &last)?
            }
            Flavour::Qwen2 => {
                let x = ops::rms_norm(tr, &self.site_norm, &x, &self.norm)?;
                let last = x.t.narrow(1, seq_len - 1, 1)?;
                let l = ops::linear_last(tr, &self.site_lm_head, &self.lm_head, &x, &last)?;
                Node { t: l.t.squeeze(1)?, seq: l.seq }
            }
            Flavour::Mistral => {
                let last = Node { t: x.t.narrow(1, seq_len - 1, 1)?, seq: x.seq };
                let x = ops::rms_norm_last(tr, &self.site_norm, &last, &self.norm)?;
                let l = ops::linear_last(tr, &self.site_lm_head, &self.lm_head, &x, &x.t)?;
                Node { t: l.t.squeeze(1)?, seq: l.seq }
            }
        };
        let logits = if logits.t.dtype() == DType::F32 {
            logits
        } else {
            ops::to_dtype_last(tr, &self.site_logits, &logits, DType::F32)?
        };
        tr.end_forward()?;
        Ok(logits.t)
    }
}

#[allow(clippy::too_many_arguments)]
fn block_forward(
    tr: &mut Tracer,
    cfg: &LlamaConfig,
    dtype: DType,
    block: &mut Block,
    x: &Node,
    mask: Option<&Tensor>,
    neg_inf: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Node> {
    let (s, w) = (&block.sites, &block.w);
    let (b_sz, seq_len, _) = x.t.dims3()?;
    let (n_head, n_kv, hd) = (cfg.n_head, cfg.n_kv_head, cfg.head_dim());

    let n = ops::rms_norm(tr, &s.input_layernorm, x, &w.input_layernorm)?;
    let q = ops::linear(tr, &s.q_proj, &w.q_proj, &n)?;
    let k = ops::linear(tr, &s.k_proj, &w.k_proj, &n)?;
    let v = ops::linear(tr, &s.v_proj, &w.v_proj, &n)?;
    let q_heads = q.t.reshape((b_sz, seq_len, n_head, hd))?.transpose(1, 2)?;
    let k_heads = k.t.reshape((b_sz, seq_len, n_kv, hd))?.transpose(1, 2)?;
    // V is made contiguous as quantized_llama and mistral do (the values are the same either way).
    let v_heads = Node { t: v.t.reshape((b_sz, seq_len, n_kv, hd))?.transpose(1, 2)?.contiguous()?, seq: v.seq };
    let q = ops::rope(tr, &s.rope_q, &q, &q_heads, cos, sin, cfg.rope_neox)?;
    let k = ops::rope(tr, &s.rope_k, &k, &k_heads, cos, sin, cfg.rope_neox)?;

    let index_pos = tr.index_pos() as usize;
    let (k_prev, v_prev) = match (&block.kv_cache, index_pos) {
        (Some((kc, vc)), p) if p > 0 => (Some(kc.clone()), Some(vc.clone())),
        _ => (None, None),
    };
    let k = ops::cache_append(tr, &s.k_cache, k_prev.as_ref(), &k)?;
    let v = ops::cache_append(tr, &s.v_cache, v_prev.as_ref(), &v_heads)?;
    block.kv_cache = Some((k.t.clone(), v.t.clone()));

    let n_rep = n_head / n_kv;
    let mut k_rep = candle_transformers::utils::repeat_kv(k.t.clone(), n_rep)?;
    let mut v_rep = candle_transformers::utils::repeat_kv(v.t.clone(), n_rep)?;
    // llama runs attention in f32 whatever the model dtype.
    let upcast = cfg.flavour == Flavour::Llama && dtype != DType::F32;
    let q_t = if upcast {
        k_rep = k_rep.to_dtype(DType::F32)?;
        v_rep = v_rep.to_dtype(DType::F32)?;
        q.t.to_dtype(DType::F32)?
    } else {
        q.t.clone()
    };
    let mask = match (mask, cfg.flavour) {
        (None, _) => AttnMask::None,
        (Some(m), Flavour::QuantizedLlama | Flavour::Llama) => AttnMask::Fill { mask: m, fill: neg_inf },
        (Some(m), Flavour::Qwen2 | Flavour::Mistral) => AttnMask::Add { mask: m, input: None },
    };
    let how = Attention { keys: Keys::Causal, mask, fused_softmax: true, head_dim: hd };
    let y = ops::attention(tr, &s.attn, &how, (&q, &q_t), (&k, &k_rep), (&v, &v_rep))?;
    let y = if upcast { ops::to_dtype_heads(tr, &s.attn_cast, &y, dtype)? } else { y };
    let y_flat = Node { t: y.t.transpose(1, 2)?.reshape((b_sz, seq_len, n_head * hd))?, seq: y.seq };
    let attn_out = ops::linear(tr, &s.o_proj, &w.o_proj, &y_flat)?;
    let x = ops::add(tr, &s.attn_residual, &attn_out, x)?;

    let m = ops::rms_norm(tr, &s.post_attention_layernorm, &x, &w.post_attention_layernorm)?;
    let gate = ops::linear(tr, &s.gate_proj, &w.gate_proj, &m)?;
    let up = ops::linear(tr, &s.up_proj, &w.up_proj, &m)?;
    let act = ops::silu(tr, &s.act, &gate)?;
    let h = ops::mul(tr, &s.mul, &act, &up)?;
    let down = ops::linear(tr, &s.down_proj, &w.down_proj, &h)?;
    ops::add(tr, &s.mlp_residual, &down, &x)
}
