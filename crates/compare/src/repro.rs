//! What replaying one recorded op needs, found in a trace and checked before anything runs: the
//! op record, its module path and op name, its descriptor, its operand values (each of exactly
//! the bytes its dtype and shape need), its dumped output when present, and, in a repro trace
//! (`trace extract`), the other run's record and operands. Runs nothing: `trace replay`
//! (`candle_trace_run::replay`) executes the plan, and the fuzz targets check this part on crafted traces.

use candle_trace_format::error::{Error, Result};
use candle_trace_format::format::Trace;
use candle_trace_format::record::{Counterpart, Dump, Item, Kernel, OpRecord, OperandValue};
use std::collections::HashMap;

/// A checked replay plan (see the module docs).
#[derive(Debug)]
pub struct Plan<'a> {
    /// The op record replayed.
    pub record: &'a OpRecord,
    /// Its module path.
    pub path: &'a str,
    /// Its op name.
    pub op: &'a str,
    /// Its op descriptor ([`OpRecord::kernel`]).
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
/// message names the `--dump` pattern to record with), several were and `seq` is not given, or
/// the trace is redacted and the op reads token ids (u32 or i64 operands, which redaction
/// zeroes).
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
        Some(s) => {
            let held = match (records.first(), records.last()) {
                (Some(f), Some(l)) => format!("op records {} to {}", f.seq, l.seq),
                _ if t.truncated => "no op record (it is truncated)".to_string(),
                _ => "no op record".to_string(),
            };
            records.iter().find(|r| r.seq == s).copied().ok_or_else(|| Error::usage(format!("{}: --op {s}: the trace has {held}", t.path.display())))?
        }
        None => {
            let dumped: Vec<&&OpRecord> = records.iter().filter(|r| !r.operands.is_empty()).collect();
            match dumped.as_slice() {
                [one] => **one,
                [] if t.truncated => {
                    return Err(Error::trace(&t.path, "is truncated (the run did not finish, or the file was cut) and its complete frames hold no dumped op: re-record with --dump '<module path>' (trace bisect names the root op and the pattern) and let the run finish"))
                }
                [] => return Err(Error::trace(&t.path, "holds no dumped op to replay: re-record with --dump '<module path>' (trace bisect names the root op and the pattern)")),
                _ => {
                    let named = |r: &&&OpRecord| format!("{} ({})", r.seq, sites.get(r.site as usize).map_or("?", |(p, _)| *p));
                    let some: Vec<String> = dumped.iter().take(4).map(named).collect();
                    let more = if dumped.len() > some.len() { ", …" } else { "" };
                    return Err(Error::usage(format!("{}: {} ops were dumped; choose one with --op SEQ: {}{more}", t.path.display(), dumped.len(), some.join(", "))));
                }
            }
        }
    };
    let (path, op) = sites.get(record.site as usize).copied().ok_or_else(|| Error::trace(&t.path, format!("op record {} names undeclared site {}", record.seq, record.site)))?;
    let kernel = record.kernel.as_ref().ok_or_else(|| Error::trace(&t.path, format!("op record {} has no op descriptor", record.seq)))?;
    if record.operands.is_empty() {
        return Err(Error::usage(format!("{}: op record {} ({path}) was not dumped; re-record with --dump '{path}'", t.path.display(), record.seq)));
    }
    let operands = checked(t, &values, &record.operands, "")?;
    fits(kernel, &operands).map_err(|e| Error::trace(&t.path, format!("op record {}: {e}", record.seq)))?;
    // Redaction zeroes integer values (token ids): the op would run on ids that were not its.
    let zeroed = |v: &&OperandValue| matches!(v, OperandValue::Tensor(d) if matches!(d.dtype.as_str(), "u32" | "i64"));
    if candle_trace_format::redact::is_redacted(&t.header) && operands.iter().any(zeroed) {
        return Err(Error::usage(format!(
            "{}: op record {} ({path}) reads token ids, which redaction zeroed in this trace: it cannot be replayed from it; cut the repro from the unredacted traces (`trace extract`, or `trace bundle --keep prompt`)",
            t.path.display(),
            record.seq
        )));
    }
    let recorded = t.items.iter().find_map(|i| match i {
        Item::Dump(d) if d.seq == record.seq && d.shape == record.shape => Some(d),
        _ => None,
    });
    let counterpart = match counterpart {
        Some(c) => {
            let cvals: HashMap<u64, &OperandValue> = c.operands.iter().map(|v| (v.id(), v)).collect();
            let ops = if c.operands.is_empty() { Vec::new() } else { checked(t, &cvals, &c.record.operands, "counterpart ")? };
            if !ops.is_empty() {
                fits(c.record.kernel.as_ref().unwrap_or(kernel), &ops).map_err(|e| Error::trace(&t.path, format!("counterpart: {e}")))?;
            }
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
            let gone = if candle_trace_format::redact::is_redacted(&t.header) { ": redaction removed the dumped values (`trace redact --keep values` keeps them; or replay the original)" } else { "" };
            let v = *values.get(id).ok_or_else(|| Error::trace(&t.path, format!("{what}operand {id} is missing{gone}")))?;
            candle_trace_format::validate::operand(v).map_err(|e| Error::trace(&t.path, format!("{what}{e}")))?;
            Ok(v)
        })
        .collect()
}

