//! Instrumented Gemma 3 decoder: the numerics of candle-transformers' `models::quantized_gemma3`
//! (GGUF files), op for op, except its MLP activation (below).
//!
//! Per layer: `h = x + post_attention_layernorm(o_proj(attn(n)))` with
//! `n = input_layernorm(x)`, then `x = h + post_feedforward_layernorm(down_proj(g))` with
//! `g = gelu_tanh(gate_proj(m)) * up_proj(m)` and `m = pre_feedforward_layernorm(h)`. Gemma 3's
//! activation is GELU with the tanh approximation (`hidden_activation: "gelu_pytorch_tanh"` in
//! its config.json; transformers' `Gemma3MLP`, llama.cpp's `LLM_FFN_GELU`). candle-transformers
//! 0.11.1's `quantized_gemma3` applies SiLU there, which moves the logits by about a third
//! (docs/upstream/candle-quantized-gemma3-silu.md); [`Gemma3::set_upstream_numerics`]
//! (`--numerics upstream`) reproduces it bit for bit. Attention: q and k are RMS-normed per
//! head (`q_norm`, `k_norm`), rotated (NeoX rope, base `rope.freq_base` on every
//! `sliding_window_type`-th layer, 10 000 on the others), and scores are `q kᵀ · 1/sqrt(head_dim)`
//! with a causal mask that, on sliding layers, also hides keys more than `sliding_window`
//! positions back. Embeddings are scaled by `sqrt(hidden)`; the final norm and `lm_head` run on
//! the last position. The GGUF norms already hold `1 + w` (llama.cpp's converter adds it).
//!
//! The sliding window is the model's definition (transformers' `sliding_window_overlay`,
//! llama.cpp's `is_masked_swa`): a query on a sliding layer sees `sliding_window` keys, itself
//! included, in every pass: prefill, chunked prefill and decode steps. Upstream differs twice
//! (docs/upstream/candle-quantized-gemma3-sliding-window.md): its prefill mask shows one key
//! more (`j + sliding_window < i` hides), and a single-token decode step runs without a mask, so
//! past `sliding_window` positions a sliding layer attends to every cached key.
//! [`Gemma3::set_upstream_numerics`] reproduces both. Where upstream fails, this model runs: a
//! prefill that continues a KV cache (`--prefill-chunk`) builds upstream's mask by concatenating
//! an f32 block to a u32 one, which candle refuses; here the window applies to the cached keys
//! as a whole prefill applies it. Left-padded batches get a mask and rotary positions per row, as
//! [`super::llama::Llama`] does.
//!
//! Module paths follow Hugging Face's Gemma 3 checkpoint names: `layers.{i}.input_layernorm`,
//! `layers.{i}.self_attn.{q,k,v,o}_proj`, `layers.{i}.self_attn.{q,k}_norm`,
//! `layers.{i}.post_attention_layernorm`, `layers.{i}.pre_feedforward_layernorm`,
//! `layers.{i}.mlp.{gate,up,down}_proj`, `layers.{i}.post_feedforward_layernorm`, `norm`,
//! `lm_head`, with `embed_scale` for the embedding scaling.

use crate::llama::{key_hidden, padded_tables, rope_tables, RopeSpec, MAX_SEQ_LEN};
use candle_core::{DType, Device, IndexOp, Tensor};
use candle_trace_format::error::Result;
use candle_trace_format::record::Phase;
use candle_trace_instrument::ops::{self, Attention, AttentionSites, AttnMask, Keys, Op, Site, Weight};
use candle_trace_instrument::tracer::{Node, Tracer};
use std::collections::HashMap;

/// Gemma 3 hyper-parameters (GGUF `gemma3.*` metadata).
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma3Config {
    /// Decoder blocks (`block_count`).
    pub n_layer: usize,
    /// Query heads (`attention.head_count`).
    pub n_head: usize,
    /// Key/value heads (`attention.head_count_kv`), dividing `n_head`.
    pub n_kv_head: usize,
    /// Residual width (`embedding_length`).
    pub hidden: usize,
    /// Per-head dimension (`attention.key_length`; 256 in the released models).
    pub head_dim: usize,
    /// RMSNorm epsilon (`attention.layer_norm_rms_epsilon`).
    pub rms_eps: f64,
    /// Vocabulary size, in tokens.
    pub vocab: usize,
    /// Keys further back than this are hidden on sliding layers (`attention.sliding_window`).
    pub sliding_window: usize,
    /// Every this-many-th layer (1-based) is global, the others sliding
    /// (`attention.sliding_window_type`, default 6).
    pub sliding_window_type: usize,
    /// Rotary base of global layers (`rope.freq_base`, default 1 000 000).
    pub rope_base: f32,
    /// Rotary base of sliding layers (`rope.local_freq_base`, default 10 000).
    pub rope_base_local: f32,
}

