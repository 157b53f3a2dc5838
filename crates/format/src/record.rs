//! What a trace holds: the run's header, the items streamed during the run, and the footer.
//!
//! Items are written in the order they happen: a [`Item::Site`] names a (module path, op) the
//! first time it is used; [`Item::Forward`] marks the start of a forward pass; [`Item::Op`] is one
//! recorded op output; [`Item::Token`] is one decode step's choice. All are postcard-encoded inside
//! zstd frames (see `docs/trace-format.md`).

use serde::{Deserialize, Serialize};

pub use crate::slice::{key_span, slice_ranges, token_slice, token_slice_len, Rows, TokenAxis};

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

impl Reads {
    /// The wider of two ways of reading positions (`All` over `Prefix` over `Same`): how an op
    /// reads an input through an op between them that is not recorded (`--level`).
    pub fn wider(self, other: Reads) -> Reads {
        match (self, other) {
            (Reads::All, _) | (_, Reads::All) => Reads::All,
            (Reads::Prefix, _) | (_, Reads::Prefix) => Reads::Prefix,
            _ => Reads::Same,
        }
    }
}

/// One input of a recorded op: the record id (`seq`) of the op that produced it.
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputRef {
    /// Record id (`seq`) of the op record that produced this input: always an earlier record.
    pub seq: u64,
    /// Which of the input's token positions each output position reads.
    pub reads: Reads,
}

impl InputRef {
    /// The inputs of a record at a level that skips ops (`--level`): an input that is a skipped
    /// op's output (`skipped(seq)` gives what that op read, already resolved to recorded ops)
    /// stands for those ancestors, each read the wider of the two ways ([`Reads::wider`]); an
    /// input reached twice is listed once, read the wider way. Order: first reached first.
    /// The one rule both the recorder (live) and bisect's projection of a trace (on records) use.
    pub fn through_skipped<'a>(inputs: impl IntoIterator<Item = InputRef>, skipped: impl Fn(u64) -> Option<&'a [InputRef]>) -> Vec<InputRef> {
        let mut out = Vec::new();
        Self::through_skipped_into(inputs, skipped, &mut out);
        out
    }

    /// [`InputRef::through_skipped`] into `out`, cleared first (its memory reused).
    pub fn through_skipped_into<'a>(inputs: impl IntoIterator<Item = InputRef>, skipped: impl Fn(u64) -> Option<&'a [InputRef]>, out: &mut Vec<InputRef>) {
        out.clear();
        let mut add = |x: InputRef| match out.iter_mut().find(|y| y.seq == x.seq) {
            Some(y) => y.reads = Reads::wider(y.reads, x.reads),
            None => out.push(x),
        };
        for i in inputs {
            match skipped(i.seq) {
                Some(ancestors) => ancestors.iter().for_each(|a| add(InputRef { seq: a.seq, reads: Reads::wider(i.reads, a.reads) })),
                None => add(i),
            }
        }
    }
}

/// One recorded op output.
///
/// `shape` and `dtype` are the output's; `digest` is xxh3-128 of its logical values
/// (`candle_trace_instrument::digest`, docs/trace-format.md); `samples` are up to 8 values at evenly spaced logical offsets; `tokens`
/// holds one entry per (batch row, absolute token position) when the tensor has a token axis.
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct OpRecord {
    /// Sequence number, unique and increasing in the trace: the record id inputs refer to.
    pub seq: u64,
    /// Forward-pass index (0-based).
    pub step: u32,
    /// Index into the trace's site table ([`Item::Site`]).
    pub site: u32,
    /// The op's recorded inputs (outputs of earlier records), in operand order; at most 64.
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_INPUTS }>")]
    pub inputs: Vec<InputRef>,
    /// Candle dtype name of the output: `"f32"`, `"f16"`, `"bf16"`, `"f64"`, `"u32"`, `"u8"` or
    /// `"i64"`.
    pub dtype: String,
    /// Output dims, outermost first (rank at most 8).
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_RANK }>")]
    pub shape: Vec<u32>,
    /// xxh3-128 of the output's logical values, little-endian bytes in row-major order.
    pub digest: u128,
    /// f64 reductions over every element of the output.
    pub stats: Stats,
    /// Up to 8 values at evenly spaced logical offsets (`floor(i·(n-1)/(m-1))`, `m = min(n, 8)`),
    /// as f32.
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_SAMPLES }>")]
    pub samples: Vec<f32>,
    /// Per-token digests and reductions, row then position; empty when `axis` is `None`. In a
    /// padded batch, padding positions are left out (see [`Rows`]).
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
    /// A pass over prompt tokens (the whole prompt, or one chunk of it with `--prefill-chunk`).
    Prefill,
    /// A pass over one generated token per batch row.
    Decode,
}

