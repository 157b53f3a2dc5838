//! Instrumented BERT encoder (the architecture of candle-transformers' `models::bert::BertModel`:
//! sentence-transformers checkpoints such as all-MiniLM-L6-v2).
//!
//! Embeddings: `LayerNorm((word(ids) + token_type(type_ids)) + position(0..s))`. Per layer:
//! `a = LayerNorm(dense(attn(query(x), key(x), value(x))) + x)`, then
//! `x = LayerNorm(dense(act(dense(a))) + a)`; attention is bidirectional
//! softmax(q k^T / sqrt(head_dim) + mask) v with an additive mask that hides padding keys.
//!
//! The numerics follow `candle_transformers::models::bert::BertModel::forward(ids, type_ids,
//! Some(mask))` op for op (same candle functions, same order, same dtypes; a parity test compares
//! the hidden states bit for bit), with one fix: the additive mask is `(1 - mask) * MIN` where
//! `MIN` is the most negative finite value *of the activation dtype*. Upstream always uses
//! `f32::MIN`, which is the same thing in f32, but in f16 and bf16 it rounds to −∞, and
//! `0 * −∞ = NaN` then poisons every score of every row (upstream's half-precision hidden states
//! are all NaN). With the dtype's own minimum (as Hugging Face's `torch.finfo(dtype).min`) the
//! visible keys get `+ (−0)` and the padding keys a large negative score, so f16/bf16 work.
//!
//! Pooling ([`Bert::pool`]) is sentence-transformers': masked mean over the tokens or the first
//! (CLS) token, optionally L2-normalised. It runs in f32: half-precision hidden states are
//! converted first.
//!
//! Module paths follow Hugging Face checkpoint names without the `bert.` prefix:
//! `embeddings.word_embeddings`, `encoder.layer.{i}.attention.self.query`,
//! `encoder.layer.{i}.attention.output.LayerNorm`, `encoder.layer.{i}.intermediate.dense`, …; ops
//! inside a module get their own names (`encoder.layer.{i}.attention.self.softmax`,
//! `encoder.layer.{i}.output.residual`), and the pooling is `pooler.mean` / `pooler.normalize`.
//! The model knows nothing of files: loaders build it from weights ([`BertWeights`]).

use candle_core::{DType, Device, IndexOp, Tensor, D};
use candle_trace_format::error::{Error, Result};
use candle_trace_format::record::Reads;
use candle_trace_instrument::kernel::{Kernel, Operand};
use candle_trace_instrument::ops::{self, Attention, AttentionSites, AttnMask, Keys, Op, Site, Weight};
use candle_trace_instrument::tracer::{Node, Tok, Tracer};

/// The activation between the two dense layers of the feed-forward block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HiddenAct {
    /// `hidden_act: "gelu"`: exact GELU (`gelu_erf`).
    GeluErf,
    /// `hidden_act: "gelu_new"` / `"gelu_pytorch_tanh"`: the tanh approximation (`gelu`).
    GeluTanh,
}

/// Hyper-parameters of a BERT encoder (the `config.json` fields that change the computation).
#[derive(Clone, Debug, PartialEq)]
pub struct BertConfig {
    /// `vocab_size`, in tokens: rows of the word embeddings.
    pub vocab_size: usize,
    /// `hidden_size`: the hidden states are `[batch, seq, hidden]`; a multiple of
    /// `num_attention_heads`.
    pub hidden_size: usize,
    /// `num_hidden_layers`: encoder layers.
    pub num_hidden_layers: usize,
    /// `num_attention_heads`: attention heads per layer.
    pub num_attention_heads: usize,
    /// `intermediate_size`: width of the feed-forward block's inner layer.
    pub intermediate_size: usize,
    /// `hidden_act` (`gelu` when absent): the feed-forward activation.
    pub hidden_act: HiddenAct,
    /// `max_position_embeddings` (512 when absent): the longest sequence, in tokens.
    pub max_position_embeddings: usize,
    /// `type_vocab_size` (2 when absent): rows of the token type embeddings.
    pub type_vocab_size: usize,
    /// `layer_norm_eps` (1e-12 when absent); the LayerNorms use the eps their
    /// [`candle_nn::LayerNorm`] carries.
    pub layer_norm_eps: f64,
}

impl BertConfig {
    /// Per-head dimension, `hidden_size / num_attention_heads`.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }
}

