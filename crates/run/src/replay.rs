//! `trace replay` and `trace extract`: re-execute a recorded op from its dumped operands, on
//! this machine, and cut a self-contained repro trace holding a root-cause op.
//!
//! Replay runs the op through the same [`Kernel::run`] the live forward pass used, twice, and
//! compares the results' digests with each other ("deterministic here?") and with the recorded
//! output ("same as the recording?").

use crate::digest::summarize;
use crate::kernel::Execute;
use crate::kernel::{Kernel, Operand};
use crate::numerics::Numerics;
use candle_core::quantized::{ggml_file, GgmlDType, QMatMul};
use candle_core::{DType, Device};
use candle_trace_format::error::{Error, Result};
use candle_trace_format::format::{read_trace_where, Trace, TraceWriter};
use candle_trace_format::record::{Counterpart, Footer, Item, OperandValue};
use serde::Serialize;
use std::collections::HashSet;
use std::path::Path;

/// What `trace replay` found.
#[derive(Clone, Debug, Serialize)]
pub struct ReplayReport {
    /// Record id (`seq`) of the op replayed.
    pub seq: u64,
    /// Its module path.
    pub path: String,
    /// Its op name.
    pub op: String,
    /// The op descriptor run.
    pub kernel: Kernel,
    /// The device the replay ran on, named as trace headers name it.
    pub device: String,
    /// The dtype the float operands were converted to, when `--dtype` asked for one.
    pub dtype: Option<String>,
    /// The replay's output has the recorded output's bits.
    pub matches_recording: bool,
    /// Two replays gave the same bits.
    pub deterministic: bool,
    /// Repro traces: the replay has the other run's recorded bits.
    pub matches_counterpart: Option<bool>,
    /// Repro traces with the other run's operands: replaying its op here gives its recorded bits.
    pub counterpart_replay_matches: Option<bool>,
    /// Against the recorded output values (when dumped): elements that differ. A `--dtype`
    /// replay's float result is read back in the recording's dtype first.
    pub differing_elements: Option<u64>,
    /// Largest distance from the recorded values in ULP of the recording's dtype (`None` when
    /// not dumped, or an integer output of another dtype). Values of opposite sign are as far
    /// apart as their distances from zero added: a `--dtype` replay that flips the sign of a
    /// value near zero counts about 1e9 ULP of f32 there, so [`Self::max_abs_diff`] says more.
    pub max_ulp: Option<u64>,
    /// Of [`Self::differing_elements`], those whose sign differs from the recorded value's (a
    /// value near zero that crossed it): their ULP distance is counted through zero.
    pub sign_changes: Option<u64>,
    /// Largest |replayed − recorded| over the elements, in the output's units (NaN when one
    /// side of a differing element is NaN); beside it [`Self::recorded_abs_max`].
    pub max_abs_diff: Option<f64>,
    /// Largest |x| of the recorded output, the scale for [`Self::max_abs_diff`].
    pub recorded_abs_max: Option<f64>,
    /// Repro traces with the other run's operands: the two replays compared at the first token
    /// position whose recorded digests differ.
    pub a_vs_b: Option<AVsB>,
    /// Repro traces with the other run's operands: each operand of a against b's, compared
    /// where they overlap (the rows both runs fed the op); empty without b's operands.
    pub shared_operands: Vec<candle_trace_compare::shared_rows::OperandOverlap>,
    /// One sentence: what the replay says about the cause.
    pub verdict: String,
    /// Remarks: a perturbed record, a `--dtype` conversion.
    pub notes: Vec<String>,
}

/// Run a's and run b's results of the op, replayed here, at one token position.
#[derive(Clone, Debug, Serialize)]
pub struct AVsB {
    /// The token position compared: the first whose recorded digests differ.
    pub position: u32,
    /// Elements of the position's slice.
    pub elements: u64,
    /// Of those, elements whose bits differ.
    pub differing: u64,
    /// Largest ULP distance between a's and b's element.
    pub max_ulp: u64,
}

