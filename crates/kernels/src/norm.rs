//! Per-row norms and pooling: [`rms_norm`] and [`layer_norm`] computing candle's fused per-row
//! kernels' arithmetic whatever the input's layout, and [`mean_pool`] over each sentence's own
//! tokens.
//!
//! candle_nn 0.11.1's `RmsNorm` and `LayerNorm` modules run the fused kernel (a sequential sum per
//! row, `candle_nn::ops::rms_norm` / `layer_norm`) only on contiguous input and otherwise a
//! composition of tensor ops (`*_slow`), whose bits differ: the same row changes with the view it
//! is read through. Here every layout takes the fused kernel's steps, which the tests check bit
//! for bit against candle's.

use candle_core::{DType, Device, Result, Tensor};
use rayon::prelude::*;

/// `v` rounded to `dtype` and back (f16 and bf16; f32 unchanged): one rounding step of candle's
/// arithmetic in that type.
fn round(v: f32, dtype: DType) -> f32 {
    match dtype {
        DType::F16 => half::f16::from_f32(v).to_f32(),
        DType::BF16 => half::bf16::from_f32(v).to_f32(),
        _ => v,
    }
}

/// `x`'s rows (last dim `n`) and each parameter as f32, after checking each parameter is `[n]`
/// of `x`'s dtype.
fn rows(x: &Tensor, params: &[&Tensor]) -> Result<(Vec<f32>, usize, Vec<Vec<f32>>)> {
    let n = x.dims().last().copied().unwrap_or(0);
    if let Some(p) = params.iter().find(|p| p.dims() != [n] || p.dtype() != x.dtype()) {
        candle_core::bail!("a norm of {:?} {:?} with a parameter {:?} {:?}: it must be [{n}] of the input's dtype", x.dims(), x.dtype(), p.dims(), p.dtype())
    }
    Ok((crate::dense::values(x)?, n, params.iter().map(|p| crate::dense::values(p)).collect::<Result<_>>()?))
}

/// `x / sqrt(mean(x²) + eps) · alpha` over the last dim (`x` `[.., n]` f32, f16 or bf16, on the
/// CPU, any layout; `alpha` `[n]`), as candle's fused kernel computes it: `Σ x²` in f32 in index
/// order, `m = sqrt(Σ/n + eps)` rounded to the dtype, then `(x / m) · alpha` in the dtype.
///
/// # Errors
/// An `alpha` of another length or dtype; `x` off the CPU or of another dtype.
pub fn rms_norm(x: &Tensor, alpha: &Tensor, eps: f32) -> Result<Tensor> {
    let (mut v, n, params) = rows(x, &[alpha])?;
    let dt = x.dtype();
    if n > 0 {
        v.par_chunks_mut(n).for_each(|row| {
            let sum2 = row.iter().map(|&v| v * v).sum::<f32>();
            let m = round((sum2 / n as f32 + eps).sqrt(), dt);
            for (d, a) in row.iter_mut().zip(&params[0]) {
                *d = round(round(*d / m, dt) * a, dt);
            }
        });
    }
    Tensor::from_vec(v, x.dims(), &Device::Cpu)?.to_dtype(dt)
}

/// `(x − mean) / sqrt(var + eps) · alpha + beta` over the last dim, as candle's fused kernel
/// computes it (in f32: `Σx` and `Σx²` in index order, `var = Σx²/n − mean²`, the result rounded
/// once to the dtype).
///
/// # Errors
/// An `alpha` or `beta` of another length or dtype; `x` off the CPU or of another dtype.
pub fn layer_norm(x: &Tensor, alpha: &Tensor, beta: &Tensor, eps: f32) -> Result<Tensor> {
    let (mut v, n, params) = rows(x, &[alpha, beta])?;
    if n > 0 {
        v.par_chunks_mut(n).for_each(|row| {
            let (sum, sum2) = row.iter().fold((0f32, 0f32), |(s, s2), &v| (s + v, s2 + v * v));
            let mean = sum / n as f32;
            let inv_std = (sum2 / n as f32 - mean * mean + eps).sqrt().recip();
            for ((d, a), b) in row.iter_mut().zip(&params[0]).zip(&params[1]) {
                *d = (*d - mean) * inv_std * a + b;
            }
        });
    }
    Tensor::from_vec(v, x.dims(), &Device::Cpu)?.to_dtype(x.dtype())
}

/// The mean of each sentence's first `lengths[b]` token vectors: `x` `[b, t, h]` (f32, f16 or
/// bf16, on the CPU; padding after each sentence's tokens) to `[b, h]` of `x`'s dtype, each sum
/// sequential over tokens in f32 and divided once. Padding is never read, so a sentence padded
/// in a batch gives its lone run's bits. A length of 0 gives zeros.
///
/// # Errors
/// A rank other than 3, `lengths` of another count than `b` or a length over `t`, a tensor off
/// the CPU or of another dtype.
pub fn mean_pool(x: &Tensor, lengths: &[usize]) -> Result<Tensor> {
    let (b, t, h) = x.dims3()?;
    if lengths.len() != b || lengths.iter().any(|&l| l > t) {
        candle_core::bail!("mean_pool of {:?} with lengths {lengths:?}: one length ≤ {t} per sentence", x.dims())
    }
    let v = crate::dense::values(x)?;
    let mut out = vec![0f32; b * h];
    for (s, (o, &len)) in out.chunks_exact_mut(h.max(1)).zip(lengths).enumerate() {
        for tok in 0..len {
            for (o, x) in o.iter_mut().zip(&v[(s * t + tok) * h..(s * t + tok + 1) * h]) {
                *o += x;
            }
        }
        if len > 0 {
            o.iter_mut().for_each(|o| *o /= len as f32);
        }
    }
    Tensor::from_vec(out, (b, h), &Device::Cpu)?.to_dtype(x.dtype())
}
