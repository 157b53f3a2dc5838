//! Whether two runs fed an op the same values where their operands overlap: the core of a
//! repro's claim that "the inputs matched, the op made the difference".
//!
//! A repro trace holds run a's op with its operands and, when b dumped the op too, b's record
//! and operands. Operands of one shape are compared whole. Operands whose shapes differ are
//! compared on the indices both hold along each differing dim: along the output's token
//! axis (same size as the output there) by absolute position, from each record's
//! [`TokenAxis::first_pos`] (whole prefill vs a chunk: the chunk's rows); along any other dim
//! from index 0 (keys 0..N of a KV cache); when several dims differ (a chunk's attention
//! scores: its query positions and its keys), the block both hold along all of them. Batch rows
//! that differ (a padded batch) are not compared, and the result says so.

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

/// An operand value's dims, outermost first: a dense tensor's, or a quantized weight's logical
/// shape.
fn dims_of(v: &OperandValue) -> Vec<usize> {
    match v {
        OperandValue::Tensor(d) | OperandValue::QMatMulTensor(d) => d.shape.iter().map(|&x| x as usize).collect(),
        OperandValue::Quantized { shape, .. } => shape.iter().map(|&x| x as usize).collect(),
    }
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
        // Each side's own dims, whatever its kind (they printed as [] here: a fresh-user trial).
        _ => return Ok(skip("one run's operand is quantized, the other's dense", dims_of(x), dims_of(y), "elements")),
    };
    let (a, b) = (candle_trace_format::dump::decode(da)?, candle_trace_format::dump::decode(db)?);
    let (sa, sb) = (a.shape.clone(), b.shape.clone());
    if a.dtype != b.dtype || sa.len() != sb.len() {
        return Ok(skip("dtypes or ranks differ", sa, sb, "elements"));
    }
    let dims: Vec<usize> = (0..sa.len()).filter(|&k| sa[k] != sb[k]).collect();
    if dims.is_empty() {
        let differing = a.ordered.iter().zip(&b.ordered).filter(|(p, q)| p != q).count() as u64;
        return Ok(OperandOverlap { index, shape_a: sa, shape_b: sb, compared: a.ordered.len() as u64, differing, unit: "elements", span: "whole".into() });
    }
    // Per differing dim: where index 0 of each side sits (absolute positions along the token
    // axis, else both at 0), and the span both hold. The batch dim is not aligned this way.
    let mut start = vec![(0usize, 0usize); sa.len()];
    let mut spans = Vec::new();
    for &k in &dims {
        let (kind, st) = match (positions(ra.axis.as_ref(), &ra.shape, k, sa[k]), positions(rb.axis.as_ref(), &rb.shape, k, sb[k])) {
            (Some(pa), Some(pb)) => ("positions", (pa, pb)),
            _ if k == 0 && sa.len() > 2 => return Ok(skip("the batch rows differ (rows are not aligned by index)", sa, sb, "elements")),
            _ => ("indices", (0, 0)),
        };
        let (lo, hi) = (st.0.max(st.1), (st.0 + sa[k]).min(st.1 + sb[k]));
        if lo >= hi {
            return Ok(skip(&format!("no {kind} in common along dim {k}"), sa, sb, "elements"));
        }
        start[k] = st;
        spans.push((k, kind, lo, hi));
    }
    // Walk the overlap: every index of the dims that agree, the common span of those that do not.
    let range = |k: usize| spans.iter().find(|x| x.0 == k).map_or((0, sa[k]), |x| (x.2, x.3));
    let mut at: Vec<usize> = (0..sa.len()).map(|k| range(k).0).collect();
    let flat = |shape: &[usize], side: usize, at: &[usize]| at.iter().enumerate().fold(0usize, |f, (k, &p)| f * shape[k] + p - if side == 0 { start[k].0 } else { start[k].1 });
    let (mut compared, mut differing) = (0u64, 0u64);
    'walk: loop {
        compared += 1;
        differing += u64::from(a.ordered[flat(&sa, 0, &at)] != b.ordered[flat(&sb, 1, &at)]);
        for k in (0..at.len()).rev() {
            at[k] += 1;
            if at[k] < range(k).1 {
                continue 'walk;
            }
            at[k] = range(k).0;
        }
        break;
    }
    let span = spans.iter().map(|(k, kind, lo, hi)| format!("{kind} {lo}..{} (dim {k})", hi - 1)).collect::<Vec<_>>().join(", ");
    Ok(OperandOverlap { index, shape_a: sa, shape_b: sb, compared, differing, unit: "elements", span })
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
        // Batch rows that differ: not compared, and never called identical.
        let o = operand_overlaps(&ra, &[&dense(&[1, 4, 2], &a_vals)], &rb, &[&dense(&[2, 2, 1], &[0.0; 4])]).unwrap();
        assert!(!o[0].identical() && o[0].span.starts_with("not compared"), "{o:?}");
        // Two dims differ (a chunk's scores: its query positions, keys from 0): the block both hold.
        let (sa, sb) = (rec(&[1, 3, 3], 0), rec(&[1, 2, 2], 1));
        let scores_a: Vec<f32> = (0..9).map(|i| i as f32).collect();
        let scores_b = [3.0, 4.0, 6.0, 7.0]; // a's rows 1..2, columns 0..1
        let o = operand_overlaps(&sa, &[&dense(&[1, 3, 3], &scores_a)], &sb, &[&dense(&[1, 2, 2], &scores_b)]).unwrap();
        assert_eq!((o[0].compared, o[0].differing, o[0].span.as_str()), (4, 0, "positions 1..2 (dim 1), indices 0..1 (dim 2)"));
        // A quantized weight against a dense one: not compared, each with its own dims.
        let q = OperandValue::Quantized { id: 0, ggml_dtype: "Q4_1".into(), shape: vec![2, 32], data: vec![0; 40] };
        let o = operand_overlaps(&ra, &[&q], &rb, &[&dense(&[2, 32], &[0.0; 64])]).unwrap();
        assert_eq!((o[0].shape_a.as_slice(), o[0].shape_b.as_slice(), o[0].compared), (&[2, 32][..], &[2, 32][..], 0), "{o:?}");
    }
}