/// A's replay `ya` (record `ra`) against b's `yb` (record `rb`) at the first position where the
/// two records' per-token digests differ, element by element; `None` without a token axis,
/// such a position, or slices of one length and dtype.
fn a_vs_b(ra: &candle_trace_format::record::OpRecord, ya: &candle_core::Tensor, rb: &candle_trace_format::record::OpRecord, yb: &candle_core::Tensor) -> Result<Option<AVsB>> {
    let (va, vb) = (candle_trace_format::dump::decode(&crate::values::encode(0, ya)?)?, candle_trace_format::dump::decode(&crate::values::encode(0, yb)?)?);
    if va.dtype != vb.dtype {
        return Ok(None);
    }
    let Some(at) = candle_trace_compare::repro::first_differing(ra, &va.shape, rb, &vb.shape) else { return Ok(None) };
    let slice = |v: &candle_trace_format::dump::Values, r: &[std::ops::Range<usize>]| -> Option<Vec<i64>> { r.iter().flat_map(|r| r.clone().map(|i| v.ordered.get(i).copied())).collect() };
    let (Some(sa), Some(sb)) = (slice(&va, &at.a_at), slice(&vb, &at.b_at)) else { return Ok(None) };
    let ulps: Vec<u64> = sa.iter().zip(&sb).map(|(x, y)| x.abs_diff(*y)).collect();
    Ok(Some(AVsB { position: at.position, elements: ulps.len() as u64, differing: ulps.iter().filter(|u| **u > 0).count() as u64, max_ulp: ulps.iter().copied().max().unwrap_or(0) }))
}

/// The replay's remarks: a perturbed record, a `--dtype` conversion, b's operands missing.
fn replay_notes(perturbed: bool, dtype: Option<DType>, no_b_operands: bool) -> Vec<String> {
    let mut notes = Vec::new();
    if perturbed {
        notes.push("this record was perturbed (--perturb) after the op ran: the replay computes the unperturbed value".into());
    }
    if let Some(dt) = dtype {
        notes.push(format!("float operands converted to {} before the replay", dt.as_str()));
    }
    if no_b_operands {
        notes.push("this repro holds b's record but not b's operands (b did not dump the op, or they were over what one frame of the repro holds): b's op cannot be replayed here; re-record b with the same --dump as a, or narrow what the op reads".into());
    }
    notes
}

fn ggml_dtype(name: &str) -> Option<GgmlDType> {
    use GgmlDType::*;
    Some(match name {
        "F32" => F32,
        "F16" => F16,
        "BF16" => BF16,
        "Q4_0" => Q4_0,
        "Q4_1" => Q4_1,
        "Q5_0" => Q5_0,
        "Q5_1" => Q5_1,
        "Q8_0" => Q8_0,
        "Q8_1" => Q8_1,
        "Q2K" => Q2K,
        "Q3K" => Q3K,
        "Q4K" => Q4K,
        "Q5K" => Q5K,
        "Q6K" => Q6K,
        "Q8K" => Q8K,
        _ => return None,
    })
}

/// Builds an operand on `device`. Only values from a [`candle_trace_compare::repro::plan`] come here: their
/// bytes were checked against dtype and shape there (candle's GGML block reader trusts the shape).
fn operand(v: &OperandValue, dtype: Option<DType>, device: &Device) -> Result<Operand> {
    Ok(match v {
        OperandValue::Tensor(d) => Operand::T(converted(crate::values::to_tensor(d, device)?, dtype)?),
        // A GGUF weight candle keeps dense converts like any dense operand.
        OperandValue::QMatMulTensor(d) => Operand::Q(QMatMul::Tensor(converted(crate::values::to_tensor(d, device)?, dtype)?)),
        OperandValue::Quantized { ggml_dtype: g, shape, data, .. } => {
            let gd = ggml_dtype(g).ok_or_else(|| Error::usage(format!("unknown quantization type {g}")))?;
            let dims = shape.iter().map(|&x| x as usize).collect();
            Operand::Q(QMatMul::from_qtensor(ggml_file::qtensor_from_ggml(gd, data, dims, device)?)?)
        }
    })
}

