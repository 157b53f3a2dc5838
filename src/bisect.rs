//! Bisect: where two runs parted ways.
//!
//! The two traces are aligned by (module path, batch row, absolute token position): every op
//! output at a position is compared with the same op's output at the same position in the other
//! run, whatever the forward pass that computed it (so whole-prompt prefill compares with chunked
//! prefill, and row 0 of a batch-4 run with a batch-1 run). KV-cache records hold only the
//! positions their pass wrote, so a cached K/V slice is compared once.
//!
//! The root cause is the first divergent (position, op) — ordered by position, then by execution
//! order in trace A — whose inputs matched bit for bit at the positions it reads (its own position,
//! or `0..=p` of the KV cache for attention): "non-determinism entered here". When the first thing
//! that differs is the token ids themselves, the inputs differ and no op is blamed.

use crate::align::{diff_bound, slice_len, Alignment, Found};
use crate::error::{Error, Result};
use crate::format::Trace;
use crate::record::TokenStat;
use crate::record::{Dump, Forward, Header, Item, OpRecord, TokenEvent};
pub use crate::site::{layer_group, layer_of};
use serde::Serialize;
use std::collections::{HashMap, HashSet};
use std::path::Path;

/// One trace, indexed for alignment.
struct Side<'a> {
    trace: &'a Trace,
    /// Site id → (path, op).
    sites: Vec<(&'a str, &'a str)>,
    site_by_path: HashMap<&'a str, u32>,
    /// Op records in seq order (seq = index for a well-formed trace).
    recs: Vec<&'a OpRecord>,
    rec_by_seq: HashMap<u64, usize>,
    /// (site, row, pos) → (record index, token index): first occurrence.
    at: HashMap<(u32, u32, u32), (usize, usize)>,
    forwards: HashMap<u32, &'a Forward>,
    tokens: Vec<&'a TokenEvent>,
    /// Output dumps by record seq (the dump whose shape is the record's).
    dumps: HashMap<u64, Vec<&'a Dump>>,
    /// This trace's batch row → the row it is compared as (run a's row holding the same
    /// request); rows absent here are not compared. `None`: every row as itself.
    rows: Option<HashMap<u32, u32>>,
    /// The inverse: compared row → this trace's own row.
    own_rows: HashMap<u32, u32>,
    /// The pooled embeddings (encoder runs), one per own row.
    embeddings: Option<&'a Vec<Vec<f32>>>,
    /// The batch holds padded rows (token-id records cover fewer positions than their shape).
    padded: bool,
    /// Op records in the whole trace (the trace read may hold only those the report needs).
    records: usize,
}

impl<'a> Side<'a> {
    fn new(trace: &'a Trace, rows: Option<HashMap<u32, u32>>) -> Result<Self> {
        let own_rows = rows.iter().flatten().map(|(&own, &cmp)| (cmp, own)).collect();
        let mut s = Side {
            records: 0,
            rows,
            own_rows,
            embeddings: None,
            padded: false,
            trace,
            sites: Vec::new(),
            site_by_path: HashMap::new(),
            recs: Vec::new(),
            rec_by_seq: HashMap::new(),
            at: HashMap::new(),
            forwards: HashMap::new(),
            tokens: Vec::new(),
            dumps: HashMap::new(),
        };
        for item in &trace.items {
            match item {
                Item::Site { id, path, op } => {
                    if *id as usize != s.sites.len() {
                        return Err(Error::trace(&trace.path, format!("site ids out of order at site {id}")));
                    }
                    s.sites.push((path, op));
                    s.site_by_path.insert(path, *id);
                }
                Item::Forward(f) => {
                    s.forwards.insert(f.step, f);
                }
                Item::Op(r) => {
                    if r.site as usize >= s.sites.len() {
                        return Err(Error::trace(&trace.path, format!("record {} names unknown site {}", r.seq, r.site)));
                    }
                    let ri = s.recs.len();
                    s.rec_by_seq.insert(r.seq, ri);
                    if r.kernel == Some(crate::record::Kernel::Input) && crate::limits::elements(&r.shape) != Some(r.tokens.len() as u64) && r.shape.len() == 2 {
                        s.padded = true;
                    }
                    for (ti, t) in r.tokens.iter().enumerate() {
                        let Some(row) = s.compared_row(t.row) else { continue };
                        s.at.entry((r.site, row, t.pos)).or_insert((ri, ti));
                    }
                    s.recs.push(r);
                }
                Item::Token(t) => s.tokens.push(t),
                Item::Embeddings(v) => s.embeddings = Some(v),
                Item::Dump(d) => s.dumps.entry(d.seq).or_default().push(d),
                Item::Operand(_) | Item::Counterpart(_) | Item::ValuePart(_) => {}
            }
        }
        s.records = s.recs.len();
        Ok(s)
    }

    /// The row own row `r` is compared as (`None`: not compared).
    fn compared_row(&self, r: u32) -> Option<u32> {
        match &self.rows {
            None => Some(r),
            Some(m) => m.get(&r).copied(),
        }
    }

    /// This trace's own row for compared row `r`.
    fn own_row(&self, r: u32) -> u32 {
        match &self.rows {
            None => r,
            Some(_) => self.own_rows.get(&r).copied().unwrap_or(u32::MAX),
        }
    }

    fn path(&self, site: u32) -> &'a str {
        self.sites[site as usize].0
    }

    fn token(&self, site: u32, row: u32, pos: u32) -> Option<(&'a OpRecord, &'a TokenStat)> {
        self.at.get(&(site, row, pos)).map(|&(ri, ti)| (self.recs[ri], &self.recs[ri].tokens[ti]))
    }

    /// The (row, pos) slice of record `r`'s dumped output, decoded (unpadded traces only: a
    /// padded row's positions are its own, not the tensor's).
    fn slice(&self, r: &OpRecord, row: u32, pos: u32) -> Option<(crate::dump::Values, Vec<usize>)> {
        if self.padded {
            return None;
        }
        let row = self.own_row(row);
        let shape: Vec<u32> = r.shape.clone();
        let d = self.dumps.get(&r.seq)?.iter().find(|d| d.shape == shape)?;
        let v = crate::dump::decode(d).ok()?;
        let dims: Vec<usize> = shape.iter().map(|&x| x as usize).collect();
        let idx: Vec<usize> = match &r.axis {
            Some(axis) => crate::record::token_slice(&dims, axis, row, pos)?.into_iter().flatten().collect(),
            None => (0..v.f64.len()).collect(),
        };
        Some((v, idx))
    }

    /// Positions of the prompt: the positions the prefill passes covered.
    fn prompt_len(&self) -> u32 {
        self.forwards.values().filter(|f| f.phase == crate::record::Phase::Prefill).map(|f| f.index_pos.saturating_add(f.seq_len)).max().unwrap_or(0)
    }

    fn record(&self, seq: u64) -> Option<&'a OpRecord> {
        self.rec_by_seq.get(&seq).map(|&i| self.recs[i])
    }

    /// Record `seq`'s entry at (compared row, pos).
    fn entry(&self, seq: u64, row: u32, pos: u32) -> Option<(&'a OpRecord, &'a TokenStat)> {
        let r = self.record(seq)?;
        r.tokens.iter().find(|t| t.pos == pos && self.compared_row(t.row) == Some(row)).map(|t| (r, t))
    }

    fn execution(&self, step: u32) -> String {
        match self.forwards.get(&step) {
            Some(f) => format!(
                "step {} ({:?}, positions {}..{}, batch {}, M={})",
                f.step,
                f.phase,
                f.index_pos,
                u64::from(f.index_pos) + u64::from(f.seq_len),
                f.batch,
                u64::from(f.seq_len) * u64::from(f.batch)
            )
            .replace("Prefill", "prefill")
            .replace("Decode", "decode"),
            None => format!("step {step}"),
        }
    }
}

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

