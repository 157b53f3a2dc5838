//! The bisect report: every type a renderer (text, markdown, JSON, HTML) reads.

use super::*;
pub use crate::untrusted::Untrusted;

/// Rows of [`Report::drift`] at most.
pub const MAX_DRIFT_ROWS: usize = 16;

/// One position of the drift table.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PositionDrift {
    /// Token position (the row's own in a padded batch).
    pub position: u32,
    /// Lower bound of max |a - b| over the op's slice there (0 where identical; NaN when a NaN or
    /// ±Inf appears on one side only).
    pub max_abs_diff: f64,
    /// The op's inputs matched there: the difference entered at this op (a root cause).
    pub inputs_matched: bool,
}

/// One position of a continuation (b's prompt continues a's output, or the reverse;
/// [`Report::positions`]): how each run computed it and what it predicted from it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PositionCompare {
    /// Token position (row 0).
    pub position: u32,
    /// How run a computed it: `decode step 12 (M=1)`, `prefill step 0 (M=41)`.
    pub a_pass: Untrusted,
    /// How run b computed it.
    pub b_pass: Untrusted,
    /// The deepest layer both runs recorded at this position (`lm_head`: the logits; else the
    /// last layer before the prefill kept only its last position).
    pub layer: Untrusted,
    /// Lower bound of max |a - b| of that layer's ops there (0 identical, NaN a NaN or ±Inf on
    /// one side; `None`: nothing compared there).
    pub max_abs_diff: Option<f64>,
    /// The token run a predicted from this position (generated at `position + 1`); `None`
    /// where a was fed its prompt's next token instead.
    pub a_next: Option<u32>,
    /// The token run b predicted from this position.
    pub b_next: Option<u32>,
}

/// Values of one side at a divergent (op, row, position).
#[derive(Clone, Debug, Serialize)]
pub struct EntryView {
    /// Record id (`seq`) of the op record in this side's trace.
    pub seq: u64,
    /// Forward-pass index of that record.
    pub step: u32,
    /// How the forward pass that ran it was shaped: step, phase, positions, batch and the
    /// step's token count (`step 0 (prefill, positions 0..11, batch 1, 11 tokens)`; the op's own
    /// rows may be fewer, see its shape).
    pub execution: Untrusted,
    /// The op output's dtype.
    pub dtype: Untrusted,
    /// The op output's dims, outermost first.
    pub shape: Vec<u32>,
    /// f64 sum of the slice's finite values ([`TokenStat::sum`]).
    pub sum: f64,
    /// Largest |v| over the slice's finite values.
    pub abs_max: f64,
    /// NaN and ±Inf values in the slice.
    pub nonfinite: u32,
    /// The slice's values at offsets `0, L/3, 2L/3, L-1` ([`TokenStat::samples`]).
    pub samples: [f32; 4],
}

/// Elementwise comparison of one (op, row, position) slice, from `--dump` values on both sides.
#[derive(Clone, Debug, Serialize)]
pub struct Elementwise {
    /// Elements in the slice.
    pub count: u64,
    /// Elements that differ (same dtype: by at least 1 ULP, so -0 equals +0; else by bits).
    pub differing: u64,
    /// Exact max |a - b| over the slice (NaN when a NaN differs).
    pub max_abs_diff: f64,
    /// max over elements of |a - b| / max(|a|, |b|).
    pub max_rel_diff: f64,
    /// Largest distance in units in the last place (same dtype on both sides only).
    pub max_ulp: Option<u64>,
    /// Elements per ULP distance bucket: "0", "1", "2-3", "4-7", … (same dtype only).
    pub ulp_histogram: Vec<(String, u64)>,
    /// Index of the element with the largest |a - b| within the slice, and its two values.
    pub worst_index: usize,
    /// Run a's value at `worst_index`.
    pub a_worst: f64,
    /// Run b's value at `worst_index`.
    pub b_worst: f64,
}