/// `t` in `dtype` when one is asked for and `t` is a float tensor.
fn converted(t: candle_core::Tensor, dtype: Option<DType>) -> Result<candle_core::Tensor> {
    Ok(match dtype {
        Some(dt) if t.dtype().is_float() => t.to_dtype(dt)?,
        _ => t,
    })
}

/// Replays record `seq` of `t` (default: the only dumped op, as in a repro trace).
///
/// # Errors
/// [`Error::Usage`] when the record does not exist, was not dumped (the message names the
/// `--dump` pattern to record with), or several ops were dumped and `seq` is not given; candle
/// errors from the op (for example a `--dtype` the op cannot take).
pub fn replay(t: &Trace, seq: Option<u64>, dtype: Option<DType>, device: &Device) -> Result<ReplayReport> {
    let plan = candle_trace_compare::repro::plan(t, seq)?;
    let (rec, path, op, kernel) = (plan.record, plan.path, plan.op, plan.kernel.clone());
    let operands = plan.operands.iter().map(|v| operand(v, dtype, device)).collect::<Result<Vec<Operand>>>()?;
    // The numerics the trace recorded decide the kernel, as they did live (`--numerics invariant`:
    // the batch-invariant kernels); the other run's op, in a repro trace, is replayed the same way.
    let numerics = Numerics::of_config(&t.header.run.model.config).ok_or_else(|| Error::usage("the trace's numerics are not ones this build knows (fixed, upstream, invariant)"))?;
    let run = |ops: &[Operand]| match (kernel.run_as(ops, numerics), dtype) {
        (Err(e), Some(dt)) => Err(Error::usage(format!("replay with --dtype {}: the op refuses its converted operands ({e}); replay without --dtype", dt.as_str()))),
        (r, _) => r.map_err(Error::from),
    };
    let y1 = run(&operands)?;
    let y2 = run(&operands)?;
    let d1 = summarize(&y1, None)?.digest;
    let d2 = summarize(&y2, None)?.digest;
    // Against the recorded values, when the output was dumped.
    let against = plan.recorded.map(|d| against_recorded(d, &rec.dtype, &y1, dtype.is_some())).transpose()?.flatten();
    let (differing_elements, max_ulp) = (against.map(|x| x.differing), against.map(|x| x.max_ulp));
    // The other run's op, replayed here from its own operands (repro traces that carry them).
    let mut counterpart_replay_matches = None;
    let (mut shapes, mut compared, mut shared_operands, mut other_kernel) = (None, None, Vec::new(), None);
    let counterpart = plan.counterpart.as_ref().map(|(c, _)| *c);
    if let Some((c, cvals)) = plan.counterpart.as_ref().filter(|(c, _)| !c.operands.is_empty()) {
        let ck = c.record.kernel.clone().unwrap_or_else(|| kernel.clone());
        other_kernel = (ck != kernel).then(|| ck.clone());
        let cops = cvals.iter().map(|v| operand(v, dtype, device)).collect::<Result<Vec<Operand>>>()?;
        let yb = ck.run_as(&cops, numerics)?;
        counterpart_replay_matches = Some(summarize(&yb, None)?.digest == c.record.digest);
        compared = a_vs_b(rec, &y1, &c.record, &yb)?;
        shared_operands = candle_trace_compare::shared_rows::operand_overlaps(rec, &plan.operands, &c.record, cvals)?;
        shapes = Some(how_operands_differ(&operands, &cops));
    }
    let mut notes = replay_notes(rec.perturbed, dtype, plan.counterpart.as_ref().is_some_and(|(c, _)| c.operands.is_empty()));
    let rows = |r: &candle_trace_format::record::OpRecord| r.shape.first().map(|&n| n as usize);
    if let Some(c) = counterpart.filter(|c| !c.operands.is_empty() && !candle_trace_compare::repro::one_row_each(rows(rec), rows(&c.record))) {
        notes.push(format!(
            "a's and b's outputs are not compared element by element: batches of {} and {} rows, whose rows need not hold the same request (`trace bisect` pairs them)",
            rec.shape.first().unwrap_or(&0),
            c.record.shape.first().unwrap_or(&0)
        ));
    }
    let matches_recording = d1 == rec.digest && y1.dtype().as_str() == rec.dtype;
    let b_perturbed = plan.counterpart.as_ref().is_some_and(|(c, _)| c.record.perturbed);
    let found = Found {
        matches_recording,
        counterpart: counterpart_replay_matches,
        shapes: shapes.as_ref(),
        kernels: other_kernel.as_ref().map(|k| (&kernel, k)),
        b_perturbed,
        deterministic: d1 == d2,
        converted: dtype.map(|to| Conversion { to, from: rec.dtype.as_str(), against }),
    };
    let verdict = verdict(&found);
    Ok(ReplayReport {
        seq: rec.seq,
        path: path.to_string(),
        op: op.to_string(),
        kernel,
        device: crate::device::device_name(device),
        dtype: dtype.map(|d| d.as_str().to_string()),
        matches_recording,
        deterministic: d1 == d2,
        matches_counterpart: counterpart.map(|c| c.record.digest == d1),
        counterpart_replay_matches,
        differing_elements,
        max_ulp,
        sign_changes: against.map(|x| x.sign_changes),
        max_abs_diff: against.map(|x| x.max_abs_diff),
        recorded_abs_max: against.map(|x| x.abs_max),
        a_vs_b: compared,
        shared_operands,
        verdict,
        notes,
    })
}

