//! The values two records of one op hold for the same (batch row, token position), when their
//! shapes differ: one implementation runs the final norm over the last position only where
//! another runs it over every position, one recorded a prompt in chunks. Used by
//! `bisect --tolerance` ([`crate::across`]) to compare what both computed.

use candle_trace_format::record::OpRecord;
use std::collections::BTreeMap;

/// Where each (batch row, absolute position)'s values lie in an output: element ranges, in order.
type Slices = BTreeMap<(usize, u32), Vec<std::ops::Range<usize>>>;

/// Offsets of each (row, absolute position)'s values in `r`'s output (row-major, `shape`), from
/// its token axis; `None` when the record has no token axis or its shape does not fit it.
fn positions(r: &OpRecord) -> Option<Slices> {
    let axis = r.axis.as_ref()?;
    let dims: Vec<usize> = r.shape.iter().map(|&d| d as usize).collect();
    let n: usize = dims.iter().product();
    let rows = *dims.first()?;
    if rows == 0 || n == 0 {
        return None;
    }
    let mut out = BTreeMap::new();
    match axis.seq_dim {
        // One position per row: the pass's last.
        None => {
            let per = n / rows;
            for row in 0..rows {
                out.insert((row, axis.first_pos), std::iter::once(row * per..(row + 1) * per).collect());
            }
        }
        Some(d) => {
            let d = d as usize;
            if d == 0 || d >= dims.len() {
                return None;
            }
            let outer: usize = dims[1..d].iter().product();
            let inner: usize = dims[d + 1..].iter().product();
            for row in 0..rows {
                for i in 0..dims[d] {
                    let pos = axis.first_pos.checked_add(u32::try_from(i).ok()?)?;
                    let ranges = (0..outer).map(|o| {
                        let start = ((row * outer + o) * dims[d] + i) * inner;
                        start..start + inner
                    });
                    out.insert((row, pos), ranges.collect());
                }
            }
        }
    }
    Some(out)
}

/// The values of `a` (record `ra`) and `b` (record `rb`) at the (row, position)s both hold, in
/// row then position order, when each such slice has the same length on both sides; `None` when
/// they share none or a slice's length differs (another head count, another key count).
pub fn common(ra: &OpRecord, a: &[f64], rb: &OpRecord, b: &[f64]) -> Option<(Vec<f64>, Vec<f64>, usize)> {
    let (pa, pb) = (positions(ra)?, positions(rb)?);
    let (mut xa, mut xb, mut shared) = (Vec::new(), Vec::new(), 0);
    for (key, ranges_a) in &pa {
        let Some(ranges_b) = pb.get(key) else { continue };
        let len = |r: &Vec<std::ops::Range<usize>>| r.iter().map(|x| x.len()).sum::<usize>();
        if len(ranges_a) != len(ranges_b) {
            return None;
        }
        for r in ranges_a {
            xa.extend_from_slice(a.get(r.clone())?);
        }
        for r in ranges_b {
            xb.extend_from_slice(b.get(r.clone())?);
        }
        shared += 1;
    }
    (shared > 0).then_some((xa, xb, shared))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_trace_format::record::TokenAxis;

    fn rec(shape: &[u32], seq_dim: Option<u32>, first_pos: u32) -> OpRecord {
        OpRecord { shape: shape.to_vec(), axis: Some(TokenAxis { seq_dim, first_pos, keep_from: 0, causal: false }), ..OpRecord::default() }
    }

    #[test]
    fn the_last_position_of_a_whole_prompt_meets_a_last_position_record() {
        // a: [1, 3, 2] positions 0..3; b: [1, 2] the last position (2).
        let a = [0.0, 1.0, 10.0, 11.0, 20.0, 21.0];
        let (xa, xb, n) = common(&rec(&[1, 3, 2], Some(1), 0), &a, &rec(&[1, 2], None, 2), &[20.5, 21.0]).unwrap();
        assert_eq!((xa, xb, n), (vec![20.0, 21.0], vec![20.5, 21.0], 1));
    }

    #[test]
    fn heads_before_the_token_axis_are_gathered_per_position() {
        // [1, 2 heads, 2 positions, 1]: position 1 is elements 1 and 3.
        let a = [0.0, 1.0, 2.0, 3.0];
        let b = [1.0, 3.0];
        let (xa, xb, _) = common(&rec(&[1, 2, 2, 1], Some(2), 0), &a, &rec(&[1, 2, 1, 1], Some(2), 1), &b).unwrap();
        assert_eq!(xa, vec![1.0, 3.0]);
        assert_eq!(xb, b.to_vec());
    }

    #[test]
    fn slices_of_another_length_or_no_shared_position_do_not_compare() {
        assert!(common(&rec(&[1, 2, 4], Some(1), 0), &[0.0; 8], &rec(&[1, 2, 2], Some(1), 0), &[0.0; 4]).is_none());
        assert!(common(&rec(&[1, 2, 2], Some(1), 0), &[0.0; 4], &rec(&[1, 2, 2], Some(1), 5), &[0.0; 4]).is_none());
        assert!(common(&OpRecord::default(), &[], &rec(&[1, 1], None, 0), &[0.0]).is_none());
    }
}