/// The start of one forward pass over positions `index_pos .. index_pos + seq_len`.
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Forward {
    /// Forward-pass index (0-based): the `step` of the op records that follow.
    pub step: u32,
    /// Prefill or decode step.
    pub phase: Phase,
    /// Absolute position of the pass's first token (the KV-cache length before the pass).
    pub index_pos: u32,
    /// Token positions per batch row in this pass.
    pub seq_len: u32,
    /// Batch rows.
    pub batch: u32,
    /// The token ids fed to this pass, row-major `[batch, seq_len]`.
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_TOKEN_IDS }>")]
    pub ids: Vec<u32>,
}

/// One batch row's choice at a decode step.
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    /// Batch row.
    pub row: u32,
    /// Chosen token id.
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
    /// Forward pass whose logits were sampled.
    pub step: u32,
    /// Generated-token number, from 0.
    pub index: u32,
    /// Absolute position this token will occupy in the sequence.
    pub pos: u32,
    /// One choice per batch row still generating, in row order (a row that generated its
    /// end-of-sequence token has none at later steps).
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_ROWS }>")]
    pub rows: Vec<Choice>,
}

/// One streamed item.
#[allow(clippy::large_enum_variant)] // op records dominate the stream; boxing them buys nothing
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Item {
    /// Names a (module path, op) site the first time an op record uses it.
    Site {
        /// Index in the site table: 0, 1, 2, … in order of first use; [`OpRecord::site`] refers to
        /// it.
        id: u32,
        /// Module path (e.g. `layers.0.self_attn.q_proj`).
        #[serde(deserialize_with = "crate::limits::string")]
        path: String,
        /// Op name (`rms_norm`, `qmatmul`, …; see "Op names" in `docs/trace-format.md`).
        #[serde(deserialize_with = "crate::limits::string")]
        op: String,
    },
    /// The start of a forward pass; the op records after it belong to that pass.
    Forward(Forward),
    /// One recorded op output.
    Op(OpRecord),
    /// One decode step's chosen token, per batch row.
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
    /// The size of the weight a linear op multiplies by, once per site, for runs that dump the
    /// op's values (format 2.6): what `bisect --tolerance` needs to bound how far the op can
    /// carry an error of its input (`docs/tolerance.md`, "Linear layers").
    WeightNorm(WeightNorm),
}

/// The size of a linear op's weight `W` (`[rows, cols]`, `y = x · Wᵀ`), as the op multiplies it
/// (a quantized weight dequantized to f32). Used by the Cauchy–Schwarz bound `|W_i · d| ≤ ‖W_i‖₂
/// ‖d‖₂` on how far an error `d` of the input moves output `i`.
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WeightNorm {
    /// The site (as [`OpRecord::site`]) of the op that multiplies by the weight.
    pub site: u32,
    /// Rows of `W` (the op's output features).
    pub rows: u32,
    /// Columns of `W` (the contraction, the input features).
    pub cols: u32,
    /// `max_i sqrt(Σ_j W_ij²)`, the largest row's L2 norm, accumulated in f64.
    pub max_row_l2: f64,
}

