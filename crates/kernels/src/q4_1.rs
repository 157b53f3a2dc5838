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

use crate::blocks::{column_sums, f16_at, f16_bits};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Result, Tensor};

/// Weights per block (`QK4_1`, `QK8_1`).
const QK: usize = crate::blocks::QK;
/// Bytes of a Q4_1 block: `d` (f16), `m` (f16), 16 bytes of 4-bit quants (ggml's `block_q4_1`).
pub(crate) const W_BLOCK: usize = 20;
/// Bytes of a Q8_1 block: `d` (f16), `s` (f16), 32 i8 quants (ggml's `block_q8_1`).
pub(crate) const X_BLOCK: usize = 36;

/// `x @ Wᵀ` for a Q4_1 weight `[n, k]` and f32 `x` `[.., k]` on the CPU: `Some([.., n])` with
/// candle's bits; `None` when this kernel does not apply (another weight type or device, a
/// non-f32 or non-contiguous `x`, K not a multiple of 32, no rows), for the caller to run
/// candle's `QMatMul`.
///
/// # Errors
/// candle's errors reading the weight's bytes or quantizing `x`.
pub fn matmul(x: &Tensor, w: &QTensor) -> Result<Option<Tensor>> {
    crate::blocks::matmul(x, w, &crate::blocks::Kind { weight: GgmlDType::Q4_1, w_block: W_BLOCK, act: GgmlDType::Q8_1, x_block: X_BLOCK, dot4: pick4(), dot1: dot_scalar })
}

/// The four-column dot product for this CPU: AVX2 and F16C where present, [`dot_scalar`] four
/// times otherwise (the same bits).
pub fn pick4() -> crate::blocks::Dot4 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c") {
        return dot4_avx2_entry;
    }
    |w, x| w.map(|w| dot_scalar(w, x))
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
        acc += sumi as f32 * f16_at(wb, 0) * f16_at(xb, 0) + f16_at(wb, 2) * f16_at(xb, 2);
    }
    acc
}

#[cfg(target_arch = "x86_64")]
fn dot4_avx2_entry(w: [&[u8]; 4], x: &[u8]) -> [f32; 4] {
    // SAFETY: chosen by `pick4` only where the CPU has AVX2 and F16C.
    unsafe { dot4_avx2(w, x) }
}

/// [`crate::blocks::Dot4`] with AVX2: each block's four integer sums by `maddubs` + `madd` and two horizontal
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
    let u16_at = |b: &[u8], at: usize| f16_bits(b, at) as i16;
    for b in 0..kb {
        let xb = &x[b * X_BLOCK..(b + 1) * X_BLOCK];
        let xq = _mm256_loadu_si256(xb[4..36].as_ptr().cast());
        // A loop, not a closure: a closure is compiled without this function's AVX2.
        let mut sums = [_mm256_setzero_si256(); 4];
        for (s, w) in sums.iter_mut().zip(w) {
            let wb = &w[b * W_BLOCK..(b + 1) * W_BLOCK];
            let q = _mm_loadu_si128(wb[4..20].as_ptr().cast());
            let wq = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low), _mm_and_si128(q, low));
            *s = _mm256_madd_epi16(_mm256_maddubs_epi16(wq, xq), ones);
        }
        let sumi = column_sums(sums);
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