impl Gemma3Config {
    /// Whether layer `i` (0-based) attends through the sliding window.
    pub fn is_sliding(&self, i: usize) -> bool {
        self.sliding_window_type == 0 || !(i + 1).is_multiple_of(self.sliding_window_type)
    }
}

/// Weights of one Gemma 3 block; norms are dense `[hidden]` (`q_norm`/`k_norm`: `[head_dim]`).
#[derive(Debug, Clone)]
pub struct Gemma3Block {
    /// `self_attn.q_proj`, `[n_head * head_dim, hidden]`.
    pub q_proj: Weight,
    /// `self_attn.k_proj`, `[n_kv_head * head_dim, hidden]`.
    pub k_proj: Weight,
    /// `self_attn.v_proj`, `[n_kv_head * head_dim, hidden]`.
    pub v_proj: Weight,
    /// `self_attn.o_proj`, `[hidden, n_head * head_dim]`.
    pub o_proj: Weight,
    /// Per-head RMSNorm of the queries.
    pub q_norm: candle_nn::RmsNorm,
    /// Per-head RMSNorm of the keys.
    pub k_norm: candle_nn::RmsNorm,
    /// Before attention (GGUF `attn_norm`).
    pub input_layernorm: candle_nn::RmsNorm,
    /// After attention, before the residual add (GGUF `post_attention_norm`).
    pub post_attention_layernorm: candle_nn::RmsNorm,
    /// Before the MLP (GGUF `ffn_norm`).
    pub pre_feedforward_layernorm: candle_nn::RmsNorm,
    /// After the MLP, before the residual add (GGUF `post_ffw_norm`).
    pub post_feedforward_layernorm: candle_nn::RmsNorm,
    /// `mlp.gate_proj`, `[intermediate, hidden]`.
    pub gate_proj: Weight,
    /// `mlp.up_proj`, `[intermediate, hidden]`.
    pub up_proj: Weight,
    /// `mlp.down_proj`, `[hidden, intermediate]`.
    pub down_proj: Weight,
}

/// All weights of a Gemma 3 model.
#[derive(Debug, Clone)]
pub struct Gemma3Weights {
    /// `[vocab, hidden]` in the compute dtype.
    pub embed_tokens: Tensor,
    /// One per layer.
    pub blocks: Vec<Gemma3Block>,
    /// Final RMSNorm.
    pub norm: candle_nn::RmsNorm,
    /// `[vocab, hidden]` (the embedding matrix when tied).
    pub lm_head: Weight,
}

struct Sites {
    input_layernorm: Site,
    q_proj: Site,
    k_proj: Site,
    v_proj: Site,
    q_norm: Site,
    k_norm: Site,
    rope_q: Site,
    rope_k: Site,
    k_cache: Site,
    v_cache: Site,
    attn: AttentionSites,
    o_proj: Site,
    post_attention_layernorm: Site,
    attn_residual: Site,
    pre_feedforward_layernorm: Site,
    gate_proj: Site,
    up_proj: Site,
    act: Site,
    mul: Site,
    down_proj: Site,
    post_feedforward_layernorm: Site,
    mlp_residual: Site,
}

