//! Activation patching: overwrite one op output's slice at one (batch row, token position) with
//! values taken from another run, or read that slice out. The tracer does both on the live op
//! path, as it records ([`crate::tracer::Tracer::with_patches`],
//! [`crate::tracer::Tracer::with_captures`]): `trace bisect --causal` (`candle_trace_run::causal`) re-runs
//! one run with the other's values at chosen op outputs to learn which difference changed a token.
//!
//! A slice is what a per-token digest covers ([`candle_trace_format::record::slice_ranges`]): the position's
//! values of one row, and for attention scores and probabilities only the keys the query sees.
//! So a patched slice digests exactly as the run it came from. Of attention scores and
//! probabilities a capture also reads the whole query rows ([`query_rows`]), masked keys too:
//! a NaN there reaches what reads them ([`crate::digest::masked`]). A patch then writes, head by
//! head, the keys both runs' rows hold, matched by their own position ([`rows_to_write`]).

use candle_core::Tensor;
use candle_trace_format::error::{Error, Result};
use candle_trace_format::record::{key_span, slice_ranges, Rows, TokenAxis};
use std::ops::Range;

/// One (module path, batch row, position) slice of an op output: where a patch is written or a
/// capture read. `row` is the run's own batch row; `pos` is counted from the row's first real
/// token (the position a trace records).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SliceKey {
    /// Module path of the op.
    pub path: String,
    /// Batch row.
    pub row: u32,
    /// Token position, counted from the row's first real token.
    pub pos: u32,
}

impl std::fmt::Display for SliceKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.row == 0 {
            write!(f, "{}@{}", self.path, self.pos)
        } else {
            write!(f, "{}@{} (row {})", self.path, self.pos, self.row)
        }
    }
}

/// Values to write over one slice when the op at `at` runs: a 1-D tensor holding the slice's
/// elements in order (as [`read`] returns them), of any float dtype (converted to the op's).
#[derive(Clone, Debug)]
pub struct Patch {
    /// The slice to overwrite.
    pub at: SliceKey,
    /// The values, 1-D, as many as the slice holds.
    pub values: Tensor,
    /// Attention scores and probabilities: the whole query rows the values came from, 1-D
    /// (heads × keys, [`query_rows`]), written instead of `values` ([`rows_to_write`]).
    pub rows: Option<Tensor>,
}

/// What a capture read of one slice: the values its digest covers (1-D, the op's dtype), and of
/// attention scores and probabilities the whole query rows ([`query_rows`]).
#[derive(Clone, Debug)]
pub struct Captured {
    /// The slice's values.
    pub values: Tensor,
    /// The whole query rows, masked keys too; `None` for other outputs.
    pub rows: Option<Tensor>,
}

impl Captured {
    /// A patch writing these values at `at`.
    pub fn patch(&self, at: SliceKey) -> Patch {
        Patch { at, values: self.values.clone(), rows: self.rows.clone() }
    }
}

/// The flat ranges of the whole query rows of batch row `b`'s slice at its own position
/// `own_pos` in an attention output of shape `dims` (`[b, heads, q, keys]`), one a head, in
/// order: every key from the row's first real one (its own key position 0) to the end, masked
/// ones too. `None` for an output whose slices keep every key (no causal axis, no padded keys
/// last) or that does not hold the position ([`slice_ranges`]).
pub fn query_rows(dims: &[usize], axis: &TokenAxis, rows: &Rows, b: usize, own_pos: u32) -> Option<Vec<Range<usize>>> {
    if !(axis.causal || rows.keys_last) || axis.seq_dim.is_none() {
        return None;
    }
    let visible = slice_ranges(dims, axis, rows, b, own_pos)?;
    let inner = *dims.last()?;
    let (lo, hi) = rows.window(b);
    let (k0, _) = key_span(axis, rows, (lo, hi), own_pos.checked_add(lo)?, inner);
    // key_span starts at the row's first real key, `lo`.
    Some(visible.into_iter().map(|r| r.start..r.start - k0 + inner).collect())
}