/// The most elements a replayed op may produce, whatever its operands: 2^25 (128 MiB of f32),
/// or 64 times the elements of its operands when that is more (attention scores are the
/// largest real case: `s / (2 · head_dim)` times their operands).
pub const MAX_REPLAY_ELEMENTS_FLOOR: u64 = 1 << 25;

/// The most elements a replayed op may produce in any case: 2^28 (1 GiB of f32). Operands of
/// zeros compress to almost nothing, so "64 times the operands" alone would let a file of a few
/// kilobytes ask for many gigabytes.
pub const MAX_REPLAY_ELEMENTS: u64 = 1 << 28;

/// (dtype, shape) of a value as the kernel sees it.
fn desc(v: &OperandValue) -> (&str, &[u32]) {
    match v {
        OperandValue::Tensor(d) | OperandValue::QMatMulTensor(d) => (d.dtype.as_str(), &d.shape),
        OperandValue::Quantized { shape, .. } => ("quantized", shape),
    }
}

/// Where a's and b's outputs of one op are first worth comparing element by element: the first
/// position (in a's token order) whose recorded per-token digests differ, and the element
/// ranges of that position in each side's row-major output (dims `a_dims`, `b_dims`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FirstDiffering {
    /// Absolute token position.
    pub position: u32,
    /// Element ranges of the position in a's output.
    pub a_at: Vec<std::ops::Range<usize>>,
    /// Element ranges of the position in b's output.
    pub b_at: Vec<std::ops::Range<usize>>,
}

/// The first position whose per-token digests differ between records `ra` and `rb` (matched by
/// position, a's order) and its slices in outputs of dims `a_dims` and `b_dims`; `None` when a
/// record has no token axis, no position differs, or a slice does not fit its dims
/// ([`candle_trace_format::record::token_slice`]). The ranges are checked to lie within the dims
/// and to hold as many elements on both sides. Only outputs of one batch row each are compared:
/// in a batch, a's request may sit in another row of b, and a padded row's positions are not
/// its indices (a padded pair compared b's other request: a fresh-user trial).
pub fn first_differing(ra: &OpRecord, a_dims: &[usize], rb: &OpRecord, b_dims: &[usize]) -> Option<FirstDiffering> {
    if !one_row_each(a_dims.first().copied(), b_dims.first().copied()) {
        return None;
    }
    let (axa, axb) = (ra.axis.as_ref()?, rb.axis.as_ref()?);
    let (ta, tb) = ra.tokens.iter().find_map(|t| rb.tokens.iter().find(|u| u.pos == t.pos && u.digest != t.digest).map(|u| (t, u)))?;
    let a_at = candle_trace_format::record::token_slice(a_dims, axa, ta.row, ta.pos)?;
    let b_at = candle_trace_format::record::token_slice(b_dims, axb, tb.row, tb.pos)?;
    let len = |r: &[std::ops::Range<usize>]| r.iter().map(|x| x.len()).sum::<usize>();
    let within = |r: &[std::ops::Range<usize>], d: &[usize]| r.iter().all(|x| x.end <= d.iter().product::<usize>());
    (len(&a_at) == len(&b_at) && within(&a_at, a_dims) && within(&b_at, b_dims)).then_some(FirstDiffering { position: ta.pos, a_at, b_at })
}

/// Whether outputs whose batch dims are `a_rows` and `b_rows` hold one row each: the only
/// outputs [`first_differing`] compares (in a batch, a's request may sit in another row of b).
pub fn one_row_each(a_rows: Option<usize>, b_rows: Option<usize>) -> bool {
    a_rows == Some(1) && b_rows == Some(1)
}