impl Sites {
    fn new(i: usize, w: &Gemma3Block, sliding: bool) -> Self {
        let l = format!("layers.{i}");
        let a = format!("{l}.self_attn");
        let m = format!("{l}.mlp");
        let s = |name: String, op: Op| Site::new(name, op);
        Sites {
            input_layernorm: s(format!("{l}.input_layernorm"), Op::RmsNorm),
            q_proj: s(format!("{a}.q_proj"), w.q_proj.op()),
            k_proj: s(format!("{a}.k_proj"), w.k_proj.op()),
            v_proj: s(format!("{a}.v_proj"), w.v_proj.op()),
            q_norm: s(format!("{a}.q_norm"), Op::RmsNorm),
            k_norm: s(format!("{a}.k_norm"), Op::RmsNorm),
            rope_q: s(format!("{a}.rope_q"), Op::Rope),
            rope_k: s(format!("{a}.rope_k"), Op::Rope),
            k_cache: s(format!("{a}.k_cache"), Op::Cat),
            v_cache: s(format!("{a}.v_cache"), Op::Cat),
            attn: AttentionSites::new(&a, if sliding { "sliding_mask" } else { "mask" }, Op::WhereCond),
            o_proj: s(format!("{a}.o_proj"), w.o_proj.op()),
            post_attention_layernorm: s(format!("{l}.post_attention_layernorm"), Op::RmsNorm),
            attn_residual: s(format!("{l}.attn_residual"), Op::Add),
            pre_feedforward_layernorm: s(format!("{l}.pre_feedforward_layernorm"), Op::RmsNorm),
            gate_proj: s(format!("{m}.gate_proj"), w.gate_proj.op()),
            up_proj: s(format!("{m}.up_proj"), w.up_proj.op()),
            act: s(format!("{m}.act"), Op::Gelu),
            mul: s(format!("{m}.mul"), Op::Mul),
            down_proj: s(format!("{m}.down_proj"), w.down_proj.op()),
            post_feedforward_layernorm: s(format!("{l}.post_feedforward_layernorm"), Op::RmsNorm),
            mlp_residual: s(format!("{l}.mlp_residual"), Op::Add),
        }
    }

    fn all(&self) -> Vec<&Site> {
        let before = [&self.input_layernorm, &self.q_proj, &self.k_proj, &self.v_proj, &self.q_norm, &self.k_norm, &self.rope_q, &self.rope_k, &self.k_cache, &self.v_cache];
        let after = [
            &self.o_proj,
            &self.post_attention_layernorm,
            &self.attn_residual,
            &self.pre_feedforward_layernorm,
            &self.gate_proj,
            &self.up_proj,
            &self.act,
            &self.mul,
            &self.down_proj,
            &self.post_feedforward_layernorm,
            &self.mlp_residual,
        ];
        before.into_iter().chain(self.attn.all()).chain(after).collect()
    }
}

struct Block {
    w: Gemma3Block,
    sites: Sites,
    sliding: bool,
    /// Upstream's numerics ([`Gemma3::set_upstream_numerics`]): the MLP activation is SiLU, not
    /// GELU, and a half-precision softmax is candle's kernel, not one computed in f32.
    upstream: bool,
    kv_cache: Option<(Tensor, Tensor)>,
}

/// An instrumented Gemma 3 decoder with a KV cache.
pub struct Gemma3 {
    cfg: Gemma3Config,
    dtype: DType,
    device: Device,
    embed: candle_nn::Embedding,
    blocks: Vec<Block>,
    norm: candle_nn::RmsNorm,
    lm_head: Weight,
    /// Rotary tables `(cos, sin)` of global and sliding layers.
    rope_global: (Tensor, Tensor),
    rope_local: (Tensor, Tensor),
    neg_inf: Tensor,
    /// u8 masks (1 = hidden) by (batch, seq_len, kv_len, sliding).
    masks: HashMap<(usize, usize, usize, bool), Tensor>,
    /// Left padding of each batch row (empty: none).
    pads: Vec<usize>,
    /// Upstream's numerics ([`Gemma3::set_upstream_numerics`]): its window and unmasked decode.
    upstream: bool,
    site_input: Site,
    site_embed: Site,
    site_embed_scale: Site,
    site_norm: Site,
    site_lm_head: Site,
    site_logits: Site,
}

