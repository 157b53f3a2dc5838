//! Whether two runs fed an op the same values where their operands overlap: the core of a
//! repro's claim that "the inputs matched, the op made the difference".
//!
//! A repro trace holds run a's op with its operands and, when b dumped the op too, b's record
//! and operands. Operands of one shape are compared whole. Operands whose shapes differ along
//! exactly one dim are compared on the indices both hold along it: along the output's token
//! axis (same size as the output there) by absolute position, from each record's
//! [`TokenAxis::first_pos`] (whole prefill vs a chunk: the chunk's rows); along any other dim
//! from index 0 (keys 0..N of a KV cache). Shapes that differ along more dims (a padded batch:
//! rows and length) are not compared, and the result says so.

use candle_trace_format::error::Result;
use candle_trace_format::record::{OpRecord, OperandValue, TokenAxis};
use serde::Serialize;

/// One operand of run a and the same operand of run b, compared where they overlap.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OperandOverlap {
    /// Operand index, in the order the op descriptor takes them.
    pub index: usize,
    /// Run a's operand dims, outermost first.
    pub shape_a: Vec<usize>,
    /// Run b's operand dims.
    pub shape_b: Vec<usize>,
    /// Elements compared (bytes for quantized weights, see `unit`); 0 when not compared.
    pub compared: u64,
    /// Of those, elements (bytes) whose bits differ.
    pub differing: u64,
    /// `"elements"`, or `"bytes"` for quantized weights (compared block bytes).
    pub unit: &'static str,
    /// What was compared: `"whole"`, `"positions P..Q (dim D)"`, `"indices 0..N (dim D)"`, or
    /// why nothing was (`"not compared: …"`).
    pub span: String,
}

impl OperandOverlap {
    /// Compared, and every compared element has the same bits in both runs.
    pub fn identical(&self) -> bool {
        self.compared > 0 && self.differing == 0
    }
}

/// Compares a's operands `va` of record `ra` with b's `vb` of record `rb`, index by index.
///
/// # Errors
/// A dumped operand whose bytes do not match its dtype and shape ([`candle_trace_format::dump::decode`]).
pub fn operand_overlaps(ra: &OpRecord, va: &[&OperandValue], rb: &OpRecord, vb: &[&OperandValue]) -> Result<Vec<OperandOverlap>> {
    va.iter().zip(vb).enumerate().map(|(i, (x, y))| overlap(i, (ra, x), (rb, y))).collect()
}

fn overlap(index: usize, (ra, x): (&OpRecord, &OperandValue), (rb, y): (&OpRecord, &OperandValue)) -> Result<OperandOverlap> {
    let skip = |why: &str, shape_a: Vec<usize>, shape_b: Vec<usize>, unit| OperandOverlap { index, shape_a, shape_b, compared: 0, differing: 0, unit, span: format!("not compared: {why}") };
    let (da, db) = match (x, y) {
        (OperandValue::Quantized { ggml_dtype: ga, shape: sa, data: a, .. }, OperandValue::Quantized { ggml_dtype: gb, shape: sb, data: b, .. }) => {
            let (sa, sb): (Vec<usize>, Vec<usize>) = (sa.iter().map(|&d| d as usize).collect(), sb.iter().map(|&d| d as usize).collect());
            if ga != gb || sa != sb || a.len() != b.len() {
                return Ok(skip("quantized weights of different types or shapes", sa, sb, "bytes"));
            }
            let differing = a.iter().zip(b).filter(|(p, q)| p != q).count() as u64;
            return Ok(OperandOverlap { index, shape_a: sa, shape_b: sb, compared: a.len() as u64, differing, unit: "bytes", span: "whole".into() });
        }
        (OperandValue::Tensor(a) | OperandValue::QMatMulTensor(a), OperandValue::Tensor(b) | OperandValue::QMatMulTensor(b)) => (a, b),
        _ => return Ok(skip("one run's operand is quantized, the other's dense", Vec::new(), Vec::new(), "elements")),
    };
    let (a, b) = (candle_trace_format::dump::decode(da)?, candle_trace_format::dump::decode(db)?);
    let (sa, sb) = (a.shape.clone(), b.shape.clone());
    if a.dtype != b.dtype || sa.len() != sb.len() {
        return Ok(skip("dtypes or ranks differ", sa, sb, "elements"));
    }
    let dims: Vec<usize> = (0..sa.len()).filter(|&k| sa[k] != sb[k]).collect();
    let (k, starts, span) = match dims.as_slice() {
        [] => {
            let differing = a.ordered.iter().zip(&b.ordered).filter(|(p, q)| p != q).count() as u64;
            return Ok(OperandOverlap { index, shape_a: sa, shape_b: sb, compared: a.ordered.len() as u64, differing, unit: "elements", span: "whole".into() });
        }
        [k] => match (positions(ra.axis.as_ref(), &ra.shape, *k, sa[*k]), positions(rb.axis.as_ref(), &rb.shape, *k, sb[*k])) {
            (Some(pa), Some(pb)) => (*k, (pa, pb), "positions"),
            _ => (*k, (0, 0), "indices"),
        },
        _ => return Ok(skip("shapes differ along more than one dim", sa, sb, "elements")),
    };
    let (lo, hi) = (starts.0.max(starts.1), (starts.0 + sa[k]).min(starts.1 + sb[k]));
    if lo >= hi {
        return Ok(skip(&format!("no {span} in common along dim {k}"), sa, sb, "elements"));
    }
    let (outer, inner): (usize, usize) = (sa[..k].iter().product(), sa[k + 1..].iter().product());
    let (mut compared, mut differing) = (0u64, 0u64);
    for o in 0..outer {
        for p in lo..hi {
            let (ia, ib) = ((o * sa[k] + p - starts.0) * inner, (o * sb[k] + p - starts.1) * inner);
            let (ca, cb) = (&a.ordered[ia..ia + inner], &b.ordered[ib..ib + inner]);
            compared += inner as u64;
            differing += ca.iter().zip(cb).filter(|(p, q)| p != q).count() as u64;
        }
    }
    Ok(OperandOverlap { index, shape_a: sa, shape_b: sb, compared, differing, unit: "elements", span: format!("{span} {lo}..{} (dim {k})", hi - 1) })
}

