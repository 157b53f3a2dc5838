//! `trace bisect A B --causal`: which of the differences between two runs changed the answer.
//!
//! Bisect lists the entry points of a divergence: op outputs that differ at one (row, position)
//! while the op's inputs matched ([`crate::bisect::EntryPoint`]). Most die out; some reach the
//! logits; which of them flipped the token is a causal question, answered here by activation
//! patching: run A is re-run with chosen entry points' outputs replaced by run B's values
//! ([`crate::patch`], applied by the tracer on the live op path), and we watch whether A then
//! produces B's token at the first flip.
//!
//! 1. Both runs are re-run here from their headers, traced in memory, and must reproduce their
//!    traces bit for bit (otherwise patching would mix this machine's numbers with theirs); these
//!    runs also capture B's (and A's) values at the entry points.
//! 2. Patching every entry point at or before the flip must reproduce B's token. When it does
//!    not, the patched run is bisected against B: ops whose inputs now match B but whose outputs
//!    still differ are new entry points (the same op computed by A's kernel on B's inputs); they
//!    are captured from B and added, round after round.
//! 3. Delta debugging (Zeller and Hildebrandt, "Simplifying and Isolating Failure-Inducing
//!    Input", IEEE TSE 28(2), 2002: the `ddmin` algorithm) shrinks the set to one where removing
//!    any member loses the flip (1-minimal), in O(k log n) re-runs for k causes among n points.
//! 4. The reverse check patches A's values at the set into B: B then produces A's token when the
//!    set is the cause in both directions.
//!
//! Runs whose tokens never flip get a ranking instead: each entry point patched alone, with how
//! far it moves A's final logits (max |patched - a|) and how far they remain from B's.

use crate::bisect::{bisect, bisect_with_entries, CauseClass, EntryPoint, TokenDivergence};
use crate::error::{Error, Result};
use crate::format::Trace;
use crate::generate::Generation;
use crate::patch::{Patch, SliceKey};
use crate::record::Item;
use crate::recorder::{options_from_header, prepare_decoder, run_decoder, DecoderRun, RecordOptions, PATCH_PREFIX};
use crate::tracer::{MemorySink, Tracer};
use candle_core::Tensor;
use serde::Serialize;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::time::Instant;

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
    /// Runs without a flip: entry points by how far they move the final logits, largest first.
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

/// One run made ready to re-run.
struct RunSide {
    run: DecoderRun,
    opts: RecordOptions,
    /// Own batch row of the request followed, and the padding before it.
    row: u32,
    pad: u32,
}

impl RunSide {
    /// Re-runs generation for `max_tokens` tokens with `patches`, reading out `captures`;
    /// traced into memory when `traced`.
    fn go(&mut self, patches: Vec<Patch>, captures: Vec<SliceKey>, max_tokens: usize, traced: bool) -> Result<(Generation, HashMap<SliceKey, Tensor>, Option<MemorySink>)> {
        if self.opts.threads > 0 {
            // candle reads it at every kernel call (`candle_core::utils::get_num_threads`).
            std::env::set_var("RAYON_NUM_THREADS", self.opts.threads.to_string());
        }
        let sink = traced.then(MemorySink::default);
        let tracer = match &sink {
            Some(s) => Tracer::new(Box::new(s.clone())),
            None => Tracer::untraced(),
        };
        let mut tracer = tracer.with_perturbs(self.opts.perturb.clone()).with_patches(patches).with_captures(captures);
        let mut opts = self.opts.clone();
        opts.gen.max_tokens = max_tokens;
        let g = run_decoder(&mut self.run, &opts, &mut tracer)?;
        if let Some(k) = tracer.patches_left().first() {
            return Err(Error::usage(format!("--causal: patch {k} was never applied (the op never produced that position)")));
        }
        tracer.finish(&crate::recorder::footer(&tracer, &g))?;
        Ok((g, tracer.take_captured(), sink))
    }

    /// The final logits that chose the token at `token_pos`: op `site` at the position before.
    fn logits_key(&self, site: &str, token_pos: u32) -> SliceKey {
        SliceKey { path: site.into(), row: self.row, pos: token_pos.saturating_sub(1 + self.pad) }
    }
}

/// Generated tokens of `trace`'s row `row`, by index.
fn trace_tokens(t: &Trace, row: u32) -> Vec<(u32, u32)> {
    t.items
        .iter()
        .filter_map(|i| match i {
            Item::Token(e) => e.rows.iter().find(|c| c.row == row).map(|c| (c.token, e.pos)),
            _ => None,
        })
        .collect()
}

/// The positions at which runs a and b generated token `step` (`ta`, `tb`: (token, position) per
/// generated token, from [`trace_tokens`]). The step comes from bisect's reading of the files, so
/// a crafted trace can name one past either list: that is refused, not indexed.
fn step_positions(ta: &[(u32, u32)], tb: &[(u32, u32)], step: usize) -> Result<(u32, u32)> {
    match (ta.get(step), tb.get(step)) {
        (Some(x), Some(y)) => Ok((x.1, y.1)),
        _ => Err(Error::Mismatch(format!("--causal: the traces hold {} and {} generated tokens, so token {step} cannot be followed", ta.len(), tb.len()))),
    }
}