/// Weights of one encoder layer, in the compute dtype.
#[derive(Debug, Clone)]
pub struct BertLayerWeights {
    /// `attention.self.{query,key,value}`, `[hidden, hidden]` with bias.
    pub query: candle_nn::Linear,
    /// `attention.self.key`, `[hidden, hidden]` with bias.
    pub key: candle_nn::Linear,
    /// `attention.self.value`, `[hidden, hidden]` with bias.
    pub value: candle_nn::Linear,
    /// `attention.output.dense` and `attention.output.LayerNorm`.
    pub attention_output: candle_nn::Linear,
    /// `attention.output.LayerNorm`, `[hidden]`; needs a bias.
    pub attention_layer_norm: candle_nn::LayerNorm,
    /// `intermediate.dense`, `[intermediate, hidden]`.
    pub intermediate: candle_nn::Linear,
    /// `output.dense`, `[hidden, intermediate]`, and `output.LayerNorm`.
    pub output: candle_nn::Linear,
    /// `output.LayerNorm`, `[hidden]`; needs a bias.
    pub output_layer_norm: candle_nn::LayerNorm,
}

/// All weights of a model, as a loader hands them over (compute dtype).
#[derive(Debug, Clone)]
pub struct BertWeights {
    /// `[vocab, hidden]`.
    pub word_embeddings: Tensor,
    /// `[max_position_embeddings, hidden]`.
    pub position_embeddings: Tensor,
    /// `[type_vocab_size, hidden]`.
    pub token_type_embeddings: Tensor,
    /// `embeddings.LayerNorm`, `[hidden]`; needs a bias.
    pub embeddings_layer_norm: candle_nn::LayerNorm,
    /// One per encoder layer, in order (`encoder.layer.{i}`): `num_hidden_layers` of them.
    pub layers: Vec<BertLayerWeights>,
}

struct LayerSites {
    query: Site,
    key: Site,
    value: Site,
    attn: AttentionSites,
    attention_output: Site,
    attention_residual: Site,
    attention_layer_norm: Site,
    intermediate: Site,
    act: Site,
    output: Site,
    output_residual: Site,
    output_layer_norm: Site,
}

impl LayerSites {
    fn new(i: usize) -> Self {
        let l = format!("encoder.layer.{i}");
        let a = format!("{l}.attention.self");
        let o = format!("{l}.attention.output");
        LayerSites {
            query: Site::new(format!("{a}.query"), Op::Linear),
            key: Site::new(format!("{a}.key"), Op::Linear),
            value: Site::new(format!("{a}.value"), Op::Linear),
            attn: AttentionSites::new(&a, "mask_add", Op::MaskAdd),
            attention_output: Site::new(format!("{o}.dense"), Op::Linear),
            attention_residual: Site::new(format!("{o}.residual"), Op::Add),
            attention_layer_norm: Site::new(format!("{o}.LayerNorm"), Op::LayerNorm),
            intermediate: Site::new(format!("{l}.intermediate.dense"), Op::Linear),
            act: Site::new(format!("{l}.intermediate.act"), Op::Gelu),
            output: Site::new(format!("{l}.output.dense"), Op::Linear),
            output_residual: Site::new(format!("{l}.output.residual"), Op::Add),
            output_layer_norm: Site::new(format!("{l}.output.LayerNorm"), Op::LayerNorm),
        }
    }

    fn all(&self) -> impl Iterator<Item = &Site> {
        let qkv = [&self.query, &self.key, &self.value];
        let after = [&self.attention_output, &self.attention_residual, &self.attention_layer_norm, &self.intermediate, &self.act, &self.output, &self.output_residual, &self.output_layer_norm];
        qkv.into_iter().chain(self.attn.all()).chain(after)
    }
}

/// One encoder layer: dense weights wrapped as the op vocabulary's [`Weight`].
struct Layer {
    query: Weight,
    key: Weight,
    value: Weight,
    attention_output: Weight,
    attention_layer_norm: candle_nn::LayerNorm,
    intermediate: Weight,
    output: Weight,
    output_layer_norm: candle_nn::LayerNorm,
    sites: LayerSites,
}

/// What a forward pass hands to the pooling: the last hidden states and the recorded mask.
#[derive(Clone, Debug)]
pub struct BertOutput {
    /// `[batch, seq, hidden]` in the activation dtype.
    pub hidden: Node,
    /// The attention mask as fed, `[batch, seq]` u32 (1 = token, 0 = padding).
    pub mask: Node,
}