/// The other side of a repro trace: its settings and environment, and its record of the op.
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Counterpart {
    /// The other run's header.
    pub header: Header,
    /// The other run's record of the op (renumbered `seq` 0, `site` 0, inputs cleared).
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
    /// A dense tensor; the dump's `seq` is the operand id.
    Tensor(Dump),
    /// A quantized GGUF weight, as candle holds it.
    Quantized {
        /// Operand id ([`OpRecord::operands`] refers to it).
        id: u64,
        /// candle's `GgmlDType` debug name (e.g. `"Q4_1"`, `"Q4K"`).
        #[serde(deserialize_with = "crate::limits::string")]
        ggml_dtype: String,
        /// The weight's dims, outermost first.
        #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_RANK }>")]
        shape: Vec<u32>,
        /// The raw block bytes.
        data: Vec<u8>,
    },
    /// A GGUF weight candle keeps dense (`QMatMul::Tensor`); the dump's `seq` is the operand id.
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
    /// Record id whose output this is, or the operand id when the dump is an [`OperandValue`].
    pub seq: u64,
    /// Candle dtype name, as [`OpRecord::dtype`].
    pub dtype: String,
    /// Dims of the dumped tensor, outermost first: the record's own shape for its output; an
    /// operand may have the shape the consuming op saw (a reshaped view, same values).
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
    /// Size of the weights file in bytes (a folder: its safetensors files together; 0 for the
    /// builtin model).
    pub size: u64,
    /// Hex sha256 of the file (of the seeded weights' description for the builtin model).
    pub sha256: String,
    /// Architecture name (e.g. `"llama"`, `"bert"`).
    pub architecture: String,
    /// Number of transformer layers.
    pub n_layers: u32,
    /// Vocabulary size, in tokens.
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
    /// The model file and its hyper-parameters.
    pub model: ModelInfo,
    /// "q" (weights as quantized in the file), "f32", "f16" or "bf16".
    pub dtype: String,
    /// The prompt as given, before any chat template (with several prompts: the first).
    #[serde(deserialize_with = "crate::limits::string")]
    pub prompt: String,
    /// True when the model's chat template was applied to the prompt.
    pub chat: bool,
    /// Token ids fed to the model, after the template; with several requests, every row's ids one
    /// row after the other. Empty in a redacted trace.
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_TOKEN_IDS }>")]
    pub prompt_tokens: Vec<u32>,
    /// Most tokens to generate per row.
    pub max_tokens: u32,
    /// Sampling temperature; `None` (or below 1e-7): greedy decoding.
    pub temperature: Option<f64>,
    /// Top-k cut-off of sampling, if any.
    pub top_k: Option<u32>,
    /// Top-p (nucleus) cut-off of sampling, if any.
    pub top_p: Option<f64>,
    /// Sampling seed.
    pub seed: u64,
    /// 0 = whole prompt in one forward pass.
    pub prefill_chunk: u32,
    /// Batch rows: the prompt replicated `--batch` times, or one row per request.
    pub batch: u32,
    /// Worker threads of candle's CPU kernels.
    pub threads: u32,
    /// How the run was altered, comma-separated: each `--perturb` spec, then for a patched
    /// re-run (`bisect --causal-out`) `patch:PATH@POSITION` per patched slice. Read through
    /// [`RunInfo::alterations`], written through `crate::fields::Alteration::field`.
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
    /// candle-trace version that wrote the trace.
    pub crate_version: String,
    /// candle version linked (e.g. `"0.11.1"`).
    pub candle_version: String,
    /// `rustc --version` at build time, or `"unknown"`.
    pub rustc: String,
    /// OS name, distribution and kernel release.
    pub os: String,
    /// CPU architecture (e.g. `"x86_64"`, `"aarch64"`).
    pub arch: String,
    /// CPU model name, or `"unknown"`, then CPU 0's data caches where Linux says (`AMD EPYC (L1d
    /// 32K 8-way, L2 1024K 8-way, L3 32768K 16-way)`): candle's CPU matmuls block by them.
    pub cpu: String,
    /// SIMD features detected at run time, in a fixed probe order.
    #[serde(deserialize_with = "crate::limits::strings::<_, { crate::limits::MAX_CONFIG_ENTRIES }>")]
    pub simd: Vec<String>,
    /// CPU kernel threads in effect.
    pub threads: u32,
    /// Device the run computed on: `cpu`, `cuda:N` (with the GPU name and driver when known) or
    /// `metal:N`.
    pub device: String,
    /// (name, value) of the allowlisted numerics-relevant variables set before the run, sorted by
    /// name (`ENV_ALLOWLIST` in `crates/instrument/src/env.rs`).
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
    /// The run's settings.
    pub run: RunInfo,
    /// The machine and build it ran on.
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
    /// Batch row.
    pub row: u32,
    /// `argmax`, `all`, `top_k`, `top_p` or `top_k_then_top_p`.
    #[serde(deserialize_with = "crate::limits::string")]
    pub mode: String,
    /// Temperature the probabilities were computed at; `None` for argmax.
    pub temperature: Option<f64>,
    /// Top-k cut-off applied, if any.
    pub top_k: Option<u32>,
    /// Top-p cut-off applied, if any.
    pub top_p: Option<f64>,
    /// Vocabulary size, and the candidate set's size after top-k and after top-p.
    pub vocab: u32,
    /// Candidate set size after top-k (the vocabulary size without top-k).
    pub after_top_k: u32,
    /// Candidate set size after top-p.
    pub after_top_p: u32,
    /// The smallest probability (and its token's logit) inside the set at the top-k and at the
    /// top-p cut-off.
    pub k_cutoff: Option<(f32, f32)>,
    /// As `k_cutoff`, at the top-p cut-off.
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
    /// The token id chosen.
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