fn file_name(t: &Trace) -> String {
    t.path.file_name().map_or_else(|| t.path.display().to_string(), |n| n.to_string_lossy().into_owned())
}

fn max_abs_diff(x: &Tensor, y: &Tensor) -> Result<f64> {
    let x = x.to_dtype(candle_core::DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let y = y.to_dtype(candle_core::DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    if x.len() != y.len() {
        return Ok(f64::NAN);
    }
    Ok(x.iter().zip(&y).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max))
}

/// A 1-D tensor of dumped values (exact: f64 holds every f32, f16 and bf16 value).
fn values_tensor(dtype: &str, v: Vec<f64>) -> Result<Tensor> {
    let d = match dtype.parse::<candle_core::DType>() {
        Ok(d @ (candle_core::DType::F32 | candle_core::DType::F16 | candle_core::DType::BF16)) => d,
        _ => return Err(Error::usage(format!("--causal: cannot patch with {dtype} values"))),
    };
    let n = v.len();
    Ok(Tensor::from_vec(v, n, &candle_core::Device::Cpu)?.to_dtype(d)?)
}

/// The largest [`max_abs_diff`] over the steps of two runs' final logits (NaN when a step is
/// missing).
fn max_step_diff(x: &[Tensor], y: &[Tensor]) -> Result<f64> {
    if x.len() != y.len() {
        return Ok(f64::NAN);
    }
    x.iter().zip(y).try_fold(0f64, |m, (p, q)| Ok(m.max(max_abs_diff(p, q)?)))
}

/// The search state: both runs, the candidates, their captured values, the run log.
struct Search {
    a: RunSide,
    b: RunSide,
    candidates: Vec<Candidate>,
    b_values: HashMap<SliceKey, Tensor>,
    a_values: HashMap<SliceKey, Tensor>,
    runs: Vec<ReRun>,
    max_runs: usize,
    started: Instant,
    /// Tokens to generate in a re-run (through the step compared).
    tokens: usize,
    /// The step compared, the tokens of a and b through it (row followed).
    step: usize,
    a_tokens: Vec<u32>,
    b_tokens: Vec<u32>,
    a_logits: SliceKey,
    b_logits: SliceKey,
    /// The final-logits slices of every step through `step`, and their unpatched values (the
    /// last: at `step` itself).
    a_steps: Vec<SliceKey>,
    b_steps: Vec<SliceKey>,
    a_all: Vec<Tensor>,
    b_all: Vec<Tensor>,
    cache: HashMap<Vec<usize>, bool>,
    /// Run b was re-run here and matched its trace.
    b_checked: bool,
}

impl Search {
    fn budget_left(&self) -> bool {
        self.runs.len() < self.max_runs
    }

    fn key_a(&self, i: usize) -> SliceKey {
        let c = &self.candidates[i];
        SliceKey { path: c.path.clone(), row: self.a.row, pos: c.position }
    }

    fn key_b(&self, i: usize) -> SliceKey {
        let c = &self.candidates[i];
        SliceKey { path: c.path.clone(), row: self.b.row, pos: c.position }
    }

    /// Logs a re-run begun at `t0`; the caller fills in what a patched run adds.
    fn log(&mut self, kind: &str, patched: Vec<usize>, outcome: String, t0: Instant) -> &mut ReRun {
        let n = self.runs.len() + 1;
        self.runs.push(ReRun { n, kind: kind.into(), patched, outcome, flipped: None, token: None, logits_max_abs_diff: None, seconds: t0.elapsed().as_secs_f64() });
        self.runs.last_mut().expect("just pushed")
    }

    /// Patches of b's values at candidates `set` into run a.
    fn patches_into_a(&self, set: &[usize]) -> Vec<Patch> {
        set.iter().filter_map(|&i| self.b_values.get(&self.key_b(i)).map(|v| Patch { at: self.key_a(i), values: v.clone() })).collect()
    }

    /// What a patched run of a produced at the step compared, against b's tokens.
    fn judge(&self, g: &Generation, want: &[u32], other: &[u32], row: u32) -> (bool, Option<u32>, String) {
        let got = g.tokens.get(row as usize).map(Vec::as_slice).unwrap_or(&[]);
        let s = self.step;
        match got.iter().zip(want).position(|(x, y)| x != y) {
            _ if got.len() <= s => (false, None, format!("stopped after {} tokens", got.len())),
            None => (true, Some(got[s]), format!("token {s} flipped to {}", got[s])),
            Some(k) if k < s => (false, Some(got[s]), format!("an earlier token flipped (token {k})")),
            Some(_) if other.get(s) == Some(&got[s]) => (false, Some(got[s]), format!("token {s} unchanged ({})", got[s])),
            Some(_) => (false, Some(got[s]), format!("token {s} became another token ({})", got[s])),
        }
    }

    /// Runs a with b's values at `set`; `None` when the run budget is spent.
    fn test(&mut self, set: &[usize]) -> Result<Option<bool>> {
        let mut key = set.to_vec();
        key.sort_unstable();
        if let Some(&r) = self.cache.get(&key) {
            return Ok(Some(r));
        }
        if !self.budget_left() {
            return Ok(None);
        }
        let t0 = Instant::now();
        let patches = self.patches_into_a(set);
        let (g, cap, _) = self.a.go(patches, vec![self.a_logits.clone()], self.tokens, false)?;
        let (ok, token, outcome) = self.judge(&g, &self.b_tokens, &self.a_tokens, self.a.row);
        let diff = match (cap.get(&self.a_logits), self.b_all.last()) {
            (Some(x), Some(y)) => Some(max_abs_diff(x, y)?),
            _ => None,
        };
        let r = self.log("patch", key.clone(), outcome, t0);
        (r.flipped, r.token, r.logits_max_abs_diff) = (Some(ok), token, diff);
        self.cache.insert(key, ok);
        Ok(Some(ok))
    }

    /// Re-runs run `which` (`a` or `b`) traced in memory and checks it against its trace bit for
    /// bit, reading out its values at every candidate and its final logits at every step.
    fn reproduce(&mut self, which: char, trace: &Trace) -> Result<()> {
        let t0 = Instant::now();
        let all: Vec<usize> = (0..self.candidates.len()).collect();
        let (mut keys, steps) =
            if which == 'a' { (all.iter().map(|&i| self.key_a(i)).collect::<Vec<_>>(), self.a_steps.clone()) } else { (all.iter().map(|&i| self.key_b(i)).collect(), self.b_steps.clone()) };
        keys.extend(steps.iter().cloned());
        let tokens = self.tokens;
        let side = if which == 'a' { &mut self.a } else { &mut self.b };
        let (_, mut cap, sink) = side.go(Vec::new(), keys, tokens, true)?;
        let rerun = sink.expect("traced").trace(&format!("{which} (re-run here)"), &side.run.header);
        let r = bisect(&rerun, trace)?;
        if r.differing > 0 || r.first_token_divergence.is_some() {
            let at = r.first_divergence.as_ref().map_or_else(|| "its tokens".to_string(), |d| format!("{} at position {}", d.path, d.position));
            return Err(Error::Mismatch(format!(
                "--causal: run {which} ({}) does not reproduce on this machine (first difference: {at}); patching needs both runs to re-run bit for bit here{}",
                file_name(trace),
                if r.env_diff.iter().any(|e| e.key.starts_with("env.")) { " (the environment differs: see bisect's settings and environment)" } else { "" }
            )));
        }
        let every: Vec<Tensor> = steps.iter().filter_map(|k| cap.remove(k)).collect();
        if every.len() != steps.len() {
            return Err(Error::Mismatch(format!("--causal: run {which} did not produce the final logits of every step")));
        }
        if which == 'a' {
            (self.a_all, self.a_values) = (every, cap);
        } else {
            self.b_all = every;
            // Values already read from b's dumps stay (they are b's recorded bits).
            for (k, v) in cap {
                self.b_values.entry(k).or_insert(v);
            }
            self.b_checked = true;
        }
        self.log(&format!("reproduce_{which}"), Vec::new(), format!("{} re-run here: identical to the trace", file_name(trace)), t0);
        Ok(())
    }

    /// Captures b's values at candidates `idx` (one re-run of b).
    fn capture_b(&mut self, idx: &[usize]) -> Result<()> {
        let keys: Vec<SliceKey> = idx.iter().map(|&i| self.key_b(i)).collect();
        let t0 = Instant::now();
        let (_, cap, _) = self.b.go(Vec::new(), keys.clone(), self.tokens, false)?;
        let missing = keys.iter().filter(|k| !cap.contains_key(k)).count();
        self.b_values.extend(cap);
        self.log("capture_b", Vec::new(), format!("read b's values at {} new entry points ({missing} not produced)", keys.len()), t0);
        Ok(())
    }
}

/// Delta debugging (`ddmin`): a 1-minimal subset of `c` for which `test` holds, given that it
/// holds for `c`. Returns the set and whether minimality was established (false when `test`
/// returned `None`: the run budget ran out).
fn ddmin(mut c: Vec<usize>, test: &mut dyn FnMut(&[usize]) -> Result<Option<bool>>) -> Result<(Vec<usize>, bool)> {
    let mut n = 2usize;
    while c.len() >= 2 {
        let size = c.len().div_ceil(n);
        let chunks: Vec<Vec<usize>> = c.chunks(size).map(<[usize]>::to_vec).collect();
        let mut reduced = false;
        for ch in &chunks {
            match test(ch)? {
                None => return Ok((c, false)),
                Some(true) => {
                    c = ch.clone();
                    n = 2;
                    reduced = true;
                    break;
                }
                Some(false) => {}
            }
        }
        if !reduced && chunks.len() > 2 {
            for ch in &chunks {
                let comp: Vec<usize> = c.iter().copied().filter(|x| !ch.contains(x)).collect();
                match test(&comp)? {
                    None => return Ok((c, false)),
                    Some(true) => {
                        c = comp;
                        n = (n - 1).max(2);
                        reduced = true;
                        break;
                    }
                    Some(false) => {}
                }
            }
        }
        if !reduced {
            if n >= c.len() {
                break;
            }
            n = (2 * n).min(c.len());
        }
    }
    Ok((c, true))
}

/// Refuses what `--causal` cannot do before any work: a bad `--causal-out`, a redacted trace.
fn refuse_early(a: &Trace, b: &Trace, opts: &CausalOptions) -> Result<()> {
    if let Some(o) = &opts.out {
        let parent = o.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
        if o.is_dir() || !parent.is_dir() {
            return Err(Error::usage(format!("--causal-out {}: {}", o.display(), if o.is_dir() { "is a directory" } else { "its folder does not exist" })));
        }
    }
    for t in [a, b] {
        // Redaction clears the forward passes' ids (unless the prompt is kept) and every
        // generated token's id and top-5 (a recorded choice always has a top-5).
        let redacted = t.items.iter().any(|i| match i {
            Item::Forward(f) => f.ids.is_empty() && f.seq_len > 0,
            Item::Token(e) => e.rows.iter().any(|c| c.top.is_empty()),
            _ => false,
        });
        if redacted {
            return Err(Error::trace(&t.path, "is redacted: it holds no generated token ids, so --causal cannot re-run and compare it; use the unredacted trace"));
        }
    }
    Ok(())
}

/// Refuses a missing `--model` (runs of a model file) or a superfluous one (builtin runs).
fn check_model(a: &Trace, opts: &CausalOptions) -> Result<()> {
    let hm = &a.header.run.model;
    let builtin = hm.name == "builtin" && hm.size == 0;
    match (&opts.model, builtin) {
        (None, false) => return Err(Error::usage(format!("--causal re-runs the model: give --model with the file the runs used ({}, sha256 {})", hm.name, hm.sha256.get(..12).unwrap_or("")))),
        (Some(p), true) => return Err(Error::usage(format!("--model {}: the runs used the builtin model; leave --model out", p.display()))),
        _ => {}
    }
    Ok(())
}

/// Loads the model for re-running `t` from its header, and checks it is the one `t` used.
fn prepare_side(t: &Trace, opts: &CausalOptions, env_vars: &[(String, String)]) -> Result<RunSide> {
    let mut o = options_from_header(&t.header, opts.model.clone()).map_err(|e| Error::trace(&t.path, e.to_string()))?;
    o.device = opts.device;
    o.env_vars = env_vars.to_vec();
    let device = o.device.open()?;
    let run = prepare_decoder(&o, &device)?;
    if run.header.run.model.sha256 != t.header.run.model.sha256 {
        let p = opts.model.clone().unwrap_or_default();
        return Err(Error::model(
            &p,
            format!(
                "sha256 {} is not the {} {} recorded: --causal needs the model the runs used",
                run.header.run.model.sha256.get(..12).unwrap_or(""),
                t.header.run.model.sha256.get(..12).unwrap_or(""),
                file_name(t)
            ),
        ));
    }
    Ok(RunSide { run, opts: o, row: 0, pad: 0 })
}

/// Runs `--causal` on traces `a` and `b` (see the module docs).
///
/// # Errors
/// [`Error::Mismatch`] when the runs had different inputs (nothing to patch: the inputs are the
/// difference); [`Error::Usage`] without the model file, for an encoder or redacted trace, or a
/// `--max-runs` below 3; [`Error::Model`] when the model's sha256 is not the traces'; and
/// [`Error::Mismatch`] when a run does not reproduce its trace on this machine. Candle errors.
pub fn causal(a: &Trace, b: &Trace, opts: &CausalOptions) -> Result<CausalReport> {
    if opts.max_runs < 3 {
        return Err(Error::usage(format!("--max-runs {}: at least 3 (the two reproductions and one patched run)", opts.max_runs)));
    }
    // Before any re-run sets RAYON_NUM_THREADS: the environment the patched trace records.
    let env_vars = crate::env::numeric_env_vars();
    refuse_early(a, b, opts)?;
    let (report, entries) = bisect_with_entries(a, b)?;
    let mut out = CausalReport {
        verdict: CausalVerdict::Identical,
        a: file_name(a),
        b: file_name(b),
        flip: report.first_token_divergence.clone(),
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
    };
    if let Some(inp) = &report.inputs_differ {
        return Err(Error::Mismatch(format!(
            "--causal: {}; patching explains one computation done two ways (`trace bisect {} {}` lists the settings that differ)",
            inp.explanation,
            file_name(a),
            file_name(b)
        )));
    }
    if report.verdict == crate::bisect::Verdict::Identical {
        return Ok(out);
    }
    check_model(a, opts)?;
    let (mut sa, mut sb) = (prepare_side(a, opts, &env_vars)?, prepare_side(b, opts, &env_vars)?);
    // The request followed: the flip's row, or the first request both runs hold.
    let row_a = report.first_token_divergence.as_ref().map(|f| f.row).or_else(|| report.rows.first().map(|r| r.a_row)).unwrap_or(0);
    let row_b = report.rows.iter().find(|r| r.a_row == row_a).map_or(row_a, |r| r.b_row);
    for (s, row) in [(&mut sa, row_a), (&mut sb, row_b)] {
        s.row = row;
        let longest = s.run.rows.iter().map(Vec::len).max().unwrap_or(0);
        s.pad = if s.run.rows.len() > 1 { (longest - s.run.rows.get(row as usize).map_or(longest, Vec::len)) as u32 } else { 0 };
    }
    let (ta, tb) = (trace_tokens(a, row_a), trace_tokens(b, row_b));
    // The step compared: the flip, or (no flip) the last step both runs made.
    let step = match &report.first_token_divergence {
        Some(f) => f.step as usize,
        None => ta.len().min(tb.len()).checked_sub(1).ok_or_else(|| Error::Mismatch("--causal: the runs generated no token to compare".into()))?,
    };
    let (pos_a, pos_b) = step_positions(&ta, &tb, step)?;
    // The op that outputs the final logits: `logits` (the f32 conversion, when activations are
    // not f32), else `lm_head`.
    let site = |t: &Trace| {
        let has = |name: &str| t.items.iter().any(|i| matches!(i, Item::Site { path, .. } if path == name));
        if has("logits") {
            "logits"
        } else {
            "lm_head"
        }
    };
    let a_logits = sa.logits_key(site(a), pos_a);
    let b_logits = sb.logits_key(site(b), pos_b);
    let a_steps: Vec<SliceKey> = ta[..=step].iter().map(|x| sa.logits_key(site(a), x.1)).collect();
    let b_steps: Vec<SliceKey> = tb[..=step].iter().map(|x| sb.logits_key(site(b), x.1)).collect();
    out.step = Some(step as u32);
    for t in [a, b] {
        if t.truncated {
            out.notes.push(format!("{} is truncated (the run did not finish): compared through token {step}, the part it holds", file_name(t)));
        }
    }
    if ta.len() != tb.len() && report.first_token_divergence.is_none() {
        out.notes.push(format!("the runs generated {} and {} tokens: compared through token {step}", ta.len(), tb.len()));
    }
    let last_pos = a_logits.pos;
    out.candidates = entries.iter().filter(|e| e.row == row_a && e.position <= last_pos).map(|e| Candidate { entry: e.clone(), round: 0 }).collect();
    let mut s = Search {
        a: sa,
        b: sb,
        candidates: out.candidates.clone(),
        b_values: HashMap::new(),
        a_values: HashMap::new(),
        runs: Vec::new(),
        max_runs: opts.max_runs,
        started: Instant::now(),
        tokens: step + 1,
        step,
        a_tokens: ta.iter().take(step + 1).map(|x| x.0).collect(),
        b_tokens: tb.iter().take(step + 1).map(|x| x.0).collect(),
        a_logits: a_logits.clone(),
        b_logits: b_logits.clone(),
        a_steps,
        b_steps,
        a_all: Vec::new(),
        b_all: Vec::new(),
        cache: HashMap::new(),
        b_checked: false,
    };

    read_values(&mut s, &mut out, a, b)?;
    out.logits_max_abs_diff = Some(max_step_diff(&s.a_all, &s.b_all)?).filter(|d| !d.is_nan());

    if report.first_token_divergence.is_none() {
        rank(&mut s, &mut out)?;
    } else {
        let named = report.first_divergence.as_ref().and_then(|d| s.candidates.iter().position(|c| c.path == d.path && c.position == d.position));
        search(&mut s, &mut out, b, named)?;
    }
    if let Some(path) = &opts.out {
        write_patched(&mut s, &out, path)?;
    }
    out.candidates = s.candidates;
    out.seconds = s.started.elapsed().as_secs_f64();
    out.runs = s.runs;
    Ok(out)
}

/// Step 1: re-runs a (and b, unless b's dumps hold its values at every entry point) and reads
/// the values patches need.
fn read_values(s: &mut Search, out: &mut CausalReport, a: &Trace, b: &Trace) -> Result<()> {
    // 1. Both runs must reproduce here; meanwhile read their values at the entry points. B's
    // values may come from its dumps instead (`--dump` covering them): then b is re-run only if
    // a later step needs it (more entry points, the reverse check).
    s.reproduce('a', a)?;
    let keys: Vec<(String, u32, u32)> = (0..s.candidates.len()).map(|i| s.key_b(i)).chain(s.b_steps.iter().cloned()).map(|k| (k.path, k.row, k.pos)).collect();
    let dumped = crate::bisect::dumped_slices(b, &keys)?;
    let n = s.candidates.len();
    if n > 0 && dumped[..n].iter().all(Option::is_some) {
        for (i, d) in dumped[..n].iter().enumerate() {
            let (dtype, v) = d.clone().expect("checked");
            s.b_values.insert(s.key_b(i), values_tensor(&dtype, v)?);
        }
        if dumped[n..].iter().all(Option::is_some) {
            s.b_all = dumped[n..].iter().map(|d| d.clone().map(|(t, v)| values_tensor(&t, v)).expect("checked")).collect::<Result<_>>()?;
        }
        out.notes.push(format!("b's values at the {n} entry points come from its dumps (b was not re-run for them)"));
    } else {
        s.reproduce('b', b)?;
    }
    Ok(())
}

/// The flip: grow the candidates until patching all of them reproduces it, shrink with ddmin,
/// then the reverse check.
fn search(s: &mut Search, out: &mut CausalReport, b: &Trace, named: Option<usize>) -> Result<()> {
    let mut round = 0u32;
    loop {
        let all: Vec<usize> = (0..s.candidates.len()).collect();
        match s.test(&all)? {
            Some(true) => break,
            None => {
                out.verdict = CausalVerdict::NotFound;
                out.notes.push(format!("the --max-runs {} budget ran out before patching reproduced the flip", s.max_runs));
                return Ok(());
            }
            Some(false) => {}
        }
        // Find the entry points the patched run still has against b.
        if s.runs.len() + 3 > s.max_runs {
            out.verdict = CausalVerdict::NotFound;
            out.notes.push(format!("patching all {} entry points did not reproduce the flip, and --max-runs {} leaves no room to look for more", all.len(), s.max_runs));
            return Ok(());
        }
        if !s.b_checked {
            if let Err(e) = s.reproduce('b', b) {
                out.verdict = CausalVerdict::NotFound;
                out.notes.push(format!("patching all {} entry points did not reproduce the flip, and b cannot be re-run to look for more: {e}", all.len()));
                return Ok(());
            }
        }
        round += 1;
        let t0 = Instant::now();
        let patches = s.patches_into_a(&all);
        let (_, _, sink) = s.a.go(patches, Vec::new(), s.tokens, true)?;
        let patched = sink.expect("traced").trace("a (patched)", &s.a.run.header);
        let (_, more) = bisect_with_entries(&patched, b)?;
        let known: HashSet<(String, u32)> = s.candidates.iter().map(|c| (c.path.clone(), c.position)).collect();
        let new: Vec<Candidate> =
            more.into_iter().filter(|e| e.row == s.a.row && e.position <= s.a_logits.pos && !known.contains(&(e.path.clone(), e.position))).map(|entry| Candidate { entry, round }).collect();
        s.log("find_more", all.clone(), format!("patched a bisected against b: {} new entry points", new.len()), t0);
        if new.is_empty() {
            out.verdict = CausalVerdict::NotFound;
            out.notes.push(format!("patching all {} entry points did not reproduce the flip, and the patched run has no further entry point", all.len()));
            return Ok(());
        }
        let first_new = s.candidates.len();
        s.candidates.extend(new);
        let idx: Vec<usize> = (first_new..s.candidates.len()).collect();
        s.capture_b(&idx)?;
    }
    // The question a maintainer asks first: is the root cause bisect names enough on its own?
    if let Some(j) = named {
        if let Some(ok) = s.test(&[j])? {
            out.bisect_root_alone = Some((j, ok));
        }
    }
    let all: Vec<usize> = (0..s.candidates.len()).collect();
    let (set, minimal) = match out.bisect_root_alone {
        // One entry point that flips the token is a minimal set (a itself does not flip).
        Some((j, true)) => (vec![j], true),
        _ => ddmin(all, &mut |set| s.test(set))?,
    };
    out.verdict = CausalVerdict::Found;
    out.set = set;
    out.minimal = minimal;
    if !minimal {
        out.notes.push(format!("--max-runs {} reached: the set reproduces the flip but was not shrunk to a minimal one", s.max_runs));
    }
    // Reverse: a's values at the set into b.
    let missing: Vec<usize> = out.set.iter().copied().filter(|&i| !s.a_values.contains_key(&s.key_a(i))).collect();
    if !missing.is_empty() && s.runs.len() < s.max_runs {
        let t0 = Instant::now();
        let keys: Vec<SliceKey> = missing.iter().map(|&i| s.key_a(i)).collect();
        let (_, cap, _) = s.a.go(Vec::new(), keys, s.tokens, false)?;
        s.a_values.extend(cap);
        s.log("capture_a", Vec::new(), format!("read a's values at {} entry points", missing.len()), t0);
    }
    if !s.b_checked && s.runs.len() + 1 < s.max_runs {
        // b's values came from its dumps; the reverse check needs b itself to re-run here.
        if let Err(e) = s.reproduce('b', b) {
            out.notes.push(format!("no reverse check: {e}"));
        }
    }
    let complete = out.set.iter().all(|&i| s.a_values.contains_key(&s.key_a(i)));
    if complete && s.b_checked && s.runs.len() < s.max_runs {
        let t0 = Instant::now();
        let patches: Vec<Patch> = out.set.iter().map(|&i| Patch { at: s.key_b(i), values: s.a_values[&s.key_a(i)].clone() }).collect();
        let (g, cap, _) = s.b.go(patches, vec![s.b_logits.clone()], s.tokens, false)?;
        let (ok, token, outcome) = s.judge(&g, &s.a_tokens, &s.b_tokens, s.b.row);
        let diff = match (cap.get(&s.b_logits), s.a_all.last()) {
            (Some(x), Some(y)) => Some(max_abs_diff(x, y)?),
            _ => None,
        };
        let r = s.log("reverse", out.set.clone(), outcome, t0);
        (r.flipped, r.token, r.logits_max_abs_diff) = (Some(ok), token, diff);
        out.reverse = Some(ok);
    } else if s.runs.len() >= s.max_runs {
        out.notes.push("the reverse check (a's values into b) was not run: --max-runs reached".into());
    }
    Ok(())
}

/// No flip: each candidate patched alone, ranked by how far it moves a's final logits.
fn rank(s: &mut Search, out: &mut CausalReport) -> Result<()> {
    out.verdict = CausalVerdict::NoFlip;
    // Live entry points first: they reached the residual stream.
    let mut order: Vec<usize> = (0..s.candidates.len()).collect();
    order.sort_by_key(|&i| !s.candidates[i].live);
    for i in order {
        if !s.budget_left() {
            out.notes.push(format!("--max-runs {} reached: ranked {} of {} entry points (live ones first)", s.max_runs, out.ranking.len(), s.candidates.len()));
            break;
        }
        let t0 = Instant::now();
        let patches = s.patches_into_a(&[i]);
        let (_, mut cap, _) = s.a.go(patches, s.a_steps.clone(), s.tokens, false)?;
        let l: Vec<Tensor> = s.a_steps.iter().filter_map(|k| cap.remove(k)).collect();
        let (moved, remaining) = (max_step_diff(&l, &s.a_all)?, max_step_diff(&l, &s.b_all)?);
        s.log("rank", vec![i], format!("final logits moved {moved:.3e}, {remaining:.3e} from b"), t0).logits_max_abs_diff = Some(remaining);
        out.ranking.push(Ranked { candidate: i, moved, remaining });
    }
    // Closest to b first (the patch that explains most of the difference), then by effect.
    out.ranking.sort_by(|x, y| x.remaining.total_cmp(&y.remaining).then(y.moved.total_cmp(&x.moved)));
    if s.candidates.iter().any(|c| c.class == CauseClass::DtypeDiffers) {
        out.notes.push("the runs differ in dtype: b's values are rounded to a's dtype when patched in, so a patch cannot carry b's precision".into());
    }
    Ok(())
}

/// Re-runs a to its full length with the set patched, into a trace file.
fn write_patched(s: &mut Search, out: &CausalReport, path: &std::path::Path) -> Result<()> {
    let set: Vec<usize> = if out.set.is_empty() { out.ranking.first().map(|r| vec![r.candidate]).unwrap_or_default() } else { out.set.clone() };
    let t0 = Instant::now();
    let mut header = s.a.run.header.clone();
    let marks: Vec<String> = set.iter().map(|&i| format!("{PATCH_PREFIX}{}@{}", s.candidates[i].path, s.candidates[i].position)).collect();
    header.run.perturb = Some(header.run.perturb.iter().cloned().chain(marks).collect::<Vec<_>>().join(","));
    let writer = crate::format::TraceWriter::create(path, &header)?;
    let mut tracer = Tracer::new(Box::new(writer)).with_perturbs(s.a.opts.perturb.clone()).with_patches(s.patches_into_a(&set));
    let opts = s.a.opts.clone();
    let g = match run_decoder(&mut s.a.run, &opts, &mut tracer) {
        Ok(g) => g,
        Err(e) => {
            let _ = tracer.end_forward();
            return Err(e);
        }
    };
    tracer.finish(&crate::recorder::footer(&tracer, &g))?;
    let text = g.texts.get(s.a.row as usize).cloned().unwrap_or_default();
    // The file name only: reports are pasted into public bug reports.
    let name = path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned());
    s.log("write", set, format!("wrote {name} ({} tokens): \"{text}\"", g.tokens.first().map_or(0, Vec::len)), t0);
    Ok(())
}