/// An instrumented BERT encoder.
pub struct Bert {
    cfg: BertConfig,
    dtype: DType,
    device: Device,
    word_embeddings: candle_nn::Embedding,
    position_embeddings: candle_nn::Embedding,
    token_type_embeddings: candle_nn::Embedding,
    embeddings_layer_norm: candle_nn::LayerNorm,
    layers: Vec<Layer>,
    /// The additive mask's fill value: the most negative finite value of the activation dtype.
    mask_min: Tensor,
    site_input_ids: Site,
    site_token_type_ids: Site,
    site_attention_mask: Site,
    site_word: Site,
    site_token_type: Site,
    site_add_token_type: Site,
    site_position: Site,
    site_add_position: Site,
    site_embeddings_layer_norm: Site,
    site_to_f32: Site,
    site_mean: Site,
    site_normalize: Site,
}

/// The most negative finite value of `dtype`, as a scalar tensor of that dtype.
fn finite_min(dtype: DType, device: &Device) -> Result<Tensor> {
    let t = match dtype {
        // Exactly upstream's `Tensor::try_from(f32::MIN)?.to_dtype(F32)`.
        DType::F32 => Tensor::new(f32::MIN, device)?,
        DType::F16 => Tensor::new(half::f16::MIN, device)?,
        DType::BF16 => Tensor::new(half::bf16::MIN, device)?,
        other => return Err(Error::usage(format!("BERT runs in f32, f16 or bf16, not {}", other.as_str()))),
    };
    Ok(t)
}

impl Bert {
    /// Switches to upstream's mask exactly (`--numerics upstream`): the fill value is `f32::MIN`
    /// converted to the activation dtype, −∞ in f16 and bf16, so that `0 · −∞ = NaN` reaches
    /// every visible key's score (padded batch or not), as candle-transformers'
    /// `BertModel` does. The trace then shows that NaN at `mask_add`, the op that made it.
    ///
    /// # Errors
    /// Candle errors building the scalar.
    pub fn set_upstream_mask(&mut self) -> Result<()> {
        self.mask_min = Tensor::new(f32::MIN, &self.device)?.to_dtype(self.dtype)?;
        Ok(())
    }

    /// Builds the model. `dtype` is the activation dtype (that of the weights): f32, f16 or bf16.
    ///
    /// # Errors
    /// [`Error::Usage`] for another dtype or a layer count that disagrees with the config.
    pub fn new(cfg: BertConfig, w: BertWeights, dtype: DType, device: &Device) -> Result<Self> {
        let mask_min = finite_min(dtype, device)?;
        if w.layers.len() != cfg.num_hidden_layers {
            return Err(Error::usage(format!("BERT weights have {} layers, the config says {}", w.layers.len(), cfg.num_hidden_layers)));
        }
        if cfg.num_attention_heads == 0 || !cfg.hidden_size.is_multiple_of(cfg.num_attention_heads) {
            return Err(Error::usage(format!("hidden_size {} is not a multiple of num_attention_heads {}", cfg.hidden_size, cfg.num_attention_heads)));
        }
        let layers = w
            .layers
            .into_iter()
            .enumerate()
            .map(|(i, l)| Layer {
                query: Weight::Dense(l.query),
                key: Weight::Dense(l.key),
                value: Weight::Dense(l.value),
                attention_output: Weight::Dense(l.attention_output),
                attention_layer_norm: l.attention_layer_norm,
                intermediate: Weight::Dense(l.intermediate),
                output: Weight::Dense(l.output),
                output_layer_norm: l.output_layer_norm,
                sites: LayerSites::new(i),
            })
            .collect();
        let h = cfg.hidden_size;
        Ok(Bert {
            word_embeddings: candle_nn::Embedding::new(w.word_embeddings, h),
            position_embeddings: candle_nn::Embedding::new(w.position_embeddings, h),
            token_type_embeddings: candle_nn::Embedding::new(w.token_type_embeddings, h),
            embeddings_layer_norm: w.embeddings_layer_norm,
            layers,
            mask_min,
            cfg,
            dtype,
            device: device.clone(),
            site_input_ids: Site::new("input_ids", Op::Input),
            site_token_type_ids: Site::new("token_type_ids", Op::Input),
            site_attention_mask: Site::new("attention_mask", Op::Input),
            site_word: Site::new("embeddings.word_embeddings", Op::Embedding),
            site_token_type: Site::new("embeddings.token_type_embeddings", Op::Embedding),
            site_add_token_type: Site::new("embeddings.add_token_type", Op::Add),
            site_position: Site::new("embeddings.position_embeddings", Op::Embedding),
            site_add_position: Site::new("embeddings.add_position", Op::Add),
            site_embeddings_layer_norm: Site::new("embeddings.LayerNorm", Op::LayerNorm),
            site_to_f32: Site::new("pooler.to_f32", Op::ToDtype),
            site_mean: Site::new("pooler.mean", Op::MeanPool),
            site_normalize: Site::new("pooler.normalize", Op::Normalize),
        })
    }