/// The absolute position of index 0 along dim `k` of an operand `len` long there, when `k` is
/// the output's token axis and the operand runs along it as the output does.
fn positions(axis: Option<&TokenAxis>, out_shape: &[u32], k: usize, len: usize) -> Option<usize> {
    let ax = axis?;
    (ax.seq_dim == Some(k as u32) && out_shape.get(k).is_some_and(|&n| n as usize == len)).then_some(ax.first_pos as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_trace_format::record::Dump;

    fn dense(shape: &[u32], vals: &[f32]) -> OperandValue {
        let data: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        OperandValue::Tensor(Dump { seq: 0, dtype: "f32".into(), shape: shape.to_vec(), shuffled: false, data })
    }

    fn rec(shape: &[u32], first_pos: u32) -> OpRecord {
        OpRecord { shape: shape.to_vec(), axis: Some(TokenAxis { seq_dim: Some(1), first_pos, keep_from: 0, causal: false }), ..Default::default() }
    }

    /// A whole prompt of 4 positions against a chunk holding positions 2..3: the chunk's rows
    /// are compared with a's rows 2 and 3, and a change there is counted.
    #[test]
    fn a_chunk_is_compared_with_the_same_positions() {
        let a_vals: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let (ra, rb) = (rec(&[1, 4, 2], 0), rec(&[1, 2, 2], 2));
        let same = dense(&[1, 2, 2], &a_vals[4..]);
        let o = operand_overlaps(&ra, &[&dense(&[1, 4, 2], &a_vals)], &rb, &[&same]).unwrap();
        assert_eq!((o[0].compared, o[0].differing, o[0].span.as_str()), (4, 0, "positions 2..3 (dim 1)"));
        assert!(o[0].identical());
        let changed = dense(&[1, 2, 2], &[4.0, 5.0, 6.0, 7.5]);
        let o = operand_overlaps(&ra, &[&dense(&[1, 4, 2], &a_vals)], &rb, &[&changed]).unwrap();
        assert_eq!((o[0].compared, o[0].differing), (4, 1));
        // Along another dim (keys), from index 0.
        let (ka, kb) = (dense(&[1, 2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), dense(&[1, 2, 2], &[1.0, 2.0, 4.0, 5.0]));
        let o = operand_overlaps(&ra, &[&ka], &rb, &[&kb]).unwrap();
        assert_eq!((o[0].compared, o[0].differing, o[0].span.as_str()), (4, 0, "indices 0..1 (dim 2)"));
        // Two dims differ: not compared, and never called identical.
        let o = operand_overlaps(&ra, &[&dense(&[1, 4, 2], &a_vals)], &rb, &[&dense(&[2, 2, 1], &[0.0; 4])]).unwrap();
        assert!(!o[0].identical() && o[0].span.starts_with("not compared"));
    }
}
