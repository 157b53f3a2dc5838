//! Q4_1 weights times f32 activations on the CPU, as ggml's `ggml_vec_dot_q4_1_q8_1` defines the
//! product and candle 0.11.1 computes it (`k_quants::matmul` with `BlockQ4_1::vec_dot_unopt`),
//! bit for bit.
//!
//! Each activation row is quantized to Q8_1 blocks by candle's own code (`QTensor::quantize`:
//! 32 values, a scale `d = max|x| / 127`, `s = d · Σq`). Then for output `(r, c)`, over the
//! blocks `b` of K in order from 0:
//!
//! ```text
//! sumi = Σ_{j<16} (w.qs[j] & 15) · x.qs[j] + (w.qs[j] >> 4) · x.qs[j + 16]     (exact, i32)
//! acc  = acc + ((sumi as f32 · w.d) · x.d + w.m · x.s)                        (f32, this order)
//! ```
//!
//! The integer sum is exact in any order, so it is computed with AVX2 (`maddubs`: u8 × i8 pairs
//! into i16, at most 2 · 15 · 128 = 3840, no saturation) where the CPU has it; the f32 chain is
//! the scalar one, in candle's order, with no fused multiply-add. The output element therefore
//! depends only on its row of `x`, its weight row and K: the kernel is batch-invariant, and so is
//! candle's.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Result, Tensor, D};
use half::f16;
use rayon::prelude::*;

/// Weights per block (`QK4_1`, `QK8_1`).
const QK: usize = 32;
/// Bytes of a Q4_1 block: `d` (f16), `m` (f16), 16 bytes of 4-bit quants (ggml's `block_q4_1`).
const W_BLOCK: usize = 20;
/// Bytes of a Q8_1 block: `d` (f16), `s` (f16), 32 i8 quants (ggml's `block_q8_1`).
const X_BLOCK: usize = 36;
/// Output columns per parallel work item.
const CHUNK: usize = 64;

/// `x @ Wᵀ` for a Q4_1 weight `[n, k]` and f32 `x` `[.., k]` on the CPU: `Some([.., n])` with
/// candle's bits; `None` when this kernel does not apply (another weight type or device, a
/// non-f32 or non-contiguous `x`, K not a multiple of 32, no rows), for the caller to run
/// candle's `QMatMul`.
///
/// # Errors
/// candle's errors reading the weight's bytes or quantizing `x`.
pub fn matmul(x: &Tensor, w: &QTensor) -> Result<Option<Tensor>> {
    if w.dtype() != GgmlDType::Q4_1 || !matches!(x.device(), Device::Cpu) || !matches!(w.device(), Device::Cpu) || x.dtype() != DType::F32 || !x.is_contiguous() || x.rank() < 2 {
        return Ok(None);
    }
    let (n, k) = w.shape().dims2()?;
    if k == 0 || n == 0 || !k.is_multiple_of(QK) || x.dim(D::Minus1)? != k || x.elem_count() == 0 {
        return Ok(None);
    }
    let m = x.elem_count() / k;
    let kb = k / QK;
    let wb = w.data()?;
    if wb.len() != n * kb * W_BLOCK {
        return Ok(None);
    }
    // `QTensor::quantize` reads its source's storage from the start, whatever the view's offset:
    // a view into a larger tensor (a row of a batch) is copied out first.
    let x2 = if x.layout().start_offset() == 0 { x.reshape((m, k))? } else { Tensor::from_vec(x.flatten_all()?.to_vec1::<f32>()?, (m, k), &Device::Cpu)? };
    let xq = QTensor::quantize(&x2, GgmlDType::Q8_1)?;
    let xb = xq.data()?;
    if xb.len() != m * kb * X_BLOCK {
        return Ok(None);
    }
    let (wr, xr) = (kb * W_BLOCK, kb * X_BLOCK);
    let quad = pick4();
    let mut out = vec![0f32; m * n];
    // Work items: CHUNK columns of one row. A row's bits do not depend on the split.
    out.par_chunks_mut(n).enumerate().for_each(|(r, row)| {
        let xrow = &xb[r * xr..(r + 1) * xr];
        row.par_chunks_mut(CHUNK).enumerate().for_each(|(ci, cols)| {
            let c0 = ci * CHUNK;
            let w = |c: usize| &wb[(c0 + c) * wr..(c0 + c + 1) * wr];
            let done = cols.len() & !3;
            let mut quads = cols.chunks_exact_mut(4);
            for (qi, o) in (&mut quads).enumerate() {
                o.copy_from_slice(&quad([w(4 * qi), w(4 * qi + 1), w(4 * qi + 2), w(4 * qi + 3)], xrow));
            }
            for (i, o) in quads.into_remainder().iter_mut().enumerate() {
                *o = dot_scalar(w(done + i), xrow);
            }
        });
    });
    let mut dims = x.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = n;
    }
    Ok(Some(Tensor::from_vec(out, dims, &Device::Cpu)?))
}