impl Gemma3 {
    /// Builds the model; `dtype` is the activation dtype (f32 with quantized weights).
    ///
    /// # Errors
    /// Candle errors when the rotary tables cannot be built.
    pub fn new(cfg: Gemma3Config, w: Gemma3Weights, dtype: DType, device: &Device) -> Result<Self> {
        let rope_global = rope_tables(&RopeSpec::standard(cfg.head_dim, cfg.rope_base), dtype, device)?;
        let rope_local = rope_tables(&RopeSpec::standard(cfg.head_dim, cfg.rope_base_local), dtype, device)?;
        let blocks = w
            .blocks
            .into_iter()
            .enumerate()
            .map(|(i, b)| {
                let sliding = cfg.is_sliding(i);
                Block { sites: Sites::new(i, &b, sliding), w: b, sliding, upstream: false, kv_cache: None }
            })
            .collect();
        Ok(Gemma3 {
            embed: candle_nn::Embedding::new(w.embed_tokens, cfg.hidden),
            site_lm_head: Site::new("lm_head", w.lm_head.op()),
            cfg,
            dtype,
            device: device.clone(),
            blocks,
            norm: w.norm,
            lm_head: w.lm_head,
            rope_global,
            rope_local,
            neg_inf: Tensor::new(f32::NEG_INFINITY, device)?.to_dtype(dtype)?,
            masks: HashMap::new(),
            pads: Vec::new(),
            upstream: false,
            site_input: Site::new("input_ids", Op::Input),
            site_embed: Site::new("embed_tokens", Op::Embedding),
            site_embed_scale: Site::new("embed_scale", Op::Scale),
            site_norm: Site::new("norm", Op::RmsNorm),
            site_logits: Site::new("logits", Op::ToDtype),
        })
    }

    /// Runs candle-transformers 0.11.1's `quantized_gemma3` exactly, its SiLU MLP activation
    /// and its sliding window included (the model's definition is GELU with the tanh
    /// approximation, and a window of `sliding_window` keys in every pass; upstream shows one key
    /// more in a prefill and every cached key in a decode step): for parity with upstream, and to
    /// show the difference (`--numerics upstream`). In f16 and bf16 attention's softmax is then
    /// candle's half-precision kernel, not one computed in f32.
    pub fn set_upstream_numerics(&mut self) {
        self.upstream = true;
        self.masks.clear();
        for b in &mut self.blocks {
            b.upstream = true;
            b.sites.act = Site::new(b.sites.act.path.clone(), Op::Silu);
        }
    }

    /// The hyper-parameters it was built with.
    pub fn config(&self) -> &Gemma3Config {
        &self.cfg
    }

    /// Activation dtype (f32 with quantized weights).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device of its weights and KV cache.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Module paths of every op site, in execution order of one forward pass.
    pub fn sites(&self) -> impl Iterator<Item = &Site> {
        let top = [&self.site_input, &self.site_embed, &self.site_embed_scale];
        let blocks = self.blocks.iter().flat_map(|b| b.sites.all());
        let tail = [&self.site_norm, &self.site_lm_head, &self.site_logits];
        top.into_iter().chain(blocks).chain(tail)
    }

    /// Sets the left padding of each batch row (empty: none), as [`super::llama::Llama::set_padding`].
    pub fn set_padding(&mut self, pads: Vec<usize>) {
        self.pads = pads;
        self.masks.clear();
    }

    /// Empties the KV cache of every layer.
    pub fn clear_kv_cache(&mut self) {
        for b in &mut self.blocks {
            b.kv_cache = None;
        }
    }

    /// How many positions back a query on a sliding layer still sees a key: `sliding_window - 1`
    /// by the model's definition (`sliding_window` keys, the query's own included: transformers'
    /// `kv_idx > q_idx - sliding_window`), `sliding_window` under upstream's numerics
    /// (candle-transformers 0.11.1 hides a key when `j + sliding_window < i`).
    fn reach(&self) -> usize {
        if self.upstream {
            self.cfg.sliding_window
        } else {
            self.cfg.sliding_window.saturating_sub(1)
        }
    }

    /// Whether a pass of `seq_len` queries from `index_pos` needs a mask on global or sliding
    /// layers: every prefill and padded pass does; a decode step does on sliding layers once a
    /// key falls out of the window, except under upstream's numerics (no mask in decode steps).
    fn needs_mask(&self, seq_len: usize, index_pos: usize, sliding: bool) -> bool {
        seq_len > 1 || !self.pads.is_empty() || (sliding && !self.upstream && index_pos > self.reach())
    }

