//! The `--causal` options and report: what a renderer reads.

use super::*;

/// What `--causal` takes besides the two traces.
#[derive(Clone, Debug)]
pub struct CausalOptions {
    /// The model file or folder both runs used (`None`: the builtin model).
    pub model: Option<PathBuf>,
    /// At most this many re-runs in all (the two reproductions included).
    pub max_runs: usize,
    /// Write run A re-run with the final set patched (to its full length) as a trace here.
    pub out: Option<PathBuf>,
    /// `--device` for the re-runs.
    pub device: crate::device::DeviceSpec,
}

impl Default for CausalOptions {
    fn default() -> Self {
        CausalOptions { model: None, max_runs: DEFAULT_MAX_RUNS, out: None, device: Default::default() }
    }
}

/// The default `--max-runs`.
pub const DEFAULT_MAX_RUNS: usize = 64;

/// An entry point considered for patching: as bisect reports it, and when it was found.
#[derive(Clone, Debug, Serialize)]
pub struct Candidate {
    /// The entry point, as bisect reports it (serialised inline).
    #[serde(flatten)]
    pub entry: EntryPoint,
    /// 0: an entry point of the recorded runs; n: found after n rounds of patching.
    pub round: u32,
}

impl std::ops::Deref for Candidate {
    type Target = EntryPoint;
    fn deref(&self) -> &EntryPoint {
        &self.entry
    }
}

/// One re-run and what came of it.
#[derive(Clone, Debug, Serialize)]
pub struct ReRun {
    /// 1-based, in the order run.
    pub n: usize,
    /// `reproduce_a`, `reproduce_b`, `patch`, `find_more` (a traced patched run, bisected
    /// against b), `capture_b`, `capture_a`, `reverse`, `rank` or `write`.
    pub kind: String,
    /// Candidates patched (indices into [`CausalReport::candidates`]).
    pub patched: Vec<usize>,
    /// What happened, in words.
    pub outcome: String,
    /// Patched runs: whether the run produced the target token at the flip step (for `reverse`:
    /// run a's token), with every token before it unchanged.
    pub flipped: Option<bool>,
    /// The token the run produced at the flip step (row of the flip).
    pub token: Option<u32>,
    /// max |patched - b| of the final logits at the flip step (`reverse`: against a).
    pub logits_max_abs_diff: Option<f64>,
    /// Wall time of this re-run, seconds.
    pub seconds: f64,
}

/// An entry point patched alone (runs without a token flip), by how much it moves the logits.
#[derive(Clone, Debug, Serialize)]
pub struct Ranked {
    /// Index into [`CausalReport::candidates`].
    pub candidate: usize,
    /// max |patched - a| of the final logits, over every step: how far the patch moved run a.
    pub moved: f64,
    /// max |patched - b| of the final logits, over every step: how far run a remains from b.
    pub remaining: f64,
}

/// What `--causal` concluded; serialised in snake case (`found`, `not_found`, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CausalVerdict {
    /// A set of entry points that, patched into a, reproduces the flip.
    Found,
    /// Patching every entry point found did not reproduce the flip (or the budget ran out first).
    NotFound,
    /// The runs diverge without a token flip: see the ranking.
    NoFlip,
    /// The runs are identical: nothing to explain.
    Identical,
}

/// The answer of `--causal`.
#[derive(Clone, Debug, Serialize)]
pub struct CausalReport {
    /// What was concluded.
    pub verdict: CausalVerdict,
    /// Trace a's file name.
    pub a: String,
    /// Trace b's file name.
    pub b: String,
    /// The first generated token that differs (`None`: the tokens do not flip).
    pub flip: Option<TokenDivergence>,
    /// Generated-token index of the logits compared (the flip step, or the last common step).
    pub step: Option<u32>,
    /// Entry points considered: run a's (of the followed row, up to the compared step's logits),
    /// then those found in later rounds.
    pub candidates: Vec<Candidate>,
    /// The set found (indices into `candidates`), in execution order.
    pub set: Vec<usize>,
    /// True when removing any member of `set` was tried and lost the flip.
    pub minimal: bool,
    /// A's values at the set patched into B made B produce A's token (`None`: not run).
    pub reverse: Option<bool>,
    /// The root cause plain bisect names (first by position among those that reach their
    /// layer's output), patched alone: its candidate index, and whether it reproduced the flip.
    pub bisect_root_alone: Option<(usize, bool)>,
    /// Runs without a flip: each entry point patched alone, closest to b's final logits first
    /// (the patch that explains most of the difference), then by how far it moved a's.
    pub ranking: Vec<Ranked>,
    /// Unpatched: the largest max |a - b| of the final logits over the steps through `step`.
    pub logits_max_abs_diff: Option<f64>,
    /// Every re-run, in the order run.
    pub runs: Vec<ReRun>,
    /// Wall time of all re-runs, seconds.
    pub seconds: f64,
    /// Remarks: truncated traces, values read from dumps, a run budget reached, ….
    pub notes: Vec<String>,
}

impl CausalReport {
    /// A report of runs `a` and `b` (file names) before any search: identical until shown not.
    pub(super) fn new(a: String, b: String, flip: Option<TokenDivergence>) -> Self {
        CausalReport {
            verdict: CausalVerdict::Identical,
            a,
            b,
            flip,
            step: None,
            candidates: Vec::new(),
            set: Vec::new(),
            minimal: false,
            reverse: None,
            bisect_root_alone: None,
            ranking: Vec::new(),
            logits_max_abs_diff: None,
            runs: Vec::new(),
            seconds: 0.0,
            notes: Vec::new(),
        }
    }
}
