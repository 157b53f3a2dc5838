//! What a trace holds: the run's header, the items streamed during the run, and the footer.
//!
//! Items are written in the order they happen: a [`Item::Site`] names a (module path, op) the
//! first time it is used; [`Item::Forward`] marks the start of a forward pass; [`Item::Op`] is one
//! recorded op output; [`Item::Token`] is one decode step's choice. All are postcard-encoded inside
//! zstd frames (see `docs/trace-format.md`).

use serde::{Deserialize, Serialize};

/// How an op reads an input, seen from one output token position `p`.
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reads {
    /// The input's own position `p` (elementwise ops, projections, norms).
    Same,
    /// The input's positions `0..=p` (attention reading the KV cache).
    Prefix,
    /// Every position of the input's row (bidirectional attention in encoders).
    All,
}

/// One input of a recorded op: the record id (`seq`) of the op that produced it.
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputRef {
    pub seq: u64,
    pub reads: Reads,
}

/// One recorded op output.
///
/// `shape` and `dtype` are the output's; `digest` is xxh3-128 of its logical values
/// ([`crate::digest`]); `samples` are up to 8 values at evenly spaced logical offsets; `tokens`
/// holds one entry per (batch row, absolute token position) when the tensor has a token axis.
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpRecord {
    /// Sequence number, unique and increasing in the trace: the record id inputs refer to.
    pub seq: u64,
    /// Forward-pass index (0-based).
    pub step: u32,
    /// Index into the trace's site table ([`Item::Site`]).
    pub site: u32,
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_INPUTS }>")]
    pub inputs: Vec<InputRef>,
    pub dtype: String,
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_RANK }>")]
    pub shape: Vec<u32>,
    pub digest: u128,
    pub stats: Stats,
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_SAMPLES }>")]
    pub samples: Vec<f32>,
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_TOKEN_STATS }>")]
    pub tokens: Vec<TokenStat>,
    /// Where the token axis is (how `tokens` were cut); `None` for whole-tensor records.
    pub axis: Option<TokenAxis>,
    /// The op and its attributes: enough, with the operands, to re-execute it.
    pub kernel: Option<Kernel>,
    /// Ids of the operand values ([`Item::Operand`]) when the op was dumped; empty otherwise.
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_INPUTS }>")]
    pub operands: Vec<u64>,
    /// True when `--perturb` flipped a bit of this output.
    pub perturbed: bool,
}

/// Whether a forward pass reads prompt tokens or generated ones.
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    Prefill,
    Decode,
}

/// The start of one forward pass over positions `index_pos .. index_pos + seq_len`.
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Forward {
    pub step: u32,
    pub phase: Phase,
    pub index_pos: u32,
    pub seq_len: u32,
    pub batch: u32,
    /// The token ids fed to this pass, row-major `[batch, seq_len]`.
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_TOKEN_IDS }>")]
    pub ids: Vec<u32>,
}

/// One batch row's choice at a decode step.
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    pub row: u32,
    pub token: u32,
    /// The token as text (its piece of the decoded output).
    #[serde(deserialize_with = "crate::limits::string")]
    pub text: String,
    /// Up to 5 (token id, logit) pairs, highest logit first; ties broken by lowest id.
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_TOP }>")]
    pub top: Vec<(u32, f32)>,
    /// Top-1 minus top-2 logit (0 when they tie).
    pub margin: f32,
    /// True when the two highest logits are exactly equal.
    pub tie: bool,
}

/// A token generated after forward pass `step`: generated token number `index` (0-based).
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenEvent {
    pub step: u32,
    pub index: u32,
    /// Absolute position this token will occupy in the sequence.
    pub pos: u32,
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_ROWS }>")]
    pub rows: Vec<Choice>,
}