/// The root cause (or the first difference) at one op and position.
#[derive(Clone, Debug, Serialize)]
pub struct OpDivergence {
    /// Record id in trace A.
    pub seq: u64,
    /// Forward pass index in trace A.
    pub step: u32,
    /// Layer index from the module path (`layers.{i}`, `encoder.layer.{i}`); `None` outside layers.
    pub layer: Option<u32>,
    /// Module path of the op.
    pub path: Untrusted,
    /// Op name (`matmul`, `softmax`, …).
    pub op: Untrusted,
    /// Run b's op name at that module path when it is another op (`--numerics upstream` runs
    /// `silu` where the default runs `gelu`); `None` when both ran `op`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub b_op: Option<Untrusted>,
    /// Token position of the slice (the row's own position in a padded batch).
    pub position: u32,
    /// Batch row in run a (`b_row`: run b's row holding the same request).
    pub row: u32,
    /// Run b's batch row holding the same request.
    pub b_row: u32,
    /// True when the op's inputs matched bit for bit at the positions it reads (always, for a
    /// root).
    pub inputs_matched: bool,
    /// Lower bound of max |a - b| over the slice, from its samples, abs-max and sum.
    pub max_abs_diff: f64,
    /// `max_abs_diff / max(abs_max_a, abs_max_b)`.
    pub max_rel_diff: f64,
    /// True when the slices differ but their recorded samples, abs-max and sum all match: the
    /// difference is below what the statistics resolve (`max_abs_diff` is then 0, not a bound
    /// worth printing); `--dump` gives exact values.
    pub below_resolution: bool,
    /// The kind of cause, from the two runs' execution contexts and settings.
    pub class: CauseClass,
    /// NaN and ±Inf values in the slice, in a and in b (the bound is NaN when they differ).
    pub nonfinite: (u32, u32),
    /// Run a's record and slice.
    pub a: EntryView,
    /// Run b's record and slice.
    pub b: EntryView,
    /// Elementwise metrics when both traces dumped this op's output (`--dump`).
    pub elementwise: Option<Elementwise>,
}

impl OpDivergence {
    /// The op as a report names it: `op`, or `a gelu, b silu` when run b ran another op there.
    pub fn op_label(&self) -> Untrusted {
        match &self.b_op {
            Some(b) => format!("a {}, b {}", self.op.unescaped(), b.unescaped()).into(),
            None => self.op.clone(),
        }
    }
}

/// How many absorbed root causes a report lists.
pub const MAX_ABSORBED_LISTED: usize = 8;

/// A root cause whose difference did not reach its layer's output.
#[derive(Clone, Debug, Serialize)]
pub struct Absorbed {
    /// Record id in trace A (`b_seq`: in trace B).
    pub seq: u64,
    /// Record id in trace B.
    pub b_seq: u64,
    /// Module path of the op.
    pub path: Untrusted,
    /// Op name.
    pub op: Untrusted,
    /// Token position of the slice.
    pub position: u32,
    /// Lower bound of max |a - b| over the slice (see [`OpDivergence::max_abs_diff`]).
    pub max_abs_diff: f64,
    /// The slices differ below what the statistics resolve (see
    /// [`OpDivergence::below_resolution`]).
    pub below_resolution: bool,
    /// The kind of cause.
    pub class: CauseClass,
}

impl From<&OpDivergence> for Absorbed {
    fn from(d: &OpDivergence) -> Self {
        Absorbed { seq: d.seq, b_seq: d.b.seq, path: d.path.clone(), op: d.op.clone(), position: d.position, max_abs_diff: d.max_abs_diff, below_resolution: d.below_resolution, class: d.class }
    }
}

