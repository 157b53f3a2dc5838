//! Instrumented llama-family decoder: the architecture of candle-transformers'
//! `models::quantized_llama`, `quantized_qwen2`, `quantized_qwen3` and `quantized_phi3` (GGUF
//! files), `models::llama`, `models::qwen2` and `models::mistral` (Hugging Face folders). They
//! differ in small numeric details — rotary convention and table dtype, attention dtype and
//! kernel, scaling by division or multiplication, where-mask or additive mask, where the last
//! position is taken — and [`Flavour`] selects which; in weights — fused projections
//! ([`QkvProj`], [`GateUpProj`]: Phi-3), per-head q/k norms (Qwen 3) — which [`BlockWeights`]
//! carry. Each matches its upstream bit for bit.
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

use candle_core::{DType, Device, IndexOp, Tensor};
use candle_trace_format::error::Result;
use candle_trace_format::record::Phase;
use candle_trace_instrument::ops::{self, Attention, AttentionSites, AttnMask, Keys, Op, Site, Weight};
use candle_trace_instrument::tracer::{Node, Tracer};
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
    /// `quantized_qwen3`: q/k RMS-normed per head before NeoX rope; on CPU at batch 1 in f32,
    /// candle_nn's flash attention kernels (one recorded `flash_attn` op); otherwise additive mask
    /// and `* (1/sqrt(d))`; norm over all positions then `narrow` to the last.
    Qwen3,
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
    /// Upstream's sliding window (candle-transformers' qwen2 and mistral): a key more than this
    /// many positions back is hidden in a prefill (`j + w < i`), none in a decode step;
    /// followed under [`Llama::set_upstream_numerics`]. `None` = no window.
    pub sliding_window: Option<usize>,
    /// The sliding window as the model defines it (transformers' `sliding_window_overlay`): a
    /// query sees this many keys, its own included, in every pass, decode steps included
    /// (mistral's `sliding_window`; qwen2's only with `use_sliding_window`). `None` = no window.
    pub window: Option<usize>,
}

impl LlamaConfig {
    /// Per-head dimension (the `head_dim` field).
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
}

/// How the rotary tables are computed: inverse frequencies `[rope_dim/2]` (from the
/// architecture's formula, scaling applied) and positions are converted to a dtype, multiplied
/// there and their cos/sin taken there, then the tables are converted to the model dtype.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeSpec {
    /// Inverse frequencies, `rope_dim / 2` of them, any rope scaling already applied.
    pub inv_freq: Vec<f32>,
    /// The dtype the tables are computed in: f32 (llama, quantized_llama, mistral), `None` for
    /// the model dtype (Hugging Face qwen2), f16 by default for `quantized_qwen3` (its
    /// `general.dtype`).
    pub compute_dtype: Option<DType>,
}

impl RopeSpec {
    /// `1 / base^(i/dim)` for even `i < dim`, in f32 (llama, quantized_llama, mistral).
    pub fn standard(dim: usize, base: f32) -> Self {
        let inv_freq = (0..dim).step_by(2).map(|i| 1f32 / base.powf(i as f32 / dim as f32)).collect();
        RopeSpec { inv_freq, compute_dtype: Some(DType::F32) }
    }

    /// `1 / (base^(i/dim) in f64, rounded to f32)` for even `i < dim` (qwen2, quantized_qwen3),
    /// computed in `compute_dtype` (`None`: the model dtype).
    pub fn f64_powers(dim: usize, base: f64, compute_dtype: Option<DType>) -> Self {
        let inv_freq = (0..dim).step_by(2).map(|i| 1f32 / base.powf(i as f64 / dim as f64) as f32).collect();
        RopeSpec { inv_freq, compute_dtype }
    }
}

/// The attention's input projections, dense or GGUF-quantized.
#[derive(Debug, Clone)]
pub enum QkvProj {
    /// `self_attn.{q,k,v}_proj`: `[n_head * head_dim, hidden]`, then `[n_kv_head * head_dim,
    /// hidden]` twice; biases only for qwen2.
    Split {
        /// `self_attn.q_proj`.
        q: Weight,
        /// `self_attn.k_proj`.
        k: Weight,
        /// `self_attn.v_proj`.
        v: Weight,
    },
    /// `self_attn.qkv_proj`, `[(n_head + 2 n_kv_head) * head_dim, hidden]`: q, k and v side by
    /// side along the output's last dim (Phi-3's `attn_qkv`).
    Fused(Weight),
}