/// The report as text for the terminal: the set, the reverse check, the runs and their times.
pub fn text(r: &CausalReport) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let describe = |i: usize| {
        let c = &r.candidates[i];
        let layer = c.layer.map_or(String::new(), |l| format!(", layer {l}"));
        let row = if c.row == 0 { String::new() } else { format!(", row {}", c.row) };
        let found = if c.round == 0 { String::new() } else { format!(" [found after patching, round {}]", c.round) };
        format!("{} ({}) at position {}{layer}{row}: {}{found}", c.path, c.op, c.position, c.class.describe())
    };
    let _ = writeln!(o, "causal: {} vs {}", crate::report::clean(&r.a), crate::report::clean(&r.b));
    let step = r.step.unwrap_or(0);
    match (&r.flip, r.verdict) {
        (_, CausalVerdict::Identical) => {
            let _ = writeln!(o, "  the runs are identical: nothing to explain");
            return o;
        }
        (Some(f), _) => {
            let _ = writeln!(
                o,
                "  which difference changed token {} (row {}): a {} {:?}, b {} {:?}",
                f.step,
                f.row,
                f.a_token,
                crate::report::clean(&f.a_text),
                f.b_token,
                crate::report::clean(&f.b_text)
            );
        }
        (None, _) => {
            let _ = writeln!(o, "  no generated token differs: which difference moves the final logits (tokens 0 to {step}) most");
        }
    }
    let found = r.candidates.iter().filter(|c| c.round > 0).count();
    let _ = writeln!(
        o,
        "  entry points (output differs, inputs matched) up to {}: {}{}",
        if r.flip.is_some() { "that token's logits" } else { "the last step's logits" },
        r.candidates.len() - found,
        if found > 0 { format!(", and {found} more found after patching") } else { String::new() }
    );
    match r.verdict {
        CausalVerdict::Found => {
            let one = r.set.len() == 1;
            let _ = writeln!(
                o,
                "\n{} that, patched into a with b's values, make{} a produce b's token {step}{}:",
                if one { "the entry point".to_string() } else { format!("the {} entry points", r.set.len()) },
                if one { "s" } else { "" },
                if r.minimal { " (leaving any one out loses the flip)" } else { " (not shown minimal)" }
            );
            for &i in &r.set {
                let _ = writeln!(o, "  {}", describe(i));
            }
            let mut classes: Vec<CauseClass> = r.set.iter().map(|&i| r.candidates[i].class).collect();
            classes.sort_unstable();
            classes.dedup();
            for c in classes {
                let _ = writeln!(o, "  remedy: {}", c.remedy());
            }
            if let Some((j, ok)) = r.bisect_root_alone {
                if !r.set.contains(&j) || r.set.len() > 1 {
                    let c = &r.candidates[j];
                    let _ = writeln!(o, "bisect's root cause {}@{} alone: {}", c.path, c.position, if ok { "also makes a produce b's token" } else { "does not change the token" });
                }
            }
            if let Some(x) = r.runs.iter().rev().find(|x| x.kind == "reverse") {
                let _ = writeln!(o, "reverse check, a's values there patched into b: {}", if x.flipped == Some(true) { "b produces a's token".to_string() } else { crate::report::clean(&x.outcome) });
            }
            if r.candidates.len() > 1 && r.flip.as_ref().is_some_and(|f| f.a_margin.min(f.b_margin) < 0.01) {
                let _ = writeln!(o, "note: the flipped token won by a margin under 0.01, so a near tie: any of several differences may suffice alone; this set is one that does");
            }
        }
        CausalVerdict::NotFound => {
            let _ = writeln!(o, "\nno set found: patching the entry points did not reproduce b's token {step}");
        }
        _ => {
            if let Some(d) = r.logits_max_abs_diff {
                let _ = writeln!(o, "  final logits unpatched: max |a-b| {d:.3e} (largest over the steps)");
            }
            if r.candidates.is_empty() {
                let _ = writeln!(o, "\nno entry point up to token {step}: the runs' numbers agree there");
            } else {
                let _ = writeln!(o, "\nentry points patched alone, closest to b first: how far each moves a's final logits, and how far a then remains from b:");
            }
            for x in r.ranking.iter().take(10) {
                let _ = writeln!(o, "  moved {:.3e}, then {:.3e} from b: {}", x.moved, x.remaining, describe(x.candidate));
            }
            if r.ranking.len() > 10 {
                let _ = writeln!(o, "  … {} more", r.ranking.len() - 10);
            }
        }
    }
    let _ = writeln!(o, "\nre-runs: {} in {:.1} s", r.runs.len(), r.seconds);
    for x in &r.runs {
        let patched = if x.patched.is_empty() { String::new() } else { format!(", {} patched", x.patched.len()) };
        let _ = writeln!(o, "  {:>3} {:<12} {:>5.1} s  {}{patched}", x.n, x.kind, x.seconds, crate::report::clean(&x.outcome));
    }
    for n in &r.notes {
        let _ = writeln!(o, "note: {n}");
    }
    o
}