/// The drift table of `path` at `row`, and whether the root cause's difference follows position:
/// where this op is a root (its inputs matched) at 8 positions or more, and at half or more of
/// the positions where it differs, either it is
/// identical at position 0 and a root at later ones (a rotation is the identity at position 0),
/// or the largest difference in the last quarter of them is over twice the largest in the
/// first. Positions downstream of a root differ because their inputs did: they are listed, not
/// judged.
fn drift_table(al: &Alignment, path: &str, row: u32, at: u32, roots: &HashSet<u32>) -> (Vec<PositionDrift>, bool) {
    let all = al.drift(path, row);
    if all.len() < 3 || all.iter().all(|&(_, d)| d == 0.0) {
        return (Vec::new(), false);
    }
    let judged: Vec<f64> = all.iter().filter(|(p, _)| roots.contains(p)).map(|&(_, d)| d).collect();
    let differing = all.iter().filter(|&&(_, d)| d != 0.0).count();
    // Judged only where the difference mostly enters here: a kernel that depends on the pass's
    // shape is a root at a few positions, whose later differences come from upstream.
    let follows = judged.len() >= 8 && judged.len() * 2 >= differing && {
        let quarter = judged.len().div_ceil(4);
        let max = |xs: &[f64]| xs.iter().copied().fold(0.0, f64::max);
        let grows = max(&judged[judged.len() - quarter..]) > 2.0 * max(&judged[..quarter]);
        let zero_at_0 = all.first().is_some_and(|&(p, d)| p == 0 && d == 0.0);
        grows || zero_at_0
    };
    let rows = drift_rows(&all, at).into_iter().map(|i| PositionDrift { position: all[i].0, max_abs_diff: all[i].1, inputs_matched: roots.contains(&all[i].0) }).collect();
    (rows, follows)
}

/// Which of the `all` positions the table shows (indexes, in order): at most [`MAX_DRIFT_ROWS`],
/// always the first and last, the root's position `at`, the first and the largest difference,
/// and as many evenly spaced others as fit.
fn drift_rows(all: &[(u32, f64)], at: u32) -> Vec<usize> {
    let n = all.len();
    let largest = all.iter().enumerate().max_by(|a, b| a.1 .1.total_cmp(&b.1 .1)).map_or(0, |(i, _)| i);
    let first_diff = all.iter().position(|&(_, d)| d != 0.0).unwrap_or(0);
    let root = all.iter().position(|&(p, _)| p == at).unwrap_or(0);
    let mut picks: Vec<usize> = vec![0, n - 1, root, first_diff, largest];
    picks.sort_unstable();
    picks.dedup();
    let room = MAX_DRIFT_ROWS.saturating_sub(picks.len());
    let spaced: Vec<usize> = (1..=room).map(|k| k * (n - 1) / (room + 1)).collect();
    picks.extend(spaced);
    picks.sort_unstable();
    picks.dedup();
    picks
}

/// How the difference grew through the layers at the root's position, and how the root's op
/// differs along the positions (with a note when that grows).
fn around_root(sa: &Side, sb: &Side, al: &Alignment, fd: &OpDivergence, notes: &mut Vec<String>) -> (Vec<LayerGrowth>, Vec<PositionDrift>, bool) {
    let growth = growth_table(sa, sb, fd.row, fd.position);
    let roots: HashSet<u32> = al.roots().iter().filter(|f| f.row == fd.row && al.path_of(0, f.seq_a) == Some(fd.path.as_str())).map(|f| f.pos).collect();
    let (drift, grows) = drift_table(al, &fd.path, fd.row, fd.position, &roots);
    // A cause already named (a perturbation, other shapes or dtypes) explains the pattern.
    let grows = grows && !matches!(fd.class, CauseClass::Perturbed | CauseClass::ShapesDiffer | CauseClass::DtypeDiffers);
    if grows {
        notes.push(format!(
            "{} is a root cause at {} positions and its difference follows position (see the table): the signature of a position-dependent fault, such as a wrong rotary (rope) layout or base",
            fd.path,
            roots.len()
        ));
    }
    (growth, drift, grows)
}

/// Values of one side at a divergent (op, row, position).
#[derive(Clone, Debug, Serialize)]
pub struct EntryView {
    /// Record id (`seq`) of the op record in this side's trace.
    pub seq: u64,
    /// Forward-pass index of that record.
    pub step: u32,
    /// How the forward pass that ran it was shaped.
    pub execution: String,
    /// The op output's dtype and shape (for attention, the last dim is the kv length).
    pub dtype: String,
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

fn elementwise(sa: &Side, ra: &OpRecord, sb: &Side, rb: &OpRecord, row: u32, pos: u32) -> Option<Elementwise> {
    let (va, ia) = sa.slice(ra, row, pos)?;
    let (vb, ib) = sb.slice(rb, row, pos)?;
    if ia.len() != ib.len() {
        return None;
    }
    let same_dtype = va.dtype == vb.dtype;
    let mut e = Elementwise {
        count: ia.len() as u64,
        differing: 0,
        max_abs_diff: 0.0,
        max_rel_diff: 0.0,
        max_ulp: same_dtype.then_some(0),
        ulp_histogram: Vec::new(),
        worst_index: 0,
        a_worst: va.f64.get(*ia.first()?).copied().unwrap_or(0.0),
        b_worst: vb.f64.get(*ib.first()?).copied().unwrap_or(0.0),
    };
    let mut buckets = [0u64; 34];
    for (k, (&i, &j)) in ia.iter().zip(&ib).enumerate() {
        let (x, y) = (va.f64[i], vb.f64[j]);
        let ulp = va.ordered[i].abs_diff(vb.ordered[j]);
        let differs = if same_dtype { ulp != 0 } else { x.to_bits() != y.to_bits() };
        if same_dtype {
            let b = if ulp == 0 { 0 } else { (64 - ulp.leading_zeros()) as usize };
            buckets[b.min(33)] += 1;
            e.max_ulp = e.max_ulp.map(|m| m.max(ulp));
        }
        if !differs {
            continue;
        }
        e.differing += 1;
        let d = (x - y).abs();
        if d > e.max_abs_diff || (d.is_nan() && !e.max_abs_diff.is_nan()) {
            e.max_abs_diff = d;
            e.worst_index = k;
            e.a_worst = x;
            e.b_worst = y;
        }
        let scale = x.abs().max(y.abs());
        if scale > 0.0 && d / scale > e.max_rel_diff {
            e.max_rel_diff = d / scale;
        }
    }
    if same_dtype {
        e.ulp_histogram = buckets
            .iter()
            .enumerate()
            .filter(|(_, n)| **n > 0)
            .map(|(b, n)| {
                let label = match b {
                    0 => "0".to_string(),
                    1 => "1".to_string(),
                    33 => ">=2^32".to_string(),
                    _ => format!("{}-{}", 1u64 << (b - 1), (1u64 << b) - 1),
                };
                (label, *n)
            })
            .collect();
    }
    Some(e)
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
    pub path: String,
    /// Op name (`matmul`, `softmax`, …).
    pub op: String,
    /// Token position of the slice (the row's own position in a padded batch).
    pub position: u32,
    /// Batch row in run a, and the row of run b it was compared with (the same request).
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

/// How many absorbed root causes a report lists.
pub const MAX_ABSORBED_LISTED: usize = 8;

/// A root cause whose difference did not reach its layer's output.
#[derive(Clone, Debug, Serialize)]
pub struct Absorbed {
    /// Record ids in trace A and trace B.
    pub seq: u64,
    /// Record id in trace B.
    pub b_seq: u64,
    /// Module path of the op.
    pub path: String,
    /// Op name.
    pub op: String,
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
    /// Same shapes and settings, different environment (versions, CPU, device, variables,
    /// model config).
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
            CauseClass::ShapesDiffer => "operand shapes differ (prefill chunk, batch or padding): the kernel depends on M",
            CauseClass::ThreadsDiffer => "the thread counts differ",
            CauseClass::EnvironmentDiffers => "same shapes, different environment or model settings (versions, CPU, device, variables, config, numerics)",
            CauseClass::Perturbed => "a fault injected by --perturb: one bit of this output was flipped",
            CauseClass::RunToRun => "same shapes, settings and environment: run-to-run non-determinism",
            CauseClass::SamplingDiffers => "matching logits, different sampling",
        }
    }

