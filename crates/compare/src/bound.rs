//! What a pair of per-token statistics says of the values behind them: a lower bound on
//! max |a − b| over the slice, from the recorded samples, abs-max and sum.

use candle_trace_format::record::{OpRecord, TokenStat};

/// Lower bound on max |a - b| over a slice of `n` elements and its relative size, from the
/// recorded samples, abs-max and sum: |Σa − Σb| ≤ n · max |a − b|.
pub(crate) fn diff_bound(a: &TokenStat, b: &TokenStat, n: Option<usize>) -> (f64, f64) {
    if a.nonfinite != b.nonfinite {
        // The statistics cover finite values only: no bound means anything here.
        return (f64::NAN, f64::NAN);
    }
    let mut d = (a.abs_max - b.abs_max).abs();
    if let Some(n) = n.filter(|&n| n > 0) {
        let ds = (a.sum - b.sum).abs() / n as f64;
        if ds.is_finite() {
            d = d.max(ds);
        }
    }
    for (x, y) in a.samples.iter().zip(&b.samples) {
        let dx = (*x as f64 - *y as f64).abs();
        if dx.is_finite() {
            d = d.max(dx);
        }
    }
    let scale = a.abs_max.max(b.abs_max);
    (d, if scale > 0.0 { d / scale } else { 0.0 })
}

/// Elements of the (row, pos) slice of record `r` (what its per-token statistics cover).
pub(crate) fn slice_len(r: &OpRecord, row: u32, pos: u32) -> Option<usize> {
    candle_trace_format::record::token_slice_len(&r.shape, r.axis.as_ref()?, row, pos)
}