#[cfg(test)]
mod tests {
    use super::{ddmin, step_positions};

    /// Regression: bisect's flip step, read from a crafted file, past the token list of either
    /// side was an index panic (`ta[step]`).
    #[test]
    fn a_step_past_either_token_list_is_refused() {
        let (ta, tb) = (vec![(5, 8), (6, 9)], vec![(5, 8)]);
        assert_eq!(step_positions(&ta, &tb, 0).unwrap(), (8, 8));
        for step in [1, 2, usize::MAX] {
            let e = step_positions(&ta, &tb, step).unwrap_err().to_string();
            assert!(e.contains("hold 2 and 1 generated tokens") && e.contains(&format!("token {step}")), "{e}");
        }
    }

    #[test]
    fn ddmin_finds_the_one_and_the_pair() {
        // One cause among 100.
        let mut runs = 0;
        let (set, minimal) = ddmin((0..100).collect(), &mut |s| {
            runs += 1;
            Ok(Some(s.contains(&37)))
        })
        .unwrap();
        assert_eq!((set, minimal), (vec![37], true));
        assert!(runs <= 20, "{runs} tests for one cause among 100");
        // Two causes needed together.
        let (set, minimal) = ddmin((0..50).collect(), &mut |s| Ok(Some(s.contains(&3) && s.contains(&41)))).unwrap();
        assert_eq!((set, minimal), (vec![3, 41], true));
        // Budget out: the current set, not shown minimal.
        let mut left = 2;
        let (set, minimal) = ddmin((0..8).collect(), &mut |s| {
            if left == 0 {
                return Ok(None);
            }
            left -= 1;
            Ok(Some(s.contains(&5)))
        })
        .unwrap();
        assert!(!minimal && set.contains(&5));
    }
}