/// The kind of cause of a root (an op whose output differs while its inputs matched), decided
/// from the two runs' execution contexts (the forward pass that ran the op) and headers, most
/// specific first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CauseClass {
    /// The token ids or texts entering the model differ: not a numerics problem.
    InputsDiffer,
    /// The runs computed in different dtypes (`--dtype`, or the op's output dtype).
    DtypeDiffers,
    /// The op ran on operands of other shapes (prefill chunk, batch, padding): the kernel's
    /// result depends on M, the rows it processes at once.
    ShapesDiffer,
    /// Same shapes, different CPU thread counts.
    ThreadsDiffer,
    /// Same shapes, a different model: file (sha256, size, weights) or a config key
    /// (`run.model.config.rope_theta`).
    ModelDiffers,
    /// Same shapes and model, a different run setting (`--numerics`, the sampler).
    SettingDiffers,
    /// Same shapes, model and settings, a different build: target CPU features, crate versions
    /// (candle, gemm, …), rustc.
    BuildDiffers,
    /// Same shapes, model, settings and build, a different machine: CPU, OS, device, numerics
    /// environment variables.
    EnvironmentDiffers,
    /// One run injected this difference: `--perturb` flipped a bit of the op's output.
    Perturbed,
    /// Same shapes, settings and environment: the op is not deterministic run to run.
    RunToRun,
    /// The logits matched but the sampler chose differently (seed, sampler settings).
    SamplingDiffers,
}

impl CauseClass {
    /// One line: what the class means.
    pub fn describe(self) -> &'static str {
        match self {
            CauseClass::InputsDiffer => "the inputs differ",
            CauseClass::DtypeDiffers => "the dtypes differ",
            CauseClass::ShapesDiffer => "operand shapes differ (prefill chunk, batch, padding, or decode step vs prefill): the kernel depends on M",
            CauseClass::ThreadsDiffer => "the thread counts differ",
            CauseClass::ModelDiffers => "same shapes, a different model file or config",
            CauseClass::SettingDiffers => "same shapes and model, a different run setting",
            CauseClass::BuildDiffers => "same shapes and settings, a different build (target features, crate versions, toolchain)",
            CauseClass::EnvironmentDiffers => "same shapes, settings and build, a different machine environment (CPU, OS, device, variables)",
            CauseClass::Perturbed => "a fault injected by --perturb: one bit of this output was flipped",
            CauseClass::RunToRun => "same shapes, settings and environment: run-to-run non-determinism",
            CauseClass::SamplingDiffers => "matching logits, different sampling",
        }
    }

    /// One line: what removes the difference.
    pub fn remedy(self) -> &'static str {
        match self {
            CauseClass::InputsDiffer => "compare runs of the same prompt; this is not a numerics problem",
            CauseClass::DtypeDiffers => "compare runs of one dtype (--dtype): quantized, dequantized and half-precision weights round differently by design",
            CauseClass::ShapesDiffer => {
                "fix the prefill chunk and batch size (and padding) between runs and compute each position the same way (decode step or prefill), or record with --numerics invariant (batch-invariant kernels, on the CPU)"
            }
            CauseClass::ThreadsDiffer => "pin the thread count (--threads, RAYON_NUM_THREADS)",
            CauseClass::ModelDiffers => "use the same model file and config in both runs",
            CauseClass::SettingDiffers => "give both runs the same settings",
            CauseClass::BuildDiffers => "build both with the same toolchain, crate versions (Cargo.lock) and target features",
            CauseClass::EnvironmentDiffers => "run both on the same CPU, OS and device, with the same numerics variables",
            CauseClass::Perturbed => "none needed: the tool's own test fault (record without --perturb)",
            CauseClass::RunToRun => "confirm with `trace replay` (it runs the op twice); use deterministic kernels",
            CauseClass::SamplingDiffers => "use the same seed and sampler settings, or greedy decoding",
        }
    }
}