/// Run settings added after format 2.6, each a (key, JSON value text) pair sorted by key (format
/// 2.7: an optional frame of kind [`crate::format::KIND_SETTINGS`] after the header, build and
/// level frames; absent when every such setting has its default). Keys so far: `repeat_penalty`
/// (candle's `apply_repeat_penalty` factor, f32) and `repeat_last_n` (tokens it looks back over).
/// Compared as `run.KEY` beside the header's own keys.
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Settings(#[serde(deserialize_with = "crate::limits::pairs::<_, { crate::limits::MAX_CONFIG_ENTRIES }>")] pub Vec<(String, String)>);

impl Settings {
    /// The JSON value text stored for `key`, if any.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// How the repeat penalty changed one decode step's logits for one row (format 2.7: optional
/// frames of kind [`crate::format::KIND_PENALTY`], written before that step's `Token` item, only
/// by runs with a repeat penalty). The step's `Choice` and `SamplingStep` describe the penalised
/// logits, which are what the sampler saw.
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PenaltyStep {
    /// Generated-token index (as [`TokenEvent::index`]).
    pub index: u32,
    /// Batch row.
    pub row: u32,
    /// Distinct tokens in the look-back window (each had its logit divided by the penalty when
    /// positive, multiplied when negative).
    pub penalised: u32,
    /// The five highest logits after the penalty, highest first (ties to the lowest id):
    /// (token, logit before, logit after); the two logits are equal for a token outside the
    /// window.
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_TOP }>")]
    pub top: Vec<(u32, f32, f32)>,
}

/// What a trace holds besides its header, items and footer, added in format 2.7: the run
/// settings frame and the repeat penalty's per-step records. Empty in older traces.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Extras {
    /// The settings frame's pairs (empty without one).
    pub settings: Settings,
    /// Every penalty frame's steps, in file order.
    pub penalty: Vec<PenaltyStep>,
}