/// One streamed item.
#[allow(clippy::large_enum_variant)] // op records dominate the stream; boxing them buys nothing
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Item {
    Site {
        id: u32,
        #[serde(deserialize_with = "crate::limits::string")]
        path: String,
        #[serde(deserialize_with = "crate::limits::string")]
        op: String,
    },
    Forward(Forward),
    Op(OpRecord),
    Token(TokenEvent),
    /// Encoder runs: the pooled sentence embeddings, one vector per input text, in order.
    Embeddings(#[serde(deserialize_with = "crate::limits::embeddings")] Vec<Vec<f32>>),
    /// Full values of one op output (`--dump`).
    Dump(Dump),
    /// One operand value of a dumped op (an activation as the op saw it, a weight, a mask…).
    Operand(OperandValue),
    /// In a repro trace (`trace extract`): the other run's header and its record of the same op.
    Counterpart(Box<Counterpart>),
    /// The leading bytes of the next `Dump` or `Operand` item's `data`, for values too large for
    /// one frame. Readers ([`crate::format::decode_trace`]) join them back; they never reach
    /// consumers.
    ValuePart(Vec<u8>),
}

/// The other side of a repro trace: its settings and environment, and its record of the op.
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Counterpart {
    pub header: Header,
    pub record: OpRecord,
    /// The other run's operand values of the op, when it was dumped there (ids as in its
    /// `record.operands`).
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_INPUTS }>")]
    pub operands: Vec<OperandValue>,
}

/// An operand value: a dense tensor (`Dump` with `seq` = operand id), a quantized GGUF weight
/// (candle's `GgmlDType` name and its raw block bytes), or a GGUF weight candle keeps dense
/// (`QMatMul::Tensor`).
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum OperandValue {
    Tensor(Dump),
    Quantized {
        id: u64,
        #[serde(deserialize_with = "crate::limits::string")]
        ggml_dtype: String,
        #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_RANK }>")]
        shape: Vec<u32>,
        data: Vec<u8>,
    },
    QMatMulTensor(Dump),
}

impl OperandValue {
    /// The value's bytes.
    pub fn data(&self) -> &[u8] {
        match self {
            OperandValue::Tensor(d) | OperandValue::QMatMulTensor(d) => &d.data,
            OperandValue::Quantized { data, .. } => data,
        }
    }

    /// The value's bytes, mutably.
    pub fn data_mut(&mut self) -> &mut Vec<u8> {
        match self {
            OperandValue::Tensor(d) | OperandValue::QMatMulTensor(d) => &mut d.data,
            OperandValue::Quantized { data, .. } => data,
        }
    }

    /// The operand id.
    pub fn id(&self) -> u64 {
        match self {
            OperandValue::Tensor(d) | OperandValue::QMatMulTensor(d) => d.seq,
            OperandValue::Quantized { id, .. } => *id,
        }
    }
}

/// A tensor's full logical values (see [`crate::dump`]): record `seq`'s output, or an operand
/// of a dumped op as that op saw it (then `shape` may be a reshaped view of the record's).
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Dump {
    pub seq: u64,
    pub dtype: String,
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_RANK }>")]
    pub shape: Vec<u32>,
    /// Byte-plane shuffled (always true in files this version writes).
    pub shuffled: bool,
    /// Little-endian element bytes, row-major, shuffled when `shuffled`.
    pub data: Vec<u8>,
}

/// The model a run used. No directory is stored, only the file name (traces are public attachments).
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// File name without directories, or "builtin".
    pub name: String,
    pub size: u64,
    /// Hex sha256 of the file (of the seeded weights' description for the builtin model).
    pub sha256: String,
    pub architecture: String,
    pub n_layers: u32,
    pub vocab_size: u32,
    /// How the weights are stored in the file (e.g. "q4_1", "f32").
    pub weights: String,
    /// The model's hyper-parameters as (key, JSON value) pairs, sorted by key: config.json's
    /// fields (nested ones as `a.b`) for folders, the `{arch}.*` metadata for GGUF files.
    #[serde(deserialize_with = "crate::limits::pairs::<_, { crate::limits::MAX_CONFIG_ENTRIES }>")]
    pub config: Vec<(String, String)>,
}

/// The settings of a run: everything that decides its numbers besides the environment.
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RunInfo {
    pub model: ModelInfo,
    /// "q" (weights as quantized in the file), "f32", "f16" or "bf16".
    pub dtype: String,
    #[serde(deserialize_with = "crate::limits::string")]
    pub prompt: String,
    pub chat: bool,
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_TOKEN_IDS }>")]
    pub prompt_tokens: Vec<u32>,
    pub max_tokens: u32,
    pub temperature: Option<f64>,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    pub seed: u64,
    /// 0 = whole prompt in one forward pass.
    pub prefill_chunk: u32,
    pub batch: u32,
    /// Worker threads of candle's CPU kernels.
    pub threads: u32,
    /// `--perturb` spec, if any.
    pub perturb: Option<String>,
    /// `--dump` spec ("none", "all" or patterns).
    pub dump: String,
    /// Encoder runs: the input texts (`--text`, in order); empty for decoder runs.
    #[serde(deserialize_with = "crate::limits::strings::<_, { crate::limits::MAX_ROWS }>")]
    pub texts: Vec<String>,
    /// Encoder runs: the pooling applied ("mean+normalize", "cls", …); empty for decoders.
    pub pooling: String,
}

