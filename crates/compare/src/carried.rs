//! What an op's input error carries to its output, computed outright from both sides' input
//! values for the ops whose function is known from their operands alone: the op as a computes
//! it, applied in f64 to a's inputs and to b's, differs by exactly what the input difference
//! causes, element by element, so no worst-case condition is needed. The rest of b's error is
//! the op's own (rounding, or a fault).
//!
//! - elementwise sums and products of operands of the output's shape (residual adds, SwiGLU's
//!   `act ⊙ up`), SiLU and GELU;
//! - a softmax over the last dim (attention probabilities): `softmax(x_b) - softmax(x_a)`;
//! - an RMS norm over the last dim, `y_i = g_i · x_i / rms(x)` with a's gains `g_i = y_i ·
//!   rms(x) / x_i` read off a's values (the weight, `w` or Gemma's `1 + w`, is not in a
//!   reference trace): `g_i · (x_b,i / rms(x_b) - x_a,i / rms(x_a))`, over the norm's unknown
//!   epsilon ([`rms_norm`]); an element whose `x_a` is zero or subnormal takes the row's largest
//!   gain. Measured against a norm's worst-case
//!   condition, this matters where the residual stream holds massive activations: an error of
//!   `e · max|x|` may sit anywhere by that condition, so a bound of `e · max|x| / min rms`
//!   (over 100 times `e` on SmolLM2's layers past the first) let a block scale altered 4-fold
//!   pass unseen.
//!
//! Each returns the largest difference relative to `max|y_a|`, or `None` when a length does not
//! fit (the caller then falls back to [`crate::gains`] and [`crate::tolerance::condition`]).

use crate::tolerance::max_abs;

/// `max_i |p_i - q_i|` over the elements finite on both sides (equal infinities count 0).
fn max_diff(p: impl Iterator<Item = f64>, q: impl Iterator<Item = f64>) -> f64 {
    p.zip(q).map(|(x, y)| if x.is_finite() && y.is_finite() { (x - y).abs() } else { 0.0 }).fold(0.0, f64::max)
}

/// SiLU, `x · σ(x)`.
fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// GELU with the tanh approximation (candle's `gelu`; Gemma's `gelu_pytorch_tanh`). Against the
/// erf form it differs by under 1e-3, far less than what moves between two close inputs.
fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

/// An elementwise op of operands each as long as the output `y_a` — `add` and `mul` of any
/// number of operands, `silu` and `gelu` of one: `max_i |f(x_b)_i - f(x_a)_i| / max|y_a|`.
/// `None` for another kind, a broadcast operand or an all-zero output.
pub fn elementwise(kind: &str, a: &[&[f64]], b: &[&[f64]], y_a: &[f64]) -> Option<f64> {
    let n = y_a.len();
    let my = max_abs(y_a);
    if my == 0.0 || a.len() != b.len() || a.is_empty() || a.iter().chain(b).any(|x| x.len() != n) {
        return None;
    }
    let f: fn(&[&[f64]], usize) -> f64 = match (kind, a.len()) {
        ("add", _) => |xs, i| xs.iter().map(|x| x[i]).sum(),
        ("mul", _) => |xs, i| xs.iter().map(|x| x[i]).product(),
        ("silu", 1) => |xs, i| silu(xs[0][i]),
        ("gelu", 1) => |xs, i| gelu(xs[0][i]),
        _ => return None,
    };
    Some(max_diff((0..n).map(|i| f(b, i)), (0..n).map(|i| f(a, i))) / my)
}

/// Softmax of one row in f64 (`-inf` entries give 0; a row with no finite entry, all zeros).
fn softmax_row(x: &[f64], out: &mut Vec<f64>) {
    out.clear();
    let m = x.iter().copied().filter(|v| v.is_finite()).fold(f64::NEG_INFINITY, f64::max);
    if !m.is_finite() {
        out.resize(x.len(), 0.0);
        return;
    }
    out.extend(x.iter().map(|&v| if v.is_finite() { (v - m).exp() } else { 0.0 }));
    let s: f64 = out.iter().sum();
    out.iter_mut().for_each(|v| *v /= s);
}