    /// One line: what removes the difference.
    pub fn remedy(self) -> &'static str {
        match self {
            CauseClass::InputsDiffer => "compare runs of the same prompt; this is not a numerics problem",
            CauseClass::DtypeDiffers => "compare runs of one dtype; half precision rounds differently by design",
            CauseClass::ShapesDiffer => "fix the prefill chunk and batch size (and padding) between runs, or use batch-invariant kernels",
            CauseClass::ThreadsDiffer => "pin the thread count (--threads, RAYON_NUM_THREADS)",
            CauseClass::EnvironmentDiffers => "pin the versions (candle, rustc), the target CPU features and the device",
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
    pub kind: String,
    /// The kind of cause shared by the group.
    pub class: CauseClass,
    /// Number of roots in the group.
    pub count: usize,
    /// The first root of the group: `layers.0.self_attn.scores @ 0`.
    pub first: String,
    /// What the class means ([`CauseClass::describe`]).
    pub description: String,
    /// What removes the difference ([`CauseClass::remedy`]).
    pub remedy: String,
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
    /// Token id run a chose.
    pub a_token: u32,
    /// Token id run b chose.
    pub b_token: u32,
    /// Run a's token as text.
    pub a_text: String,
    /// Run b's token as text.
    pub b_text: String,
    /// Top-1 minus top-2 logit in run a ([`crate::record::Choice::margin`]).
    pub a_margin: f32,
    /// Top-1 minus top-2 logit in run b.
    pub b_margin: f32,
    /// The two highest logits of run a were exactly equal.
    pub a_tie: bool,
    /// The two highest logits of run b were exactly equal.
    pub b_tie: bool,
    /// Text both runs generated before this token (row 0).
    pub common_text: String,
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
    pub layer: String,
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
    pub key: String,
    /// Run a's value as text (header strings quoted; cut at 80 characters).
    pub a: String,
    /// Run b's value, as `a`.
    pub b: String,
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
    pub path: String,
    /// The file ended before its footer.
    pub truncated: bool,
    /// Op records in the trace.
    pub op_records: usize,
    /// Decode steps recorded ([`crate::record::Item::Token`] items).
    pub tokens: usize,
    /// Row 0's generated text, joined from its decode-step choices.
    pub text: String,
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
    pub input: String,
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
    pub first_root: Option<String>,
}

/// Why a sampled token flipped, from the two runs' sampling records at that step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SamplingVerdict {
    /// `boundary` (same draw, the candidate set differed at a cut-off), `different_draw` (same
    /// distribution, another random draw), or `distribution_differed` (the probabilities differ:
    /// see the forward-pass root).
    pub class: String,
    /// One sentence for the report.
    pub explanation: String,
    /// Run a's uniform draw ([`crate::record::SamplingStep::draw`]).
    pub a_draw: Option<f32>,
    /// Run b's uniform draw.
    pub b_draw: Option<f32>,
    /// The tokens at the boundary (tied or within 1 ULP of a cut-off, in either run).
    pub tokens: Vec<u32>,
}

/// Classifies a sampled divergence from the two runs' records of the step (see
/// [`SamplingVerdict`]).
pub fn classify_sampling(a: &crate::record::SamplingStep, b: &crate::record::SamplingStep) -> SamplingVerdict {
    let mut tokens: Vec<u32> = a.boundary.iter().chain(&b.boundary).map(|x| x.0).collect();
    tokens.sort_unstable();
    tokens.dedup();
    let (a_draw, b_draw) = (a.draw, b.draw);
    let same_draw = a_draw.map(f32::to_bits) == b_draw.map(f32::to_bits);
    // The sets differ at the boundary: an exact tie or 1-ULP neighbour at a cut-off, or the
    // least likely kept token changed while the cut-off probabilities stayed within 1%.
    let near = |x: Option<(f32, f32)>, y: Option<(f32, f32)>| match (x, y) {
        (Some((p, _)), Some((q, _))) => (p - q).abs() <= 0.01 * p.max(q),
        _ => false,
    };
    let moved = a.set_digest != b.set_digest && a.cutoff_token != b.cutoff_token && (near(a.k_cutoff, b.k_cutoff) || near(a.p_cutoff, b.p_cutoff));
    if moved {
        tokens.extend(a.cutoff_token.into_iter().chain(b.cutoff_token));
        tokens.sort_unstable();
        tokens.dedup();
    }
    let sets_differ = moved || (a.set_digest != b.set_digest && !tokens.is_empty());
    let (class, explanation) = if a.probs_digest == b.probs_digest {
        (
            "different_draw",
            format!(
                "the same probabilities met a different random draw (a {}, b {}): the seed, the sampler settings or the order draws were consumed differ",
                a_draw.map_or("-".into(), |d| d.to_string()),
                b_draw.map_or("-".into(), |d| d.to_string())
            ),
        )
    } else if same_draw && a.mode != "argmax" && sets_differ {
        let list: Vec<String> = tokens.iter().map(u32::to_string).collect();
        (
            "boundary",
            format!(
                "the same draw met a different candidate set: at the {} cut-off, token(s) {} tie or nearly tie and changed places (set sizes a {}/{}, b {}/{} after top-k/top-p)",
                if a.after_top_k != b.after_top_k || a.k_cutoff.is_some() { "top-k" } else { "top-p" },
                if list.is_empty() { "?".into() } else { list.join(", ") },
                a.after_top_k,
                a.after_top_p,
                b.after_top_k,
                b.after_top_p
            ),
        )
    } else if a.mode == "argmax" {
        ("distribution_differed", "greedy decoding: the logits differ, and the maximum moved (see the root cause)".to_string())
    } else {
        ("distribution_differed", "the probabilities differ: the forward pass computed other logits (see the root cause)".to_string())
    };
    SamplingVerdict { class: class.into(), explanation, a_draw, b_draw, tokens }
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
    /// Trace a.
    pub a: SideInfo,
    /// Trace b.
    pub b: SideInfo,
    /// Per request (batch row in both runs): whether its output changed, first.
    pub rows: Vec<RowAnswer>,
    /// The first generated token that differs (`None`: none, or a redacted trace).
    pub first_token_divergence: Option<TokenDivergence>,
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
    /// (op, row, position) entries compared (outputs without a token axis counted whole).
    pub compared: u64,
    /// Of the compared entries, those that differ (outputs without a token axis counted whole).
    pub differing: u64,
    /// Remarks for the reader: how rows were paired, truncated traces, the `--dump` that gives
    /// elementwise metrics, ….
    pub notes: Vec<String>,
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
    pub path: String,
    /// Batch row (run a).
    pub row: u32,
    /// Token position.
    pub position: u32,
    /// Module paths of its inputs in run a, in operand order.
    pub a_inputs: Vec<String>,
    /// Module paths of its inputs in run b.
    pub b_inputs: Vec<String>,
}

