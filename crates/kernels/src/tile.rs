//! The dense kernels' micro-kernel: up to [`MR`] activation rows against one panel of [`NR`]
//! weight columns over a run of K, each output element one fused multiply-add chain from +0 in
//! the order k = 0, 1, 2, … of the run.
//!
//! Every tile shape (1 to [`MR`] rows) and every instruction set performs, per element, the same
//! operations in the same order: `acc = fma(x[k], w[k], acc)`, rounded once per step as IEEE 754
//! defines the fused multiply-add. AVX2 with FMA computes eight elements per instruction; the
//! scalar path (`f32::mul_add`, a correctly rounded FMA on every platform) computes one. Their
//! bits are equal, which is what makes a row's bits independent of how many rows share its tile.

/// Output columns per weight panel: two AVX registers of eight f32.
pub const NR: usize = 16;
/// Activation rows per tile: six rows × two registers are 12 accumulators, which with two weight
/// registers and one broadcast fit the 16 AVX registers.
pub const MR: usize = 6;

/// The sums of one tile: `[row][column]`, rows past the tile's count zero.
pub type Sums = [[f32; NR]; MR];

/// Panels a one-row call of [`Kernel::row`] covers at most.
pub const RP: usize = 4;

/// The sums of one row against up to [`RP`] panels: `[panel][column]`.
pub type RowSums = [[f32; NR]; RP];

/// A micro-kernel, in two shapes with the same per-element chain:
/// - `tile`: `xs` (1 to [`MR`] rows, each at least `kc` long) against one panel `w` (`kc` steps of
///   [`NR`] weights, `w.len() == kc · NR`): element `(r, j)` is the chain over `k < kc` of
///   `x[r][k] · w[k·NR + j]`;
/// - `row`: one row `x` against 1 to [`RP`] panels of `kc` steps each: for a lone row (a decode
///   step) the tile shape would leave two chains in flight, latency-bound; this one keeps up to
///   eight.
#[derive(Clone, Copy, Debug)]
pub struct Kernel {
    pub tile: fn(xs: &[&[f32]], w: &[f32]) -> Sums,
    pub row: fn(x: &[f32], ws: &[&[f32]]) -> RowSums,
}

/// The micro-kernel for this CPU: AVX2 and FMA where present, [`SCALAR`] otherwise (the same
/// bits).
pub fn pick() -> Kernel {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        return Kernel { tile: avx2_entry, row: avx2_row_entry };
    }
    SCALAR
}

/// The micro-kernel on any CPU.
pub const SCALAR: Kernel = Kernel { tile: scalar, row: scalar_row };

/// [`Kernel::row`] on any CPU: [`scalar`] once per panel.
pub fn scalar_row(x: &[f32], ws: &[&[f32]]) -> RowSums {
    assert!(ws.len() <= RP, "at most {RP} panels");
    let mut out = [[0f32; NR]; RP];
    for (o, w) in out.iter_mut().zip(ws) {
        *o = scalar(&[x], w)[0];
    }
    out
}

