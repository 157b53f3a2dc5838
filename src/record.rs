//! What a trace holds: the run's header, the items streamed during the run, and the footer.
//!
//! Items are written in the order they happen: a [`Item::Site`] names a (module path, op) the
//! first time it is used; [`Item::Forward`] marks the start of a forward pass; [`Item::Op`] is one
//! recorded op output; [`Item::Token`] is one decode step's choice. All are postcard-encoded inside
//! zstd frames (see `docs/trace-format.md`).

use crate::digest::{Stats, TokenAxis, TokenStat};
use crate::kernel::Kernel;
use serde::{Deserialize, Serialize};

/// How an op reads an input, seen from one output token position `p`.
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
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpRecord {
    /// Sequence number, unique and increasing in the trace: the record id inputs refer to.
    pub seq: u64,
    /// Forward-pass index (0-based).
    pub step: u32,
    /// Index into the trace's site table ([`Item::Site`]).
    pub site: u32,
    pub inputs: Vec<InputRef>,
    pub dtype: String,
    pub shape: Vec<u32>,
    pub digest: u128,
    pub stats: Stats,
    pub samples: Vec<f32>,
    pub tokens: Vec<TokenStat>,
    /// Where the token axis is (how `tokens` were cut); `None` for whole-tensor records.
    pub axis: Option<TokenAxis>,
    /// The op and its attributes: enough, with the operands, to re-execute it.
    pub kernel: Option<Kernel>,
    /// Ids of the operand values ([`Item::Operand`]) when the op was dumped; empty otherwise.
    pub operands: Vec<u64>,
    /// True when `--perturb` flipped a bit of this output.
    pub perturbed: bool,
}

/// Whether a forward pass reads prompt tokens or generated ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    Prefill,
    Decode,
}

/// The start of one forward pass over positions `index_pos .. index_pos + seq_len`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Forward {
    pub step: u32,
    pub phase: Phase,
    pub index_pos: u32,
    pub seq_len: u32,
    pub batch: u32,
    /// The token ids fed to this pass, row-major `[batch, seq_len]`.
    pub ids: Vec<u32>,
}

/// One batch row's choice at a decode step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    pub row: u32,
    pub token: u32,
    /// The token as text (its piece of the decoded output).
    pub text: String,
    /// Up to 5 (token id, logit) pairs, highest logit first; ties broken by lowest id.
    pub top: Vec<(u32, f32)>,
    /// Top-1 minus top-2 logit (0 when they tie).
    pub margin: f32,
    /// True when the two highest logits are exactly equal.
    pub tie: bool,
}

/// A token generated after forward pass `step`: generated token number `index` (0-based).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenEvent {
    pub step: u32,
    pub index: u32,
    /// Absolute position this token will occupy in the sequence.
    pub pos: u32,
    pub rows: Vec<Choice>,
}

/// One streamed item.
#[allow(clippy::large_enum_variant)] // op records dominate the stream; boxing them buys nothing
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Item {
    Site { id: u32, path: String, op: String },
    Forward(Forward),
    Op(OpRecord),
    Token(TokenEvent),
    /// Encoder runs: the pooled sentence embeddings, one vector per input text, in order.
    Embeddings(Vec<Vec<f32>>),
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
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Counterpart {
    pub header: Header,
    pub record: OpRecord,
    /// The other run's operand values of the op, when it was dumped there (ids as in its
    /// `record.operands`).
    pub operands: Vec<OperandValue>,
}

/// An operand value: a dense tensor (`Dump` with `seq` = operand id), a quantized GGUF weight
/// (candle's `GgmlDType` name and its raw block bytes), or a GGUF weight candle keeps dense
/// (`QMatMul::Tensor`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum OperandValue {
    Tensor(Dump),
    Quantized { id: u64, ggml_dtype: String, shape: Vec<u32>, data: Vec<u8> },
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
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Dump {
    pub seq: u64,
    pub dtype: String,
    pub shape: Vec<u32>,
    /// Byte-plane shuffled (always true in files this version writes).
    pub shuffled: bool,
    /// Little-endian element bytes, row-major, shuffled when `shuffled`.
    pub data: Vec<u8>,
}

/// The model a run used. No directory is stored, only the file name (traces are public attachments).
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
    pub config: Vec<(String, String)>,
}

/// The settings of a run: everything that decides its numbers besides the environment.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RunInfo {
    pub model: ModelInfo,
    /// "q" (weights as quantized in the file), "f32", "f16" or "bf16".
    pub dtype: String,
    pub prompt: String,
    pub chat: bool,
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
    pub texts: Vec<String>,
    /// Encoder runs: the pooling applied ("mean+normalize", "cls", …); empty for decoders.
    pub pooling: String,
}

/// The machine and build a run happened on. Only numerics-relevant environment variables are
/// kept (`RAYON_NUM_THREADS`, `CANDLE_*`); no user, host or home path.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EnvInfo {
    pub crate_version: String,
    pub candle_version: String,
    pub rustc: String,
    pub os: String,
    pub arch: String,
    pub cpu: String,
    pub simd: Vec<String>,
    pub threads: u32,
    pub device: String,
    pub env_vars: Vec<(String, String)>,
}

/// The first frame of a trace.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Header {
    pub run: RunInfo,
    pub env: EnvInfo,
}

/// The last frame of a complete trace.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Footer {
    /// Items written before the footer (set by the writer).
    pub items: u64,
    pub op_records: u64,
    pub forward_passes: u32,
    pub tokens_generated: u32,
    /// Generated text of each batch row.
    pub texts: Vec<String>,
    /// Why the run stopped: "max_tokens", "eos", "nonfinite (op record N)" (`--stop-on-nonfinite`),
    /// or "done" (encoder runs).
    pub stop: String,
}
