//! Softmax over the last dim whose row sum is grouped by index from the row's first nonzero
//! exponential: [`softmax_last_dim`], and [`softmax_row`] for the attention kernel.
//!
//! For a row `x` (f32): `max = maxᵢ xᵢ` (exact in any order), `eᵢ = exp(xᵢ − max)`, and the sum
//! `Σ eᵢ` in eight lanes, element `i` into lane `(i − first) mod 8` in index order, `first` the
//! first `i` with `eᵢ ≠ 0`; the lanes then added as `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 +
//! l7))`; `pᵢ = eᵢ / sum`. Masked entries (−∞) give `eᵢ = 0`: before the first key (left padding)
//! they are skipped, after the last (a longer kv length, a prefill chunk's masked tail) they add
//! exact zeros to non-negative lanes. So a query's probabilities have the same bits whether its
//! row is its own keys or those keys inside a longer, padded row.
//!
//! candle 0.11.1's `softmax_last_dim` sums with `vec_reduce_sum`, whose grouping follows the row
//! length: a query's probabilities change with the kv length around it.

use candle_core::{DType, Device, Result, Tensor};
use rayon::prelude::*;

/// Lanes of the row sum.
const LANES: usize = 8;

/// Softmax of `row` in place (see the module docs). A row of only −∞ (a query with no key)
/// becomes zeros, not NaN.
pub fn softmax_row(row: &mut [f32]) {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if max == f32::NEG_INFINITY {
        row.iter_mut().for_each(|v| *v = 0.0);
        return;
    }
    for v in row.iter_mut() {
        *v = (*v - max).exp();
    }
    let first = row.iter().position(|&e| e != 0.0).unwrap_or(row.len());
    let mut lanes = [0f32; LANES];
    let mut chunks = row[first..].chunks_exact(LANES);
    for c in &mut chunks {
        for (l, e) in lanes.iter_mut().zip(c) {
            *l += e;
        }
    }
    for (l, e) in lanes.iter_mut().zip(chunks.remainder()) {
        *l += e;
    }
    let sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    for v in row.iter_mut() {
        *v /= sum;
    }
}

/// Softmax over the last dim of `x` (f32, f16 or bf16, on the CPU, any layout; f16 and bf16
/// computed in f32 and rounded once), each row by [`softmax_row`], rows in parallel.
///
/// # Errors
/// `x` off the CPU, of another dtype, or of rank 0.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let n = x.dims().last().copied().ok_or_else(|| candle_core::Error::Msg("softmax of a scalar".into()))?;
    let mut v = crate::dense::values(x)?;
    if n > 0 {
        v.par_chunks_mut(n).for_each(softmax_row);
    }
    Tensor::from_vec(v, x.dims(), &Device::Cpu)?.to_dtype(match x.dtype() {
        DType::F16 | DType::BF16 => x.dtype(),
        _ => DType::F32,
    })
}
