//! Comparing two implementations of one model op by op (candle against a reference such as
//! PyTorch), where almost no bit agrees: the root is the first op whose output error is more
//! than its inputs' error and its dtype's rounding explain, not the first op that differs.
//! The model is specified in docs/tolerance.md; in short, for each op in execution order:
//!
//! - its output error `e` is the largest absolute difference over the output, relative to the
//!   reference output's largest magnitude ([`relative_error`]; Polygraphy compares per layer
//!   with such a tolerance, msprobe's precision comparison reports the same ratio);
//! - its input error `e_in` is the largest output error among the ops whose outputs it read
//!   (0 for model inputs: token ids, weights);
//! - its rounding `r` is what its dtype allows: `ulps × eps(dtype)`, `eps` the dtype's machine
//!   epsilon (f32 2⁻²³, f16 2⁻¹⁰, bf16 2⁻⁷), or a relative tolerance given outright;
//! - its condition `κ` is how much it may amplify a relative input error: [`GAIN`] unless the
//!   op's kind and input values say more ([`condition`]: a softmax over scores up to `|x|`
//!   amplifies a relative error of its scores by up to `2|x|`).
//!
//! An op is explained when `e <= κ · e_in + r`; the first op that is not is the root, and its
//! amplification `e / max(e_in, r)` says by how much. Ops only one side has are left out of the
//! chain (their readers see the error of what they read last on the shared path).

use serde::Serialize;

/// The amplification any op may apply to a relative input error (sums of two equally erring
/// operands, a normalisation dividing by an erring scale): a factor of 4.
pub const GAIN: f64 = 4.0;

/// Rounding allowance in units of the dtype's epsilon when no tolerance is given (`auto`), for
/// f32 (and f64) outputs: reductions over thousands of terms in another order stay within it.
pub const AUTO_ULPS: f64 = 64.0;

/// The same for half-precision outputs (f16, bf16): their kernels accumulate in f32 and round
/// the result once, so a few epsilons (64 of bf16's would be half the value).
pub const AUTO_ULPS_HALF: f64 = 4.0;

/// One op of the chain, with both implementations' outputs compared.
#[derive(Clone, Debug, PartialEq)]
pub struct OpError {
    /// Module path (`layers.3.mlp.act`).
    pub path: String,
    /// Output dtype (`f32`, `f16`, `bf16`).
    pub dtype: String,
    /// Output error ([`relative_error`]).
    pub error: f64,
    /// Indices (into the chain) of the ops whose outputs it read; earlier than itself.
    pub inputs: Vec<usize>,
    /// The op's condition when its kind and inputs give one ([`condition`]); `None`: [`GAIN`].
    pub condition: Option<f64>,
}

/// How one op was judged.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Judged {
    /// Its output error.
    pub error: f64,
    /// Its input error (the largest output error among what it read).
    pub input_error: f64,
    /// The error its inputs and rounding explain: `κ · input_error + rounding`.
    pub allowed: f64,
    /// The rounding allowed to the op itself (relative): the tolerance, or under `auto` its
    /// dtype's epsilon times [`AUTO_ULPS`] (`AUTO_ULPS_HALF` for f16 and bf16).
    pub rounding: f64,
    /// `error / max(input_error, rounding)`: above 1, the op made the error larger than both.
    pub amplification: f64,
    /// `error <= allowed`.
    pub explained: bool,
}

/// The tolerance: a relative rounding allowance for every op, or `auto` (per dtype).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Tolerance {
    /// [`AUTO_ULPS`] × the dtype's epsilon.
    Auto,
    /// This relative error is rounding for every op.
    Relative(f64),
}

/// The machine epsilon of a dtype (f32 2⁻²³, f16 2⁻¹⁰, bf16 2⁻⁷; other dtypes: exact, 0).
pub fn epsilon(dtype: &str) -> f64 {
    match dtype {
        "f32" => f32::EPSILON as f64,
        "f16" => 2f64.powi(-10),
        "bf16" => 2f64.powi(-7),
        "f64" => f64::EPSILON,
        _ => 0.0,
    }
}