    /// The u8 mask (1 = hidden) `[b, 1, q, kv]` of a pass: a key is hidden from query `i`
    /// (absolute position `index_pos + i`) when it is later, before the row's first real token,
    /// or (sliding layers) further back than [`Self::reach`]; a padding query sees only itself
    /// (so its softmax is not over nothing).
    fn mask(&mut self, b_sz: usize, seq_len: usize, index_pos: usize, sliding: bool) -> Result<Tensor> {
        let kv_len = index_pos + seq_len;
        let key = (b_sz, seq_len, kv_len, sliding);
        if let Some(m) = self.masks.get(&key) {
            return Ok(m.clone());
        }
        let window = sliding.then_some(self.reach());
        let pads: Vec<usize> = if self.pads.is_empty() { vec![0; b_sz] } else { self.pads.clone() };
        let v: Vec<u8> = pads.iter().flat_map(|&p| (0..seq_len).flat_map(move |i| (0..kv_len).map(move |j| u8::from(key_hidden(p, index_pos + i, j, window))))).collect();
        let m = Tensor::from_vec(v, (b_sz, 1, seq_len, kv_len), &self.device)?;
        self.masks.insert(key, m.clone());
        Ok(m)
    }

    /// Rotary tables for this pass, `[s, head_dim/2]` (or `[b, s, head_dim/2]` at each padded
    /// row's own positions).
    fn rope(&self, table: &(Tensor, Tensor), seq_len: usize, index_pos: usize) -> Result<(Tensor, Tensor)> {
        if self.pads.is_empty() {
            return Ok((table.0.narrow(0, index_pos, seq_len)?, table.1.narrow(0, index_pos, seq_len)?));
        }
        padded_tables((&table.0, &table.1), &self.pads, seq_len, index_pos)
    }

    /// One forward pass over token ids `[batch, seq_len]` (u32) at positions `index_pos ..
    /// index_pos + seq_len`, appending to the KV cache. Returns the last position's logits,
    /// `[batch, vocab]` f32.
    ///
    /// # Errors
    /// Candle errors (positions past [`MAX_SEQ_LEN`]) and sink errors.
    pub fn forward(&mut self, tr: &mut Tracer, ids: &Tensor, index_pos: usize, phase: Phase) -> Result<Tensor> {
        let (b_sz, seq_len) = ids.dims2()?;
        if index_pos + seq_len > MAX_SEQ_LEN {
            return Err(candle_trace_format::Error::usage(format!("sequence of {} tokens is longer than the {MAX_SEQ_LEN} positions supported", index_pos + seq_len)));
        }
        if !self.pads.is_empty() && self.pads.len() != b_sz {
            return Err(candle_trace_format::Error::usage(format!("padding set for {} rows, the batch has {b_sz}", self.pads.len())));
        }
        tr.begin_forward(phase, index_pos, ids)?;
        let global = if self.needs_mask(seq_len, index_pos, false) { Some(self.mask(b_sz, seq_len, index_pos, false)?) } else { None };
        let sliding = if self.needs_mask(seq_len, index_pos, true) { Some(self.mask(b_sz, seq_len, index_pos, true)?) } else { None };
        let ropes = (self.rope(&self.rope_global, seq_len, index_pos)?, self.rope(&self.rope_local, seq_len, index_pos)?);
        let ids = ops::input(tr, &self.site_input, ids)?;
        let x = ops::embedding(tr, &self.site_embed, &self.embed, &ids)?;
        let mut x = ops::affine(tr, &self.site_embed_scale, &x, (self.cfg.hidden as f64).sqrt(), 0.0)?;
        for block in &mut self.blocks {
            let mask = if block.sliding { sliding.as_ref() } else { global.as_ref() };
            let (cos, sin) = if block.sliding { &ropes.1 } else { &ropes.0 };
            x = block_forward(tr, &self.cfg, block, &x, mask, &self.neg_inf, cos, sin)?;
        }
        // Upstream takes the last position as a strided view and norms it with the fused kernel;
        // made contiguous here (same values), so batch > 1 works.
        let last = Node { t: x.t.i((.., seq_len - 1, ..))?.contiguous()?, seq: x.seq };
        let n = ops::rms_norm_last(tr, &self.site_norm, &last, &self.norm)?;
        let logits = ops::linear_last(tr, &self.site_lm_head, &self.lm_head, &n, &n.t)?;
        let logits = if logits.t.dtype() == DType::F32 { logits } else { ops::to_dtype_last(tr, &self.site_logits, &logits, DType::F32)? };
        tr.end_forward()?;
        Ok(logits.t)
    }
}

