//! Which elements of a recorded tensor one per-token entry covers: where its token axis is
//! ([`TokenAxis`], stored in each op record), and a batch row's slice at one position, with the
//! keys its query sees (padded batches, causal and encoder attention). Re-exported from
//! [`crate::record`].

use serde::{Deserialize, Serialize};

/// Where the token axis of a tensor is, and which positions it holds.
///
/// Dim 0 is always the batch axis. `seq_dim = Some(d)`: index `i` along dim `d` is absolute position
/// `first_pos + i`. `seq_dim = None`: the whole of each batch row is position `first_pos` (logits of
/// the last token). Positions below `keep_from` are not summarised (KV-cache entries written by an
/// earlier forward pass). `causal`: the last dim indexes keys and only keys `0..=p` are summarised
/// for position `p` (needs `seq_dim = Some(rank - 2)`).
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenAxis {
    /// Dim indexing token positions (`1 <= d < rank`); `None`: each batch row is one position.
    pub seq_dim: Option<u32>,
    /// Absolute position of index 0 along `seq_dim` (or of each whole row when `seq_dim` is
    /// `None`).
    pub first_pos: u32,
    /// Positions below this one are not summarised (KV-cache entries an earlier pass wrote).
    pub keep_from: u32,
    /// The last dim indexes keys: only keys `0..=p` are summarised for position `p`.
    pub causal: bool,
}

/// Which positions of each batch row hold real tokens, for batches of different requests
/// padded to one length: row `r`'s tokens are at absolute positions `windows[r].0 ..
/// windows[r].1` (left padding: `pad_r .. ∞`; right padding: `0 .. len_r`). Per-token
/// statistics then cover only those positions, numbered from the row's own first token (so
/// a padded row aligns with the same request run alone), and, for outputs whose last dim
/// indexes keys, only the keys the row's mask lets a query see. Empty `windows`: every
/// position of every row is a token (no padding).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rows {
    /// Per batch row, the absolute positions `lo .. hi` of its real tokens; empty: no padding.
    pub windows: Vec<(u32, u32)>,
    /// The last dim indexes keys (attention scores and probabilities of an encoder: every
    /// key of the row's window is visible).
    pub keys_last: bool,
}

impl Rows {
    /// Row `b`'s window (everything when none is set).
    pub fn window(&self, b: usize) -> (u32, u32) {
        self.windows.get(b).copied().unwrap_or((0, u32::MAX))
    }
}

/// The part of a position's innermost run of `inner` values that a query at absolute position
/// `pos` of a row with token window `(lo, hi)` sees: causal attention, keys `lo ..= pos`; an
/// encoder's attention, keys `lo .. hi`; anything else, all of it.
pub fn key_span(axis: &TokenAxis, rows: &Rows, (lo, hi): (u32, u32), pos: u32, inner: usize) -> (usize, usize) {
    let (k0, k1) = if axis.causal {
        (lo as usize, inner.min(pos as usize + 1))
    } else if rows.keys_last {
        (lo as usize, inner.min(hi as usize))
    } else {
        (0, inner)
    };
    (k0.min(k1), k1)
}

/// The flat (row-major) element ranges of batch row `b`'s slice at its own position `own_pos`
/// (counted from the row's first real token) in a tensor of shape `dims`: exactly the elements
/// its per-token digest covers. `None` when the tensor does not hold that position for that row.
/// Used to read (`--causal` captures) and overwrite (patches) one recorded slice.
pub fn slice_ranges(dims: &[usize], axis: &TokenAxis, rows: &Rows, b: usize, own_pos: u32) -> Option<Vec<std::ops::Range<usize>>> {
    slice_runs(dims.len(), |d| dims[d], axis, rows, b, own_pos).map(|r| r.ranges().collect())
}

/// Where [`slice_ranges`]' ranges lie: `count` runs of `len` elements, the first at `first`,
/// each `stride` after the one before.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SliceRuns {
    first: usize,
    stride: usize,
    len: usize,
    count: usize,
}