/// What a replay found, for its verdict.
struct Found<'a> {
    /// a's replay has a's recorded bits.
    matches_recording: bool,
    /// b's replay (from b's operands) has b's recorded bits.
    counterpart: Option<bool>,
    /// How a's operands differ from b's ([`how_operands_differ`]), when b's were replayed.
    shapes: Option<&'a String>,
    /// a's and b's ops, when they differ.
    kernels: Option<(&'a Kernel, &'a Kernel)>,
    /// b's record was perturbed (`--perturb`).
    b_perturbed: bool,
    /// Two replays of a gave the same bits.
    deterministic: bool,
    /// The operands were converted (`--dtype`).
    converted: Option<Conversion<'a>>,
}

/// A `--dtype` replay, for its verdict.
struct Conversion<'a> {
    /// The dtype the float operands were converted to.
    to: DType,
    /// The recording's dtype.
    from: &'a str,
    /// Against the recorded values read back in `from`, when dumped.
    against: Option<Against>,
}

/// A replay's output against the recorded one (see [`ReplayReport`]'s fields of the same names).
#[derive(Clone, Copy, Debug)]
struct Against {
    differing: u64,
    max_ulp: u64,
    sign_changes: u64,
    max_abs_diff: f64,
    abs_max: f64,
}

/// The replay's output `y` against the recorded dump `d` of dtype `recorded`; a converted
/// (`--dtype`) float result is read back in `recorded` first. `None` when the two cannot be
/// compared element by element (another integer dtype or element count).
fn against_recorded(d: &candle_trace_format::record::Dump, recorded: &str, y: &candle_core::Tensor, converted: bool) -> Result<Option<Against>> {
    let y = match recorded.parse::<DType>() {
        Ok(rd) if converted && rd.is_float() && y.dtype().is_float() => y.to_dtype(rd)?,
        _ => y.clone(),
    };
    let (want, got) = (candle_trace_format::dump::decode(d)?, candle_trace_format::dump::decode(&crate::values::encode(0, &y)?)?);
    if want.dtype != got.dtype || want.ordered.len() != got.ordered.len() {
        return Ok(None);
    }
    let mut a = Against { differing: 0, max_ulp: 0, sign_changes: 0, max_abs_diff: 0.0, abs_max: 0.0 };
    for i in 0..want.ordered.len() {
        a.abs_max = a.abs_max.max(want.f64[i].abs());
        let ulp = want.ordered[i].abs_diff(got.ordered[i]);
        if ulp > 0 {
            a.differing += 1;
            a.max_ulp = a.max_ulp.max(ulp);
            let (x, y) = (want.f64[i], got.f64[i]);
            a.sign_changes += u64::from(!x.is_nan() && !y.is_nan() && x.is_sign_negative() != y.is_sign_negative());
            let diff = (want.f64[i] - got.f64[i]).abs();
            // NaN on either side is kept, not passed over as f64::max would.
            a.max_abs_diff = if diff.is_nan() || a.max_abs_diff.is_nan() { f64::NAN } else { a.max_abs_diff.max(diff) };
        }
    }
    Ok(Some(a))
}