/// `max_i |a_i - b_i| / max_i |b_i|` (`b` the reference); 0 for two empty or all-zero outputs
/// that agree; infinite when a NaN or ±Inf appears on one side only or the lengths differ.
pub fn relative_error(a: &[f64], b: &[f64]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    let (mut diff, mut scale) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        if x.is_finite() != y.is_finite() {
            return f64::INFINITY;
        }
        if x.is_finite() {
            diff = diff.max((x - y).abs());
            scale = scale.max(y.abs());
        }
    }
    if diff == 0.0 {
        0.0
    } else if scale == 0.0 {
        diff
    } else {
        diff / scale
    }
}

/// The condition of an op of kind `op` (the trace's op name) on input values `x` and the
/// reference's output values `y`, when one is known:
///
/// - `softmax` amplifies a relative error of its inputs by up to `2 max|x|` (an absolute input
///   error `δ` moves each probability by up to `2δ` relative), `exp` by `max|x|`;
/// - `rms_norm` scales element `i` by `g_i = w_i / rms(row)`: an input error of `e·max|x|` at an
///   element of large gain becomes `e·max|x|·max g` in the output, which is `max|x|·max g /
///   max|y|` times `e` relative to the output's scale (the *gain spread*; 1 when every gain is
///   equal), and the erring scale adds as much again: `2 × spread`. The gains are read off the
///   values, `|y_i / x_i|` over the elements with `|x_i| >= max|x| / 100` (where the ratio is
///   not rounding noise); `x` and `y` must be the same length.
///
/// Each is at least [`GAIN`]; every other kind: `None` ([`GAIN`]).
pub fn condition(op: &str, x: &[f64], y: &[f64]) -> Option<f64> {
    let max_abs = |v: &[f64]| v.iter().filter(|v| v.is_finite()).fold(0.0f64, |m, v| m.max(v.abs()));
    let m = max_abs(x);
    match op {
        "softmax" => Some((2.0 * m).max(GAIN)),
        "exp" => Some(m.max(GAIN)),
        "rms_norm" if x.len() == y.len() && m > 0.0 => {
            let my = max_abs(y);
            let gain = x.iter().zip(y).filter(|(a, b)| a.abs() >= m / 100.0 && b.is_finite()).fold(0.0f64, |g, (a, b)| g.max((b / a).abs()));
            (my > 0.0).then(|| (2.0 * m * gain / my).max(GAIN))
        }
        _ => None,
    }
}