fn entry_view(side: &Side, r: &OpRecord, t: &TokenStat) -> EntryView {
    EntryView {
        seq: r.seq,
        step: r.step,
        execution: side.execution(r.step),
        dtype: r.dtype.clone(),
        shape: r.shape.clone(),
        sum: t.sum,
        abs_max: t.abs_max,
        nonfinite: t.nonfinite,
        samples: t.samples,
    }
}

/// Each batch row's request: the texts (encoder runs, and decoder runs of several prompts), or
/// the prompt in every row.
fn row_inputs(h: &Header) -> Vec<String> {
    if h.run.texts.is_empty() {
        vec![h.run.prompt.clone(); (h.run.batch as usize).clamp(1, crate::limits::MAX_ROWS)]
    } else {
        h.run.texts.clone()
    }
}

/// Each batch row's request identity ([`crate::redact::request_key`]: a hash, so a redacted
/// trace's rows still pair with the original's).
fn row_keys(h: &Header) -> Vec<String> {
    row_inputs(h).iter().map(|t| crate::redact::request_key(t)).collect()
}

/// (row of a, row of b) pairs holding the same request: each row of b with the first row of a
/// not yet taken that holds its request.
fn row_pairs(a: &[String], b: &[String]) -> Vec<(u32, u32)> {
    let mut taken = vec![false; a.len()];
    let mut out = Vec::new();
    for (rb, x) in b.iter().enumerate() {
        if let Some(ra) = (0..a.len()).find(|&ra| !taken[ra] && a[ra] == *x) {
            taken[ra] = true;
            out.push((ra as u32, rb as u32));
        }
    }
    out
}

/// The op of a module path without its layer: `layers.3.self_attn.scores` → `self_attn.scores`.
fn op_kind(path: &str, op: &str) -> String {
    let rest = match layer_of(path) {
        Some(l) => path.strip_prefix(&format!("layers.{l}.")).or_else(|| path.strip_prefix(&format!("encoder.layer.{l}."))).unwrap_or(path),
        None => path,
    };
    format!("{rest} ({op})")
}

/// The cause class of a root at records `ra` (run a) and `rb` (run b); see [`CauseClass`].
fn classify(sa: &Side, ra: &OpRecord, sb: &Side, rb: &OpRecord, env: &[EnvDiff]) -> CauseClass {
    let (ha, hb) = (&sa.trace.header.run, &sb.trace.header.run);
    if ra.perturbed || rb.perturbed {
        return CauseClass::Perturbed;
    }
    if ha.dtype != hb.dtype || ra.dtype != rb.dtype {
        return CauseClass::DtypeDiffers;
    }
    let ctx = |s: &Side, r: &OpRecord| s.forwards.get(&r.step).map(|f| (f.seq_len, f.batch));
    if ra.shape != rb.shape || ctx(sa, ra) != ctx(sb, rb) {
        return CauseClass::ShapesDiffer;
    }
    if ha.threads != hb.threads || sa.trace.header.env.threads != sb.trace.header.env.threads {
        return CauseClass::ThreadsDiffer;
    }
    if env.iter().any(|e| e.key.starts_with("env.") || e.key.starts_with("run.model")) {
        return CauseClass::EnvironmentDiffers;
    }
    CauseClass::RunToRun
}

/// Groups roots by (op kind, class), largest group first (then by first appearance).
fn group_roots(roots: &[OpDivergence]) -> Vec<RootGroup> {
    let mut groups: Vec<RootGroup> = Vec::new();
    for d in roots {
        let kind = op_kind(&d.path, &d.op);
        match groups.iter_mut().find(|g| g.kind == kind && g.class == d.class) {
            Some(g) => g.count += 1,
            None => groups.push(RootGroup { first: format!("{} @ {}", d.path, d.position), description: d.class.describe().into(), remedy: d.class.remedy().into(), kind, class: d.class, count: 1 }),
        }
    }
    groups.sort_by_key(|g| std::cmp::Reverse(g.count));
    groups
}

/// Fields of two headers that differ, flattened as `run.seed`, `env.threads`, `run.model.name`….
pub fn env_diff(a: &Header, b: &Header) -> Vec<EnvDiff> {
    fn short(v: &serde_json::Value) -> String {
        let s = match v {
            // Quoted and escaped, so a trailing newline or tab is visible.
            serde_json::Value::String(s) => format!("{s:?}"),
            other => other.to_string(),
        };
        if s.chars().count() > 80 {
            format!("{}…", s.chars().take(80).collect::<String>())
        } else {
            s
        }
    }
    let to = |h: &Header| {
        let mut v = serde_json::json!({ "run": h.run, "env": h.env });
        // Hyper-parameters as an object, so each differing key is its own line.
        let cfg: serde_json::Map<String, serde_json::Value> = h.run.model.config.iter().map(|(k, x)| (k.clone(), serde_json::Value::String(x.clone()))).collect();
        v["run"]["model"]["config"] = serde_json::Value::Object(cfg);
        v
    };
    let (fa, fb) = (crate::text::flatten_json(&to(a)), crate::text::flatten_json(&to(b)));
    let in_b: std::collections::HashMap<&str, &serde_json::Value> = fb.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let in_a: std::collections::HashSet<&str> = fa.iter().map(|(k, _)| k.as_str()).collect();
    let null = serde_json::Value::Null;
    // Keys of either side: one only b has differs as much as one only a has.
    let pairs = fa.iter().map(|(k, va)| (k, va, *in_b.get(k.as_str()).unwrap_or(&&null)));
    let pairs = pairs.chain(fb.iter().filter(|(k, _)| !in_a.contains(k.as_str())).map(|(k, vb)| (k, &null, vb)));
    let show = |key: &str, v: &serde_json::Value| match (key, v.as_u64()) {
        ("run.prefill_chunk", Some(0)) => "0 (whole prompt)".to_string(),
        _ => short(v),
    };
    pairs.filter(|(_, va, vb)| va != vb).map(|(k, va, vb)| EnvDiff { a: show(k, va), b: show(k, vb), key: k.clone() }).collect()
}

/// Compares two traces.
///
/// # Errors
/// [`Error::Mismatch`] when the traces record different models (by sha256) or architectures;
/// [`Error::Trace`] for an internally inconsistent trace.
pub fn bisect(a: &Trace, b: &Trace) -> Result<Report> {
    bisect_with_entries(a, b).map(|(r, _)| r)
}

/// Refuses two traces of different models (by sha256 and architecture).
pub(crate) fn same_model(a: &Header, b: &Header, pa: &Path, pb: &Path) -> Result<()> {
    let (ma, mb) = (&a.run.model, &b.run.model);
    if ma.sha256 != mb.sha256 || ma.architecture != mb.architecture {
        return Err(Error::Mismatch(format!(
            "{} and {} record different models ({} {} vs {} {}): bisect compares runs of one model",
            pa.display(),
            pb.display(),
            ma.name,
            &ma.sha256.get(..12).unwrap_or(""),
            mb.name,
            &mb.sha256.get(..12).unwrap_or("")
        )));
    }
    Ok(())
}