/// Checks, before candle sees them, that the operands fit the op: their count, ranks and
/// dtypes, no empty tensor, and an output within [`MAX_REPLAY_ELEMENTS_FLOOR`] (or 64 times
/// the operands, and never over [`MAX_REPLAY_ELEMENTS`]): a crafted repro must not make candle
/// panic or allocate gigabytes.
///
/// # Errors
/// One sentence saying what does not fit.
pub fn fits(kernel: &Kernel, ops: &[&OperandValue]) -> std::result::Result<(), String> {
    let d: Vec<(&str, &[u32])> = ops.iter().map(|v| desc(v)).collect();
    let float = |i: usize| d.get(i).is_some_and(|(t, _)| matches!(*t, "f32" | "f16" | "bf16" | "f64"));
    let rank = |i: usize| d.get(i).map_or(0, |(_, s)| s.len());
    let need = |n: usize| -> std::result::Result<(), String> {
        if d.len() < n {
            return Err(format!("{kernel:?} takes {n} operands, the trace holds {}", d.len()));
        }
        Ok(())
    };
    for (i, (_, s)) in d.iter().enumerate() {
        if s.contains(&0) {
            return Err(format!("operand {i} of shape {s:?} is empty"));
        }
    }
    let floats = |idx: &[usize]| -> std::result::Result<(), String> {
        match idx.iter().find(|&&i| !float(i)) {
            Some(i) => Err(format!("{kernel:?} takes a float operand {i}, the trace holds {}", d.get(*i).map_or("none", |x| x.0))),
            None => Ok(()),
        }
    };
    let min_rank = |i: usize, r: usize| -> std::result::Result<(), String> {
        if rank(i) < r {
            return Err(format!("{kernel:?} needs operand {i} of rank {r} or more, the trace holds rank {}", rank(i)));
        }
        Ok(())
    };
    let n = needs(kernel);
    need(n.count)?;
    floats(n.floats)?;
    for &(i, r) in n.min_ranks {
        min_rank(i, r)?;
    }
    match kernel {
        Kernel::Embedding if rank(1) != 2 => return Err("Embedding needs a table of rank 2".into()),
        Kernel::Rope { .. } if rank(0) != 4 || !(2..=3).contains(&rank(1)) || !(2..=3).contains(&rank(2)) => return Err("Rope needs x of rank 4 and cos/sin of rank 2 or 3".into()),
        Kernel::Cat { dim } => min_rank(0, *dim as usize + 1)?,
        Kernel::FlashAttn { .. } if (0..3).any(|i| rank(i) != 4) => return Err("FlashAttn needs q, k and v of rank 4".into()),
        _ => {}
    }
    let (out, total) = output_elements(kernel, &d);
    let cap = MAX_REPLAY_ELEMENTS_FLOOR.max(total.saturating_mul(64)).min(MAX_REPLAY_ELEMENTS);
    if out > cap {
        return Err(format!("its output would hold {out} elements, over the replay cap of {cap}"));
    }
    Ok(())
}

/// What a kernel needs of its operands (listed per variant in `docs/trace-format.md`): how many,
/// which must be floats, and (operand, rank) minimums. [`fits`] checks these, then the few
/// shapes a variant needs exactly.
struct Needs {
    count: usize,
    floats: &'static [usize],
    min_ranks: &'static [(usize, usize)],
}

fn needs(kernel: &Kernel) -> Needs {
    let n = |count, floats, min_ranks| Needs { count, floats, min_ranks };
    match kernel {
        Kernel::Input | Kernel::Cat { .. } => n(1, &[], &[]),
        Kernel::Embedding => n(2, &[1], &[(0, 1)]),
        Kernel::RmsNorm { .. } => n(2, &[0, 1], &[(0, 1)]),
        Kernel::Softmax { .. } | Kernel::SoftmaxWide | Kernel::Normalize | Kernel::Silu | Kernel::Gelu { .. } | Kernel::Scale { .. } | Kernel::Affine { .. } => n(1, &[0], &[(0, 1)]),
        Kernel::LayerNorm { .. } => n(3, &[0, 1, 2], &[(0, 1)]),
        Kernel::QMatMul => n(2, &[0], &[(0, 2)]),
        Kernel::Linear | Kernel::Matmul { .. } => n(2, &[0, 1], &[(0, 2), (1, 2)]),
        Kernel::WhereCond => n(3, &[0, 2], &[]),
        Kernel::BroadcastAdd | Kernel::Mul | Kernel::Add => n(2, &[0, 1], &[]),
        Kernel::Rope { .. } | Kernel::FlashAttn { .. } => n(3, &[0, 1, 2], &[]),
        Kernel::ToDtype { .. } => n(1, &[0], &[]),
        Kernel::MeanPool => n(2, &[0], &[(0, 3), (1, 2)]),
    }
}