/// Roots of one (op kind, class): e.g. 117 entries of `self_attn.scores (matmul)`, shapes differ.
#[derive(Clone, Debug, Serialize)]
pub struct RootGroup {
    /// The op without its layer: `self_attn.scores (matmul)`.
    pub kind: Untrusted,
    /// The kind of cause shared by the group.
    pub class: CauseClass,
    /// Number of roots in the group.
    pub count: usize,
    /// The first root of the group: `layers.0.self_attn.scores @ 0`.
    pub first: Untrusted,
    /// What the class means ([`CauseClass::describe`]).
    pub description: String,
    /// What removes the difference: [`CauseClass::remedy`] and the differing keys of the
    /// group's class with their values ([`remedy`](super::remedy)).
    pub remedy: Untrusted,
}

/// The first generated token that differs.
#[derive(Clone, Debug, Serialize)]
pub struct TokenDivergence {
    /// Generated-token index (0-based): the decode step.
    pub step: u32,
    /// Batch row in run a.
    pub row: u32,
    /// Absolute position the token occupies in trace A.
    pub pos: u32,
    /// Absolute position the token occupies in trace B (differs when the prompts differ).
    pub b_pos: u32,
    /// Token id run a chose (`None`: a's token ids were redacted).
    pub a_token: Option<u32>,
    /// Token id run b chose (`None`: b's token ids were redacted).
    pub b_token: Option<u32>,
    /// Run a's token as text (empty when its id was redacted).
    pub a_text: Untrusted,
    /// Run b's token as text (empty when its id was redacted).
    pub b_text: Untrusted,
    /// Top-1 minus top-2 logit in run a ([`candle_trace_format::record::Choice::margin`]).
    pub a_margin: f32,
    /// Top-1 minus top-2 logit in run b.
    pub b_margin: f32,
    /// The two highest logits of run a were exactly equal.
    pub a_tie: bool,
    /// The two highest logits of run b were exactly equal.
    pub b_tie: bool,
    /// Text both runs generated before this token (row 0).
    pub common_text: Untrusted,
    /// A trace's token ids were redacted: the flip was found where the digests of the input ids
    /// that fed the tokens back first differ; the redacted side's token id is `None` and its
    /// text empty (the other side's, when it holds its ids, are given).
    pub ids_redacted: bool,
}

/// How the generated tokens were compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "by")]
pub enum TokenComparison {
    /// By their ids, from the decode-step records.
    Ids {
        /// Generated tokens compared: those both runs made (the first that differs, if any, is
        /// [`Report::first_token_divergence`]).
        compared: u32,
    },
    /// A trace is redacted (no token ids): through the digests of the `input_ids` records of the
    /// steps that fed each token back. The last token of a run is never fed back, so it is not
    /// compared.
    InputDigests {
        /// Generated tokens compared: those both runs made and fed back.
        compared: u32,
    },
}

impl TokenComparison {
    /// Generated tokens compared.
    pub fn compared(self) -> u32 {
        match self {
            TokenComparison::Ids { compared } | TokenComparison::InputDigests { compared } => compared,
        }
    }
}

/// When the token ids entering the model differ.
#[derive(Clone, Debug, Serialize)]
pub struct InputsDiffer {
    /// First token position whose ids differ (0 when the texts of a batch differ).
    pub position: u32,
    /// Batch row (run a).
    pub row: u32,
    /// True when the position is in the prompt (another prompt), false for a generated token
    /// (sampling chose differently from matching logits).
    pub in_prompt: bool,
    /// One sentence for the report.
    pub explanation: String,
}

/// One line of the growth table: a layer's output at the root-cause position.
#[derive(Clone, Debug, Serialize)]
pub struct LayerGrowth {
    /// `layers.{i}` / `encoder.layer.{i}`, or a top-level module (`embed_tokens`, `norm`,
    /// `lm_head`).
    pub layer: Untrusted,
    /// Every op of the layer compared at this position matched bit for bit.
    pub identical: bool,
    /// Ops of this layer whose output differs at this position.
    pub ops_differing: u32,
    /// Ops of this layer compared at this position.
    pub ops_compared: u32,
    /// Lower bound of max |a - b| over the differing ops (from samples and reductions; NaN when a
    /// NaN/±Inf count differs).
    pub max_abs_diff: f64,
    /// Largest `max_abs_diff / max(abs_max_a, abs_max_b)` over the differing ops.
    pub max_rel_diff: f64,
    /// From `--dump` values, when both traces hold this layer's outputs: exact max |a - b| and
    /// max ULP distance over its ops at this position.
    pub exact_max_abs_diff: Option<f64>,
    /// Max ULP distance over its ops at this position, from `--dump` values (same dtype only).
    pub max_ulp: Option<u64>,
}