    /// The hyper-parameters it was built with.
    pub fn config(&self) -> &BertConfig {
        &self.cfg
    }

    /// Activation dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device of its weights; the tensors passed to [`Bert::forward`] must be on it.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Module paths of every op site, in execution order of one forward pass and the pooling
    /// (`pooler.to_f32` only runs for half-precision activations, `pooler.mean` only for mean
    /// pooling, `pooler.normalize` only when normalising).
    pub fn sites(&self) -> impl Iterator<Item = &Site> {
        let top = [
            &self.site_input_ids,
            &self.site_token_type_ids,
            &self.site_attention_mask,
            &self.site_word,
            &self.site_token_type,
            &self.site_add_token_type,
            &self.site_position,
            &self.site_add_position,
            &self.site_embeddings_layer_norm,
        ];
        let layers = self.layers.iter().flat_map(|l| l.sites.all());
        let tail = [&self.site_to_f32, &self.site_mean, &self.site_normalize];
        top.into_iter().chain(layers).chain(tail)
    }

    /// One forward pass over token ids `[batch, seq]` (u32), token type ids (same shape, u32) and
    /// attention mask (same shape, u32: 1 = token, 0 = padding). Positions are `0 .. seq`.
    ///
    /// The caller brackets it with [`Tracer::begin_forward`] / [`Tracer::end_forward`].
    ///
    /// # Errors
    /// [`Error::Usage`] for a sequence longer than `max_position_embeddings` or mismatched
    /// shapes; candle errors; sink errors.
    pub fn forward(&self, tr: &mut Tracer, input_ids: &Tensor, token_type_ids: &Tensor, attention_mask: &Tensor) -> Result<BertOutput> {
        let (b_sz, seq_len) = input_ids.dims2()?;
        if token_type_ids.dims() != input_ids.dims() || attention_mask.dims() != input_ids.dims() {
            return Err(Error::usage(format!("token ids {:?}, token type ids {:?} and attention mask {:?} differ in shape", input_ids.dims(), token_type_ids.dims(), attention_mask.dims())));
        }
        if seq_len > self.cfg.max_position_embeddings {
            return Err(Error::usage(format!("sequence of {seq_len} tokens is longer than the {} positions of the model", self.cfg.max_position_embeddings)));
        }
        let ids = ops::input(tr, &self.site_input_ids, input_ids)?;
        let type_ids = ops::input(tr, &self.site_token_type_ids, token_type_ids)?;
        let mask = ops::input(tr, &self.site_attention_mask, attention_mask)?;

        // Embeddings, in upstream's order: word, token type, their sum, position, sum, LayerNorm.
        let word = ops::embedding(tr, &self.site_word, &self.word_embeddings, &ids)?;
        let token_type = ops::embedding(tr, &self.site_token_type, &self.token_type_embeddings, &type_ids)?;
        let x = ops::add(tr, &self.site_add_token_type, &word, &token_type)?;
        // Position ids `[1, seq]`: the lookup gives `[1, seq, hidden]` (the trace's dim 0 is the
        // batch), the same values upstream's `[seq, hidden]` lookup broadcasts.
        let position_ids: Vec<u32> = (0..seq_len as u32).collect();
        let position_ids = Tensor::from_vec(position_ids, (1, seq_len), &self.device)?;
        let table = Operand::T(self.position_embeddings.embeddings().clone());
        let position = tr.run(&self.site_position, Kernel::Embedding, &[Operand::T(position_ids), table], &[], Tok::Seq(1))?;
        let x = tr.run(&self.site_add_position, Kernel::BroadcastAdd, &[Operand::T(x.t.clone()), Operand::T(position.t.clone())], &[(&x, Reads::Same), (&position, Reads::Same)], Tok::Seq(1))?;
        let x = layer_norm(tr, &self.site_embeddings_layer_norm, &self.embeddings_layer_norm, &x)?;

        // Upstream's get_extended_attention_mask, with the dtype's own finite minimum.
        let m = mask.t.unsqueeze(1)?.unsqueeze(1)?.to_dtype(self.dtype)?;
        let ext_mask = (m.ones_like()? - &m)?.broadcast_mul(&self.mask_min)?;

        let mut x = x;
        for layer in &self.layers {
            x = self.layer_forward(tr, layer, &x, &ext_mask, &mask, b_sz, seq_len)?;
        }
        Ok(BertOutput { hidden: x, mask })
    }

