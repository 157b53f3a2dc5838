//! The size a `--dump` will take, said before the run writes it ([`estimate`]).
//!
//! How: the run's own model and tracer settings run a few small calibration passes (`RUNS`:
//! prefills of 2, 3 and 4 positions, decode steps after a one-pass and after a chunked prefill)
//! into a sink that keeps only the shape of each value it would dump. Each dim of a value is then
//! fitted, against the same value (same site, occurrence in the pass, rank and dtype) in another
//! pass, to one of a few forms: a constant (hidden size, heads, batch), the pass's positions `s`,
//! the keys attended to `p + s`, both, or the positions cached before the pass `p` (`Form`).
//! Each pass the run will make is sized from the calibration pass of its kind (the first pass,
//! the one after it, a later one; prefill or decode), at its own positions. A value of the first
//! pass that no later one dumps again is a weight (an operand stored once per trace): counted
//! once. The figure is the values' bytes before the trace's compression (which takes little off
//! float values); a run that stops early at end-of-sequence writes less, and left-padded rows
//! are sized as full rows.

use crate::generate::GenConfig;
use crate::models::Decoder;
use crate::tracer::Sink;
use crate::tracer::Tracer;
use candle_core::Tensor;
use candle_trace_format::dump::DumpSpec;
use candle_trace_format::error::{Error, Result};
use candle_trace_format::record::{Item, OperandValue, Phase};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The expected dump of a decoder run, in bytes of values before compression.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DumpEstimate {
    /// Prefill passes the dump covers, and their bytes.
    pub prefill_passes: u32,
    /// Bytes of the covered prefill passes.
    pub prefill: u64,
    /// Decode steps the dump covers (a run that stops early makes fewer).
    pub decode_passes: u32,
    /// Bytes of the covered decode steps.
    pub decode: u64,
    /// Bytes of values dumped once per trace (weights, as the dumped ops' operands).
    pub once: u64,
}

impl DumpEstimate {
    /// All bytes: prefill, decode and once-per-trace values.
    pub fn total(&self) -> u64 {
        self.prefill + self.decode + self.once
    }

    /// One line for the user before the run: the total and its parts, and for an unbounded dump
    /// the bounds that shrink it (`--dump SPEC@decode`, `SPEC@from:N`).
    pub fn note(&self, spec: &DumpSpec) -> String {
        let mut parts = Vec::new();
        if self.prefill_passes > 0 {
            parts.push(format!("prefill {} in {} pass{}", bytes(self.prefill), self.prefill_passes, if self.prefill_passes == 1 { "" } else { "es" }));
        }
        if self.decode_passes > 0 {
            parts.push(format!("{} decode step{} {}", self.decode_passes, if self.decode_passes == 1 { "" } else { "s" }, bytes(self.decode)));
        }
        if self.once > 0 {
            parts.push(format!("weights {}", bytes(self.once)));
        }
        let hint = if spec.unbounded() == spec && self.prefill > self.decode { "; bound it with --dump SPEC@decode (decode steps only) or SPEC@from:N" } else { "" };
        format!("--dump {}: about {} of values before compression ({}){hint}", spec.to_arg(), bytes(self.total()), parts.join(", "))
    }
}

/// `n` bytes in words: `512 B`, `48.2 MB`, `1.10 GB` (powers of 1000).
pub fn bytes(n: u64) -> String {
    let x = n as f64;
    match n {
        0..=999 => format!("{n} B"),
        1_000..=999_999 => format!("{:.1} kB", x / 1e3),
        1_000_000..=999_999_999 => format!("{:.1} MB", x / 1e6),
        _ => format!("{:.2} GB", x / 1e9),
    }
}

/// A calibration pass: its phase, first position `p` and positions `s` (keys `k = p + s`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Point {
    phase: Phase,
    p: u64,
    s: u64,
}

impl Point {
    const fn new(phase: Phase, p: u64, s: u64) -> Self {
        Point { phase, p, s }
    }
}