/// A softmax over rows of `row` elements: `max |softmax(x_b) - softmax(x_a)| / max|y_a|`.
pub fn softmax(a: &[f64], b: &[f64], row: usize, y_a: &[f64]) -> Option<f64> {
    let my = max_abs(y_a);
    if my == 0.0 || row == 0 || a.len() != b.len() || a.len() != y_a.len() || !a.len().is_multiple_of(row) {
        return None;
    }
    let (mut pa, mut pb, mut worst) = (Vec::new(), Vec::new(), 0.0f64);
    for (ra, rb) in a.chunks(row).zip(b.chunks(row)) {
        softmax_row(ra, &mut pa);
        softmax_row(rb, &mut pb);
        worst = worst.max(max_diff(pb.iter().copied(), pa.iter().copied()));
    }
    Some(worst / my)
}

/// Mean square of a row's finite entries.
fn mean_square(x: &[f64]) -> f64 {
    x.iter().filter(|v| v.is_finite()).map(|v| v * v).sum::<f64>() / x.len().max(1) as f64
}

/// The largest epsilon an RMS norm adds to the mean square (`rms_norm_eps`: llama 1e-5, Gemma 3
/// and Qwen 1e-6). The trace does not say which; the bound holds for any in `[0, NORM_EPS]`.
pub const NORM_EPS: f64 = 1e-5;