    #[allow(clippy::too_many_arguments)]
    fn layer_forward(&self, tr: &mut Tracer, layer: &Layer, x: &Node, ext_mask: &Tensor, mask: &Node, b_sz: usize, seq_len: usize) -> Result<Node> {
        let s = &layer.sites;
        let (n_head, hd) = (self.cfg.num_attention_heads, self.cfg.head_dim());
        let heads = |t: &Tensor| -> candle_core::Result<Tensor> { t.reshape((b_sz, seq_len, n_head, hd))?.transpose(1, 2)?.contiguous() };

        // Self-attention.
        let q = ops::linear(tr, &s.query, &layer.query, x)?;
        let k = ops::linear(tr, &s.key, &layer.key, x)?;
        let v = ops::linear(tr, &s.value, &layer.value, x)?;
        let (q_h, k_h, v_h) = (heads(&q.t)?, heads(&k.t)?, heads(&v.t)?);
        // Every query reads every key of its row; softmax as candle_nn::ops::softmax (unfused).
        let how = Attention { keys: Keys::All, mask: AttnMask::Add { mask: ext_mask, input: Some(mask) }, fused_softmax: false, softmax_f32: false, head_dim: hd };
        let ctx = ops::attention(tr, &s.attn, &how, (&q, &q_h), (&k, &k_h), (&v, &v_h))?;
        let ctx = Node { t: ctx.t.transpose(1, 2)?.contiguous()?.flatten_from(D::Minus2)?, seq: ctx.seq };

        // attention.output: dense, residual, LayerNorm.
        let h = ops::linear(tr, &s.attention_output, &layer.attention_output, &ctx)?;
        let h = ops::add(tr, &s.attention_residual, &h, x)?;
        let a = layer_norm(tr, &s.attention_layer_norm, &layer.attention_layer_norm, &h)?;

        // intermediate + output.
        let i = ops::linear(tr, &s.intermediate, &layer.intermediate, &a)?;
        let erf = matches!(self.cfg.hidden_act, HiddenAct::GeluErf);
        let act = tr.run(&s.act, Kernel::Gelu { erf }, &[Operand::T(i.t.clone())], &[(&i, Reads::Same)], Tok::Seq(1))?;
        let o = ops::linear(tr, &s.output, &layer.output, &act)?;
        let o = ops::add(tr, &s.output_residual, &o, &a)?;
        layer_norm(tr, &s.output_layer_norm, &layer.output_layer_norm, &o)
    }

    /// Sentence-transformers pooling of a forward pass's output, in f32: masked mean over the
    /// tokens (`cls = false`: `sum(hidden * mask) / sum(mask)`) or the first token (`cls = true`),
    /// then, with `normalize`, division by the L2 norm (floored at 1e-12, as `F.normalize`).
    /// Returns `[batch, hidden]` f32.
    ///
    /// Recorded: `pooler.to_f32` (half-precision activations only), `pooler.mean` (mean pooling),
    /// `pooler.normalize`. Taking the CLS row is data movement and is not recorded.
    ///
    /// # Errors
    /// Candle errors; sink errors.
    pub fn pool(&self, tr: &mut Tracer, out: &BertOutput, cls: bool, normalize: bool) -> Result<Node> {
        let hidden = if out.hidden.t.dtype() == DType::F32 {
            out.hidden.clone()
        } else {
            let k = Kernel::ToDtype { dtype: "f32".into() };
            tr.run(&self.site_to_f32, k, &[Operand::T(out.hidden.t.clone())], &[(&out.hidden, Reads::Same)], Tok::Seq(1))?
        };
        let pooled = if cls {
            Node { t: hidden.t.i((.., 0, ..))?.contiguous()?, seq: hidden.seq }
        } else {
            let ops = [Operand::T(hidden.t.clone()), Operand::T(out.mask.t.clone())];
            tr.run(&self.site_mean, Kernel::MeanPool, &ops, &[(&hidden, Reads::Same), (&out.mask, Reads::Same)], Tok::Whole)?
        };
        if !normalize {
            return Ok(pooled);
        }
        tr.run(&self.site_normalize, Kernel::Normalize, &[Operand::T(pooled.t.clone())], &[(&pooled, Reads::Same)], Tok::Whole)
    }
}

/// LayerNorm as candle_nn's `LayerNorm::forward` (the fused kernel on contiguous input).
fn layer_norm(tr: &mut Tracer, site: &Site, ln: &candle_nn::LayerNorm, x: &Node) -> Result<Node> {
    let bias = ln.bias().ok_or_else(|| Error::usage(format!("{}: layer norm without bias", site.path)))?;
    let ops = [Operand::T(x.t.clone()), Operand::T(ln.weight().clone()), Operand::T(bias.clone())];
    tr.run(site, Kernel::LayerNorm { eps: ln.eps() }, &ops, &[(x, Reads::Same)], Tok::Seq(1))
}