/// The micro-kernel on any CPU: one `mul_add` chain per element.
///
/// # Panics
/// When `xs` holds more than [`MR`] rows or a row is shorter than `w.len() / NR`.
pub fn scalar(xs: &[&[f32]], w: &[f32]) -> Sums {
    let kc = w.len() / NR;
    assert!(xs.len() <= MR && xs.iter().all(|x| x.len() >= kc), "a tile of at most {MR} rows of {kc}");
    let mut out = [[0f32; NR]; MR];
    for (x, o) in xs.iter().zip(&mut out) {
        for (j, o) in o.iter_mut().enumerate() {
            *o = (0..kc).fold(0f32, |acc, k| x[k].mul_add(w[k * NR + j], acc));
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
fn avx2_entry(xs: &[&[f32]], w: &[f32]) -> Sums {
    // SAFETY: `pick` returns this only where the CPU has AVX2 and FMA.
    unsafe {
        match xs.len() {
            1 => avx2::<1>(xs, w),
            2 => avx2::<2>(xs, w),
            3 => avx2::<3>(xs, w),
            4 => avx2::<4>(xs, w),
            5 => avx2::<5>(xs, w),
            6 => avx2::<6>(xs, w),
            n => panic!("a tile of {n} rows (at most {MR})"),
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2_row_entry(x: &[f32], ws: &[&[f32]]) -> RowSums {
    // SAFETY: `pick` returns this only where the CPU has AVX2 and FMA.
    unsafe {
        match ws.len() {
            1 => avx2_row::<1>(x, ws),
            2 => avx2_row::<2>(x, ws),
            3 => avx2_row::<3>(x, ws),
            4 => avx2_row::<4>(x, ws),
            n => panic!("{n} panels (at most {RP})"),
        }
    }
}

/// [`Kernel::row`] for `P` panels with AVX2 and FMA: per step, one broadcast of `x[k]` and two
/// `vfmadd` per panel.
///
/// # Safety
/// The CPU must have AVX2 and FMA. The lengths are checked: `ws.len() == P`, every panel as long
/// as the first, `x` at least `kc` long.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_row<const P: usize>(x: &[f32], ws: &[&[f32]]) -> RowSums {
    use std::arch::x86_64::*;
    let kc = ws[0].len() / NR;
    assert!(ws.len() == P && ws.iter().all(|w| w.len() == kc * NR) && x.len() >= kc, "{P} panels of {kc}");
    let mut lo = [_mm256_setzero_ps(); P];
    let mut hi = [_mm256_setzero_ps(); P];
    let mut panels = [std::ptr::null::<f32>(); P];
    for (p, w) in panels.iter_mut().zip(ws) {
        *p = w.as_ptr();
    }
    for (k, x) in x[..kc].iter().enumerate() {
        let x = _mm256_broadcast_ss(x);
        for p in 0..P {
            // In bounds: k < kc and each panel holds kc·NR values.
            lo[p] = _mm256_fmadd_ps(x, _mm256_loadu_ps(panels[p].add(k * NR)), lo[p]);
            hi[p] = _mm256_fmadd_ps(x, _mm256_loadu_ps(panels[p].add(k * NR + 8)), hi[p]);
        }
    }
    let mut out = [[0f32; NR]; RP];
    for p in 0..P {
        _mm256_storeu_ps(out[p].as_mut_ptr(), lo[p]);
        _mm256_storeu_ps(out[p].as_mut_ptr().add(8), hi[p]);
    }
    out
}

/// [`Kernel::tile`] for `R` rows with AVX2 and FMA: per step, the panel's two weight registers, then
/// for each row its broadcast value and two `vfmadd` into that row's accumulators.
///
/// # Safety
/// The CPU must have AVX2 and FMA. The lengths are checked: `xs.len() == R`, each row at least
/// `w.len() / NR` long.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2<const R: usize>(xs: &[&[f32]], w: &[f32]) -> Sums {
    use std::arch::x86_64::*;
    let kc = w.len() / NR;
    assert!(xs.len() == R && xs.iter().all(|x| x.len() >= kc), "a tile of {R} rows of {kc}");
    let mut lo = [_mm256_setzero_ps(); R];
    let mut hi = [_mm256_setzero_ps(); R];
    let mut rows = [std::ptr::null::<f32>(); R];
    for (p, x) in rows.iter_mut().zip(xs) {
        *p = x.as_ptr();
    }
    let wp = w.as_ptr();
    for k in 0..kc {
        // In bounds: k < kc, so k·NR + 16 ≤ w.len(), and k < each row's length.
        let w0 = _mm256_loadu_ps(wp.add(k * NR));
        let w1 = _mm256_loadu_ps(wp.add(k * NR + 8));
        for r in 0..R {
            let x = _mm256_broadcast_ss(&*rows[r].add(k));
            lo[r] = _mm256_fmadd_ps(x, w0, lo[r]);
            hi[r] = _mm256_fmadd_ps(x, w1, hi[r]);
        }
    }
    let mut out = [[0f32; NR]; MR];
    for r in 0..R {
        _mm256_storeu_ps(out[r].as_mut_ptr(), lo[r]);
        _mm256_storeu_ps(out[r].as_mut_ptr().add(8), hi[r]);
    }
    out
}