/// A setting or environment field that differs between the two headers.
#[derive(Clone, Debug, Serialize)]
pub struct EnvDiff {
    /// The field, flattened: `run.seed`, `env.threads`, `run.model.config.KEY`, `build.crate.NAME`,
    /// ….
    pub key: Untrusted,
    /// Run a's value as text (header strings quoted; cut at 80 characters).
    pub a: Untrusted,
    /// Run b's value, as `a`.
    pub b: Untrusted,
}

/// Each side's first non-finite op output (`None`: all finite).
#[derive(Clone, Debug, Serialize)]
pub struct NonFiniteSides {
    /// Run a's first non-finite op output.
    pub a: Option<crate::nonfinite::NonFinite>,
    /// Run b's first non-finite op output.
    pub b: Option<crate::nonfinite::NonFinite>,
}

/// Summary of one input trace.
#[derive(Clone, Debug, Serialize)]
pub struct SideInfo {
    /// The trace's file name, without directories.
    pub path: Untrusted,
    /// The file ended before its footer.
    pub truncated: bool,
    /// Op records in the trace.
    pub op_records: usize,
    /// Decode steps recorded ([`candle_trace_format::record::Item::Token`] items).
    pub tokens: usize,
    /// Row 0's generated text, joined from its decode-step choices.
    pub text: Untrusted,
}

/// An encoder run's pooled embedding of one request, in both runs.
#[derive(Clone, Debug, Serialize)]
pub struct EmbeddingDiff {
    /// Every component has the same bits in both runs.
    pub identical: bool,
    /// Exact max |a - b| over the vector's components.
    pub max_abs_diff: f64,
    /// Cosine similarity of the two vectors, in f64.
    pub cosine: f64,
    /// Vector length.
    pub dims: usize,
}

/// The answer for one request (a batch row present in both runs): did its output change?
#[derive(Clone, Debug, Serialize)]
pub struct RowAnswer {
    /// Batch row in run a.
    pub a_row: u32,
    /// Run b's row holding the same request.
    pub b_row: u32,
    /// The request (its text, or the prompt), at most 80 characters.
    pub input: Untrusted,
    /// Encoder runs: the pooled embedding of this text in both runs.
    pub embedding: Option<EmbeddingDiff>,
    /// Decoder runs: generated tokens compared, and the index of the first that differs.
    pub tokens_compared: u32,
    /// Generated-token index of the first token that differs (`None`: none of those compared).
    pub first_flip: Option<u32>,
    /// Decoder runs: lower bound of max |a - b| of the final logits at each decode step up to
    /// the flip (or all compared).
    pub logits_max_abs_diff: Vec<f64>,
    /// The first op of this row whose output differs while its inputs matched: `path @ position`.
    pub first_root: Option<Untrusted>,
}

/// Why a sampled token flipped, from the two runs' sampling records at that step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SamplingVerdict {
    /// `sampler_settings` (the runs sampled with another temperature, top-k, top-p, or one
    /// greedily), `boundary` (same draw, the candidate set differed at a cut-off),
    /// `different_draw` (same distribution, another random draw), or `distribution_differed`
    /// (the probabilities differ: see the forward-pass root).
    pub class: String,
    /// One sentence for the report.
    pub explanation: String,
    /// Run a's uniform draw ([`candle_trace_format::record::SamplingStep::draw`]).
    pub a_draw: Option<f32>,
    /// Run b's uniform draw.
    pub b_draw: Option<f32>,
    /// The tokens at the boundary (tied or within 1 ULP of a cut-off, in either run).
    pub tokens: Vec<u32>,
}