/// Whether the headers show different inputs (prompts, or texts no row of the other holds),
/// and how to say so.
fn header_inputs(a: &Trace, b: &Trace, both_hold: bool, (keys_a, keys_b): (&[String], &[String]), pairs: &[(u32, u32)], (inputs_a, inputs_b): (&[String], &[String])) -> (bool, Option<InputsDiffer>) {
    // Different prompts: the inputs differ, no op is to blame.
    let (pa, pb) = (&a.header.run.prompt_tokens, &b.header.run.prompt_tokens);
    // Batches of texts (encoders, or decoders given several prompts): the rows are the requests,
    // and they differ when no row of one run holds a request of the other.
    // A redacted trace holds no prompt: its ids are compared through the input_ids records' digests.
    let (ta, tb) = (&a.header.run.texts, &b.header.run.texts);
    let by_rows = !ta.is_empty() || !tb.is_empty();
    let prompt_differs = both_hold && keys_a != keys_b && if by_rows { pairs.is_empty() } else { pa != pb };
    let mut header_inputs = None;
    if prompt_differs && by_rows {
        let row = inputs_a.iter().zip(inputs_b.iter()).position(|(x, y)| x != y).unwrap_or(0);
        header_inputs = Some(InputsDiffer { position: 0, row: row as u32, in_prompt: true, explanation: format!("the texts differ (row {row}): the runs had different inputs, so no op is to blame") });
    } else if prompt_differs {
        let at = pa.iter().zip(pb.iter()).position(|(x, y)| x != y).unwrap_or(pa.len().min(pb.len()));
        header_inputs = Some(InputsDiffer {
            position: at as u32,
            row: 0,
            in_prompt: true,
            explanation: format!("the prompts differ ({} vs {} tokens, first difference at position {at}): the runs had different inputs, so no op is to blame", pa.len(), pb.len()),
        });
    }
    (prompt_differs, header_inputs)
}

/// Outputs without a token axis, compared whole: (compared, differing, paths that differ).
fn align_whole(sa: &Side, sb: &Side) -> (u64, u64, Vec<String>) {
    // Outputs without a token axis (pooled embeddings): the n-th record of a path in one trace
    // against the n-th of the same path in the other, by whole-tensor digest.
    let (mut compared, mut differing) = (0u64, 0u64);
    let mut whole_differ: Vec<String> = Vec::new();
    {
        let mut seen_a: HashMap<u32, usize> = HashMap::new();
        let mut by_site_b: HashMap<u32, Vec<&OpRecord>> = HashMap::new();
        for r in sb.recs.iter().filter(|r| r.tokens.is_empty()) {
            by_site_b.entry(r.site).or_default().push(r);
        }
        for r in sa.recs.iter().filter(|r| r.tokens.is_empty()) {
            let n = seen_a.entry(r.site).or_insert(0);
            let k = *n;
            *n += 1;
            let Some(&site_b) = sb.site_by_path.get(sa.path(r.site)) else { continue };
            let Some(rb) = by_site_b.get(&site_b).and_then(|v| v.get(k)) else { continue };
            if r.shape.first() != rb.shape.first() {
                continue; // another batch size: rows are compared through the per-token records
            }
            compared += 1;
            if r.digest != rb.digest || r.shape != rb.shape || r.dtype != rb.dtype {
                differing += 1;
                whole_differ.push(sa.path(r.site).to_string());
            }
        }
    }
    (compared, differing, whole_differ)
}

/// A root inside layer L is absorbed when layer L's output at its (row, position) still matches.
fn absorbed(al: &Alignment, path: &str, row: u32, pos: u32) -> bool {
    layer_of(path).is_some_and(|l| al.matched(&format!("layers.{l}.mlp_residual"), row, pos))
}

/// The root the report names: the first that reaches its layer's output, else the first.
pub(crate) fn reported(al: &Alignment, roots: &[Found]) -> Option<Found> {
    let path = |f: &Found| al.path_of(0, f.seq_a).unwrap_or_default();
    roots.iter().find(|f| !absorbed(al, path(f), f.row, f.pos)).or(roots.first()).copied()
}

/// The first pass's root causes as the report states them (records read back from both traces),
/// and the first point where the token ids themselves differ (no op is blamed for that).
fn find_roots(sa: &Side, sb: &Side, al: &Alignment, envd: &[EnvDiff]) -> (Vec<OpDivergence>, Option<InputsDiffer>) {
    let inputs_differ = al.input_differs.map(|f| {
        let in_prompt = f.pos < sa.prompt_len().min(sb.prompt_len());
        let explanation = if in_prompt {
            format!("the token ids entering the model differ at prompt position {}: the runs had different prompts", f.pos)
        } else {
            format!("the token ids differ at generated position {} although everything before matched: the sampling chose differently (see the settings that differ)", f.pos)
        };
        InputsDiffer { position: f.pos, row: f.row, in_prompt, explanation }
    });
    let roots = al
        .roots()
        .into_iter()
        .filter_map(|f| {
            let (ra, ta) = sa.entry(f.seq_a, f.row, f.pos)?;
            let (rb, tb) = sb.entry(f.seq_b, f.row, f.pos)?;
            let (d, rel) = diff_bound(ta, tb, slice_len(ra, f.row, f.pos));
            let path = sa.path(ra.site).to_string();
            Some(OpDivergence {
                seq: ra.seq,
                step: ra.step,
                layer: layer_of(&path),
                path,
                op: sa.sites[ra.site as usize].1.to_string(),
                position: f.pos,
                row: f.row,
                b_row: sb.own_row(f.row),
                inputs_matched: true,
                max_abs_diff: d,
                max_rel_diff: rel,
                below_resolution: d == 0.0 && ta.digest != tb.digest,
                nonfinite: (ta.nonfinite, tb.nonfinite),
                class: classify(sa, ra, sb, rb, envd),
                a: entry_view(sa, ra, ta),
                b: entry_view(sb, rb, tb),
                elementwise: None,
            })
        })
        .collect();
    (roots, inputs_differ)
}

/// The entry point a root is, `live` when it reached its layer's output.
fn entry_point(d: &OpDivergence, live: bool) -> EntryPoint {
    EntryPoint { path: d.path.clone(), op: d.op.clone(), layer: d.layer, position: d.position, row: d.row, b_row: d.b_row, class: d.class, max_abs_diff: d.max_abs_diff, live }
}

/// What a report says of one trace.
fn side_info(s: &Side) -> SideInfo {
    SideInfo {
        // The file name only: reports are pasted into public bug reports, paths carry user names.
        path: s.trace.path.file_name().map_or_else(|| s.trace.path.display().to_string(), |n| n.to_string_lossy().into_owned()),
        truncated: s.trace.truncated,
        op_records: s.records,
        tokens: s.tokens.len(),
        text: s.tokens.iter().filter_map(|t| t.rows.first()).map(|c| c.text.as_str()).collect(),
    }
}

/// The settings that differ, less the prompts unless both traces hold theirs (`both_hold`; a
/// redacted trace's placeholder differs from any prompt).
fn reported_env(mut d: Vec<EnvDiff>, both_hold: bool) -> Vec<EnvDiff> {
    if !both_hold {
        d.retain(|x| !matches!(x.key.as_str(), "run.prompt" | "run.prompt_tokens") && !x.key.starts_with("run.texts"));
    }
    d
}