/// Judges each op of `chain` (execution order) under `tol`; returns the judgements and the
/// root: the first op not explained.
pub fn judge(chain: &[OpError], tol: Tolerance) -> (Vec<Judged>, Option<usize>) {
    let mut out: Vec<Judged> = Vec::with_capacity(chain.len());
    let mut root = None;
    for (i, op) in chain.iter().enumerate() {
        let input_error = op.inputs.iter().filter(|&&j| j < i).map(|&j| chain[j].error).fold(0.0f64, f64::max);
        let rounding = match tol {
            Tolerance::Auto => epsilon(&op.dtype) * if matches!(op.dtype.as_str(), "f16" | "bf16") { AUTO_ULPS_HALF } else { AUTO_ULPS },
            Tolerance::Relative(r) => r,
        };
        let kappa = op.condition.unwrap_or(GAIN);
        let allowed = kappa * input_error + rounding;
        let explained = op.error <= allowed;
        let base = input_error.max(rounding);
        let amplification = if base > 0.0 {
            op.error / base
        } else if op.error == 0.0 {
            0.0
        } else {
            f64::INFINITY
        };
        if !explained && root.is_none() {
            root = Some(i);
        }
        out.push(Judged { error: op.error, input_error, allowed, rounding, amplification, explained });
    }
    (out, root)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(path: &str, error: f64, inputs: &[usize]) -> OpError {
        OpError { path: path.into(), dtype: "f32".into(), error, inputs: inputs.to_vec(), condition: None }
    }

    /// Rounding-level differences everywhere (a reduction in another order, f32): no root.
    #[test]
    fn rounding_level_error_passes() {
        let chain = [op("embed_tokens", 0.0, &[]), op("layers.0.q_proj", 3e-7, &[0]), op("layers.0.softmax", 6e-7, &[1]), op("layers.0.o_proj", 1.2e-6, &[2])];
        let (j, root) = judge(&chain, Tolerance::Auto);
        assert_eq!(root, None, "{j:?}");
        assert!(j.iter().all(|x| x.explained));
    }

    /// A 1e-3 relative jump at one op is the root; the ops after it, which only carry it (within
    /// their gain), are not.
    #[test]
    fn a_jump_at_one_op_is_the_root() {
        let chain = [op("layers.0.q_proj", 2e-7, &[]), op("layers.0.mlp.act", 1e-3, &[0]), op("layers.0.mlp.down_proj", 2e-3, &[1]), op("layers.1.q_proj", 3e-3, &[2])];
        let (j, root) = judge(&chain, Tolerance::Auto);
        assert_eq!(root, Some(1), "{j:?}");
        assert!(j[1].amplification > 100.0, "{:?}", j[1]);
        assert!(j[2].explained && j[3].explained);
        // A tolerance given outright that covers the jump: no root.
        assert_eq!(judge(&chain, Tolerance::Relative(2e-3)).1, None);
    }

    /// A softmax over scores up to 40 amplifies its input error up to 80 times: within its
    /// condition it is not blamed; the same growth in an op without that condition is.
    #[test]
    fn an_op_amplifying_within_its_condition_is_not_blamed() {
        let scores: Vec<f64> = vec![-3.0, 40.0, 12.5];
        let softmax = OpError { condition: condition("softmax", &scores, &[]), ..op("layers.0.softmax", 5e-4, &[1]) };
        let mut chain = vec![op("layers.0.q_proj", 3e-6, &[]), op("layers.0.scores", 1e-5, &[0]), softmax];
        let (j, root) = judge(&chain, Tolerance::Auto);
        assert_eq!(root, None, "{j:?}");
        assert!((j[2].amplification - 50.0).abs() < 1e-9, "{:?}", j[2]);
        chain[2].condition = None;
        assert_eq!(judge(&chain, Tolerance::Auto).1, Some(2));
    }

    /// An RMS norm whose gains spread 50-fold turns a 1e-6 input error into up to 5e-5 relative
    /// to its output's scale: within its condition (2 × 50), not blamed; with equal gains the same
    /// growth is the root.
    #[test]
    fn a_norm_amplifies_within_its_gain_spread() {
        // Two positions of two elements; the second element's gain is 50, the first's 1.
        let x = [1.0, 0.02, 1.0, 0.02];
        let k = condition("rms_norm", &x, &[1.0, 1.0, 1.0, 1.0]).unwrap();
        assert!((k - 100.0).abs() < 1e-9, "{k}");
        let norm = OpError { condition: Some(k), ..op("layers.0.post_feedforward_layernorm", 5e-5, &[0]) };
        let chain = vec![op("layers.0.mlp.down_proj", 1e-6, &[]), norm];
        assert_eq!(judge(&chain, Tolerance::Auto).1, None);
        // Equal gains: the condition is the default gain, and the same growth is the root.
        let flat = condition("rms_norm", &x, &x).unwrap();
        assert_eq!(flat, GAIN);
        let chain = vec![chain[0].clone(), OpError { condition: Some(flat), ..chain[1].clone() }];
        assert_eq!(judge(&chain, Tolerance::Auto).1, Some(1));
    }

    /// The error measure: relative to the reference's scale; NaN on one side only is infinite.
    #[test]
    fn relative_error_is_scaled_by_the_reference() {
        assert_eq!(relative_error(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!((relative_error(&[1.0, 2.002], &[1.0, 2.0]) - 1e-3).abs() < 1e-12);
        assert_eq!(relative_error(&[f64::NAN], &[1.0]), f64::INFINITY);
        assert_eq!(relative_error(&[1.0], &[1.0, 2.0]), f64::INFINITY);
        assert_eq!(epsilon("bf16"), 2f64.powi(-7));
    }
}