/// The MLP's input projections.
#[derive(Debug, Clone)]
pub enum GateUpProj {
    /// `mlp.gate_proj` and `mlp.up_proj`, each `[intermediate, hidden]`.
    Split {
        /// `mlp.gate_proj`: its SiLU multiplies `up_proj`'s output.
        gate: Weight,
        /// `mlp.up_proj`.
        up: Weight,
    },
    /// `mlp.gate_up_proj`, `[2 * intermediate, hidden]`: the gate's half first, then up's
    /// (Phi-3's `ffn_up`).
    Fused(Weight),
}

/// Weights of one block. Norms carry dense `[hidden]` weights in the compute dtype and eps.
#[derive(Debug, Clone)]
pub struct BlockWeights {
    /// q, k and v projections.
    pub qkv: QkvProj,
    /// `self_attn.o_proj`, `[hidden, n_head * head_dim]`, no bias.
    pub o_proj: Weight,
    /// gate and up projections.
    pub gate_up: GateUpProj,
    /// `mlp.down_proj`, `[hidden, intermediate]`.
    pub down_proj: Weight,
    /// RMSNorm before attention.
    pub input_layernorm: candle_nn::RmsNorm,
    /// RMSNorm before the MLP.
    pub post_attention_layernorm: candle_nn::RmsNorm,
    /// `self_attn.q_norm` and `self_attn.k_norm`, RMSNorms over each head's `[head_dim]`
    /// (Qwen 3); `None` elsewhere.
    pub qk_norm: Option<(candle_nn::RmsNorm, candle_nn::RmsNorm)>,
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
    /// `q_proj`, `k_proj`, `v_proj`, or `qkv_proj` alone.
    qkv: Vec<Site>,
    q_norm: Site,
    k_norm: Site,
    rope_q: Site,
    rope_k: Site,
    k_cache: Site,
    v_cache: Site,
    attn: AttentionSites,
    flash_attn: Site,
    attn_cast: Site,
    o_proj: Site,
    attn_residual: Site,
    post_attention_layernorm: Site,
    /// `gate_proj`, `up_proj`, or `gate_up_proj` alone.
    gate_up: Vec<Site>,
    act: Site,
    mul: Site,
    down_proj: Site,
    mlp_residual: Site,
}