/// The calibration runs: each from an empty KV cache, its passes in order. The first run gives a
/// decode step right after a one-pass prefill; the second a chunked prefill and steady decode
/// steps (each pass after the second reads a cache the pass before it built, which an `all`
/// dump stores again as an operand).
const RUNS: [&[Point]; 2] = [
    &[Point::new(Phase::Prefill, 0, 2), Point::new(Phase::Decode, 2, 1)],
    &[Point::new(Phase::Prefill, 0, 2), Point::new(Phase::Prefill, 2, 3), Point::new(Phase::Prefill, 5, 4), Point::new(Phase::Decode, 9, 1), Point::new(Phase::Decode, 10, 1)],
];
/// Indices into the calibration passes (in [`RUNS`] order): what a pass of the run is sized
/// like, and the passes its values' dims are fitted against, first first.
const FIRST: (usize, &[usize]) = (0, &[4]);
const AFTER_ONE_PREFILL: (usize, &[usize]) = (1, &[6]);
const SECOND_PREFILL: (usize, &[usize]) = (3, &[4]);
const LATER_PREFILL: (usize, &[usize]) = (4, &[3, 6]);
const LATER_DECODE: (usize, &[usize]) = (6, &[5]);

/// The expected dump of a run of `model` over `rows` prompts of (padded) length `prompt_len`
/// generating `gen.max_tokens` tokens in passes of `gen.prefill_chunk` positions, dumping what
/// `spec` selects, under the settings `configure` gives a tracer (the run's level and numerics;
/// it must not set a sink or a summary worker). The model's KV cache and padding are emptied
/// after the calibration.
///
/// # Errors
/// `configure`'s errors; candle errors of the calibration passes.
pub fn estimate(model: &mut Decoder, configure: impl FnOnce(Tracer) -> Result<Tracer>, spec: &DumpSpec, rows: usize, prompt_len: usize, gen: &GenConfig) -> Result<DumpEstimate> {
    let calib = Calibration::default();
    let mut tr = configure(Tracer::new(Box::new(calib.clone())))?.with_dump(spec.unbounded().clone());
    let device = model.device().clone();
    model.set_padding(Vec::new());
    let run = RUNS.iter().try_for_each(|points| -> Result<()> {
        model.clear_kv_cache();
        for pt in *points {
            let ids = Tensor::zeros((rows.max(1), pt.s as usize), candle_core::DType::U32, &device)?;
            model.forward(&mut tr, &ids, pt.p as usize, pt.phase)?;
        }
        Ok(())
    });
    model.clear_kv_cache();
    run?;
    let seen = std::mem::take(&mut *calib.0.lock().map_err(|_| Error::usage("dump estimate: a calibration pass panicked"))?);
    Ok(size_run(&seen.passes, spec, prompt_len, gen))
}

/// Sizes every pass of the run from the calibration passes `seen` ([`RUNS`] order).
fn size_run(seen: &[Vec<Value>], spec: &DumpSpec, prompt_len: usize, gen: &GenConfig) -> DumpEstimate {
    let points: Vec<Point> = RUNS.iter().flat_map(|r| r.iter().copied()).collect();
    let template = |(i, partners): (usize, &[usize])| Template::fit(seen, &points, i, partners);
    let (first, after_one, second, later_p, later_d) = (template(FIRST), template(AFTER_ONE_PREFILL), template(SECOND_PREFILL), template(LATER_PREFILL), template(LATER_DECODE));
    let mut est = DumpEstimate::default();
    let chunk = if gen.prefill_chunk == 0 { prompt_len.max(1) } else { gen.prefill_chunk };
    let mut passes = Vec::new();
    let mut pos = 0;
    while pos < prompt_len {
        let n = chunk.min(prompt_len - pos);
        passes.push(Point::new(Phase::Prefill, pos as u64, n as u64));
        pos += n;
    }
    let prefills = passes.len();
    passes.extend((0..gen.max_tokens.saturating_sub(1)).map(|i| Point::new(Phase::Decode, (prompt_len + i) as u64, 1)));
    for (i, pt) in passes.iter().enumerate() {
        let t = match (i, pt.phase) {
            (0, _) => &first,
            (1, Phase::Prefill) => &second,
            (_, Phase::Prefill) => &later_p,
            (_, _) if i == prefills && prefills == 1 => &after_one,
            _ => &later_d,
        };
        if !spec.covers(pt.phase, pt.p as u32, pt.s as u32) {
            continue;
        }
        let b = t.bytes(*pt);
        if pt.phase == Phase::Prefill {
            (est.prefill_passes, est.prefill) = (est.prefill_passes + 1, est.prefill + b);
        } else {
            (est.decode_passes, est.decode) = (est.decode_passes + 1, est.decode + b);
        }
    }
    if est.prefill_passes + est.decode_passes > 0 {
        est.once = first.once;
    }
    est
}

