//! The driver every block-quantized kernel of this crate shares: activation rows quantized by
//! candle's own code, then each output element a dot product of one weight row with one
//! activation row, four columns at a time, in parallel over rows and column panels (a row's bits
//! do not depend on the split).

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Result, Tensor, D};
use rayon::prelude::*;

/// Weights per block of the types here (`QK4_1`, `QK5_0`, `QK8_0`, `QK8_1`).
pub const QK: usize = 32;
/// Output columns per parallel work item.
const CHUNK: usize = 64;

/// Four output elements of one activation row `x` against four weight rows `w` (each as many
/// blocks as `x`): `[f32; 4]`, each with the type's scalar dot product's bits.
pub type Dot4 = fn(w: [&[u8]; 4], x: &[u8]) -> [f32; 4];
/// One output element: weight row `w` against activation row `x`.
pub type Dot1 = fn(w: &[u8], x: &[u8]) -> f32;

/// The f16 at byte `at` of a block (a scale), as f32 (exact).
pub fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(f16_bits(b, at)).to_f32()
}

/// The raw bits of the f16 at byte `at` of a block.
pub fn f16_bits(b: &[u8], at: usize) -> u16 {
    u16::from_ne_bytes([b[at], b[at + 1]])
}

/// The integer sums of four columns from their eight-lane partial sums (`madd` results): lane
/// `j` holds column `j`'s total. Exact.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub unsafe fn column_sums(s: [std::arch::x86_64::__m256i; 4]) -> std::arch::x86_64::__m128i {
    use std::arch::x86_64::*;
    // Lane j of each 128-bit half: partial sums of column j; the halves added give the total.
    let h = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
    _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1))
}

/// A weight type's kernel: its block size in bytes, the type its activations are quantized to
/// (candle's `VecDotType`) and that block's size, and its dot products.
pub struct Kind {
    pub weight: GgmlDType,
    pub w_block: usize,
    pub act: GgmlDType,
    pub x_block: usize,
    pub dot4: Dot4,
    pub dot1: Dot1,
}

/// `x @ Wᵀ` for a weight `[n, k]` of `kind.weight` and f32 `x` `[.., k]` on the CPU:
/// `Some([.., n])`; `None` when the kernel does not apply (another weight type or device, a
/// non-f32 or non-contiguous `x`, K not a multiple of 32, no rows).
///
/// # Errors
/// candle's errors reading the weight's bytes or quantizing `x`.
pub fn matmul(x: &Tensor, w: &QTensor, kind: &Kind) -> Result<Option<Tensor>> {
    if w.dtype() != kind.weight || !matches!(x.device(), Device::Cpu) || !matches!(w.device(), Device::Cpu) || x.dtype() != DType::F32 || !x.is_contiguous() || x.rank() < 2 {
        return Ok(None);
    }
    let (n, k) = w.shape().dims2()?;
    if k == 0 || n == 0 || !k.is_multiple_of(QK) || x.dim(D::Minus1)? != k || x.elem_count() == 0 {
        return Ok(None);
    }
    let m = x.elem_count() / k;
    let kb = k / QK;
    let wb = w.data()?;
    if wb.len() != n * kb * kind.w_block {
        return Ok(None);
    }
    // `QTensor::quantize` reads its source's storage from the start, whatever the view's offset:
    // a view into a larger tensor (a row of a batch) is copied out first.
    let x2 = if x.layout().start_offset() == 0 { x.reshape((m, k))? } else { Tensor::from_vec(x.flatten_all()?.to_vec1::<f32>()?, (m, k), &Device::Cpu)? };
    let xq = QTensor::quantize(&x2, kind.act)?;
    let xb = xq.data()?;
    if xb.len() != m * kb * kind.x_block {
        return Ok(None);
    }
    let (wr, xr) = (kb * kind.w_block, kb * kind.x_block);
    let mut out = vec![0f32; m * n];
    out.par_chunks_mut(n).enumerate().for_each(|(r, row)| {
        let xrow = &xb[r * xr..(r + 1) * xr];
        row.par_chunks_mut(CHUNK).enumerate().for_each(|(ci, cols)| {
            let c0 = ci * CHUNK;
            let w = |c: usize| &wb[(c0 + c) * wr..(c0 + c + 1) * wr];
            let done = cols.len() & !3;
            let mut quads = cols.chunks_exact_mut(4);
            for (qi, o) in (&mut quads).enumerate() {
                o.copy_from_slice(&(kind.dot4)([w(4 * qi), w(4 * qi + 1), w(4 * qi + 2), w(4 * qi + 3)], xrow));
            }
            for (i, o) in quads.into_remainder().iter_mut().enumerate() {
                *o = (kind.dot1)(w(done + i), xrow);
            }
        });
    });
    let mut dims = x.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = n;
    }
    Ok(Some(Tensor::from_vec(out, dims, &Device::Cpu)?))
}