impl BlockSites {
    fn new(i: usize, w: &BlockWeights, flavour: Flavour) -> Self {
        let mask_op = match flavour {
            Flavour::QuantizedLlama | Flavour::Llama => Op::WhereCond,
            Flavour::Qwen2 | Flavour::Mistral | Flavour::Qwen3 => Op::MaskAdd,
        };
        let l = format!("layers.{i}");
        let a = format!("{l}.self_attn");
        let m = format!("{l}.mlp");
        BlockSites {
            input_layernorm: Site::new(format!("{l}.input_layernorm"), Op::RmsNorm),
            qkv: match &w.qkv {
                QkvProj::Split { q, k, v } => {
                    vec![Site::new(format!("{a}.q_proj"), q.op()), Site::new(format!("{a}.k_proj"), k.op()), Site::new(format!("{a}.v_proj"), v.op())]
                }
                QkvProj::Fused(qkv) => vec![Site::new(format!("{a}.qkv_proj"), qkv.op())],
            },
            q_norm: Site::new(format!("{a}.q_norm"), Op::RmsNorm),
            k_norm: Site::new(format!("{a}.k_norm"), Op::RmsNorm),
            rope_q: Site::new(format!("{a}.rope_q"), Op::Rope),
            rope_k: Site::new(format!("{a}.rope_k"), Op::Rope),
            k_cache: Site::new(format!("{a}.k_cache"), Op::Cat),
            v_cache: Site::new(format!("{a}.v_cache"), Op::Cat),
            attn: AttentionSites::new(&a, "mask", mask_op),
            flash_attn: Site::new(format!("{a}.flash_attn"), Op::FlashAttn),
            attn_cast: Site::new(format!("{a}.attn_cast"), Op::ToDtype),
            o_proj: Site::new(format!("{a}.o_proj"), w.o_proj.op()),
            attn_residual: Site::new(format!("{l}.attn_residual"), Op::Add),
            post_attention_layernorm: Site::new(format!("{l}.post_attention_layernorm"), Op::RmsNorm),
            gate_up: match &w.gate_up {
                GateUpProj::Split { gate, up } => {
                    vec![Site::new(format!("{m}.gate_proj"), gate.op()), Site::new(format!("{m}.up_proj"), up.op())]
                }
                GateUpProj::Fused(gu) => vec![Site::new(format!("{m}.gate_up_proj"), gu.op())],
            },
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
    /// In f16 and bf16, attention's softmax as candle's kernel computes it, summed in the half
    /// dtype ([`Llama::set_upstream_numerics`]); else in f32, as the model is defined.
    upstream: bool,
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
    let cd = spec.compute_dtype.unwrap_or(dtype);
    let freqs = pos.to_dtype(cd)?.reshape((MAX_SEQ_LEN, 1))?.matmul(&inv.to_dtype(cd)?)?;
    Ok((freqs.cos()?.to_dtype(dtype)?, freqs.sin()?.to_dtype(dtype)?))
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
    /// Follows candle's numerics where they depart from the model's definition (`--numerics
    /// upstream`): in f16 and bf16, attention's softmax runs candle's half-precision kernel
    /// (`softmax_last_dim`, which sums the exponentials in the half dtype) where the default
    /// computes it in f32 and rounds once, as transformers does. f32 runs and the `Llama`
    /// flavour (whose attention runs in f32) are the same either way.
    pub fn set_upstream_numerics(&mut self) {
        self.upstream = true;
    }

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
        let blocks = w.blocks.into_iter().enumerate().map(|(i, b)| Block { sites: BlockSites::new(i, &b, cfg.flavour), w: b, kv_cache: None }).collect();
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
            upstream: false,
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

    /// Every op site, in execution order of one forward pass (`attn_cast` and `logits`
    /// conversions only run for non-f32 activations; Qwen 3 lists both its `flash_attn` and the
    /// unfused attention it runs at batch > 1).
    pub fn sites(&self) -> impl Iterator<Item = &Site> {
        let top = [&self.site_input, &self.site_embed];
        let qwen3 = self.cfg.flavour == Flavour::Qwen3;
        let blocks = self.blocks.iter().flat_map(move |b| {
            let s = &b.sites;
            let norms = b.w.qk_norm.as_ref().map(|_| [&s.q_norm, &s.k_norm]).into_iter().flatten();
            let flash = qwen3.then_some(&s.flash_attn);
            let mut all: Vec<&Site> = std::iter::once(&s.input_layernorm).chain(&s.qkv).chain(norms).collect();
            all.extend([&s.rope_q, &s.rope_k, &s.k_cache, &s.v_cache]);
            all.extend(flash.into_iter().chain(s.attn.all()));
            all.extend([&s.attn_cast, &s.o_proj, &s.attn_residual, &s.post_attention_layernorm]);
            all.extend(s.gate_up.iter().chain([&s.act, &s.mul, &s.down_proj, &s.mlp_residual]));
            all
        });
        let tail = [&self.site_norm, &self.site_lm_head, &self.site_logits];
        top.into_iter().chain(blocks).chain(tail)
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
        let window = self.reach();
        let hidden = |pad: usize, i: usize, j: usize| key_hidden(pad, index_pos + i, j, window);
        let b = self.pads.len();
        let dev = &self.device;
        Ok(match self.cfg.flavour {
            Flavour::QuantizedLlama | Flavour::Llama => {
                let v: Vec<u8> = self.pads.iter().flat_map(|&p| (0..seq_len).flat_map(move |i| (0..kv_len).map(move |j| u8::from(hidden(p, i, j))))).collect();
                Tensor::from_vec(v, (b, 1, seq_len, kv_len), dev)?
            }
            Flavour::Qwen2 | Flavour::Mistral | Flavour::Qwen3 => {
                let v: Vec<f32> = self.pads.iter().flat_map(|&p| (0..seq_len).flat_map(move |i| (0..kv_len).map(move |j| if hidden(p, i, j) { f32::NEG_INFINITY } else { 0.0 }))).collect();
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

    /// How many positions back a query still sees a key, if a window hides any: the defined
    /// window's `w - 1` ([`LlamaConfig::window`]), or upstream's `w` under its numerics
    /// ([`LlamaConfig::sliding_window`]).
    fn reach(&self) -> Option<usize> {
        if self.upstream {
            self.cfg.sliding_window
        } else {
            self.cfg.window.map(|w| w.saturating_sub(1))
        }
    }

    /// Whether a single-token decode step needs a mask: once a key has left the defined window
    /// (upstream's numerics never mask a decode step).
    fn decode_masked(&self, index_pos: usize) -> bool {
        !self.upstream && self.cfg.window.is_some() && self.reach().is_some_and(|r| index_pos > r)
    }

    /// The causal mask of a pass: u8 `[q, kv]` (1 = hidden) for where-mask flavours, or an
    /// additive `[b|1, 1, q, kv]` mask (0 / -inf) in the model dtype for qwen2 and mistral, built
    /// as upstream builds it (every cached key visible), or, with a defined window outside
    /// upstream's numerics, hiding the keys outside it, cached ones included.
    fn mask(&mut self, b_sz: usize, seq_len: usize, index_pos: usize) -> Result<Tensor> {
        let kv_len = index_pos + seq_len;
        let key = (b_sz, seq_len, kv_len);
        if let Some(m) = self.masks.get(&key) {
            return Ok(m.clone());
        }
        let dev = &self.device;
        let m = match self.cfg.flavour {
            Flavour::QuantizedLlama | Flavour::Llama => candle_transformers::utils::build_causal_mask(seq_len, index_pos, dev)?,
            Flavour::Qwen2 | Flavour::Mistral | Flavour::Qwen3 if !self.upstream && self.cfg.window.is_some() => {
                let reach = self.reach();
                let vals: Vec<f32> = (0..seq_len).flat_map(|i| (0..kv_len).map(move |j| if key_hidden(0, index_pos + i, j, reach) { f32::NEG_INFINITY } else { 0.0 })).collect();
                let rows = if self.cfg.flavour == Flavour::Mistral { 1 } else { b_sz };
                Tensor::from_vec(vals, (seq_len, kv_len), dev)?.expand((rows, 1, seq_len, kv_len))?.to_dtype(self.dtype)?
            }
            Flavour::Qwen2 | Flavour::Mistral | Flavour::Qwen3 => {
                let window = self.cfg.sliding_window.unwrap_or(seq_len + 1);
                let vals: Vec<f32> = (0..seq_len).flat_map(|i| (0..seq_len).map(move |j| if i < j || j + window < i { f32::NEG_INFINITY } else { 0.0 })).collect();
                let m = Tensor::from_slice(&vals, (seq_len, seq_len), dev)?;
                let m = if index_pos > 0 {
                    let zeros = Tensor::zeros((seq_len, index_pos), DType::F32, dev)?;
                    Tensor::cat(&[&zeros, &m], 1)?
                } else {
                    m
                };
                let rows = if self.cfg.flavour == Flavour::Mistral { 1 } else { b_sz };
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
            return Err(candle_trace_format::Error::usage(format!("sequence of {} tokens is longer than the {MAX_SEQ_LEN} positions supported", index_pos + seq_len)));
        }
        tr.begin_forward(phase, index_pos, ids)?;
        let b_sz = ids.dim(0)?;
        let padded = !self.pads.is_empty();
        if padded && self.pads.len() != b_sz {
            return Err(candle_trace_format::Error::usage(format!("padding set for {} rows, the batch has {b_sz}", self.pads.len())));
        }
        // quantized_qwen3 runs candle_nn's flash attention kernels on CPU at batch 1 (f32), and
        // builds no mask for them.
        let flash = self.cfg.flavour == Flavour::Qwen3 && b_sz == 1 && !padded && self.device.is_cpu() && self.dtype == DType::F32;
        let mask = if padded {
            Some(self.padded_mask(seq_len, index_pos)?)
        } else if (seq_len == 1 && !self.decode_masked(index_pos)) || flash {
            None
        } else {
            Some(self.mask(b_sz, seq_len, index_pos)?)
        };
        let ids = ops::input(tr, &self.site_input, ids)?;
        let mut x = ops::embedding(tr, &self.site_embed, &self.embed, &ids)?;
        let (cos, sin) = if padded { self.padded_rope(seq_len, index_pos)? } else { (self.cos.narrow(0, index_pos, seq_len)?, self.sin.narrow(0, index_pos, seq_len)?) };
        let pass = Pass { cfg: &self.cfg, dtype: self.dtype, mask: mask.as_ref(), neg_inf: &self.neg_inf, cos: &cos, sin: &sin, flash, upstream: self.upstream };
        for block in &mut self.blocks {
            x = block_forward(tr, &pass, block, &x)?;
        }
        let cfg = &self.cfg;
        let logits = match cfg.flavour {
            Flavour::QuantizedLlama | Flavour::Llama => {
                let x = ops::rms_norm(tr, &self.site_norm, &x, &self.norm)?;
                let last = x.t.i((.., seq_len - 1, ..))?.contiguous()?;
                ops::linear_last(tr, &self.site_lm_head, &self.lm_head, &x, &last)?
            }
            Flavour::Qwen2 | Flavour::Qwen3 => {
                let x = ops::rms_norm(tr, &self.site_norm, &x, &self.norm)?;
                // Contiguous for a quantized lm_head at batch > 1 (quantized_qwen3 fails there
                // with "input tensor is not contiguous"); the values are the same.
                let last = x.t.narrow(1, seq_len - 1, 1)?.contiguous()?;
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
        let logits = if logits.t.dtype() == DType::F32 { logits } else { ops::to_dtype_last(tr, &self.site_logits, &logits, DType::F32)? };
        tr.end_forward()?;
        Ok(logits.t)
    }
}

/// What every block of one forward pass shares.
struct Pass<'a> {
    cfg: &'a LlamaConfig,
    dtype: DType,
    /// The pass's mask (`None`: a single-token step, or Qwen 3's flash kernels).
    mask: Option<&'a Tensor>,
    neg_inf: &'a Tensor,
    cos: &'a Tensor,
    sin: &'a Tensor,
    /// Attention by candle_nn's CPU flash kernels (Qwen 3 at batch 1).
    flash: bool,
    /// Upstream's numerics ([`Llama::set_upstream_numerics`]).
    upstream: bool,
}

/// The q, k and v projections of `n`: three ops, or one fused op and three views of its output.
fn project_qkv(tr: &mut Tracer, cfg: &LlamaConfig, s: &BlockSites, w: &BlockWeights, n: &Node) -> Result<(Node, Node, Node)> {
    match &w.qkv {
        QkvProj::Split { q, k, v } => Ok((ops::linear(tr, &s.qkv[0], q, n)?, ops::linear(tr, &s.qkv[1], k, n)?, ops::linear(tr, &s.qkv[2], v, n)?)),
        QkvProj::Fused(qkv) => {
            let y = ops::linear(tr, &s.qkv[0], qkv, n)?;
            let (q_dim, kv_dim) = (cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim);
            let part = |start: usize, len: usize| -> Result<Node> { Ok(Node { t: y.t.narrow(candle_core::D::Minus1, start, len)?, seq: y.seq }) };
            Ok((part(0, q_dim)?, part(q_dim, kv_dim)?, part(q_dim + kv_dim, kv_dim)?))
        }
    }
}

/// `silu(gate) * up` of `m`, as the architecture's upstream computes it.
fn gated(tr: &mut Tracer, s: &BlockSites, w: &BlockWeights, m: &Node) -> Result<Node> {
    match &w.gate_up {
        GateUpProj::Split { gate, up } => {
            let gate = ops::linear(tr, &s.gate_up[0], gate, m)?;
            let up = ops::linear(tr, &s.gate_up[1], up, m)?;
            let act = ops::silu(tr, &s.act, &gate)?;
            ops::mul(tr, &s.mul, &act, &up)
        }
        GateUpProj::Fused(gu) => {
            // quantized_phi3: `up * silu(gate)` over the two halves of one projection (the
            // product is the same bits in either order).
            let y = ops::linear(tr, &s.gate_up[0], gu, m)?;
            let half = y.t.dim(candle_core::D::Minus1)? / 2;
            let gate = Node { t: y.t.narrow(candle_core::D::Minus1, 0, half)?, seq: y.seq };
            let up = Node { t: y.t.narrow(candle_core::D::Minus1, half, half)?, seq: y.seq };
            let act = ops::silu(tr, &s.act, &gate)?;
            ops::mul(tr, &s.mul, &up, &act)
        }
    }
}

fn block_forward(tr: &mut Tracer, p: &Pass, block: &mut Block, x: &Node) -> Result<Node> {
    let cfg = p.cfg;
    let (s, w) = (&block.sites, &block.w);
    let (b_sz, seq_len, _) = x.t.dims3()?;
    let (n_head, n_kv, hd) = (cfg.n_head, cfg.n_kv_head, cfg.head_dim());

    let n = ops::rms_norm(tr, &s.input_layernorm, x, &w.input_layernorm)?;
    let (q, k, v) = project_qkv(tr, cfg, s, w, &n)?;
    let mut q_heads = q.t.reshape((b_sz, seq_len, n_head, hd))?.transpose(1, 2)?;
    let mut k_heads = k.t.reshape((b_sz, seq_len, n_kv, hd))?.transpose(1, 2)?;
    let (mut q, mut k) = (q, k);
    if let Some((q_norm, k_norm)) = &w.qk_norm {
        // quantized_qwen3 norms `[b*h*s, d]` rows: the same values as the contiguous heads.
        q = ops::rms_norm_heads(tr, &s.q_norm, &q, &q_heads.contiguous()?, q_norm)?;
        k = ops::rms_norm_heads(tr, &s.k_norm, &k, &k_heads.contiguous()?, k_norm)?;
        (q_heads, k_heads) = (q.t.clone(), k.t.clone());
    }
    // V is made contiguous as quantized_llama and mistral do (the values are the same either way).
    let v_heads = Node { t: v.t.reshape((b_sz, seq_len, n_kv, hd))?.transpose(1, 2)?.contiguous()?, seq: v.seq };
    let q = ops::rope(tr, &s.rope_q, &q, &q_heads, p.cos, p.sin, cfg.rope_neox)?;
    let k = ops::rope(tr, &s.rope_k, &k, &k_heads, p.cos, p.sin, cfg.rope_neox)?;

    let index_pos = tr.index_pos() as usize;
    let (k_prev, v_prev) = match (&block.kv_cache, index_pos) {
        (Some((kc, vc)), p) if p > 0 => (Some(kc.clone()), Some(vc.clone())),
        _ => (None, None),
    };
    let k = ops::cache_append(tr, &s.k_cache, k_prev.as_ref(), &k)?;
    let v = ops::cache_append(tr, &s.v_cache, v_prev.as_ref(), &v_heads)?;
    block.kv_cache = Some((k.t.clone(), v.t.clone()));

    let y = if p.flash {
        let seq_major = |t: &Tensor| -> Result<Tensor> { Ok(t.transpose(1, 2)?.contiguous()?) };
        let scale = 1.0 / (hd as f32).sqrt();
        ops::flash_attention(tr, &s.flash_attn, scale, (&q, &seq_major(&q.t)?), (&k, &seq_major(&k.t)?), (&v, &seq_major(&v.t)?))?
    } else {
        attention(tr, p, s, (&q, &k, &v))?
    };
    let y_flat = Node { t: y.t.transpose(1, 2)?.reshape((b_sz, seq_len, n_head * hd))?, seq: y.seq };
    let attn_out = ops::linear(tr, &s.o_proj, &w.o_proj, &y_flat)?;
    let x = ops::add(tr, &s.attn_residual, &attn_out, x)?;

    let m = ops::rms_norm(tr, &s.post_attention_layernorm, &x, &w.post_attention_layernorm)?;
    let h = gated(tr, s, w, &m)?;
    let down = ops::linear(tr, &s.down_proj, &w.down_proj, &h)?;
    ops::add(tr, &s.mlp_residual, &down, &x)
}

/// Unfused attention over the KV cache (GQA heads repeated), cast back for llama in f16/bf16.
fn attention(tr: &mut Tracer, p: &Pass, s: &BlockSites, (q, k, v): (&Node, &Node, &Node)) -> Result<Node> {
    let (cfg, dtype) = (p.cfg, p.dtype);
    let n_rep = cfg.n_head / cfg.n_kv_head;
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
    let mask = match (p.mask, cfg.flavour) {
        (None, _) => AttnMask::None,
        (Some(m), Flavour::QuantizedLlama | Flavour::Llama) => AttnMask::Fill { mask: m, fill: p.neg_inf },
        (Some(m), Flavour::Qwen2 | Flavour::Mistral | Flavour::Qwen3) => AttnMask::Add { mask: m, input: None },
    };
    let how = Attention { keys: Keys::Causal, mask, fused_softmax: true, softmax_f32: !p.upstream, head_dim: cfg.head_dim() };
    let y = ops::attention(tr, &s.attn, &how, (q, &q_t), (k, &k_rep), (v, &v_rep))?;
    if upcast {
        ops::to_dtype_heads(tr, &s.attn_cast, &y, dtype)
    } else {
        Ok(y)
    }
}