/// An RMS norm over rows of `row` elements, a's gains read off its values (module docs).
/// Element `i` of a row is `y_i = ĝ_i · x_i` with `ĝ_i = g_i / sqrt(ms(x) + ε)` read off a's
/// values; on b's input it is `ĝ_i · x_b,i · R` with `R = sqrt((ms(x_a) + ε) / (ms(x_b) + ε))`.
/// The norm's ε is unknown but at most [`NORM_EPS`], and `R` is monotone in it, so `|ĝ_i x_b,i R
/// - x_a,i ĝ_i|`, convex in `R`, is largest at `ε = 0` or `ε = NORM_EPS`: the larger of the two
/// is the bound. Returns `max_i` of it over `max|y_a|`.
pub fn rms_norm(a: &[f64], b: &[f64], row: usize, y_a: &[f64]) -> Option<f64> {
    let my = max_abs(y_a);
    if my == 0.0 || row == 0 || a.len() != b.len() || a.len() != y_a.len() || !a.len().is_multiple_of(row) {
        return None;
    }
    let normal = |v: f64| v.is_finite() && v.abs() >= f64::from(f32::MIN_POSITIVE);
    let mut worst = 0.0f64;
    for ((xa, xb), ya) in a.chunks(row).zip(b.chunks(row)).zip(y_a.chunks(row)) {
        let (ma, mb) = (mean_square(xa), mean_square(xb));
        if mb == 0.0 {
            continue;
        }
        let ratios = [(ma / mb).sqrt(), ((ma + NORM_EPS) / (mb + NORM_EPS)).sqrt()];
        // a's gain ĝ_i = y_i / x_i; the row's largest where x_a is too small to say.
        let gain = |x: f64, y: f64| if normal(x) && y.is_finite() { (y / x).abs() } else { 0.0 };
        let top = xa.iter().zip(ya).map(|(&x, &y)| gain(x, y)).fold(0.0f64, f64::max);
        for ((&x, &z), &y) in xa.iter().zip(xb).zip(ya) {
            if !(x.is_finite() && z.is_finite()) {
                continue;
            }
            let g = if normal(x) { gain(x, y) } else { top };
            for r in ratios {
                worst = worst.max(g * (z * r - x).abs());
            }
        }
    }
    Some(worst / my)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same function of both sides' inputs: exact differences, relative to `max|y_a|`.
    #[test]
    fn elementwise_ops_carry_exactly_their_inputs_difference() {
        let (a0, a1) = ([1.0, 2.0], [3.0, -1.0]);
        let (b0, b1) = ([1.5, 2.0], [3.0, -1.25]);
        // a: [4, 1]; b: [4.5, 0.75]: largest difference 0.5 over 4.
        assert_eq!(elementwise("add", &[&a0, &a1], &[&b0, &b1], &[4.0, 1.0]), Some(0.125));
        // a: [3, -2]; b: [4.5, -2.5]: 1.5 over 3.
        assert_eq!(elementwise("mul", &[&a0, &a1], &[&b0, &b1], &[3.0, -2.0]), Some(0.5));
        // A broadcast operand, an unknown kind: not computed.
        assert_eq!(elementwise("add", &[&a0, &[1.0]], &[&b0, &[1.0]], &[4.0, 1.0]), None);
        assert_eq!(elementwise("exp", &[&a0], &[&b0], &[4.0, 1.0]), None);
        // SiLU of one operand: silu(1.5) - silu(1) over max|silu(a)| = silu(2).
        let c = elementwise("silu", &[&a0], &[&b0], &[silu(1.0), silu(2.0)]).unwrap();
        assert!((c - (silu(1.5) - silu(1.0)) / silu(2.0)).abs() < 1e-12, "{c}");
        assert!((gelu(1.0) - 0.841192).abs() < 1e-6 && gelu(0.0) == 0.0);
    }

    /// Two rows of three scores, one masked: softmax applied to both sides' scores.
    #[test]
    fn softmax_carries_the_scores_difference() {
        let a = [0.0, 0.0, f64::NEG_INFINITY, 1.0, 1.0, 1.0];
        let b = [(3.0f64).ln(), 0.0, f64::NEG_INFINITY, 1.0, 1.0, 1.0];
        let y = [0.5, 0.5, 0.0, 1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0];
        // Row 0 of b: [0.75, 0.25, 0]: 0.25 over max|y| 0.5.
        let c = softmax(&a, &b, 3, &y).unwrap();
        assert!((c - 0.5).abs() < 1e-12, "{c}");
        assert_eq!(softmax(&a, &b, 4, &y), None);
    }

    /// A row with a massive activation: an error of 1 at the massive element (1 % of the
    /// input's scale) moves the small ones only through the rms, by 1 %, where the worst-case
    /// condition (102) allows 102 %.
    #[test]
    fn a_norm_carries_what_the_rows_really_change() {
        let a = [100.0, 1.0, -1.0, 1.0];
        let b = [101.0, 1.0, -1.0, 1.0];
        // Gains: 0.01 on the massive element, 1 elsewhere.
        let (ra, rb) = (mean_square(&a).sqrt(), mean_square(&b).sqrt());
        let y: Vec<f64> = a.iter().zip([0.01, 1.0, 1.0, 1.0]).map(|(x, g)| g * x / ra).collect();
        let want = (1.0 / ra - 1.0 / rb).max(0.01 * (101.0 / rb - 100.0 / ra).abs()) / (1.0 / ra);
        let c = rms_norm(&a, &b, 4, &y).unwrap();
        // The norm's epsilon moves the bound by a part in 1e8 here.
        assert!((c - want).abs() < 1e-9 && c < 0.02, "{c} {want}");
        assert_eq!(rms_norm(&a, &b, 3, &y), None);
    }

    /// A row so small that the norm's epsilon dominates its mean square: whatever the epsilon
    /// (0 to 1e-5), the bound covers what b's input really does.
    #[test]
    fn a_norms_bound_holds_for_any_epsilon() {
        let a = [1e-3, 2e-3, -1e-3, 5e-4];
        let b: Vec<f64> = a.iter().map(|x| x * 1.1 + 1e-4).collect();
        let g = [1.0, 2.0, 3.0, 4.0];
        for eps in [0.0, 1e-6, 1e-5] {
            let norm = |x: &[f64]| -> Vec<f64> {
                let s = (mean_square(x) + eps).sqrt();
                x.iter().zip(g).map(|(v, w)| w * v / s).collect()
            };
            let (ya, yb) = (norm(&a), norm(&b));
            let truth = max_diff(yb.iter().copied(), ya.iter().copied()) / max_abs(&ya);
            let c = rms_norm(&a, &b, 4, &ya).unwrap();
            assert!(c >= truth * (1.0 - 1e-12), "epsilon {eps}: bound {c} under {truth}");
        }
    }
}