/// How operands `a` differ from `b`, as the end of a sentence: in dtype (the first operand that
/// does, `in dtype (operand 1: a f32, b bf16)`), else in shape (`in shape (operand 0: a [1, 30,
/// 64], b [1, 1, 64]): another prefill chunk, batch or padding`), else in count, else in value
/// (an op before this one computed them differently).
fn how_operands_differ(a: &[Operand], b: &[Operand]) -> String {
    let desc = |o: &Operand| match o {
        Operand::T(t) => (t.dtype().as_str().to_string(), format!("{:?}", t.dims())),
        Operand::Q(_) => ("quantized".to_string(), "?".to_string()),
    };
    let (da, db): (Vec<_>, Vec<_>) = (a.iter().map(desc).collect(), b.iter().map(desc).collect());
    if let Some((i, (x, y))) = da.iter().zip(&db).enumerate().find(|(_, (x, y))| x.0 != y.0) {
        return format!("in dtype (operand {i}: a {}, b {})", x.0, y.0);
    }
    if let Some((i, (x, y))) = da.iter().zip(&db).enumerate().find(|(_, (x, y))| x.1 != y.1) {
        return format!("in shape (operand {i}: a {}, b {}): another prefill chunk, batch or padding", x.1, y.1);
    }
    if da.len() != db.len() {
        return format!("in count (a {}, b {})", da.len(), db.len());
    }
    "in value only (same dtypes and shapes: an op before this one computed them differently)".into()
}

/// One sentence: what the replay says about the cause.
fn verdict(f: &Found) -> String {
    match (f.matches_recording, f.counterpart, f.shapes) {
        (true, Some(true), _) if f.kernels.is_some() => {
            let (a, b) = f.kernels.expect("checked");
            format!("both runs' results reproduce on this machine from their own operands, and the runs ran different ops here (a: {a:?}, b: {b:?}): the difference is the op's definition (a model setting or implementation), not the environment")
        }
        (true, Some(false), _) if f.b_perturbed => {
            "a reproduces here; b's recording was perturbed (--perturb) after its op ran, so its replay computes the unperturbed value: the difference is the injected fault".into()
        }
        // Converted operands are another computation: no verdict on the environment.
        (false, _, _) if f.deterministic && f.converted.is_some() => {
            let Conversion { to, from, against } = f.converted.as_ref().expect("checked");
            let by = against.map(|a| format!(" ({} elements, largest |Δ| {:.3e} where the largest |x| is {:.3e})", a.differing, a.max_abs_diff, a.abs_max)).unwrap_or_default();
            format!("deterministic here; in {} the op's result differs from the {from} recording{by}: the rounding of {}, not the environment", to.as_str(), to.as_str())
        }
        (true, Some(true), Some(how)) => {
            format!("both runs' results reproduce on this machine from their own operands, which differ {how}: the difference comes from what the op was given, not from the environment")
        }
        (true, Some(false), _) => "a reproduces here but b does not: b's result depends on b's environment".into(),
        (false, Some(true), _) => "b reproduces here but a does not: a's result depends on a's environment".into(),
        (false, Some(false), _) => "neither run's result reproduces here: both depend on their environment".into(),
        (true, _, _) if f.deterministic => "deterministic here, and the same bits as the recording".into(),
        (false, _, _) if f.deterministic => "deterministic here, but different from the recording: the recording's environment (or a perturbation) made the difference".into(),
        _ => "not deterministic here: two replays differ".into(),
    }
}