/// Where the op graphs part ([`Alignment::fork`]), by module path, when that comes before the
/// op blamed (`fd`): the graphs parted first, so `fd` is no longer the first divergence; a note
/// names it.
fn graph_fork(al: &Alignment, fd: &mut Option<OpDivergence>, notes: &mut Vec<String>) -> Option<GraphFork> {
    let (f, ia, ib) = al.fork()?;
    if let Some(d) = fd.as_ref() {
        if (d.position, d.seq) <= (f.pos, f.seq_a) {
            return None;
        }
        notes.push(format!("after the graphs part, {} ({}) at token position {} differs with matching inputs: {}", d.path, d.op, d.position, d.class.describe()));
        *fd = None;
    }
    let owned = |v: Vec<&str>| v.into_iter().map(str::to_string).collect();
    Some(GraphFork { path: al.path_of(0, f.seq_a)?.to_string(), row: f.row, position: f.pos, a_inputs: owned(ia), b_inputs: owned(ib) })
}

/// Each side's first non-finite op output, when they differ in where (or whether) one appears.
fn nonfinite_sides(al: &Alignment) -> Option<NonFiniteSides> {
    let [x, y] = al.nonfinite();
    let same = match (&x, &y) {
        (None, None) => true,
        (Some(p), Some(q)) => (p.path.as_str(), p.position) == (q.path.as_str(), q.position),
        _ => false,
    };
    (!same).then_some(NonFiniteSides { a: x, b: y })
}

/// Inputs that differ at or before the root cause explain it: no op is blamed then; a root
/// before the first differing input stands. Differing inputs seen in the headers win.
fn reconcile(mut inputs_differ: Option<InputsDiffer>, mut first_divergence: Option<OpDivergence>, header_inputs: Option<InputsDiffer>) -> (Option<InputsDiffer>, Option<OpDivergence>) {
    if let (Some(inp), Some(fd)) = (&inputs_differ, &first_divergence) {
        if inp.position <= fd.position && inp.in_prompt {
            first_divergence = None;
        }
    }
    if let (Some(inp), Some(fd)) = (&inputs_differ, &first_divergence) {
        if inp.position > fd.position {
            inputs_differ = None;
        }
    }
    if header_inputs.is_some() {
        inputs_differ = header_inputs;
        first_divergence = None;
    }
    (inputs_differ, first_divergence)
}

/// Fills in the root cause's elementwise metrics from both traces' dumps; without them, the
/// note saying which `--dump` gives them.
fn add_elementwise(sa: &Side, sb: &Side, fd: &mut OpDivergence) -> Option<String> {
    if let (Some(ra), Some(rb)) = (sa.record(fd.seq), sb.record(fd.b.seq)) {
        fd.elementwise = elementwise(sa, ra, sb, rb, fd.row, fd.position);
    }
    fd.elementwise.is_none().then(|| {
        let pattern = match fd.layer {
            Some(_) => format!("{}.*", layer_group(&fd.path)),
            None => fd.path.clone(),
        };
        format!("for elementwise metrics (ULP distances) of the root cause, re-record both runs with --dump '{pattern}'")
    })
}

/// Notes on how the rows were paired and which trace is truncated.
fn pairing_notes(sa: &Side, sb: &Side, pairs: &[(u32, u32)]) -> Vec<String> {
    let mut notes = Vec::new();
    if !pairs.is_empty() {
        let list: Vec<String> = pairs.iter().map(|(ra, rb)| format!("a row {ra} = b row {rb}")).collect();
        notes.push(format!("rows compared by request: {}; other rows have no counterpart", list.join(", ")));
    }
    for s in [sa, sb] {
        if s.trace.truncated {
            notes.push(format!(
                "{} is truncated (the run did not finish): compared its {} complete records",
                s.trace.path.file_name().map_or_else(|| s.trace.path.display().to_string(), |n| n.to_string_lossy().into_owned()),
                s.records
            ));
        }
    }
    notes
}

/// Why a sampled token flipped, from both runs' sampling records of that step.
fn sampling_of(a: &Trace, b: &Trace, sb: &Side, t: &TokenDivergence) -> Option<SamplingVerdict> {
    let x = a.sampling.iter().find(|s| s.index == t.step && s.row == t.row)?;
    let y = b.sampling.iter().find(|s| s.index == t.step && s.row == sb.own_row(t.row))?;
    Some(classify_sampling(x, y))
}

/// Notes on how the runs ended: different stops, or identical only over the common part.
fn ending_notes(sa: &Side, sb: &Side, identical: bool) -> Vec<String> {
    let (a, b) = (sa.trace, sb.trace);
    let mut notes = Vec::new();
    let stops = (a.footer.as_ref().map(|f| f.stop.as_str()), b.footer.as_ref().map(|f| f.stop.as_str()));
    if let (Some(x), Some(y)) = stops {
        if x != y {
            notes.push(format!("the runs stopped differently: a {x}, b {y}"));
        }
    }
    if identical && (a.truncated || b.truncated || sa.tokens.len() != sb.tokens.len() || sa.records != sb.records) {
        notes.push("identical over the part both traces hold; the longer run was not compared past it".into());
    }
    notes
}

/// Where a difference entered: an op output that differs at one (row, position) while the op's
/// inputs matched bit for bit there. `trace bisect --causal` patches these.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EntryPoint {
    /// Module path of the op.
    pub path: String,
    /// Op name.
    pub op: String,
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
    pub layer: String,
    /// Lower bound of max |a - b| over the layer's op outputs (from samples and reductions);
    /// NaN when a NaN/±Inf appears on one side only.
    pub max_abs_diff: f64,
    /// (op, row, position) entries of the layer that differ.
    pub differing: u64,
    /// (op, row, position) entries of the layer compared.
    pub compared: u64,
}

/// The largest difference per layer along the whole run (every row and position), for a chart.
///
/// # Errors
/// As [`bisect`] for traces that do not align.
pub fn layer_profile(a: &Trace, b: &Trace) -> Result<Vec<LayerPoint>> {
    let (sa, sb) = (Side::new(a, None)?, Side::new(b, None)?);
    let mut out: Vec<LayerPoint> = Vec::new();
    for r in &sa.recs {
        let path = sa.path(r.site);
        let layer = layer_group(path);
        let i = match out.iter().position(|p| p.layer == layer) {
            Some(i) => i,
            None => {
                out.push(LayerPoint { layer, max_abs_diff: 0.0, differing: 0, compared: 0 });
                out.len() - 1
            }
        };
        let Some(&site_b) = sb.site_by_path.get(path) else { continue };
        for t in &r.tokens {
            let Some((rb, tb)) = sb.token(site_b, t.row, t.pos) else { continue };
            let p = &mut out[i];
            p.compared += 1;
            if t.digest != tb.digest || r.dtype != rb.dtype {
                p.differing += 1;
                let (d, _) = diff_bound(t, tb, slice_len(r, t.row, t.pos));
                p.max_abs_diff = if d.is_nan() || p.max_abs_diff.is_nan() { f64::NAN } else { p.max_abs_diff.max(d) };
            }
        }
    }
    Ok(out)
}

/// A dumped slice: its dtype (`f32`, `f16`, `bf16`) and its values in order.
pub type DumpedSlice = (String, Vec<f64>);

/// The dumped values of op outputs in `t` at `(module path, own batch row, position)` keys, one
/// answer per key: the dtype and the slice's values in order (the elements its per-token digest
/// covers, as [`crate::record::token_slice`] lists them), or `None` where the op's output was
/// not dumped (`--dump`), the key names no record, or the batch is padded.
///
/// # Errors
/// A trace whose site table is out of order.
pub fn dumped_slices(t: &Trace, keys: &[(String, u32, u32)]) -> Result<Vec<Option<DumpedSlice>>> {
    let side = Side::new(t, None)?;
    Ok(keys
        .iter()
        .map(|(path, row, pos)| {
            let site = *side.site_by_path.get(path.as_str())?;
            let (r, _) = side.token(site, *row, *pos)?;
            let (v, idx) = side.slice(r, *row, *pos)?;
            let vals: Option<Vec<f64>> = idx.iter().map(|&i| v.f64.get(i).copied()).collect();
            Some((v.dtype.clone(), vals?))
        })
        .collect())
}