/// How one dim of a dumped value grows with a pass: `m · f(pass)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Form {
    /// Fixed (hidden size, heads, batch): `m`.
    Const,
    /// The pass's positions: `m · s`.
    Positions,
    /// The keys attended to: `m · (p + s)`.
    Keys,
    /// Both: `m · s · (p + s)`.
    Both,
    /// The positions cached before the pass: `m · p`.
    Cached,
}

impl Form {
    /// Tried in this order: the first that fits two observations wins.
    const ALL: [Form; 5] = [Form::Const, Form::Positions, Form::Keys, Form::Both, Form::Cached];

    fn at(self, pt: Point) -> u64 {
        match self {
            Form::Const => 1,
            Form::Positions => pt.s,
            Form::Keys => pt.p + pt.s,
            Form::Both => pt.s * (pt.p + pt.s),
            Form::Cached => pt.p,
        }
    }

    /// The form and factor `m` with `m · f(a) = ya` and `m · f(b) = yb`, if one fits.
    fn fit(ya: u64, a: Point, yb: u64, b: Point) -> Option<(Form, u64)> {
        Form::ALL.into_iter().find_map(|f| {
            let (fa, fb) = (f.at(a), f.at(b));
            let m = ya.checked_div(fa).or(yb.checked_div(fb))?;
            (m * fa == ya && m * fb == yb).then_some((f, m))
        })
    }
}

/// One value's size: each dim's form and factor, its bytes per element, and for a value of
/// fixed size (bytes per element 0: a quantized weight's blocks) its bytes.
type Sized = (Vec<(Form, u64)>, u64, u64);

/// The values one pass of the run dumps, sized like a calibration pass.
#[derive(Default)]
struct Template {
    /// Each value's size.
    values: Vec<Sized>,
    /// Bytes of the pass's values without a counterpart in a later pass: weights, dumped once.
    once: u64,
}

impl Template {
    /// Calibration pass `i` of `seen` (at `points[i]`), each value's dims fitted against its
    /// counterpart in the first of `partners` that has one (same site, occurrence, rank and
    /// dtype); a value none has is a weight (counted once) in the first pass, else taken as seen.
    fn fit(seen: &[Vec<Value>], points: &[Point], i: usize, partners: &[usize]) -> Template {
        let mut t = Template::default();
        let Some(values) = seen.get(i) else { return t };
        let mut used: Vec<Vec<bool>> = partners.iter().map(|&j| vec![false; seen.get(j).map_or(0, Vec::len)]).collect();
        for v in values {
            let found = partners.iter().enumerate().find_map(|(n, &j)| {
                // Among the pass's values of the same key, the first every dim of which fits a
                // form (a cache append's operands: the cache before it and the new keys).
                let fits = |w: &Value| v.shape.iter().zip(&w.shape).all(|(&ya, &yb)| Form::fit(ya as u64, points[i], yb as u64, points[j]).is_some());
                let candidates: Vec<usize> =
                    seen.get(j)?.iter().enumerate().filter(|(x, w)| !used[n][*x] && w.key == v.key && w.elem == v.elem && w.shape.len() == v.shape.len()).map(|(x, _)| x).collect();
                let w = candidates.iter().copied().find(|&x| fits(&seen[j][x])).or(candidates.first().copied())?;
                used[n][w] = true;
                Some((j, w))
            });
            let dims = match found {
                Some((j, w)) => v.shape.iter().zip(&seen[j][w].shape).map(|(&ya, &yb)| Form::fit(ya as u64, points[i], yb as u64, points[j]).unwrap_or((Form::Const, ya as u64))).collect(),
                None if i == FIRST.0 => {
                    t.once += v.bytes;
                    continue;
                }
                None => v.shape.iter().map(|&y| (Form::Const, y as u64)).collect(),
            };
            t.values.push((dims, v.elem, if v.elem == 0 { v.bytes } else { 0 }));
        }
        t
    }