/// Plain-text rendering of a [`ReplayReport`].
pub fn text(r: &ReplayReport) -> String {
    let clean = candle_trace_compare::report::clean;
    let mut o = format!("replayed op record {} {} ({}) on {}: {}\n", r.seq, clean(&r.path), clean(&r.op), r.device, clean(&format!("{:?}", r.kernel)));
    o.push_str(if r.matches_recording { "  same bits as the recording\n" } else { "  DIFFERS from the recording\n" });
    if let (Some(n), Some(u)) = (r.differing_elements, r.max_ulp) {
        let read = r.dtype.as_ref().map(|d| format!(" (the {d} result read back in the recording's dtype)")).unwrap_or_default();
        let abs = r.max_abs_diff.zip(r.recorded_abs_max).map(|(d, m)| format!(", largest |Δ| {d:.3e} (largest |x| {m:.3e})")).unwrap_or_default();
        let through = match r.sign_changes {
            Some(k) if k > 0 => format!(" (counted through zero: {} changed sign)", candle_trace_compare::text::plural(k, "element")),
            _ => String::new(),
        };
        o.push_str(&format!("  against the recorded values{read}: {n} elements differ, max {u} ULP{through}{abs}\n"));
    }
    o.push_str(if r.deterministic { "  deterministic here: two replays gave the same bits\n" } else { "  NOT deterministic here: two replays differ\n" });
    match r.matches_counterpart {
        Some(true) => o.push_str("  same bits as the other run's recording (b)\n"),
        Some(false) => o.push_str("  differs from the other run's recording (b)\n"),
        None => {}
    }
    match r.counterpart_replay_matches {
        Some(true) => o.push_str("  b's op, replayed from b's operands: same bits as b's recording\n"),
        Some(false) => o.push_str("  b's op, replayed from b's operands: DIFFERS from b's recording\n"),
        None => {}
    }
    if let Some(x) = &r.a_vs_b {
        let inn = r.dtype.as_ref().map(|d| format!(" in {d}")).unwrap_or_default();
        o.push_str(&format!("  a vs b, both replayed here{inn}, at position {}: {} of {} elements differ, max {} ULP\n", x.position, x.differing, x.elements, x.max_ulp));
    }
    o.push_str(&shared_text(&r.shared_operands, r.dtype.as_deref()));
    o.push_str(&format!("verdict: {}\n", r.verdict));
    for n in &r.notes {
        o.push_str(&format!("note: {n}\n"));
    }
    o
}

/// The operand lines of [`text`]: per operand what of a and b was compared and whether the bits
/// agree, then one line saying whether every shared row is bit-identical.
fn shared_text(ops: &[candle_trace_compare::shared_rows::OperandOverlap], dtype: Option<&str>) -> String {
    let mut o = String::new();
    for x in ops {
        let what = if x.compared == 0 {
            x.span.clone()
        } else if x.differing == 0 {
            format!("{}: all {} {} bit-identical", x.span, x.compared, x.unit)
        } else {
            format!("{}: {} of {} {} DIFFER", x.span, x.differing, x.compared, x.unit)
        };
        o.push_str(&format!("  operand {} (a {:?}, b {:?}): {what}\n", x.index, x.shape_a, x.shape_b));
    }
    if !ops.is_empty() {
        let n = ops.iter().filter(|x| x.compared == 0).count();
        // The recorded runs' difference: a replay in another dtype is another computation.
        let made = dtype.map_or(String::new(), |d| format!(" (in the recorded dtypes; the replay in {d} above is another computation)"));
        o.push_str(&match (ops.iter().any(|x| x.differing > 0), n) {
            (true, _) => "  the operands differ where both runs hold them: the op is not where the difference entered\n".to_string(),
            (false, 0) => format!("  every operand's shared rows are bit-identical in a and b as recorded: the op made the difference{made}\n"),
            (false, n) if n == ops.len() => "  no operand could be compared row by row (their batch rows differ)\n".to_string(),
            (false, n) => format!("  the compared operands' shared rows are bit-identical; {n} operand(s) could not be compared\n"),
        });
    }
    o
}