/// The elements a replay of `kernel` would output, and its operands' total, from their shapes
/// (checked by [`fits`] first).
fn output_elements(kernel: &Kernel, d: &[(&str, &[u32])]) -> (u64, u64) {
    // The output's size: a matmul's is [.., m, n]; a broadcast's the broadcast shape; the rest
    // are no larger than their operands (an embedding: ids × table rows).
    let elems = |s: &[u32]| candle_trace_format::limits::elements(s).unwrap_or(u64::MAX);
    let total: u64 = d.iter().map(|(_, s)| elems(s)).fold(0u64, u64::saturating_add);
    let out: u64 = match kernel {
        Kernel::Matmul { rhs_t } => {
            let (a, b) = (d[0].1, d[1].1);
            let m = a[a.len() - 2] as u64;
            let n = if *rhs_t { b[b.len() - 2] } else { b[b.len() - 1] } as u64;
            let batch: u64 = a[..a.len() - 2].iter().map(|&x| x as u64).fold(1u64, u64::saturating_mul);
            batch.saturating_mul(m).saturating_mul(n)
        }
        Kernel::BroadcastAdd | Kernel::Mul | Kernel::Add | Kernel::WhereCond => {
            let r = d.iter().map(|(_, s)| s.len()).max().unwrap_or(0);
            (0..r).map(|k| d.iter().filter_map(|(_, s)| (k + s.len()).checked_sub(r).map(|j| s[j] as u64)).max().unwrap_or(1)).fold(1u64, u64::saturating_mul)
        }
        Kernel::Embedding => elems(d[0].1).saturating_mul(d[1].1[1] as u64),
        _ => total,
    };
    (out, total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_trace_format::record::Dump;

    fn t(shape: &[u32]) -> OperandValue {
        OperandValue::Tensor(Dump { seq: 0, dtype: "f32".into(), shape: shape.to_vec(), shuffled: false, data: Vec::new() })
    }

    /// An output 64 times its operands is still refused past 2^28 elements: a matmul of two
    /// 2^27-element operands (zeros compress to nothing) would ask for 4 GiB.
    #[test]
    fn replay_output_has_an_absolute_cap() {
        let k = Kernel::Matmul { rhs_t: false };
        let (a, b) = (t(&[32768, 2048]), t(&[2048, 32768]));
        let err = fits(&k, &[&a, &b]).unwrap_err();
        assert!(err.contains("over the replay cap of 268435456"), "{err}");
        let (a, b) = (t(&[4096, 2048]), t(&[2048, 4096]));
        assert!(fits(&k, &[&a, &b]).is_ok());
    }

    /// The first position whose digests differ, in a's order, and its slices on each side; a
    /// slice past the dims or of another length on the other side gives `None`.
    #[test]
    fn first_differing_position_and_slices() {
        use candle_trace_format::record::{TokenAxis, TokenStat};
        let tok = |pos, digest| TokenStat { row: 0, pos, digest, sum: 0.0, abs_max: 0.0, nonfinite: 0, samples: [0.0; 4] };
        let rec = |digests: &[u64]| OpRecord {
            axis: Some(TokenAxis { seq_dim: Some(2), first_pos: 0, keep_from: 0, causal: false }),
            tokens: digests.iter().enumerate().map(|(p, &d)| tok(p as u32, d)).collect(),
            ..OpRecord::default()
        };
        let (a, b) = (rec(&[1, 2, 3]), rec(&[1, 9, 8]));
        // Positions along the last dim: position 1 is every third element from element 1.
        let at = first_differing(&a, &[1, 4, 3], &b, &[1, 4, 3]).unwrap();
        assert_eq!(at, FirstDiffering { position: 1, a_at: vec![1..2, 4..5, 7..8, 10..11], b_at: vec![1..2, 4..5, 7..8, 10..11] });
        assert_eq!(first_differing(&a, &[1, 4, 3], &b, &[1, 2, 3]), None, "slices of unequal length");
        assert_eq!(first_differing(&a, &[1, 4, 1], &b, &[1, 4, 1]), None, "position 1 past the dims");
        assert_eq!(first_differing(&a, &[1, 4, 3], &a, &[1, 4, 3]), None, "no position differs");
        assert_eq!(first_differing(&a, &[1, 4, 3], &b, &[2, 4, 3]), None, "b a batch of two: its rows are not a's");
    }
}