/// [`bisect`], also returning every entry point (not only the reported root cause and the
/// absorbed ones before it), in (position, execution) order.
///
/// # Errors
/// As [`bisect`].
pub fn bisect_with_entries(a: &Trace, b: &Trace) -> Result<(Report, Vec<EntryPoint>)> {
    same_model(&a.header, &b.header, &a.path, &b.path)?;
    let pairs = pairing(&a.header, &b.header);
    let al = Alignment::run(&mut a.items.iter(), &mut b.items.iter(), b_rows(&pairs), [&a.path, &b.path])?;
    report(a, b, &pairs, &al)
}

/// (row of a, row of b) pairs holding the same request, when the batches differ; empty when
/// they hold the same requests (every row compared as itself).
pub(crate) fn pairing(a: &Header, b: &Header) -> Vec<(u32, u32)> {
    let (keys_a, keys_b) = (row_keys(a), row_keys(b));
    if keys_a != keys_b {
        row_pairs(&keys_a, &keys_b)
    } else {
        Vec::new()
    }
}

/// Run b's own row → the row of a it is compared as (`None`: every row as itself).
pub(crate) fn b_rows(pairs: &[(u32, u32)]) -> Option<HashMap<u32, u32>> {
    (!pairs.is_empty()).then(|| pairs.iter().map(|&(ra, rb)| (rb, ra)).collect())
}

/// The report of `a` against `b`, from the first pass `al` over them; `a` and `b` hold at least
/// the records the report names (the whole traces, or what
/// [`crate::bisect_file::bisect_files`] read back).
pub(crate) fn report(a: &Trace, b: &Trace, pairs: &[(u32, u32)], al: &Alignment) -> Result<(Report, Vec<EntryPoint>)> {
    // A batch of different requests: each row of b is compared with the row of a that holds the
    // same request (a prompt alone against the same prompt among others).
    let (inputs_a, inputs_b) = (row_inputs(&a.header), row_inputs(&b.header));
    let (keys_a, keys_b) = (row_keys(&a.header), row_keys(&b.header));
    let both_hold = crate::redact::holds_prompt(&a.header) && crate::redact::holds_prompt(&b.header);
    let pairs = pairs.to_vec();
    let mut sa = Side::new(a, None)?;
    let mut sb = Side::new(b, b_rows(&pairs))?;
    (sa.records, sb.records) = (al.records(0), al.records(1));
    let mut notes = pairing_notes(&sa, &sb, &pairs);

    let mut envd = env_diff(&a.header, &b.header);
    envd.extend(crate::env::build_diff(a.build.as_ref(), b.build.as_ref()).into_iter().map(|(key, a, b)| EnvDiff { key, a, b }));

    let (prompt_differs, header_inputs) = header_inputs(a, b, both_hold, (&keys_a, &keys_b), &pairs, (&inputs_a, &inputs_b));

    // Token flips (a redacted trace holds no token ids: its generated tokens are compared
    // through the input_ids digests of the steps that read them).
    let first_token_divergence = if both_hold { first_token_flip(&sa, &sb) } else { None };
    if !both_hold {
        notes.push("a redacted trace holds no token ids: generated tokens were compared through the digests of the input ids that fed them back".into());
    }
    let sampling_verdict = first_token_divergence.as_ref().and_then(|t| sampling_of(a, b, &sb, t));
    if sa.tokens.len() != sb.tokens.len() && first_token_divergence.is_none() {
        notes.push(format!("the runs generated {} and {} tokens; the common {} agree", sa.tokens.len(), sb.tokens.len(), sa.tokens.len().min(sb.tokens.len())));
    }

    let (wc, wd, whole_differ) = align_whole(&sa, &sb);
    let (compared, differing) = (al.compared + wc, al.differing + wd);
    let (mut roots, inputs_differ) = find_roots(&sa, &sb, al, &envd);
    if al.roots_total > roots.len() as u64 {
        notes.push(format!("{} root causes found; the earliest {} are listed", al.roots_total, roots.len()));
    }
    // A root cause inside layer L is absorbed when layer L's output at that (row, position) still
    // matches: later ops rounded the difference away (softmax over one key, for example). Report
    // the first one that reaches the residual stream; list the absorbed ones before it.
    let rows = row_answers(&sa, &sb, &pairs, &inputs_a, &roots, both_hold);
    let entries: Vec<EntryPoint> = roots.iter().map(|d| entry_point(d, !absorbed(al, &d.path, d.row, d.position))).collect();
    let live = roots.iter().position(|d| !absorbed(al, &d.path, d.row, d.position));
    let groups = group_roots(&roots[..live.map_or(roots.len().min(1), |i| i + 1)]);
    let (first_divergence, absorbed_roots) = match live {
        Some(i) => {
            let before: Vec<Absorbed> = roots[..i].iter().map(Absorbed::from).collect();
            (Some(roots.swap_remove(i)), before)
        }
        None => (roots.first().cloned(), Vec::new()),
    };
    let absorbed_count = absorbed_roots.len();
    let mut absorbed_roots = absorbed_roots;
    absorbed_roots.truncate(MAX_ABSORBED_LISTED);
    let (inputs_differ, mut first_divergence) = reconcile(inputs_differ, first_divergence, header_inputs);
    let graph_fork = if inputs_differ.is_none() { graph_fork(al, &mut first_divergence, &mut notes) } else { None };
    if let Some(fd) = first_divergence.as_mut() {
        notes.extend(add_elementwise(&sa, &sb, fd));
    }
    let first_divergence_reported = first_divergence.is_some();
    let (growth, drift, drift_grows) = match &first_divergence {
        Some(fd) => around_root(&sa, &sb, al, fd, &mut notes),
        None => (Vec::new(), Vec::new(), false),
    };
    if compared == 0 {
        return Err(Error::Mismatch(format!("nothing to compare: {} ({} op records) and {} ({} op records) have no op output in common", a.path.display(), sa.records, b.path.display(), sb.records)));
    }
    if let Some(first) = whole_differ.first() {
        notes.push(format!("{} output(s) without a token axis differ, first {first} (compared whole, by digest)", whole_differ.len()));
    }
    let identical = differing == 0 && first_token_divergence.is_none() && !prompt_differs;
    // Identical so far, but a run did not finish or generated less: not a pass.
    let incomplete = identical && (a.truncated || b.truncated || sa.tokens.len() != sb.tokens.len());
    notes.extend(ending_notes(&sa, &sb, identical));
    let report = Report {
        verdict: if incomplete {
            Verdict::Incomplete
        } else if identical {
            Verdict::Identical
        } else {
            Verdict::Diverged
        },
        rows,
        a: side_info(&sa),
        b: side_info(&sb),
        first_token_divergence,
        sampling: sampling_verdict,
        first_divergence,
        inputs_differ,
        growth,
        drift,
        drift_grows,
        absorbed: absorbed_roots,
        absorbed_count,
        groups: if first_divergence_reported { groups } else { Vec::new() },
        nonfinite: nonfinite_sides(al),
        env_diff: reported_env(envd, both_hold),
        compared,
        differing,
        notes,
        graph_fork,
    };
    Ok((report, entries))
}