    /// Bytes the pass at `pt` dumps (`once` apart).
    fn bytes(&self, pt: Point) -> u64 {
        self.values
            .iter()
            .map(|(dims, elem, fixed)| if *elem == 0 { *fixed } else { dims.iter().fold(*elem, |n, &(f, m)| n.saturating_mul(m.saturating_mul(f.at(pt)))) })
            .fold(0u64, u64::saturating_add)
    }
}

/// One value a calibration pass would have dumped.
#[derive(Clone, Debug)]
struct Value {
    /// (site, occurrence of the site in the pass, 0 for the output or 1 for an operand).
    key: (u32, u32, u8),
    shape: Vec<u32>,
    /// Bytes per element; 0 for a quantized weight (blocks, not elements).
    elem: u64,
    bytes: u64,
}

/// What the calibration passes would have dumped, pass by pass.
#[derive(Default)]
struct Seen {
    passes: Vec<Vec<Value>>,
    /// The current pass's op records: seq → (site, occurrence).
    ops: HashMap<u64, (u32, u32)>,
    occurrences: HashMap<u32, u32>,
    /// Operands pushed before the op record that reads them.
    pending: Vec<Value>,
}

/// The calibration's sink: keeps the shape of each value a pass would dump, drops the rest.
#[derive(Clone, Default)]
struct Calibration(Arc<Mutex<Seen>>);

impl Sink for Calibration {
    fn push(&mut self, item: Item) -> Result<()> {
        let mut seen = self.0.lock().map_err(|_| Error::usage("dump estimate: a calibration pass panicked"))?;
        let seen = &mut *seen;
        match item {
            Item::Forward(_) => {
                seen.passes.push(Vec::new());
                seen.ops.clear();
                seen.occurrences.clear();
            }
            Item::Op(rec) => {
                let occ = seen.occurrences.entry(rec.site).or_insert(0);
                seen.ops.insert(rec.seq, (rec.site, *occ));
                let key = (rec.site, *occ, 1);
                *occ += 1;
                let pending: Vec<Value> = seen.pending.drain(..).map(|v| Value { key, ..v }).collect();
                seen.passes.last_mut().into_iter().for_each(|p| p.extend(pending.iter().cloned()));
            }
            Item::Dump(d) => {
                let (site, occ) = seen.ops.get(&d.seq).copied().unwrap_or((u32::MAX, 0));
                let v = Value { key: (site, occ, 0), elem: elem_bytes(&d.shape, d.data.len()), shape: d.shape, bytes: d.data.len() as u64 };
                seen.passes.last_mut().into_iter().for_each(|p| p.push(v.clone()));
            }
            Item::Operand(OperandValue::Tensor(d) | OperandValue::QMatMulTensor(d)) => {
                seen.pending.push(Value { key: (u32::MAX, 0, 1), elem: elem_bytes(&d.shape, d.data.len()), shape: d.shape, bytes: d.data.len() as u64 });
            }
            Item::Operand(OperandValue::Quantized { shape, data, .. }) => seen.pending.push(Value { key: (u32::MAX, 0, 1), elem: 0, shape, bytes: data.len() as u64 }),
            _ => {}
        }
        Ok(())
    }
}

/// Bytes per element of a dense value of `shape` held in `len` bytes (0 for an empty one).
fn elem_bytes(shape: &[u32], len: usize) -> u64 {
    let n: u64 = shape.iter().map(|&d| d as u64).product();
    (len as u64).checked_div(n).unwrap_or(0)
}