/// The answer of a bisect; serialised as `identical`, `diverged` or `incomplete`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Every compared op output and generated token is bit-identical, and both runs are whole.
    Identical,
    /// Something differs.
    Diverged,
    /// Identical over the part both traces hold, but a run did not finish or generated less.
    Incomplete,
}

impl Verdict {
    /// The word reports print.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Identical => "identical",
            Verdict::Diverged => "diverged",
            Verdict::Incomplete => "incomplete",
        }
    }
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<&str> for Verdict {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// The bisect report.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Whether the two runs computed the same bits.
    pub verdict: Verdict,
    /// Both runs recorded `--numerics invariant`: a root from a shape difference is a defect of
    /// the mode (see [`crate::bisect::remedy`]). In the JSON only when true.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub both_invariant: bool,
    /// What was compared (`"ops"`, `"layers"` or `"logits"`, as `trace record --level` names
    /// it): the coarser of the two traces' levels. Below `ops`, a root cause is the first
    /// recorded output that differs while the output recorded before it matched: the
    /// difference entered somewhere between the two, not necessarily in the root's own op.
    #[serde(serialize_with = "level_name")]
    pub level: candle_trace_format::site::Level,
    /// Trace a.
    pub a: SideInfo,
    /// Trace b.
    pub b: SideInfo,
    /// Per request (batch row in both runs): whether its output changed, first.
    pub rows: Vec<RowAnswer>,
    /// When one run's prompt continues the other's output (KV-cache decoding vs recomputing the
    /// sequence): each position of the span one run decoded step by step and the other
    /// prefilled, from the last prompt position both share; empty otherwise.
    pub positions: Vec<PositionCompare>,
    /// The first generated token that differs (`None`: none of those compared).
    pub first_token_divergence: Option<TokenDivergence>,
    /// How many generated tokens were compared, and how.
    pub tokens: TokenComparison,
    /// Sampled runs: why the first differing token flipped (from the sampling records).
    pub sampling: Option<SamplingVerdict>,
    /// The root cause: the first op whose output differs while its inputs matched, among those
    /// whose difference reached their layer's output when there are any; `None` when no op output
    /// differs or the inputs differ.
    pub first_divergence: Option<OpDivergence>,
    /// Set when the token ids or texts entering the model differ: no op is blamed then.
    pub inputs_differ: Option<InputsDiffer>,
    /// Per layer, how its op outputs differ at the root cause's (row, position); empty without one.
    pub growth: Vec<LayerGrowth>,
    /// The root cause's op at each position of its row (at most [`MAX_DRIFT_ROWS`], evenly
    /// spaced, the largest kept): how the difference moves along the sequence; empty without a
    /// root or with fewer than 3 positions compared.
    pub drift: Vec<PositionDrift>,
    /// The root cause's difference follows position where it entered (the `drift` rows with
    /// `inputs_matched`): identical at position 0 and entering at later ones, or growing along
    /// them. The signature of a position-dependent fault: a wrong rope layout or base, a wrong
    /// position offset.
    pub drift_grows: bool,
    /// Root causes before `first_divergence` whose difference died out within their layer
    /// (at most [`MAX_ABSORBED_LISTED`] listed).
    pub absorbed: Vec<Absorbed>,
    /// Number of absorbed roots before the root cause (listed or not).
    pub absorbed_count: usize,
    /// The roots reported (the absorbed ones and the root cause), grouped by (op kind, class),
    /// largest group first.
    pub groups: Vec<RootGroup>,
    /// When the two runs differ in where (or whether) a NaN/±Inf first appeared: each side's
    /// first non-finite op output.
    pub nonfinite: Option<NonFiniteSides>,
    /// Settings, environment and build fields that differ between the two traces.
    pub env_diff: Vec<EnvDiff>,
    /// Both runs' model file and environment, differing or not (`key`: `model`, `model sha256`,
    /// `candle`, `os`, `cpu`, `simd`, `device`, …).
    pub environment: Vec<EnvDiff>,
    /// (op, row, position) entries compared (outputs without a token axis counted whole).
    pub compared: u64,
    /// Of the compared entries, those that differ (outputs without a token axis counted whole).
    pub differing: u64,
    /// Remarks for the reader: how rows were paired, truncated traces, the `--dump` that gives
    /// elementwise metrics, ….
    pub notes: Vec<Untrusted>,
    /// When the two runs' op graphs part before any op is blamed: the first differing output
    /// they computed from ops at different module paths (a code path or kernel chosen by batch
    /// size, prompt length, dtype or device), its inputs at shared paths matching. The op blamed
    /// later, if any, is then named in a note, not in `first_divergence`.
    pub graph_fork: Option<GraphFork>,
}