/// Four output elements of one activation row `x` against four weight rows `w` (each `kb`
/// blocks): `[f32; 4]`, each with [`dot_scalar`]'s bits.
pub type Dot4 = fn(w: [&[u8]; 4], x: &[u8]) -> [f32; 4];

/// The four-column dot product for this CPU: AVX2 and F16C where present, [`dot_scalar`] four
/// times otherwise (the same bits).
pub fn pick4() -> Dot4 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c") {
        return dot4_avx2_entry;
    }
    |w, x| w.map(|w| dot_scalar(w, x))
}

fn half(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_ne_bytes([b[at], b[at + 1]])).to_f32()
}

/// The scalar dot product (any CPU): ggml's reference loop, and the f32 step of each block in
/// candle's order, `acc + ((sumi · w.d) · x.d + w.m · x.s)`.
pub fn dot_scalar(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (wb, xb) in w.chunks_exact(W_BLOCK).zip(x.chunks_exact(X_BLOCK)) {
        let mut sumi = 0i32;
        for j in 0..QK / 2 {
            let q = wb[4 + j] as i32;
            sumi += (q & 0x0F) * (xb[4 + j] as i8 as i32) + (q >> 4) * (xb[4 + j + QK / 2] as i8 as i32);
        }
        acc += sumi as f32 * half(wb, 0) * half(xb, 0) + half(wb, 2) * half(xb, 2);
    }
    acc
}

#[cfg(target_arch = "x86_64")]
fn dot4_avx2_entry(w: [&[u8]; 4], x: &[u8]) -> [f32; 4] {
    // SAFETY: chosen by `pick4` only where the CPU has AVX2 and F16C.
    unsafe { dot4_avx2(w, x) }
}

/// [`Dot4`] with AVX2: each block's four integer sums by `maddubs` + `madd` and two horizontal
/// adds; the f32 step in four lanes, one per output, with separate multiplies and adds (lane by
/// lane the scalar step's operations, so its bits).
///
/// # Safety
/// The CPU must have AVX2 and F16C. Every row of `w` must be as long as `x` holds blocks for:
/// `x.len() / 36` blocks of 20 bytes (checked).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn dot4_avx2(w: [&[u8]; 4], x: &[u8]) -> [f32; 4] {
    use std::arch::x86_64::*;
    let kb = x.len() / X_BLOCK;
    assert!(w.iter().all(|w| w.len() >= kb * W_BLOCK), "weight rows shorter than the activation row");
    let low = _mm_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm_setzero_ps();
    let u16_at = |b: &[u8], at: usize| u16::from_ne_bytes([b[at], b[at + 1]]) as i16;
    for b in 0..kb {
        let xb = &x[b * X_BLOCK..(b + 1) * X_BLOCK];
        let xq = _mm256_loadu_si256(xb[4..36].as_ptr().cast());
        let sums = w.map(|w| {
            let wb = &w[b * W_BLOCK..(b + 1) * W_BLOCK];
            let q = _mm_loadu_si128(wb[4..20].as_ptr().cast());
            let wq = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low), _mm_and_si128(q, low));
            _mm256_madd_epi16(_mm256_maddubs_epi16(wq, xq), ones)
        });
        // Lane j of each 128-bit half: partial sums of column j; the halves added give sumi.
        let h = _mm256_hadd_epi32(_mm256_hadd_epi32(sums[0], sums[1]), _mm256_hadd_epi32(sums[2], sums[3]));
        let sumi = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        let wd = w.map(|w| u16_at(w, b * W_BLOCK));
        let wm = w.map(|w| u16_at(w, b * W_BLOCK + 2));
        // f16 to f32 is exact: the four weight rows' d and m, then the activation's d and s.
        let wf = _mm256_cvtph_ps(_mm_set_epi16(wm[3], wm[2], wm[1], wm[0], wd[3], wd[2], wd[1], wd[0]));
        let (d, m) = (_mm256_castps256_ps128(wf), _mm256_extractf128_ps(wf, 1));
        let xf = _mm_cvtph_ps(_mm_set1_epi32(i32::from_ne_bytes([xb[0], xb[1], xb[2], xb[3]])));
        let (xd, xs) = (_mm_shuffle_ps(xf, xf, 0b0000_0000), _mm_shuffle_ps(xf, xf, 0b0101_0101));
        let term = _mm_add_ps(_mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(sumi), d), xd), _mm_mul_ps(m, xs));
        acc = _mm_add_ps(acc, term);
    }
    let mut out = [0f32; 4];
    _mm_storeu_ps(out.as_mut_ptr(), acc);
    out
}

#[cfg(test)]
mod tests;
