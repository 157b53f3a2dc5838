//! Instrumented llama-family decoder (the architecture of candle-transformers'
//! `models::quantized_llama`, SmolLM2, TinyLlama, Llama 2/3 GGUF files).
//!
//! Per layer: `x = x + o_proj(attn(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))` with
//! `n = input_layernorm(x)`, then `x = x + down_proj(silu(gate_proj(m)) * up_proj(m))` with
//! `m = post_attention_layernorm(x)`; attention is causal softmax(q k^T / sqrt(head_dim)) v with
//! grouped KV heads repeated to the query heads. The numerics follow
//! `candle_transformers::models::quantized_llama::ModelWeights::forward` op for op (a parity test
//! compares logits bit for bit), with one fix: the last position's hidden state is made contiguous
//! before the output projection, so batch > 1 works (upstream fails there with "input tensor is not
//! contiguous").
//!
//! Module paths follow Hugging Face checkpoint names: `embed_tokens`, `layers.{i}.input_layernorm`,
//! `layers.{i}.self_attn.{q,k,v,o}_proj`, `layers.{i}.mlp.{gate,up,down}_proj`, `norm`, `lm_head`;
//! ops inside a module get their own names (`layers.{i}.self_attn.softmax`).
//! The model knows nothing of files: loaders build it from weights ([`LlamaWeights`]).

use crate::error::Result;
use crate::ops::{self, Op, Site, Weight};
use crate::record::Phase;
use crate::tracer::{Node, Tracer};
use candle_core::{DType, Device, IndexOp, Tensor};
use std::collections::HashMap;

/// Rotary tables are precomputed for this many positions (as upstream).
pub const MAX_SEQ_LEN: usize = 4096;

/// Hyper-parameters of a llama-family model.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub hidden: usize,
    /// Rotary dimension (usually `hidden / n_head`).
    pub rope_dim: usize,
    pub rope_base: f32,
    pub rms_eps: f64,
    pub vocab: usize,
    /// Non-interleaved (NeoX) rotary embedding; false = interleaved (llama GGUF).
    pub rope_neox: bool,
}

impl LlamaConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden / self.n_head
    }
}

/// Weights of one block. Norm weights are dense `[hidden]` in the compute dtype.
#[derive(Debug, Clone)]
pub struct BlockWeights {
    pub q_proj: Weight,
    pub k_proj: Weight,
    pub v_proj: Weight,
    pub o_proj: Weight,
    pub gate_proj: Weight,
    pub up_proj: Weight,
    pub down_proj: Weight,
    pub input_layernorm: Tensor,
    pub post_attention_layernorm: Tensor,
}

/// All weights of a model, as a loader hands them over.
#[derive(Debug, Clone)]
pub struct LlamaWeights {
    /// `[vocab, hidden]` in the compute dtype.
    pub embed_tokens: Tensor,
    pub blocks: Vec<BlockWeights>,
    pub norm: Tensor,
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
    scores: Site,
    scale: Site,
    mask: Site,
    softmax: Site,
    attn_v: Site,
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
    fn new(i: usize, w: &BlockWeights) -> Self {
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
            scores: Site::new(format!("{a}.scores"), Op::Matmul),
            scale: Site::new(format!("{a}.scale"), Op::Scale),
            mask: Site::new(format!("{a}.mask"), Op::WhereCond),
            softmax: Site::new(format!("{a}.softmax"), Op::Softmax),
            attn_v: Site::new(format!("{a}.attn_v"), Op::Matmul),
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
    norm: Tensor,
    lm_head: Weight,
    cos: Tensor,
    sin: Tensor,
    neg_inf: Tensor,
    masks: HashMap<(usize, usize), Tensor>,
    site_input: Site,
    site_embed: Site,
    site_norm: Site,
    site_lm_head: Site,
    site_logits: Site,
}

/// Rotary tables `[MAX_SEQ_LEN, rope_dim/2]` in f32, computed as upstream does.
fn rope_tables(rope_dim: usize, base: f32, device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
    let theta: Vec<f32> = (0..rope_dim)
        .step_by(2)
        .map(|i| 1f32 / base.powf(i as f32 / rope_dim as f32))
        .collect();
    let theta = Tensor::new(theta.as_slice(), device)?;
    let idx = Tensor::arange(0, MAX_SEQ_LEN as u32, device)?
        .to_dtype(DType::F32)?
        .reshape((MAX_SEQ_LEN, 1))?
        .matmul(&theta.reshape((1, theta.elem_count()))?)?;
    Ok((idx.cos()?, idx.sin()?))
}

impl Llama {
    /// Builds the model. `dtype` is the activation dtype (f32 for quantized weights).
    ///
    /// # Errors
    /// Candle errors when the rotary tables cannot be built.
    pub fn new(cfg: LlamaConfig, w: LlamaWeights, dtype: DType, device: &Device) -> Result<Self> {
        let (cos, sin) = rope_tables(cfg.rope_dim, cfg.rope_base, device)?;
        let (cos, sin) = (cos.to_dtype(dtype)?, sin.to_dtype(dtype)?);
        let neg_inf = Tensor::new(f32::NEG_INFINITY, device)?.to_dtype(dtype)?;
        let blocks = w
            .blocks
            .into_iter()
            .enumerate()
            .map(|(i, b)| Block { sites: BlockSites::new(i, &b), w: b, kv_cache: None })
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
            site_input: Site::new("input_ids", Op::Input),
            site_embed: Site::new("embed_tokens", Op::Embedding),
            site_norm: Site::new("norm", Op::RmsNorm),
            site_lm_head,
            site_logits: Site::new("logits", Op::ToDtype),
        })
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// Activation dtype (f32 with quantized weights).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Module paths of every op site, in execution order of one forward pass (the `logits`
    /// conversion only runs for non-f32 activations).
    pub fn site_paths(&self) -> impl Iterator<Item = &str> {
        let top = [&self.site_input, &self.site_embed];
        let blocks = self.blocks.iter().flat_map(|b| {
            let s = &b.sites;
            [
                &s.input_layernorm, &s.q_proj, &s.k_proj, &s.v_proj, &s.rope_q, &s.rope_k, &s.k_cache, &s.v_cache,
                &s.scores, &s.scale, &s.mask, &s.softmax, &s.attn_v, &s.o_proj, &s.attn_residual,
                &s.post_attention_layernorm, &s.gate_proj, &s.up_proj, &s.act, &s.mul, &s.down_proj, &s.mlp_residual,
            ]
        });
        let tail = [&self.site_norm, &self.site_lm_head, &self.site_logits];
        top.into_iter().chain(blocks).chain(tail).map(|s| s.path.as_str())
    }