/// What `trace extract` wrote.
#[derive(Clone, Debug, Serialize)]
pub struct ExtractReport {
    /// The op extracted: the root cause, or the first earlier one A dumped.
    pub path: String,
    /// The root cause bisect names (differs from `path` when that one was not dumped).
    pub live_root_cause: String,
    /// Op name of the extracted op.
    pub op: String,
    /// Token position of its divergence.
    pub position: u32,
    /// Size of the repro trace written, in bytes.
    pub bytes: u64,
    /// B's operand values are in the repro (B dumped the op too): `replay` then also runs B's op.
    pub b_operands: bool,
    /// b dumped the op, but its operands (this many bytes) are over what one frame of the repro
    /// holds ([`candle_trace_format::format::VALUE_BYTES_PER_FRAME`]): left out, so `replay`
    /// runs a's op only.
    pub b_operands_too_large: Option<u64>,
    /// The repro holds a prompt (text or token ids) of a or b, as their headers do: redact it
    /// (`trace redact`, or cut it with `trace bundle`) before attaching it in public.
    pub holds_prompt: bool,
}

/// b's operands as a repro holds them: in one item, which one frame must hold, so past half the
/// frame cap ([`candle_trace_format::format::VALUE_BYTES_PER_FRAME`]) none, with their size (the
/// repro then replays a's op only, and says why).
fn fitting(b_operands: Vec<OperandValue>) -> (Vec<OperandValue>, Option<u64>) {
    let bytes: usize = b_operands.iter().map(|v| v.data().len()).sum();
    if bytes > candle_trace_format::format::VALUE_BYTES_PER_FRAME {
        return (Vec::new(), Some(bytes as u64));
    }
    (b_operands, None)
}

/// Refuses a root below `--level ops`: there it is a layer's output, not the op where the
/// difference entered, and its operands differ too, so a repro of it shows nothing (found by a
/// fresh-user trial). The error names the `--level` and `--dump` to re-record with.
fn below_ops(level: candle_trace_format::site::Level, fd: &candle_trace_compare::bisect::OpDivergence, (pa, pb): (&Path, &Path)) -> Result<()> {
    if level == candle_trace_format::site::Level::Ops {
        return Ok(());
    }
    let group = candle_trace_format::site::layer_dump_pattern(&fd.path).unwrap_or_else(|| fd.path.text());
    Err(Error::usage(format!(
        "{} and {}: recorded at --level {}, the root {} is a layer's output, not the op where the difference entered; re-record both runs at --level ops with --dump '{group}' to extract that op",
        pa.display(),
        pb.display(),
        level.as_str(),
        fd.path.text()
    )))
}

