//! What replaying one recorded op needs, found in a trace and checked before anything runs: the
//! op record, its module path and op name, its descriptor, its operand values (each of exactly
//! the bytes its dtype and shape need), its dumped output when present, and, in a repro trace
//! (`trace extract`), the other run's record and operands. Runs nothing: `trace replay`
//! ([`crate::replay`]) executes the plan, and the fuzz targets check this part on crafted traces.

use crate::error::{Error, Result};
use crate::format::Trace;
use crate::record::{Counterpart, Dump, Item, Kernel, OpRecord, OperandValue};
use std::collections::HashMap;

/// A checked replay plan (see the module docs).
#[derive(Debug)]
pub struct Plan<'a> {
    pub record: &'a OpRecord,
    pub path: &'a str,
    pub op: &'a str,
    pub kernel: &'a Kernel,
    /// The operand values, in the order the descriptor takes them.
    pub operands: Vec<&'a OperandValue>,
    /// The dumped output of the record, when it was dumped with the record's shape.
    pub recorded: Option<&'a Dump>,
    /// Repro traces: the other run's record and its operand values (empty when it dumped none).
    pub counterpart: Option<(&'a Counterpart, Vec<&'a OperandValue>)>,
}

/// Finds and checks what replaying record `seq` of `t` needs (default: the only dumped op, as
/// in a repro trace).
///
/// # Errors
/// [`Error::Trace`] when the record does not exist, has no descriptor, or an operand is missing
/// or does not fit its dtype and shape; [`Error::Usage`] when the record was not dumped (the
/// message names the `--dump` pattern to record with) or several were and `seq` is not given.
pub fn plan(t: &Trace, seq: Option<u64>) -> Result<Plan<'_>> {
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
    let record = match seq {
        Some(s) => records.iter().find(|r| r.seq == s).copied().ok_or_else(|| {
            Error::usage(format!("{}: --op {s}: the trace has op records 0 to {}", t.path.display(), records.len().saturating_sub(1)))
        })?,
        None => {
            let dumped: Vec<&&OpRecord> = records.iter().filter(|r| !r.operands.is_empty()).collect();
            match dumped.as_slice() {
                [one] => **one,
                [] => return Err(Error::trace(&t.path, "holds no dumped op to replay (record with --dump, or give --op SEQ)")),
                _ => return Err(Error::usage(format!("{}: {} ops were dumped; choose one with --op SEQ", t.path.display(), dumped.len()))),
            }
        }
    };
    let (path, op) = sites
        .get(record.site as usize)
        .copied()
        .ok_or_else(|| Error::trace(&t.path, format!("op record {} names undeclared site {}", record.seq, record.site)))?;
    let kernel = record.kernel.as_ref().ok_or_else(|| Error::trace(&t.path, format!("op record {} has no op descriptor", record.seq)))?;
    if record.operands.is_empty() {
        return Err(Error::usage(format!(
            "{}: op record {} ({path}) was not dumped; re-record with --dump '{path}'",
            t.path.display(),
            record.seq
        )));
    }
    let operands = checked(t, &values, &record.operands, "")?;
    let recorded = t.items.iter().find_map(|i| match i {
        Item::Dump(d) if d.seq == record.seq && d.shape == record.shape => Some(d),
        _ => None,
    });
    let counterpart = match counterpart {
        Some(c) => {
            let cvals: HashMap<u64, &OperandValue> = c.operands.iter().map(|v| (v.id(), v)).collect();
            let ops = if c.operands.is_empty() { Vec::new() } else { checked(t, &cvals, &c.record.operands, "counterpart ")? };
            Some((c, ops))
        }
        None => None,
    };
    Ok(Plan { record, path, op, kernel, operands, recorded, counterpart })
}

/// The operand values `ids`, each present and of exactly the bytes its dtype and shape need.
fn checked<'a>(t: &Trace, values: &HashMap<u64, &'a OperandValue>, ids: &[u64], what: &str) -> Result<Vec<&'a OperandValue>> {
    ids.iter()
        .map(|id| {
            let v = *values.get(id).ok_or_else(|| Error::trace(&t.path, format!("{what}operand {id} is missing")))?;
            crate::validate::operand(v).map_err(|e| Error::trace(&t.path, format!("{what}{e}")))?;
            Ok(v)
        })
        .collect()
}