/// The machine and build a run happened on. Only numerics-relevant environment variables are
/// kept (`RAYON_NUM_THREADS`, `CANDLE_*`); no user, host or home path.
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EnvInfo {
    pub crate_version: String,
    pub candle_version: String,
    pub rustc: String,
    pub os: String,
    pub arch: String,
    pub cpu: String,
    #[serde(deserialize_with = "crate::limits::strings::<_, { crate::limits::MAX_CONFIG_ENTRIES }>")]
    pub simd: Vec<String>,
    pub threads: u32,
    pub device: String,
    #[serde(deserialize_with = "crate::limits::pairs::<_, { crate::limits::MAX_ENV_VARS }>")]
    pub env_vars: Vec<(String, String)>,
}

/// How the binary that wrote a trace was built (format 1.2: an optional frame of kind
/// [`crate::format::KIND_BUILD`] right after the header; older traces have none). What decides
/// which CPU kernels run besides the machine: the compile-time target features and CPU, the
/// crate's GPU features, and the versions of the numerics crates.
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BuildInfo {
    /// `CARGO_CFG_TARGET_FEATURE` at build time (`avx2`, `fma`, `neon`, ...), sorted.
    #[serde(deserialize_with = "crate::limits::strings::<_, { crate::limits::MAX_CONFIG_ENTRIES }>")]
    pub target_features: Vec<String>,
    /// `-C target-cpu`, when the build set one (empty: the target's default).
    #[serde(deserialize_with = "crate::limits::string")]
    pub target_cpu: String,
    /// This crate's backend features compiled in (`cuda`, `metal`).
    #[serde(deserialize_with = "crate::limits::strings::<_, { crate::limits::MAX_CONFIG_ENTRIES }>")]
    pub features: Vec<String>,
    /// (crate, version) of the numerics crates, from Cargo.lock at build time.
    #[serde(deserialize_with = "crate::limits::pairs::<_, { crate::limits::MAX_CONFIG_ENTRIES }>")]
    pub crates: Vec<(String, String)>,
}

/// The first frame of a trace.
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Header {
    pub run: RunInfo,
    pub env: EnvInfo,
}

/// How one decode step chose one row's token (format 1.1: written in optional frames of kind
/// [`crate::format::KIND_SAMPLING`], which older v1 readers skip). Probabilities are those
/// candle-transformers' `LogitsProcessor` computes: `softmax(logits / temperature)` in f32.
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SamplingStep {
    /// Generated-token index (as [`TokenEvent::index`]) and batch row.
    pub index: u32,
    pub row: u32,
    /// `argmax`, `all`, `top_k`, `top_p` or `top_k_then_top_p`.
    #[serde(deserialize_with = "crate::limits::string")]
    pub mode: String,
    pub temperature: Option<f64>,
    pub top_k: Option<u32>,
    pub top_p: Option<f64>,
    /// Vocabulary size, and the candidate set's size after top-k and after top-p.
    pub vocab: u32,
    pub after_top_k: u32,
    pub after_top_p: u32,
    /// The smallest probability (and its token's logit) inside the set at the top-k and at the
    /// top-p cut-off.
    pub k_cutoff: Option<(f32, f32)>,
    pub p_cutoff: Option<(f32, f32)>,
    /// Tokens outside the set whose probability ties a cut-off exactly or lies within 1 ULP of
    /// it (argmax: logits tying or within 1 ULP of the maximum): (token, probability, exact tie).
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_TOP }>")]
    pub boundary: Vec<(u32, f32, bool)>,
    /// Probability mass of the final candidate set (the weights the draw was made over).
    pub mass: f32,
    /// The uniform value drawn, in `[0, 1)`: the weighted draw is `draw × mass` (none for
    /// argmax, or when the draw could not be replayed).
    pub draw: Option<f32>,
    pub chosen: u32,
    /// The chosen token's rank by probability (0 = most likely; ties to the lowest id).
    pub rank: u32,
    /// xxh3-64 of the probability vector's f32 little-endian bytes.
    pub probs_digest: u64,
    /// xxh3-64 of the final candidate set's token ids, ascending, as u32 little-endian bytes.
    pub set_digest: u64,
    /// The token at the last cut-off (the least likely one kept), when a cut-off applied.
    pub cutoff_token: Option<u32>,
}