/// Cuts from the traces at `pa` and `pb` a self-contained repro trace at `out`: the root cause
/// op of their bisect with its descriptor and dumped operands (from a), a's record and output
/// dump, and b's header, record and operands ([`Counterpart`]). Both files are read a frame at a
/// time (the streaming bisect, then one pass each for the chosen op's values).
///
/// # Errors
/// [`Error::Mismatch`] when the traces do not diverge at an op; [`Error::Usage`] when `a` did not
/// dump the root cause, or a trace was recorded below `--level ops` (the root is then a layer's
/// output; the message names the `--level` and `--dump` to re-record with); I/O errors.
pub fn extract(pa: &Path, pb: &Path, out: &Path) -> Result<ExtractReport> {
    // Bisected a frame at a time, as `trace bisect` does: the traces as far as the report reads
    // them (headers, tokens, the roots' records); the chosen op's values are read after.
    let (report, a, b) = candle_trace_compare::bisect_file::bisect_files(pa, pb)?;
    let (a, b) = (&a, &b);
    let fd = report.first_divergence.ok_or_else(|| {
        let why = match &report.graph_fork {
            Some(g) => format!(
                "the op graphs differ instead (at {}: {} in a, {} in b), and a repro holds one op",
                g.path.text(),
                candle_trace_compare::report::Out::Text.list(&g.a_inputs),
                candle_trace_compare::report::Out::Text.list(&g.b_inputs)
            ),
            None => "no op whose inputs matched and output differed".into(),
        };
        Error::Mismatch(format!("{} and {}: {why}; nothing to extract", a.path.display(), b.path.display()))
    })?;
    below_ops(report.level, &fd, (&a.path, &b.path))?;
    let find = |t: &Trace, seq: u64| {
        t.items.iter().find_map(|i| match i {
            Item::Op(r) if r.seq == seq => Some(r.clone()),
            _ => None,
        })
    };
    // The root cause, or else the first earlier one (absorbed within its layer) that A dumped.
    let candidates = std::iter::once((fd.seq, fd.b.seq, fd.path.clone(), fd.op.clone(), fd.position)).chain(report.absorbed.iter().map(|x| (x.seq, x.b_seq, x.path.clone(), x.op.clone(), x.position)));
    let mut chosen = None;
    for (sa, sb, path, op, pos) in candidates {
        let ra = find(a, sa).expect("bisect names a record of a");
        if !ra.operands.is_empty() {
            chosen = Some((ra, find(b, sb).expect("bisect names a record of b"), path, op, pos));
            break;
        }
    }
    let Some((mut ra, mut rb, path, op, position)) = chosen else {
        return Err(Error::usage(format!("{}: the root cause {} was not dumped; re-record both runs with --dump '{}'", a.path.display(), fd.path.text(), fd.path.text())));
    };
    // The chosen record's output and operand values, read from each file a frame at a time.
    let (wanted_a, wanted_b): (HashSet<u64>, HashSet<u64>) = (ra.operands.iter().copied().collect(), rb.operands.iter().copied().collect());
    let seq_a = ra.seq;
    let va = read_trace_where(pa, |i| matches!(i, Item::Operand(v) if wanted_a.contains(&v.id())) || matches!(i, Item::Dump(d) if d.seq == seq_a))?;
    let vb = read_trace_where(pb, |i| matches!(i, Item::Operand(v) if wanted_b.contains(&v.id())))?;
    let b_operands: Vec<OperandValue> = vb
        .items
        .into_iter()
        .filter_map(|i| match i {
            Item::Operand(v) => Some(v),
            _ => None,
        })
        .collect();
    let output = va.items.iter().find_map(|i| match i {
        Item::Dump(d) if d.seq == ra.seq && d.shape == ra.shape => Some(d.clone()),
        _ => None,
    });
    let operands: Vec<Item> = va.items.iter().filter(|i| matches!(i, Item::Operand(_))).cloned().collect();
    for r in [&mut ra, &mut rb] {
        r.seq = 0;
        r.site = 0;
        r.inputs.clear();
    }
    let mut w = TraceWriter::create(out, &a.header, a.build.as_ref())?;
    w.push(Item::Site { id: 0, path: path.to_string(), op: op.to_string() })?;
    w.push(Item::Op(ra))?;
    if let Some(mut d) = output {
        d.seq = 0;
        w.push(Item::Dump(d))?;
    }
    for item in operands {
        w.push(item)?;
    }
    let (b_operands, b_too_large) = fitting(b_operands);
    let has_b = !b_operands.is_empty();
    w.push(Item::Counterpart(Box::new(Counterpart { header: b.header.clone(), record: rb, operands: b_operands })))?;
    w.finish(&Footer { op_records: 1, stop: candle_trace_format::fields::StopReason::Extract.to_string(), ..Footer::default() })?;
    let bytes = std::fs::metadata(out).map_err(|e| Error::io(out, e))?.len();
    let holds_prompt = [a, b].iter().any(|t| candle_trace_format::redact::holds_prompt(&t.header));
    Ok(ExtractReport { path: path.to_string(), op: op.to_string(), position, bytes, live_root_cause: fd.path.to_string(), b_operands: has_b, b_operands_too_large: b_too_large, holds_prompt })
}