/// The per-request answers: each paired row (or rows 0.. of both when the batches hold the same
/// requests), with its embedding difference (encoders) or first token flip and final-logits
/// difference per step (decoders), and its first root.
fn row_answers(sa: &Side, sb: &Side, pairs: &[(u32, u32)], inputs_a: &[String], roots: &[OpDivergence], tokens_held: bool) -> Vec<RowAnswer> {
    let pairs: Vec<(u32, u32)> = if pairs.is_empty() {
        let n = inputs_a.len().min(row_inputs(&sb.trace.header).len()) as u32;
        (0..n).map(|r| (r, r)).collect()
    } else {
        pairs.to_vec()
    };
    // The final logits: `logits` (a cast to f32) when the model has it, else `lm_head`.
    let logits_site = ["logits", "lm_head"].into_iter().find(|p| sa.site_by_path.contains_key(p) && sb.site_by_path.contains_key(p));
    let logit_recs: Vec<&OpRecord> = match logits_site {
        Some(path) => sa.recs.iter().copied().filter(|r| r.site == sa.site_by_path[path]).collect(),
        None => Vec::new(),
    };
    pairs
        .iter()
        .map(|&(ra, rb)| {
            let input: String = inputs_a.get(ra as usize).map(|t| t.chars().take(80).collect()).unwrap_or_default();
            let embedding = match (sa.embeddings.and_then(|v| v.get(ra as usize)), sb.embeddings.and_then(|v| v.get(rb as usize))) {
                (Some(x), Some(y)) if x.len() == y.len() => Some(EmbeddingDiff {
                    identical: x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
                    // NaN when a component is NaN on one side (f64::max would skip it).
                    max_abs_diff: x.iter().zip(y).map(|(p, q)| (*p as f64 - *q as f64).abs()).fold(0.0, |m, d| if d.is_nan() || m.is_nan() { f64::NAN } else { m.max(d) }),
                    cosine: cosine(x, y),
                    dims: x.len(),
                }),
                _ => None,
            };
            let (mut compared, mut first_flip) = (0u32, None);
            for (k, (ea, eb)) in sa.tokens.iter().zip(&sb.tokens).enumerate().filter(|_| tokens_held) {
                let (Some(ca), Some(cb)) = (ea.rows.iter().find(|c| c.row == ra), eb.rows.iter().find(|c| c.row == rb)) else {
                    break;
                };
                compared += 1;
                if ca.token != cb.token {
                    first_flip = Some(k as u32);
                    break;
                }
            }
            let mut logits_max_abs_diff = Vec::new();
            if let Some(path) = logits_site {
                let site_b = sb.site_by_path[path];
                for r in &logit_recs {
                    for t in r.tokens.iter().filter(|t| t.row == ra) {
                        if let Some((rb_rec, tb)) = sb.token(site_b, ra, t.pos) {
                            let d = if t.digest == tb.digest { 0.0 } else { diff_bound(t, tb, slice_len(r, ra, t.pos).or(slice_len(rb_rec, rb, t.pos))).0 };
                            logits_max_abs_diff.push(d);
                        }
                    }
                    if first_flip.is_some_and(|f| logits_max_abs_diff.len() > f as usize) {
                        break;
                    }
                }
            }
            let first_root = roots.iter().find(|d| d.row == ra).map(|d| format!("{} @ {}", d.path, d.position));
            RowAnswer { a_row: ra, b_row: rb, input, embedding, tokens_compared: compared, first_flip, logits_max_abs_diff, first_root }
        })
        .collect()
}

fn first_token_flip(sa: &Side, sb: &Side) -> Option<TokenDivergence> {
    for (k, (ea, eb)) in sa.tokens.iter().zip(&sb.tokens).enumerate() {
        for ca in &ea.rows {
            // Run b's choice for the same request (row mapping), if b has that row.
            let Some(cb) = eb.rows.iter().find(|c| sb.compared_row(c.row) == Some(ca.row)) else { continue };
            if ca.token != cb.token {
                let common_text = sa.tokens[..k].iter().filter_map(|t| t.rows.first()).map(|c| c.text.as_str()).collect();
                return Some(TokenDivergence {
                    step: ea.index,
                    row: ca.row,
                    pos: ea.pos,
                    b_pos: eb.pos,
                    a_token: ca.token,
                    b_token: cb.token,
                    a_text: ca.text.clone(),
                    b_text: cb.text.clone(),
                    a_margin: ca.margin,
                    b_margin: cb.margin,
                    a_tie: ca.tie,
                    b_tie: cb.tie,
                    common_text,
                });
            }
        }
    }
    None
}

/// Per layer (then `norm`, `lm_head`): how much its ops' outputs differ at (row, pos).
fn growth_table(sa: &Side, sb: &Side, row: u32, pos: u32) -> Vec<LayerGrowth> {
    let mut order: Vec<String> = Vec::new();
    let mut acc: HashMap<String, LayerGrowth> = HashMap::new();
    for r in &sa.recs {
        for t in &r.tokens {
            if t.row != row || t.pos != pos {
                continue;
            }
            let path = sa.path(r.site);
            let Some(&site_b) = sb.site_by_path.get(path) else { continue };
            let Some((rb, tb)) = sb.token(site_b, row, pos) else { continue };
            let group = layer_group(path);
            let g = acc.entry(group.clone()).or_insert_with(|| {
                order.push(group.clone());
                LayerGrowth { layer: group, identical: true, ops_differing: 0, ops_compared: 0, max_abs_diff: 0.0, max_rel_diff: 0.0, exact_max_abs_diff: None, max_ulp: None }
            });
            g.ops_compared += 1;
            if t.digest != tb.digest {
                g.identical = false;
                g.ops_differing += 1;
                let (d, rel) = diff_bound(t, tb, slice_len(r, row, pos));
                if d.is_nan() || g.max_abs_diff.is_nan() {
                    g.max_abs_diff = f64::NAN;
                    g.max_rel_diff = f64::NAN;
                } else {
                    g.max_abs_diff = g.max_abs_diff.max(d);
                    g.max_rel_diff = g.max_rel_diff.max(rel);
                }
                if let Some(e) = elementwise(sa, r, sb, rb, row, pos) {
                    g.exact_max_abs_diff = Some(g.exact_max_abs_diff.unwrap_or(0.0).max(e.max_abs_diff));
                    if let Some(u) = e.max_ulp {
                        g.max_ulp = Some(g.max_ulp.unwrap_or(0).max(u));
                    }
                }
            }
        }
    }
    order.into_iter().filter_map(|k| acc.remove(&k)).collect()
}

/// Cosine similarity of two vectors, in f64: `a·b / (|a| |b|)` (0 when either is zero).
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (*x as f64, *y as f64);
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    if aa == 0.0 || bb == 0.0 {
        0.0
    } else {
        ab / (aa.sqrt() * bb.sqrt())
    }
}

#[cfg(test)]
mod tests {
    use super::{drift_rows, MAX_DRIFT_ROWS};

    #[test]
    fn drift_rows_keep_the_root_the_first_difference_and_the_largest() {
        let mut all: Vec<(u32, f64)> = (0..100).map(|p| (p, 0.0)).collect();
        all[29].1 = 1e-6;
        all[61].1 = 5.0;
        all[62].1 = 1e-7;
        let rows = drift_rows(&all, 29);
        assert!(rows.len() <= MAX_DRIFT_ROWS, "{rows:?}");
        for must in [0, 29, 61, 99] {
            assert!(rows.contains(&must), "{must} missing from {rows:?}");
        }
        assert!(rows.windows(2).all(|w| w[0] < w[1]), "{rows:?}");
        assert_eq!(drift_rows(&all[..4], 2), vec![0, 1, 2, 3]);
    }
}
