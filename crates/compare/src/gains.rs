//! How much each input's error can move an op's output, read off the reference's values: the
//! per-input gains of [`crate::tolerance::Carry::Each`] for the ops whose arithmetic is known
//! from their operands alone (a sum, an elementwise product, a product of two activations).
//!
//! Errors are relative to each tensor's largest magnitude ([`crate::tolerance::relative_error`]):
//! an input `x_k` with error `e_k` is off by at most `e_k · max|x_k|` anywhere, and the gain `g_k`
//! is what that becomes relative to the output's scale, so that the output is off by at most
//! `Σ_k g_k e_k` (to first order) plus the op's own rounding:
//!
//! - `y = a + b` (elementwise, broadcast or not): `|Δy| ≤ |Δa| + |Δb|`, so `g_k = max|x_k| /
//!   max|y|`. Large when the operands cancel (a residual stream and a block output of opposite
//!   sign): a bf16 run's `layers.10.mlp_residual` on SmolLM2 has gain 4.8 from the stream.
//! - `y = a ⊙ b`: `|Δy| ≤ |Δa||b| + |a||Δb| (+ |Δa||Δb|)`, so `g_a = g_b = max|a| · max|b| /
//!   max|y|` (large when the large entries of `a` meet small ones of `b`: SwiGLU's `gate ⊙ up`).
//! - `C = A · B` over a contraction of length `K` (attention's `q · kᵀ` and `p · v`): `|ΔC_ij| ≤
//!   Σ_k |ΔA_ik| |B_kj| + |A_ik| |ΔB_kj|`, so `g_A = max|A| · max_j Σ_k |B_kj| / max|C|` and `g_B =
//!   max|B| · max_i Σ_k |A_ik| / max|C|` (the L1 norms of `B`'s columns and `A`'s rows along the
//!   contraction; Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.5).
//!
//! A linear layer `y = x · Wᵀ` is bounded outright ([`linear`]) when a trace holds its weight's
//! largest row norm ([`candle_trace_format::record::WeightNorm`], written with dumped values):
//! by Cauchy–Schwarz, output `i` at position `p` moves by at most `‖W_i‖₂ · ‖d(p)‖₂` for an
//! input error `d(p)` at that position, whatever the error's shape. Without it (two imported
//! references), the default [`crate::tolerance::GAIN`].

use crate::tolerance::max_abs;

/// Gains of an elementwise sum `y = Σ x_k` (any broadcast): `max|x_k| / max|y|` each; `None`
/// when the output is all zeros (no scale to be relative to).
pub fn add(inputs: &[&[f64]], y: &[f64]) -> Option<Vec<f64>> {
    let my = max_abs(y);
    (my > 0.0).then(|| inputs.iter().map(|x| max_abs(x) / my).collect())
}

/// Gains of an elementwise product `y = a ⊙ b` (any broadcast): `max|a| · max|b| / max|y|` for
/// both; `None` when the output is all zeros or `inputs` is not two operands.
pub fn mul(inputs: &[&[f64]], y: &[f64]) -> Option<Vec<f64>> {
    let my = max_abs(y);
    let [a, b] = inputs else { return None };
    (my > 0.0).then(|| {
        let g = max_abs(a) * max_abs(b) / my;
        vec![g, g]
    })
}

/// Largest L1 norm of `v`'s vectors along dim `d` of `shape` (row-major): over every index of
/// the other dims, `Σ_i |v[.., i, ..]|`. `None` when the shape does not hold `v.len()` values or
/// `d` is out of range.
fn max_l1_along(v: &[f64], shape: &[usize], d: usize) -> Option<f64> {
    if shape.iter().product::<usize>() != v.len() || d >= shape.len() {
        return None;
    }
    let n = shape[d];
    let inner: usize = shape[d + 1..].iter().product();
    let outer = v.len() / (n * inner).max(1);
    let mut best = 0.0f64;
    for o in 0..outer {
        for i in 0..inner {
            let base = o * n * inner + i;
            let s: f64 = (0..n).map(|k| v[base + k * inner]).filter(|x| x.is_finite()).map(f64::abs).sum();
            best = best.max(s);
        }
    }
    Some(best)
}

