//! `trace replay` and `trace extract`: re-execute a recorded op from its dumped operands, on
//! this machine, and cut a self-contained repro trace holding a root-cause op.
//!
//! Replay runs the op through the same [`Kernel::run`] the live forward pass used, twice, and
//! compares the results' digests with each other ("deterministic here?") and with the recorded
//! output ("same as the recording?").

use crate::bisect::bisect;
use crate::digest::summarize;
use crate::error::{Error, Result};
use crate::format::{Trace, TraceWriter};
use crate::kernel::{Kernel, Operand};
use crate::record::{Counterpart, Footer, Item, OpRecord, OperandValue};
use candle_core::quantized::{ggml_file, GgmlDType, QMatMul};
use candle_core::{DType, Device};
use serde::Serialize;
use std::collections::HashMap;
use std::path::Path;

/// What `trace replay` found.
#[derive(Clone, Debug, Serialize)]
pub struct ReplayReport {
    pub seq: u64,
    pub path: String,
    pub op: String,
    pub kernel: Kernel,
    pub device: String,
    /// The dtype the float operands were converted to, when `--dtype` asked for one.
    pub dtype: Option<String>,
    /// The replay's output has the recorded output's bits.
    pub matches_recording: bool,
    /// Two replays gave the same bits.
    pub deterministic: bool,
    /// Repro traces: the replay has the other run's recorded bits.
    pub matches_counterpart: Option<bool>,
    pub notes: Vec<String>,
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

fn operand(v: &OperandValue, dtype: Option<DType>, device: &Device) -> Result<Operand> {
    Ok(match v {
        OperandValue::Tensor(d) => {
            let t = crate::dump::to_tensor(d, device)?;
            match dtype {
                Some(dt) if t.dtype().is_float() => Operand::T(t.to_dtype(dt)?),
                _ => Operand::T(t),
            }
        }
        OperandValue::QMatMulTensor(d) => Operand::Q(QMatMul::Tensor(crate::dump::to_tensor(d, device)?)),
        OperandValue::Quantized { ggml_dtype: g, shape, data, .. } => {
            let gd = ggml_dtype(g).ok_or_else(|| Error::usage(format!("unknown quantization type {g}")))?;
            let dims = shape.iter().map(|&x| x as usize).collect();
            Operand::Q(QMatMul::from_qtensor(ggml_file::qtensor_from_ggml(gd, data, dims, device)?)?)
        }
    })
}

/// Replays record `seq` of `t` (default: the only dumped op, as in a repro trace).
///
/// # Errors
/// [`Error::Usage`] when the record does not exist, was not dumped (the message names the
/// `--dump` pattern to record with), or several ops were dumped and `seq` is not given; candle
/// errors from the op (for example a `--dtype` the op cannot take).
pub fn replay(t: &Trace, seq: Option<u64>, dtype: Option<DType>, device: &Device) -> Result<ReplayReport> {
    let mut sites: Vec<(&str, &str)> = Vec::new();
    let mut values: HashMap<u64, &OperandValue> = HashMap::new();
    let mut records: Vec<&OpRecord> = Vec::new();
    let mut counterpart = None;
    for item in &t.items {
        match item {
            Item::Site { path, op, .. } => sites.push((path, op)),
            Item::Op(r) => records.push(r),
            Item::Operand(v) => {
                values.insert(v.id(), v);
            }
            Item::Counterpart(c) => counterpart = Some(c.as_ref()),
            _ => {}
        }
    }
    let rec = match seq {
        Some(s) => records.iter().find(|r| r.seq == s).copied().ok_or_else(|| Error::trace(&t.path, format!("has no op record {s}")))?,
        None => {
            let dumped: Vec<&&OpRecord> = records.iter().filter(|r| !r.operands.is_empty()).collect();
            match dumped.as_slice() {
                [one] => **one,
                [] => return Err(Error::trace(&t.path, "holds no dumped op to replay (record with --dump, or give --op SEQ)")),
                _ => return Err(Error::usage(format!("{}: {} ops were dumped; choose one with --op SEQ", t.path.display(), dumped.len()))),
            }
        }
    };
    let (path, op) = sites.get(rec.site as usize).copied().unwrap_or(("?", "?"));
    let kernel = rec.kernel.clone().ok_or_else(|| Error::trace(&t.path, format!("record {} has no op descriptor", rec.seq)))?;
    if rec.operands.is_empty() {
        return Err(Error::usage(format!(
            "{}: op record {} ({path}) was not dumped; re-record with --dump '{path}'",
            t.path.display(),
            rec.seq
        )));
    }
    let operands = rec
        .operands
        .iter()
        .map(|id| {
            let v = values.get(id).ok_or_else(|| Error::trace(&t.path, format!("operand {id} of record {} is missing", rec.seq)))?;
            operand(v, dtype, device)
        })
        .collect::<Result<Vec<Operand>>>()?;
    let y1 = kernel.run(&operands)?;
    let y2 = kernel.run(&operands)?;
    let d1 = summarize(&y1, None)?.digest;
    let d2 = summarize(&y2, None)?.digest;
    let mut notes = Vec::new();
    if rec.perturbed {
        notes.push("this record was perturbed (--perturb) after the op ran: the replay computes the unperturbed value".into());
    }
    if let Some(dt) = dtype {
        notes.push(format!("float operands converted to {} before the replay", dt.as_str()));
    }
    Ok(ReplayReport {
        seq: rec.seq,
        path: path.to_string(),
        op: op.to_string(),
        kernel,
        device: crate::recorder::device_name(device),
        dtype: dtype.map(|d| d.as_str().to_string()),
        matches_recording: d1 == rec.digest && y1.dtype().as_str() == rec.dtype,
        deterministic: d1 == d2,
        matches_counterpart: counterpart.map(|c| c.record.digest == d1),
        notes,
    })
}

/// Plain-text rendering of a [`ReplayReport`].
pub fn text(r: &ReplayReport) -> String {
    let mut o = format!("replayed op record {} {} ({}) on {}: {:?}\n", r.seq, r.path, r.op, r.device, r.kernel);
    o.push_str(if r.matches_recording { "  same bits as the recording\n" } else { "  DIFFERS from the recording\n" });
    o.push_str(if r.deterministic { "  deterministic here: two replays gave the same bits\n" } else { "  NOT deterministic here: two replays differ\n" });
    match r.matches_counterpart {
        Some(true) => o.push_str("  same bits as the other run's recording (b)\n"),
        Some(false) => o.push_str("  differs from the other run's recording (b)\n"),
        None => {}
    }
    for n in &r.notes {
        o.push_str(&format!("note: {n}\n"));
    }
    o
}

/// What `trace extract` wrote.
#[derive(Clone, Debug, Serialize)]
pub struct ExtractReport {
    pub path: String,
    pub op: String,
    pub position: u32,
    pub bytes: u64,
}

/// Cuts from `a` and `b` a self-contained repro trace at `out`: the root cause op of
/// `bisect(a, b)` with its descriptor and dumped operands (from `a`), `a`'s record and output
/// dump, and `b`'s header and record ([`Counterpart`]).
///
/// # Errors
/// [`Error::Mismatch`] when the traces do not diverge at an op; [`Error::Usage`] when `a` did not
/// dump the root cause (the message names the `--dump` pattern to re-record with); I/O errors.
pub fn extract(a: &Trace, b: &Trace, out: &Path) -> Result<ExtractReport> {
    let report = bisect(a, b)?;
    let fd = report
        .first_divergence
        .ok_or_else(|| Error::Mismatch(format!("{} and {}: no op whose inputs matched and output differed, nothing to extract", a.path.display(), b.path.display())))?;
    let find = |t: &Trace, seq: u64| {
        t.items.iter().find_map(|i| match i {
            Item::Op(r) if r.seq == seq => Some(r.clone()),
            _ => None,
        })
    };
    let mut ra = find(a, fd.seq).expect("bisect names a record of a");
    let mut rb = find(b, fd.b.seq).expect("bisect names a record of b");
    if ra.operands.is_empty() {
        return Err(Error::usage(format!(
            "{}: the root cause {} was not dumped; re-record with --dump '{}' (both runs, for elementwise metrics too)",
            a.path.display(),
            fd.path,
            fd.path
        )));
    }
    let wanted: std::collections::HashSet<u64> = ra.operands.iter().copied().collect();
    let output = a.items.iter().find_map(|i| match i {
        Item::Dump(d) if d.seq == ra.seq && d.shape == ra.shape => Some(d.clone()),
        _ => None,
    });
    let operands: Vec<Item> = a.items.iter().filter(|i| matches!(i, Item::Operand(v) if wanted.contains(&v.id()))).cloned().collect();
    for r in [&mut ra, &mut rb] {
        r.seq = 0;
        r.site = 0;
        r.inputs.clear();
    }
    rb.operands.clear();
    let mut w = TraceWriter::create(out, &a.header)?;
    w.push(Item::Site { id: 0, path: fd.path.clone(), op: fd.op.clone() })?;
    w.push(Item::Op(ra))?;
    if let Some(mut d) = output {
        d.seq = 0;
        w.push(Item::Dump(d))?;
    }
    for item in operands {
        w.push(item)?;
    }
    w.push(Item::Counterpart(Box::new(Counterpart { header: b.header.clone(), record: rb })))?;
    w.finish(&Footer { op_records: 1, stop: "extract".into(), ..Footer::default() })?;
    let bytes = std::fs::metadata(out).map_err(|e| Error::io(out, e))?.len();
    Ok(ExtractReport { path: fd.path, op: fd.op, position: fd.position, bytes })
}