    /// Empties the KV cache of every layer.
    pub fn clear_kv_cache(&mut self) {
        for b in &mut self.blocks {
            b.kv_cache = None;
        }
    }

    fn mask(&mut self, seq_len: usize, index_pos: usize) -> Result<Tensor> {
        let kv_len = index_pos + seq_len;
        if let Some(m) = self.masks.get(&(seq_len, kv_len)) {
            return Ok(m.clone());
        }
        let m = candle_transformers::utils::build_causal_mask(seq_len, index_pos, &self.device)?;
        self.masks.insert((seq_len, kv_len), m.clone());
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
        let (_, seq_len) = ids.dims2()?;
        if index_pos + seq_len > MAX_SEQ_LEN {
            return Err(crate::Error::usage(format!(
                "sequence of {} tokens is longer than the {MAX_SEQ_LEN} positions supported",
                index_pos + seq_len
            )));
        }
        tr.begin_forward(phase, index_pos, ids)?;
        let mask = if seq_len == 1 { None } else { Some(self.mask(seq_len, index_pos)?) };
        let ids = ops::input(tr, &self.site_input, ids)?;
        let mut x = ops::embedding(tr, &self.site_embed, &self.embed, &ids)?;
        let cos = self.cos.narrow(0, index_pos, seq_len)?;
        let sin = self.sin.narrow(0, index_pos, seq_len)?;
        let cfg = &self.cfg;
        for block in &mut self.blocks {
            x = block_forward(tr, cfg, block, &x, mask.as_ref(), &self.neg_inf, &cos, &sin)?;
        }
        let x = ops::rms_norm(tr, &self.site_norm, &x, &self.norm, cfg.rms_eps as f32)?;
        let last = x.t.i((.., seq_len - 1, ..))?.contiguous()?;
        let logits = ops::linear_last(tr, &self.site_lm_head, &self.lm_head, &x, &last)?;
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
    block: &mut Block,
    x: &Node,
    mask: Option<&Tensor>,
    neg_inf: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Node> {
    let (s, w) = (&block.sites, &block.w);
    let (b_sz, seq_len, hidden) = x.t.dims3()?;
    let (n_head, n_kv, hd) = (cfg.n_head, cfg.n_kv_head, cfg.head_dim());

    let n = ops::rms_norm(tr, &s.input_layernorm, x, &w.input_layernorm, cfg.rms_eps as f32)?;
    let q = ops::linear(tr, &s.q_proj, &w.q_proj, &n)?;
    let k = ops::linear(tr, &s.k_proj, &w.k_proj, &n)?;
    let v = ops::linear(tr, &s.v_proj, &w.v_proj, &n)?;
    let q_heads = q.t.reshape((b_sz, seq_len, n_head, hd))?.transpose(1, 2)?;
    let k_heads = k.t.reshape((b_sz, seq_len, n_kv, hd))?.transpose(1, 2)?;
    // Contiguous V as upstream (lets the fast matmul kernel run later).
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
    let k_rep = candle_transformers::utils::repeat_kv(k.t.clone(), n_rep)?;
    let v_rep = candle_transformers::utils::repeat_kv(v.t.clone(), n_rep)?;
    let att = ops::scores(tr, &s.scores, &q, &k, &k_rep)?;
    let att = ops::scale(tr, &s.scale, &att, (hd as f64).sqrt())?;
    let att = match mask {
        None => att,
        Some(m) => ops::mask_fill(tr, &s.mask, &att, m, neg_inf)?,
    };
    let probs = ops::softmax(tr, &s.softmax, &att)?;
    let y = ops::attend(tr, &s.attn_v, &probs, &v, &v_rep)?;
    let y_flat = Node { t: y.t.transpose(1, 2)?.reshape(&[b_sz, seq_len, hidden])?, seq: y.seq };
    let attn_out = ops::linear(tr, &s.o_proj, &w.o_proj, &y_flat)?;
    let x = ops::add(tr, &s.attn_residual, &attn_out, x)?;

    let m = ops::rms_norm(tr, &s.post_attention_layernorm, &x, &w.post_attention_layernorm, cfg.rms_eps as f32)?;
    let gate = ops::linear(tr, &s.gate_proj, &w.gate_proj, &m)?;
    let up = ops::linear(tr, &s.up_proj, &w.up_proj, &m)?;
    let act = ops::silu(tr, &s.act, &gate)?;
    let h = ops::mul(tr, &s.mul, &act, &up)?;
    let down = ops::linear(tr, &s.down_proj, &w.down_proj, &h)?;
    ops::add(tr, &s.mlp_residual, &down, &x)
}