/// Where the two runs' op graphs part: an output computed from different ops.
#[derive(Clone, Debug, Serialize)]
pub struct GraphFork {
    /// Module path of the output (`layers.0.self_attn.o_proj`).
    pub path: Untrusted,
    /// Batch row (run a).
    pub row: u32,
    /// Token position.
    pub position: u32,
    /// Module paths of its inputs in run a, in operand order.
    pub a_inputs: Vec<Untrusted>,
    /// Module paths of its inputs in run b.
    pub b_inputs: Vec<Untrusted>,
}

/// Where a difference entered: an op output that differs at one (row, position) while the op's
/// inputs matched bit for bit there. `trace bisect --causal` patches these.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EntryPoint {
    /// Module path of the op.
    pub path: Untrusted,
    /// Op name.
    pub op: Untrusted,
    /// Layer index from the module path; `None` outside layers.
    pub layer: Option<u32>,
    /// Token position of the slice (the row's own position in a padded batch).
    pub position: u32,
    /// Batch row in run a, and run b's row holding the same request.
    pub row: u32,
    /// Run b's row holding the same request.
    pub b_row: u32,
    /// The kind of cause.
    pub class: CauseClass,
    /// Lower bound of max |a - b| over the slice (see [`OpDivergence::max_abs_diff`]).
    pub max_abs_diff: f64,
    /// The difference reached its layer's output (false: it died out within the layer).
    pub live: bool,
}

/// One layer (or top-level module) of the run: the largest difference between the two traces
/// at any (op, row, position) in it.
#[derive(Clone, Debug, Serialize)]
pub struct LayerPoint {
    /// `layers.3`, `embed_tokens`, `norm`, ... in execution order of trace a.
    pub layer: Untrusted,
    /// Lower bound of max |a - b| over the layer's op outputs (from samples and reductions);
    /// NaN when a NaN/±Inf appears on one side only.
    pub max_abs_diff: f64,
    /// (op, row, position) entries of the layer that differ.
    pub differing: u64,
    /// (op, row, position) entries of the layer compared.
    pub compared: u64,
}

/// One batch row's difference by layer and token position (numeric ops only: `input` ops hold
/// token ids), for the report page's heatmap.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Heat {
    /// Run a's batch row shown (the flip's, else the root's, else 0).
    pub row: u32,
    /// Layers (`layers.3`, `embed_tokens`, `norm`, …) in the order trace a first ran them.
    pub layers: Vec<Untrusted>,
    /// Per layer: (token position, the largest lower bound of max |a - b| over the layer's ops
    /// there) for each compared position; 0 identical, `f64::MIN_POSITIVE` differs below the
    /// statistics' resolution, NaN a NaN or ±Inf on one side.
    pub cells: Vec<Vec<(u32, f64)>>,
}

/// Serializes a [`candle_trace_format::site::Level`] by its command-line name.
fn level_name<S: serde::Serializer>(l: &candle_trace_format::site::Level, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(l.as_str())
}