impl SliceRuns {
    fn ranges(self) -> impl Iterator<Item = std::ops::Range<usize>> {
        (0..self.count).map(move |m| {
            let start = self.first + m * self.stride;
            start..start + self.len
        })
    }
}

/// [`slice_ranges`] as runs, of a tensor of rank `rank` whose dim `d` is `dim(d)`.
fn slice_runs(rank: usize, dim: impl Fn(usize) -> usize, axis: &TokenAxis, rows: &Rows, b: usize, own_pos: u32) -> Option<SliceRuns> {
    if rank == 0 || b >= dim(0) {
        return None;
    }
    let product = |r: std::ops::Range<usize>| r.map(&dim).product::<usize>();
    let (lo, hi) = rows.window(b);
    let pos = own_pos.checked_add(lo)?;
    if pos >= hi || pos < axis.keep_from || pos < axis.first_pos {
        return None;
    }
    let row_len = product(1..rank);
    let Some(sd) = axis.seq_dim.map(|d| d as usize) else {
        return (pos == axis.first_pos).then_some(SliceRuns { first: b * row_len, stride: 0, len: row_len, count: 1 });
    };
    if sd == 0 || sd >= rank || (axis.causal && sd + 2 != rank) {
        return None;
    }
    let (mid, seq, inner) = (product(1..sd), dim(sd), product(sd + 1..rank));
    let s = (pos - axis.first_pos) as usize;
    if s >= seq {
        return None;
    }
    let (k0, k1) = key_span(axis, rows, (lo, hi), pos, inner);
    Some(SliceRuns { first: (b * mid * seq + s) * inner + k0, stride: seq * inner, len: k1 - k0, count: mid })
}

/// The number of elements [`token_slice`] lists for row `row` at position `pos` of a record of
/// shape `shape` (what its per-token statistics cover), without listing them.
pub fn token_slice_len(shape: &[u32], axis: &TokenAxis, row: u32, pos: u32) -> Option<usize> {
    slice_runs(shape.len(), |d| shape[d] as usize, axis, &Rows::default(), row as usize, pos).map(|r| r.len * r.count)
}

/// [`slice_ranges`] in a batch without padding: row `row`'s slice at absolute position `pos`.
pub fn token_slice(dims: &[usize], axis: &TokenAxis, row: u32, pos: u32) -> Option<Vec<std::ops::Range<usize>>> {
    slice_ranges(dims, axis, &Rows::default(), row as usize, pos)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The length computed without listing is the listed ranges' total, for every row and
    /// position of tensors with and without a sequence dim, causal or not, with a KV-cache
    /// offset and positions outside the tensor; and the ranges of a causal (1, 2, 3, 4) slice
    /// are the keys its query sees, head by head.
    #[test]
    fn slice_len_is_the_listed_ranges_total() {
        let axes = [(None, 0, 0, false), (Some(1), 0, 0, false), (Some(2), 3, 0, false), (Some(2), 3, 4, true), (Some(1), 2, 3, false)];
        let mut checked = 0;
        for shape in [vec![2u32, 5, 6], vec![1, 2, 3, 4], vec![3, 4, 5, 6], vec![2, 7]] {
            let dims: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
            for &(seq_dim, first_pos, keep_from, causal) in &axes {
                let axis = TokenAxis { seq_dim, first_pos, keep_from, causal };
                for row in 0..4 {
                    for pos in 0..12 {
                        let listed = token_slice(&dims, &axis, row, pos).map(|r| r.iter().map(|x| x.len()).sum::<usize>());
                        assert_eq!(token_slice_len(&shape, &axis, row, pos), listed, "{shape:?} {axis:?} row {row} pos {pos}");
                        checked += listed.is_some() as usize;
                    }
                }
            }
        }
        assert!(checked > 100, "{checked} slices held");
        let axis = TokenAxis { seq_dim: Some(2), first_pos: 5, keep_from: 0, causal: true };
        assert_eq!(token_slice(&[1, 2, 3, 8], &axis, 0, 6), Some(vec![8..15, 32..39]));
    }
}