/// Where and what to write of `from` (another run's [`query_rows`] at slice `at`, 1-D, heads ×
/// its keys) into an output of shape `dims`: per head, the keys both runs' rows hold, matched by
/// their own position (another chunking or padding gives the rows other lengths and offsets).
/// `None` when the output has no such rows at `at` or the head counts differ.
///
/// # Errors
/// Candle's, reading `from`.
pub fn rows_to_write(dims: &[usize], axis: &TokenAxis, rows: &Rows, at: &SliceKey, from: &Tensor) -> Result<Option<(Vec<Range<usize>>, Tensor)>> {
    let Some(q) = query_rows(dims, axis, rows, at.row as usize, at.pos) else { return Ok(None) };
    let heads = q.len();
    if heads == 0 || !from.elem_count().is_multiple_of(heads) {
        return Ok(None);
    }
    let theirs = from.elem_count() / heads;
    let n = q[0].len().min(theirs);
    let values = read(from, &(0..heads).map(|m| m * theirs..m * theirs + n).collect::<Vec<_>>())?;
    Ok(Some((q.iter().map(|r| r.start..r.start + n).collect(), values)))
}

/// The elements of `t` in `ranges` (flat, row-major indices), as one 1-D tensor of `t`'s dtype.
///
/// # Errors
/// Candle errors; a range past the tensor's end.
pub fn read(t: &Tensor, ranges: &[Range<usize>]) -> Result<Tensor> {
    let flat = t.flatten_all()?;
    let n = flat.dim(0)?;
    let mut parts = Vec::with_capacity(ranges.len());
    for r in ranges {
        if r.end > n || r.start > r.end {
            return Err(Error::usage(format!("slice {}..{} is outside the op's {n} values", r.start, r.end)));
        }
        parts.push(flat.narrow(0, r.start, r.end - r.start)?);
    }
    Ok(Tensor::cat(&parts, 0)?)
}

/// A copy of `t` with the elements in `ranges` replaced, in order, by `values` (1-D, converted to
/// `t`'s dtype). The ranges must be sorted and disjoint, as [`candle_trace_format::record::slice_ranges`] gives.
///
/// # Errors
/// [`Error::Usage`] when `values` does not hold exactly as many elements as the ranges cover (the
/// two runs' slices differ in size: another kv length or hidden size); candle errors.
pub fn write(t: &Tensor, ranges: &[Range<usize>], values: &Tensor) -> Result<Tensor> {
    let want: usize = ranges.iter().map(|r| r.end - r.start).sum();
    let have = values.elem_count();
    if want != have {
        return Err(Error::usage(format!("the patch holds {have} values where the op's slice holds {want}")));
    }
    let flat = t.flatten_all()?;
    let n = flat.dim(0)?;
    let values = values.flatten_all()?.to_dtype(t.dtype())?.to_device(t.device())?;
    let mut parts = Vec::with_capacity(2 * ranges.len() + 1);
    let (mut at, mut v) = (0usize, 0usize);
    for r in ranges {
        if r.start < at || r.end > n {
            return Err(Error::usage(format!("slice {}..{} is outside the op's {n} values", r.start, r.end)));
        }
        if r.start > at {
            parts.push(flat.narrow(0, at, r.start - at)?);
        }
        let len = r.end - r.start;
        if len > 0 {
            parts.push(values.narrow(0, v, len)?);
        }
        v += len;
        at = r.end;
    }
    if at < n {
        parts.push(flat.narrow(0, at, n - at)?);
    }
    Ok(Tensor::cat(&parts, 0)?.reshape(t.shape())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    #[test]
    fn write_then_read_round_trips() -> Result<()> {
        let t = Tensor::arange(0f32, 12., &Device::Cpu)?.reshape((3, 4))?;
        let ranges = [1..3, 5..6, 10..12];
        let v = Tensor::new(&[-1f32, -2., -3., -4., -5.], &Device::Cpu)?;
        let p = write(&t, &ranges, &v)?;
        assert_eq!(p.dims(), &[3, 4]);
        assert_eq!(p.flatten_all()?.to_vec1::<f32>()?, vec![0., -1., -2., 3., 4., -3., 6., 7., 8., 9., -4., -5.]);
        assert_eq!(read(&p, &ranges)?.to_vec1::<f32>()?, vec![-1., -2., -3., -4., -5.]);
        assert!(write(&t, &ranges, &Tensor::new(&[1f32], &Device::Cpu)?).is_err());
        Ok(())
    }
}