/// The last frame of a complete trace.
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Footer {
    /// Items written before the footer (set by the writer).
    pub items: u64,
    pub op_records: u64,
    pub forward_passes: u32,
    pub tokens_generated: u32,
    /// Generated text of each batch row.
    #[serde(deserialize_with = "crate::limits::strings::<_, { crate::limits::MAX_ROWS }>")]
    pub texts: Vec<String>,
    /// Why the run stopped: "max_tokens", "eos", "nonfinite (op record N)" (`--stop-on-nonfinite`),
    /// or "done" (encoder runs).
    pub stop: String,
}

/// f64 reductions over a tensor (or a token slice of it).
///
/// `sum`, `min`, `max`, `abs_max` and `l2` (sqrt of the sum of squares) are over finite values
/// only; non-finite values are counted in `nan`, `pos_inf`, `neg_inf`. `min`/`max`/`abs_max` are 0
/// when no value is finite.
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    pub count: u64,
    pub sum: f64,
    pub min: f64,
    pub max: f64,
    pub abs_max: f64,
    pub l2: f64,
    pub nan: u64,
    pub pos_inf: u64,
    pub neg_inf: u64,
}

impl Stats {
    /// Mean of the finite values (0 when there are none).
    pub fn mean(&self) -> f64 {
        let finite = self.count - self.nonfinite();
        if finite == 0 {
            0.0
        } else {
            self.sum / finite as f64
        }
    }
    /// Number of NaN and ±Inf values.
    pub fn nonfinite(&self) -> u64 {
        self.nan + self.pos_inf + self.neg_inf
    }
}

/// Digest and reductions of one (batch row, absolute token position) slice of a tensor.
///
/// `samples` are the values at offsets `0, L/3, 2L/3, L-1` of the slice's `L` logical values,
/// as f32 (exact for f32, f16 and bf16 tensors).
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenStat {
    pub row: u32,
    pub pos: u32,
    pub digest: u64,
    pub sum: f64,
    pub abs_max: f64,
    pub nonfinite: u32,
    pub samples: [f32; 4],
}

/// Where the token axis of a tensor is, and which positions it holds.
///
/// Dim 0 is always the batch axis. `seq_dim = Some(d)`: index `i` along dim `d` is absolute position
/// `first_pos + i`. `seq_dim = None`: the whole of each batch row is position `first_pos` (logits of
/// the last token). Positions below `keep_from` are not summarised (KV-cache entries written by an
/// earlier forward pass). `causal`: the last dim indexes keys and only keys `0..=p` are summarised
/// for position `p` (needs `seq_dim = Some(rank - 2)`).
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenAxis {
    pub seq_dim: Option<usize>,
    pub first_pos: u32,
    pub keep_from: u32,
    pub causal: bool,
}

/// An op and its attributes. Operand order is given per variant.
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Kernel {
    /// `[ids]`: the token ids themselves.
    Input,
    /// `[ids, table]`: `candle_nn::Embedding` lookup.
    Embedding,
    /// `[x, weight]`: `candle_nn::RmsNorm` (fused kernel on contiguous input, unfused otherwise).
    RmsNorm { eps: f64 },
    /// `[x, weight, bias]`: `candle_nn::LayerNorm`.
    LayerNorm { eps: f64 },
    /// `[x, weight]` with a quantized (or GGUF dense) weight: `QMatMul::forward`, `x @ Wᵀ`.
    QMatMul,
    /// `[x, weight]` or `[x, weight, bias]`: `candle_nn::Linear`, `x @ Wᵀ + b`.
    Linear,
    /// `[a, b]`: `a @ bᵀ` when `rhs_t`, else `a @ contiguous(b)`.
    Matmul { rhs_t: bool },
    /// `[x]`: `x / divisor` (candle computes `x * (1/divisor)`).
    Scale { divisor: f64 },
    /// `[x, mask u8, fill scalar]`: where `mask` (broadcast) is set, `fill`.
    WhereCond,
    /// `[x, mask]`: `x + mask`, broadcast.
    BroadcastAdd,
    /// `[x]`: softmax over the last dim; `fused`: `softmax_last_dim`, else `softmax(x, -1)`.
    Softmax { fused: bool },
    /// `[x, cos, sin]`: rotary embedding of contiguous `x`; `interleaved`: `rope_i`, else `rope`.
    Rope { interleaved: bool },
    /// `[prev, new]` or `[new]`: concatenation along `dim` (KV-cache append).
    Cat { dim: usize },
    /// `[x]`
    Silu,
    /// `[x]`: `gelu_erf` when `erf`, else the tanh approximation.
    Gelu { erf: bool },
    /// `[a, b]`
    Mul,
    /// `[a, b]`
    Add,
    /// `[x]`: conversion to `dtype` (`"f32"`, `"f16"`, `"bf16"`).
    ToDtype { dtype: String },
    /// `[hidden f32, mask]`: `sum(hidden * mask, 1) / sum(mask, 1)`.
    MeanPool,
    /// `[x f32]`: `x / max(‖x‖₂, 1e-12)` over the last dim.
    Normalize,
}

