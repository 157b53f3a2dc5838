//! Q5_0 weights times f32 activations on the CPU, as ggml's `ggml_vec_dot_q5_0_q8_0` defines the
//! product and candle 0.11.1 computes it (`k_quants::matmul` with `BlockQ5_0::vec_dot_unopt`, a
//! scalar loop), bit for bit. Gemma 3's `q4_k_m` files hold some tensors in Q5_0.
//!
//! A Q5_0 block holds 32 weights: `d` (f16), `qh` (32 fifth bits, little-endian u32), 16 bytes
//! of low nibbles; weight `j < 16` is `(qs[j] & 15 | bit j of qh << 4) − 16`, weight `j + 16` is
//! `(qs[j] >> 4 | bit j + 16 of qh << 4) − 16`. Activation rows are quantized to Q8_0 by
//! candle's own code (`d = max|x| / 127`, 32 i8 quants, `|q| ≤ 127`). Then for output `(r, c)`,
//! over the blocks of K in order from 0:
//!
//! ```text
//! sumi = Σ_{j<32} w_j · x.qs[j]                       (exact, i32)
//! acc  = acc + (sumi as f32 · w.d) · x.d              (f32, this order)
//! ```
//!
//! With AVX2 the products are `maddubs(|w|, x · sign(w))`: `|w| ≤ 16`, `|x| ≤ 127`, pairs at
//! most 4064, no saturation.

use crate::blocks::{column_sums, f16_at, f16_bits, Dot4, Kind, QK};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Result, Tensor};

/// Bytes of a Q5_0 block: `d` (f16), `qh` (4 bytes), 16 bytes of nibbles (ggml's `block_q5_0`).
pub(crate) const W_BLOCK: usize = 22;
/// Bytes of a Q8_0 block: `d` (f16), 32 i8 quants (ggml's `block_q8_0`).
pub(crate) const X_BLOCK: usize = 34;

/// `x @ Wᵀ` for a Q5_0 weight `[n, k]` and f32 `x` `[.., k]` on the CPU, with candle's bits;
/// `None` where the kernel does not apply (as [`crate::q4_1::matmul`]).
///
/// # Errors
/// candle's errors reading the weight's bytes or quantizing `x`.
pub fn matmul(x: &Tensor, w: &QTensor) -> Result<Option<Tensor>> {
    crate::blocks::matmul(x, w, &Kind { weight: GgmlDType::Q5_0, w_block: W_BLOCK, act: GgmlDType::Q8_0, x_block: X_BLOCK, dot4: pick4(), dot1: dot_scalar })
}

/// The four-column dot product for this CPU: AVX2 and F16C where present, [`dot_scalar`] four
/// times otherwise (the same bits).
pub fn pick4() -> Dot4 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c") {
        return dot4_avx2_entry;
    }
    |w, x| w.map(|w| dot_scalar(w, x))
}

/// The scalar dot product (any CPU): ggml's reference loop, in candle's order.
pub fn dot_scalar(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (wb, xb) in w.chunks_exact(W_BLOCK).zip(x.chunks_exact(X_BLOCK)) {
        let qh = u32::from_le_bytes([wb[2], wb[3], wb[4], wb[5]]);
        let mut sumi = 0i32;
        for j in 0..QK / 2 {
            let lo = (wb[6 + j] & 0x0F) as i32 | (((qh >> j) & 1) << 4) as i32;
            let hi = (wb[6 + j] >> 4) as i32 | (((qh >> (j + 16)) & 1) << 4) as i32;
            sumi += (lo - 16) * (xb[2 + j] as i8 as i32) + (hi - 16) * (xb[2 + j + QK / 2] as i8 as i32);
        }
        acc += sumi as f32 * f16_at(wb, 0) * f16_at(xb, 0);
    }
    acc
}

#[cfg(target_arch = "x86_64")]
fn dot4_avx2_entry(w: [&[u8]; 4], x: &[u8]) -> [f32; 4] {
    // SAFETY: chosen by `pick4` only where the CPU has AVX2 and F16C.
    unsafe { dot4_avx2(w, x) }
}

/// [`Dot4`] with AVX2: the fifth bits spread to bytes (byte `i` takes byte `i / 8` of `qh`, kept
/// where its bit `i % 8` is set), the signed weights' magnitudes times the activations carrying
/// their signs by `maddubs`, summed by `madd` and two horizontal adds; the f32 step in four
/// lanes with separate multiplies and adds.
///
/// # Safety
/// The CPU must have AVX2 and F16C. Every row of `w` must hold `x.len() / 34` blocks of 22 bytes
/// (checked).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn dot4_avx2(w: [&[u8]; 4], x: &[u8]) -> [f32; 4] {
    use std::arch::x86_64::*;
    let kb = x.len() / X_BLOCK;
    assert!(w.iter().all(|w| w.len() >= kb * W_BLOCK), "weight rows shorter than the activation row");
    let low = _mm_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    // Byte i of the spread: byte i / 8 of qh (in each 128-bit lane, bytes 0-7 and 8-15 take
    // two of the four bytes), tested against bit i % 8.
    let spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    let bit = _mm256_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
    let sixteen = _mm256_set1_epi8(16);
    let mut acc = _mm_setzero_ps();
    let u16_at = |b: &[u8], at: usize| f16_bits(b, at) as i16;
    for b in 0..kb {
        let xb = &x[b * X_BLOCK..(b + 1) * X_BLOCK];
        let xq = _mm256_loadu_si256(xb[2..34].as_ptr().cast());
        // A loop, not a closure: a closure is compiled without this function's AVX2.
        let mut sums = [_mm256_setzero_si256(); 4];
        for (s, w) in sums.iter_mut().zip(w) {
            let wb = &w[b * W_BLOCK..(b + 1) * W_BLOCK];
            let qh = i32::from_le_bytes([wb[2], wb[3], wb[4], wb[5]]);
            let set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(qh), spread), bit), bit);
            let q = _mm_loadu_si128(wb[6..22].as_ptr().cast());
            let nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low), _mm_and_si128(q, low));
            let wq = _mm256_sub_epi8(_mm256_or_si256(nibbles, _mm256_and_si256(set, sixteen)), sixteen);
            *s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq)), ones);
        }
        let sumi = column_sums(sums);
        let wd = w.map(|w| u16_at(w, b * W_BLOCK));
        let d = _mm_cvtph_ps(_mm_set_epi16(0, 0, 0, 0, wd[3], wd[2], wd[1], wd[0]));
        let xd = _mm_cvtph_ps(_mm_set1_epi16(u16_at(xb, 0)));
        acc = _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(sumi), d), xd));
    }
    let mut out = [0f32; 4];
    _mm_storeu_ps(out.as_mut_ptr(), acc);
    out
}