/// Gains of a product of two activations `C = A · B` (batched over leading dims), `A` of shape
/// `[.., m, K]`; `B` as recorded, `[.., K, n]` or transposed `[.., n, K]` (attention's keys):
/// the contraction is the dim of `B`'s last two that has `A`'s last dim's length, the larger
/// norm when both do. `None` when a shape does not hold its values, `B` has no such dim, or the
/// output is all zeros.
pub fn matmul((a, sa): (&[f64], &[usize]), (b, sb): (&[f64], &[usize]), c: &[f64]) -> Option<Vec<f64>> {
    let mc = max_abs(c);
    let (&k, rb) = (sa.last()?, sb.len());
    if mc == 0.0 || rb < 2 {
        return None;
    }
    let rows_a = max_l1_along(a, sa, sa.len() - 1)?;
    let cols_b = [rb - 2, rb - 1].into_iter().filter(|&d| sb[d] == k).map(|d| max_l1_along(b, sb, d)).try_fold(None, |m: Option<f64>, x| x.map(|x| Some(m.map_or(x, |m| m.max(x)))))??;
    Some(vec![max_abs(a) * cols_b / mc, max_abs(b) * rows_a / mc])
}

/// What a linear op's input looks like on both sides, per token position, for [`linear`].
pub struct LinearInput<'v> {
    /// a's input values (the reference).
    pub a: &'v [f64],
    /// b's input values, the same shape.
    pub b: &'v [f64],
    /// The position (batch row and index along the token dim) of each element: a key per
    /// element, `0..positions`.
    pub position: &'v dyn Fn(usize) -> usize,
    /// Positions (one more than the largest key).
    pub positions: usize,
}

/// Standard deviations [`linear`] allows the rounding and quantization noise of one output
/// element: a Gaussian exceeds 6 σ with probability 2·10⁻⁹.
pub const SIGMAS: f64 = 6.0;