/// The last frame of a complete trace.
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Footer {
    /// Items written before the footer (set by the writer).
    pub items: u64,
    /// Op records in the file ([`Item::Op`] items).
    pub op_records: u64,
    /// Forward passes run.
    pub forward_passes: u32,
    /// Tokens generated per row (row 0's count); 0 for encoder runs.
    pub tokens_generated: u32,
    /// Generated text of each batch row.
    #[serde(deserialize_with = "crate::limits::strings::<_, { crate::limits::MAX_ROWS }>")]
    pub texts: Vec<String>,
    /// Why the run stopped: "max_tokens", "eos", "nonfinite (op record N)" (`--stop-on-nonfinite`),
    /// "done" (encoder runs) or "extract" (a repro trace): [`crate::fields::StopReason`]'s words.
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
    /// Number of elements, finite or not.
    pub count: u64,
    /// Sum of the finite values.
    pub sum: f64,
    /// Smallest finite value (0 when none).
    pub min: f64,
    /// Largest finite value (0 when none).
    pub max: f64,
    /// Largest |v| over the finite values (0 when none).
    pub abs_max: f64,
    /// L2 norm of the finite values: sqrt of their sum of squares.
    pub l2: f64,
    /// Number of NaN values.
    pub nan: u64,
    /// Number of +Inf values.
    pub pos_inf: u64,
    /// Number of -Inf values.
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
    /// Number of NaN and ±Inf values (saturating: counts read from a file may be anything, and
    /// the result is 0 only when all three are).
    pub fn nonfinite(&self) -> u64 {
        self.nan.saturating_add(self.pos_inf).saturating_add(self.neg_inf)
    }
}