#[allow(clippy::too_many_arguments)]
fn block_forward(tr: &mut Tracer, cfg: &Gemma3Config, block: &mut Block, x: &Node, mask: Option<&Tensor>, neg_inf: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Node> {
    let (s, w) = (&block.sites, &block.w);
    let (b_sz, seq_len, _) = x.t.dims3()?;
    let (n_head, n_kv, hd) = (cfg.n_head, cfg.n_kv_head, cfg.head_dim);
    let n = ops::rms_norm(tr, &s.input_layernorm, x, &w.input_layernorm)?;
    let q = ops::linear(tr, &s.q_proj, &w.q_proj, &n)?;
    let k = ops::linear(tr, &s.k_proj, &w.k_proj, &n)?;
    let v = ops::linear(tr, &s.v_proj, &w.v_proj, &n)?;
    let q_heads = q.t.reshape((b_sz, seq_len, n_head, hd))?.transpose(1, 2)?.contiguous()?;
    let k_heads = k.t.reshape((b_sz, seq_len, n_kv, hd))?.transpose(1, 2)?.contiguous()?;
    let v_heads = Node { t: v.t.reshape((b_sz, seq_len, n_kv, hd))?.transpose(1, 2)?, seq: v.seq };
    let q = ops::rms_norm_heads(tr, &s.q_norm, &q, &q_heads, &w.q_norm)?;
    let k = ops::rms_norm_heads(tr, &s.k_norm, &k, &k_heads, &w.k_norm)?;
    let q = ops::rope(tr, &s.rope_q, &q, &q.t, cos, sin, true)?;
    let k = ops::rope(tr, &s.rope_k, &k, &k.t, cos, sin, true)?;

    let index_pos = tr.index_pos() as usize;
    let (k_prev, v_prev) = match (&block.kv_cache, index_pos) {
        (Some((kc, vc)), p) if p > 0 => (Some(kc.clone()), Some(vc.clone())),
        _ => (None, None),
    };
    let k = ops::cache_append(tr, &s.k_cache, k_prev.as_ref(), &k)?;
    let v = ops::cache_append(tr, &s.v_cache, v_prev.as_ref(), &v_heads)?;
    block.kv_cache = Some((k.t.clone(), v.t.clone()));
    let n_rep = n_head / n_kv;
    let k_rep = candle_transformers::utils::repeat_kv(k.t.clone(), n_rep)?;
    let v_rep = candle_transformers::utils::repeat_kv(v.t.clone(), n_rep)?;
    let mask = match mask {
        None => AttnMask::None,
        Some(m) => AttnMask::Fill { mask: m, fill: neg_inf },
    };
    let how = Attention { keys: Keys::Causal, mask, fused_softmax: true, softmax_f32: !block.upstream, head_dim: hd };
    let y = ops::attention(tr, &s.attn, &how, (&q, &q.t), (&k, &k_rep), (&v, &v_rep))?;
    let y_flat = Node { t: y.t.transpose(1, 2)?.reshape((b_sz, seq_len, n_head * hd))?, seq: y.seq };
    let o = ops::linear(tr, &s.o_proj, &w.o_proj, &y_flat)?;
    let o = ops::rms_norm(tr, &s.post_attention_layernorm, &o, &w.post_attention_layernorm)?;
    let h = ops::add(tr, &s.attn_residual, &o, x)?;

    let m = ops::rms_norm(tr, &s.pre_feedforward_layernorm, &h, &w.pre_feedforward_layernorm)?;
    let gate = ops::linear(tr, &s.gate_proj, &w.gate_proj, &m)?;
    let up = ops::linear(tr, &s.up_proj, &w.up_proj, &m)?;
    let act = if block.upstream { ops::silu(tr, &s.act, &gate)? } else { ops::gelu_tanh(tr, &s.act, &gate)? };
    let prod = ops::mul(tr, &s.mul, &act, &up)?;
    let down = ops::linear(tr, &s.down_proj, &w.down_proj, &prod)?;
    let down = ops::rms_norm(tr, &s.post_feedforward_layernorm, &down, &w.post_feedforward_layernorm)?;
    ops::add(tr, &s.mlp_residual, &down, &h)
}