/// The largest error of a linear op's output `y = x · Wᵀ (+ bias)` that its input error
/// explains, and the largest its activation quantization and weight rounding add, each relative
/// to `max|y|`, where `w2` is the weight's largest row L2 norm and, at position `p` (`n_p`
/// elements), `d(p) = x_b(p) - x_a(p)`:
///
/// - carried, by Cauchy–Schwarz (`|W_i · d| ≤ ‖W_i‖₂ ‖d‖₂`, whatever the error's shape):
///   `w2 · max_p ‖d(p)‖₂ / max|y|`;
/// - own, by the probabilistic model of rounding errors (independent, zero-mean; Higham and
///   Mary, "A New Approach to Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput.
///   41(5), 2019): a side that quantizes its activations rounds each to a step of at most
///   `s = Q8_STEP · max|x(p)|` (its block's largest magnitude over 127, at most the
///   position's; [`crate::tolerance::Q8_STEP`]), an error uniform on `±s/2`, variance `s²/12`;
///   a weight held in half precision on one side only is off by up to `u·|W_ij|` (`u` half its
///   epsilon), variance at most `u²·W_ij²/3`. Summed over `j` with the weight row, output `i`'s
///   error has variance at most `‖W_i‖₂² · (Σ_sides s²/12 + u²·max|x_a(p)|²/3)`, and own is
///   [`SIGMAS`] standard deviations of it: `SIGMAS · w2 · max_p sqrt(..) / max|y|`.
///
/// `quantizes` says whether a and b quantize their activations, `u` is 0 when both hold the
/// weight alike. `None` when the output is all zeros or the input sides differ in length.
pub fn linear(w2: f64, x: &LinearInput, quantizes: (bool, bool), u: f64, y: &[f64]) -> Option<(f64, f64)> {
    let my = max_abs(y);
    if my == 0.0 || x.a.len() != x.b.len() || !w2.is_finite() {
        return None;
    }
    // Per position: ‖d‖², max|x_a|, max|x_b|.
    let mut at = vec![(0.0f64, 0.0f64, 0.0f64); x.positions];
    for (i, (va, vb)) in x.a.iter().zip(x.b).enumerate() {
        let s = at.get_mut((x.position)(i))?;
        let d = if va.is_finite() && vb.is_finite() { vb - va } else { 0.0 };
        s.0 += d * d;
        s.1 = if va.is_finite() { s.1.max(va.abs()) } else { s.1 };
        s.2 = if vb.is_finite() { s.2.max(vb.abs()) } else { s.2 };
    }
    let step = crate::tolerance::Q8_STEP;
    let (mut carried, mut own) = (0.0f64, 0.0f64);
    for &(d2, ma, mb) in &at {
        let (sa, sb) = (if quantizes.0 { step * ma } else { 0.0 }, if quantizes.1 { step * mb } else { 0.0 });
        let variance = (sa * sa + sb * sb) / 12.0 + (u * ma).powi(2) / 3.0;
        carried = carried.max(d2.sqrt());
        own = own.max(SIGMAS * variance.sqrt());
    }
    Some((w2 * carried / my, w2 * own / my))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A residual add whose operands cancel: the output's scale is a fifth of the stream's, so
    /// the stream's error counts five times.
    #[test]
    fn a_sum_that_cancels_amplifies() {
        let (s, b) = ([10.0, -3.0], [-8.0, 1.0]);
        let y = [2.0, -2.0];
        assert_eq!(add(&[&s, &b], &y), Some(vec![5.0, 4.0]));
        assert_eq!(add(&[&s, &b], &[0.0, 0.0]), None);
    }

    /// A product whose large entries meet small ones: gain `max|a| max|b| / max|y|`.
    #[test]
    fn a_product_of_mismatched_entries_amplifies() {
        let (a, b) = ([4.0, 0.1], [0.1, 5.0]);
        let y = [0.4, 0.5];
        let g = mul(&[&a, &b], &y).unwrap();
        assert!((g[0] - 40.0).abs() < 1e-12 && g[0] == g[1], "{g:?}");
    }

    /// A linear op over two positions of two features: carried is `‖W_i‖₂ ‖d‖₂` at the worse
    /// position; own is six standard deviations of the quantization noise of the side that
    /// quantizes (a step of `max|x(p)| / 127`, uniform, variance `step² / 12`).
    #[test]
    fn a_linear_layer_is_bounded_by_its_weight_norm() {
        let (a, b) = ([3.0, 4.0, 1.0, 0.0], [3.0, 4.0, 1.0, 0.5]);
        let position = |i: usize| i / 2;
        let x = LinearInput { a: &a, b: &b, position: &position, positions: 2 };
        let y = [10.0, -2.0];
        let (carried, own) = linear(2.0, &x, (false, true), 0.0, &y).unwrap();
        assert!((carried - 2.0 * 0.5 / 10.0).abs() < 1e-12, "{carried}");
        let step = 4.0 * crate::tolerance::Q8_STEP;
        assert!((own - SIGMAS * 2.0 * (step * step / 12.0).sqrt() / 10.0).abs() < 1e-12, "{own}");
        // Neither side quantizes nor rounds its weight: nothing of its own.
        assert_eq!(linear(2.0, &x, (false, false), 0.0, &y).map(|c| c.1), Some(0.0));
        assert_eq!(linear(2.0, &x, (false, false), 0.0, &[0.0, 0.0]), None);
    }

    /// `A [2, 3] · B [3, 2]`, and the same `B` stored transposed: the contraction's L1 norms.
    #[test]
    fn matmul_gains_use_the_contractions_norms() {
        let a = [1.0, -2.0, 3.0, 0.5, 0.5, 0.5];
        let b = [1.0, 0.0, 1.0, 1.0, -1.0, 2.0];
        // C = A·B: row 0 = [1 - 2 - 3, 0 - 2 + 6] = [-4, 4]; row 1 = [0.5, 1.5].
        let c = [-4.0, 4.0, 0.5, 1.5];
        // max|A| 3, max column L1 of B 3 (column 1: 0 + 1 + 2); max|B| 2, max row L1 of A 6.
        assert_eq!(matmul((&a, &[2, 3]), (&b, &[3, 2]), &c), Some(vec![3.0 * 3.0 / 4.0, 2.0 * 6.0 / 4.0]));
        let bt = [1.0, 1.0, -1.0, 0.0, 1.0, 2.0];
        assert_eq!(matmul((&a, &[2, 3]), (&bt, &[2, 3]), &c), Some(vec![3.0 * 3.0 / 4.0, 2.0 * 6.0 / 4.0]));
        // No dim of B's last two has A's contraction length; a shape that does not hold the values.
        assert_eq!(matmul((&a, &[2, 3]), (&b, &[1, 6]), &c), None);
        assert_eq!(matmul((&a, &[2, 2]), (&b, &[3, 2]), &c), None);
    }
}