/// Digest and reductions of one (batch row, absolute token position) slice of a tensor.
///
/// `samples` are the values at offsets `0, L/3, 2L/3, L-1` of the slice's `L` logical values,
/// as f32 (exact for f32, f16 and bf16 tensors).
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenStat {
    /// Batch row.
    pub row: u32,
    /// Token position: absolute, or in a padded batch counted from the row's first real token
    /// (see [`Rows`]).
    pub pos: u32,
    /// xxh3-64 of the slice's little-endian element bytes, in slice order.
    pub digest: u64,
    /// Sequential f64 sum of the slice's finite values.
    pub sum: f64,
    /// Largest |v| over the slice's finite values (0 when none).
    pub abs_max: f64,
    /// Number of NaN and ±Inf values in the slice.
    pub nonfinite: u32,
    /// Values at slice offsets `0, L/3, 2L/3, L-1` (all 0 when `L` is 0).
    pub samples: [f32; 4],
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
    RmsNorm {
        /// Added to the mean square before the square root.
        eps: f64,
    },
    /// `[x, weight, bias]`: `candle_nn::LayerNorm`.
    LayerNorm {
        /// Added to the variance before the square root.
        eps: f64,
    },
    /// `[x, weight]` with a quantized (or GGUF dense) weight: `QMatMul::forward`, `x @ Wᵀ`.
    QMatMul,
    /// `[x, weight]` or `[x, weight, bias]`: `candle_nn::Linear`, `x @ Wᵀ + b`.
    Linear,
    /// `[a, b]`: `a @ bᵀ` when `rhs_t`, else `a @ contiguous(b)`.
    Matmul {
        /// Multiply by the transpose of `b`.
        rhs_t: bool,
    },
    /// `[x]`: `x / divisor` (candle computes `x * (1/divisor)`).
    Scale {
        /// The divisor (`sqrt(head_dim)` for attention scores).
        divisor: f64,
    },
    /// `[x, mask u8, fill scalar]`: where `mask` (broadcast) is set, `fill`.
    WhereCond,
    /// `[x, mask]`: `x + mask`, broadcast.
    BroadcastAdd,
    /// `[x]`: softmax over the last dim; `fused`: `softmax_last_dim`, else `softmax(x, -1)`.
    Softmax {
        /// candle_nn's fused `softmax_last_dim` kernel.
        fused: bool,
    },
    /// `[x, cos, sin]`: rotary embedding of contiguous `x`; `interleaved`: `rope_i`, else `rope`.
    Rope {
        /// Interleaved pairs (`rope_i`); else halves (`rope`).
        interleaved: bool,
    },
    /// `[prev, new]` or `[new]`: concatenation along `dim` (KV-cache append).
    Cat {
        /// The dim concatenated along (the KV cache's sequence dim).
        dim: u32,
    },
    /// `[x]`
    Silu,
    /// `[x]`: `gelu_erf` when `erf`, else the tanh approximation.
    Gelu {
        /// The exact, erf-based GELU; else the tanh approximation.
        erf: bool,
    },
    /// `[a, b]`
    Mul,
    /// `[a, b]`
    Add,
    /// `[x]`: conversion to `dtype` (`"f32"`, `"f16"`, `"bf16"`).
    ToDtype {
        /// Target dtype, by candle's name for it (a float dtype).
        dtype: String,
    },
    /// `[hidden f32, mask]`: `sum(hidden * mask, 1) / sum(mask, 1)`.
    MeanPool,
    /// `[x f32]`: `x / max(‖x‖₂, 1e-12)` over the last dim.
    Normalize,
    /// `[x]`: `x * mul + add` (candle's `affine`; `x * c` is `affine(c, 0)`).  Format 2.1 (Gemma 3
    /// scales its embeddings by `sqrt(hidden)`).
    Affine {
        /// The factor.
        mul: f64,
        /// The offset.
        add: f64,
    },
    /// `[q, k, v]`, f32 at batch 1, `q` `(1, S, H, D)` and `k`, `v` `(1, KV, H_kv, D)` (the whole
    /// KV cache, `H` a multiple of `H_kv`): candle_nn's CPU flash attention as candle-transformers'
    /// `quantized_qwen3` runs it, softmax(q kᵀ · `scale`) v with query `i` seeing keys
    /// `0 ..= KV − S + i`. For S > 1, `attention::flash_attn::<f32>` with
    /// `AttnMask::causal_with_offset(KV − S)`; for S = 1, `causal_decode_f32_interleaved` over
    /// K and V interleaved per head (`(KV, H_kv, 2D)`). Output `(1, H, S, D)`. Format 2.2.
    FlashAttn {
        /// The factor on the scores (`1 / sqrt(head_dim)`, in f32).
        scale: f32,
    },
    /// `[x]` in f16 or bf16: softmax over the last dim computed in f32 and rounded to `x`'s dtype
    /// once (`softmax_last_dim(x.to_dtype(f32)).to_dtype(x.dtype)`), as transformers'
    /// attention does (`softmax(w, dtype=torch.float32).to(dtype)`). candle's own half-precision
    /// softmax sums the exponentials in the half dtype, where small terms added to a running sum
    /// near 1 are rounded away. Format 2.6.
    SoftmaxWide,
}

#[cfg(test)]
mod tests {
    use super::{InputRef, Reads};

    /// A skipped input stands for its ancestors, each read the wider way; an input reached twice
    /// (directly and through the skipped op) is listed once, read the wider way.
    #[test]
    fn inputs_through_a_skipped_op_merge_the_wider_way() {
        let r = |seq, reads| InputRef { seq, reads };
        let skipped = [r(1, Reads::Same), r(2, Reads::All)];
        let through = |seq: u64| (seq == 9).then_some(&skipped[..]);
        let got = InputRef::through_skipped([r(1, Reads::Same), r(9, Reads::Prefix)], through);
        assert_eq!(got, vec![r(1, Reads::Prefix), r(2, Reads::All)]);
        assert_eq!(InputRef::through_skipped([r(3, Reads::Same)], through), vec![r(3, Reads::Same)]);
    }
}