/// Which positions of each batch row hold real tokens, for batches of different requests
/// padded to one length: row `r`'s tokens are at absolute positions `windows[r].0 ..
/// windows[r].1` (left padding: `pad_r .. ∞`; right padding: `0 .. len_r`). Per-token
/// statistics then cover only those positions, numbered from the row's own first token (so
/// a padded row aligns with the same request run alone), and, for outputs whose last dim
/// indexes keys, only the keys the row's mask lets a query see. Empty `windows`: every
/// position of every row is a token (no padding).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rows {
    pub windows: Vec<(u32, u32)>,
    /// The last dim indexes keys (attention scores and probabilities of an encoder: every
    /// key of the row's window is visible).
    pub keys_last: bool,
}

impl Rows {
    /// Row `b`'s window (everything when none is set).
    pub fn window(&self, b: usize) -> (u32, u32) {
        self.windows.get(b).copied().unwrap_or((0, u32::MAX))
    }
}

/// The part of a position's innermost run of `inner` values that a query at absolute position
/// `pos` of a row with token window `(lo, hi)` sees: causal attention, keys `lo ..= pos`; an
/// encoder's attention, keys `lo .. hi`; anything else, all of it.
pub fn key_span(axis: &TokenAxis, rows: &Rows, (lo, hi): (u32, u32), pos: u32, inner: usize) -> (usize, usize) {
    let (k0, k1) = if axis.causal {
        (lo as usize, inner.min(pos as usize + 1))
    } else if rows.keys_last {
        (lo as usize, inner.min(hi as usize))
    } else {
        (0, inner)
    };
    (k0.min(k1), k1)
}

/// The flat (row-major) element ranges of batch row `b`'s slice at its own position `own_pos`
/// (counted from the row's first real token) in a tensor of shape `dims`: exactly the elements
/// its per-token digest covers. `None` when the tensor does not hold that position for that row.
/// Used to read (`--causal` captures) and overwrite (patches) one recorded slice.
pub fn slice_ranges(dims: &[usize], axis: &TokenAxis, rows: &Rows, b: usize, own_pos: u32) -> Option<Vec<std::ops::Range<usize>>> {
    let rank = dims.len();
    if rank == 0 || b >= dims[0] {
        return None;
    }
    let (lo, hi) = rows.window(b);
    let pos = own_pos.checked_add(lo)?;
    if pos >= hi || pos < axis.keep_from || pos < axis.first_pos {
        return None;
    }
    let row_len: usize = dims[1..].iter().product();
    let Some(sd) = axis.seq_dim else {
        #[allow(clippy::single_range_in_vec_init)]
        return (pos == axis.first_pos).then(|| vec![b * row_len..(b + 1) * row_len]);
    };
    if sd == 0 || sd >= rank || (axis.causal && sd + 2 != rank) {
        return None;
    }
    let (mid, seq, inner) = (dims[1..sd].iter().product::<usize>(), dims[sd], dims[sd + 1..].iter().product::<usize>());
    let s = (pos - axis.first_pos) as usize;
    if s >= seq {
        return None;
    }
    let (k0, k1) = key_span(axis, rows, (lo, hi), pos, inner);
    Some((0..mid).map(|m| {
        let base = ((b * mid + m) * seq + s) * inner;
        base + k0..base + k1
    }).collect())
}

/// [`slice_ranges`] in a batch without padding: row `row`'s slice at absolute position `pos`.
pub fn token_slice(dims: &[usize], axis: &TokenAxis, row: u32, pos: u32) -> Option<Vec<std::ops::Range<usize>>> {
    slice_ranges(dims, axis, &Rows::default(), row as usize, pos)
}

