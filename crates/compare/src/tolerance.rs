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
//! - how its inputs' errors reach its output ([`Carry`]): per input, by gains read off the values
//!   for sums, elementwise products and products of two activations ([`crate::gains`]); else a
//!   condition `κ` times the largest: [`GAIN`] unless the op's kind and input values say more
//!   ([`condition`]: a softmax over scores up to `|x|` amplifies a relative error of its scores
//!   by up to `2|x|`);
//! - a linear op adds the error of quantizing its activations ([`Q8_STEP`]) and of a weight held
//!   in half precision on one side ([`OpError::own`]).
//!
//! An op is explained when `e <= carried + r`; the first op that is not is the root, and its
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

/// The quantization step of the 8-bit activation blocks a quantized matmul multiplies (llama.cpp's
/// and candle's `Q8_0`, `Q8_1` and `Q8_K`, for every block-quantized weight type), relative to its
/// block's largest magnitude: the block's scale is `max|x_block| / 127` (`Q8_K`: `/ 128`) and
/// each element is rounded to a multiple of it. A run that quantizes is off from the exact
/// activation by at most half a step, `1/254` of the block's (so of the tensor's) largest
/// magnitude; two runs that both quantize slightly different inputs, by up to a step apart.
pub const Q8_STEP: f64 = 1.0 / 127.0;

/// How the errors of an op's inputs reach its output, relative to its scale.
#[derive(Clone, Debug, PartialEq)]
pub enum Carry {
    /// `κ` times the largest input error: [`GAIN`], or the op's [`condition`].
    Largest(f64),
    /// `Σ_k g_k · e_k · (1 + max_k e_k)`, one gain per input (aligned with [`OpError::inputs`]),
    /// read off the values ([`crate::gains`]; the last factor bounds the products of two
    /// errors that a product of two erring operands adds).
    Each(Vec<f64>),
    /// `κ` times the largest error of every op before it: for two traces neither of which
    /// records which op read which (two imported references).
    Before(f64),
    /// Computed outright from both sides' input values: a linear layer's bound on what its input
    /// error carries ([`crate::gains::linear`]).
    Outright(f64),
}

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
    /// How the inputs' errors reach the output.
    pub carry: Carry,
    /// Error the op itself adds beyond its output's rounding, relative to its output's scale:
    /// a linear op's activation quantization and weight rounding ([`crate::gains::linear`]), or
    /// without its weight's norm [`GAIN`] times its activation quantization (half a
    /// [`Q8_STEP`] when one side's op is a quantized matmul, a whole step when both are); else 0.
    pub own: f64,
}

/// How one op was judged.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Judged {
    /// Its output error.
    pub error: f64,
    /// Its input error (the largest output error among what it read).
    pub input_error: f64,
    /// The error its inputs and rounding explain: the inputs' errors carried ([`Carry`]) plus
    /// `rounding`.
    pub allowed: f64,
    /// The rounding allowed to the op itself (relative): the tolerance, or under `auto` its
    /// dtype's epsilon times [`AUTO_ULPS`] (`AUTO_ULPS_HALF` for f16 and bf16); plus what the op
    /// itself adds ([`OpError::own`]: activation quantization, weight rounding).
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

/// Largest finite magnitude of `v` (0 when empty): the scale errors are relative to.
pub fn max_abs(v: &[f64]) -> f64 {
    v.iter().filter(|x| x.is_finite()).fold(0.0f64, |m, x| m.max(x.abs()))
}

/// The condition of an op of kind `op` (the trace's op name) on input values `x` and the
/// reference's output values `y`, when one is known:
///
/// - `softmax` amplifies a relative error of its inputs by up to `2 max|x|` (an absolute input
///   error `δ` moves each probability by up to `2δ` relative), `exp` by `max|x|`;
/// - `rms_norm` over rows of `row` elements scales element `i` of a row by `g_i = w_i / rms(row)`.
///   An input error of `e·max|x|` at an element of large gain becomes `e·max|x|·max g` in the
///   output, which is `max|x|·max g / max|y|` times `e` relative to the output's scale (the *gain
///   spread*; 1 when every gain is equal); and the row's rms, off by up to `e·max|x|` (the
///   triangle inequality on its L2 norm), moves every output by up to `|y_i|·e·max|x| / rms(row)`:
///   `max|x| / min rms(row)` times `e`. Both add: `max|x| · (max g / max|y| + 1 / min rms)`. The
///   gains are read off the values, `|y_i / x_i|` over every normal nonzero `x_i`, so a
///   small element with a large weight counts (the residual stream's massive activations make
///   `max|x|` hundreds of times most elements); `x` and `y` must be the same length, a whole
///   number of rows.
///
/// Each is at least [`GAIN`]; every other kind: `None` ([`GAIN`]).
pub fn condition(op: &str, x: &[f64], row: usize, y: &[f64]) -> Option<f64> {
    let m = max_abs(x);
    match op {
        "softmax" => Some((2.0 * m).max(GAIN)),
        "exp" => Some(m.max(GAIN)),
        "rms_norm" if x.len() == y.len() && m > 0.0 && row > 0 && x.len().is_multiple_of(row) => {
            let my = max_abs(y);
            let normal = |a: &f64| a.is_finite() && a.abs() >= f64::from(f32::MIN_POSITIVE);
            let gain = x.iter().zip(y).filter(|(a, b)| normal(a) && b.is_finite()).fold(0.0f64, |g, (a, b)| g.max((b / a).abs()));
            let rms = x.chunks(row).map(|r| (r.iter().filter(|v| v.is_finite()).map(|v| v * v).sum::<f64>() / row as f64).sqrt()).filter(|r| *r > 0.0).fold(f64::INFINITY, f64::min);
            (my > 0.0 && rms.is_finite()).then(|| (m * (gain / my + 1.0 / rms)).max(GAIN))
        }
        _ => None,
    }
}

/// Judges each op of `chain` (execution order) under `tol`; returns the judgements and the
/// root: the first op not explained.
pub fn judge(chain: &[OpError], tol: Tolerance) -> (Vec<Judged>, Option<usize>) {
    let mut out: Vec<Judged> = Vec::with_capacity(chain.len());
    let mut root = None;
    // The largest error of the ops before the current one (Carry::Before).
    let mut before = 0.0f64;
    for (i, op) in chain.iter().enumerate() {
        let read = || op.inputs.iter().filter(|&&j| j < i).map(|&j| chain[j].error);
        let (input_error, carried) = match &op.carry {
            Carry::Largest(k) => {
                let e = read().fold(0.0f64, f64::max);
                (e, k * e)
            }
            Carry::Each(g) => {
                let e = read().fold(0.0f64, f64::max);
                let sum: f64 = op.inputs.iter().zip(g).filter(|(&j, _)| j < i).map(|(&j, g)| g * chain[j].error).sum();
                (e, sum * (1.0 + e))
            }
            Carry::Before(k) => (before, k * before),
            Carry::Outright(c) => (read().fold(0.0f64, f64::max), *c),
        };
        before = before.max(op.error);
        let rounding = match tol {
            Tolerance::Auto => epsilon(&op.dtype) * if matches!(op.dtype.as_str(), "f16" | "bf16") { AUTO_ULPS_HALF } else { AUTO_ULPS },
            Tolerance::Relative(r) => r,
        } + op.own;
        let allowed = carried + rounding;
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
        OpError { path: path.into(), dtype: "f32".into(), error, inputs: inputs.to_vec(), carry: Carry::Largest(GAIN), own: 0.0 }
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
        let softmax = OpError { carry: Carry::Largest(condition("softmax", &scores, 3, &[]).unwrap()), ..op("layers.0.softmax", 5e-4, &[1]) };
        let mut chain = vec![op("layers.0.q_proj", 3e-6, &[]), op("layers.0.scores", 1e-5, &[0]), softmax];
        let (j, root) = judge(&chain, Tolerance::Auto);
        assert_eq!(root, None, "{j:?}");
        assert!((j[2].amplification - 50.0).abs() < 1e-9, "{:?}", j[2]);
        chain[2].carry = Carry::Largest(GAIN);
        assert_eq!(judge(&chain, Tolerance::Auto).1, Some(2));
    }

    /// An RMS norm whose gains spread 50-fold turns a 1e-6 input error into up to 5e-5 relative
    /// to its output's scale: within its condition (50 + 1.4), not blamed; with equal gains the same
    /// growth is the root.
    #[test]
    fn a_norm_amplifies_within_its_gain_spread() {
        // Two positions of two elements; the second element's gain is 50, the first's 1; each
        // row's rms is sqrt((1 + 0.0004) / 2).
        let x = [1.0, 0.02, 1.0, 0.02];
        let k = condition("rms_norm", &x, 2, &[1.0, 1.0, 1.0, 1.0]).unwrap();
        assert!((k - (50.0 + 1.0 / 0.5002f64.sqrt())).abs() < 1e-9, "{k}");
        let norm = OpError { carry: Carry::Largest(k), ..op("layers.0.post_feedforward_layernorm", 5e-5, &[0]) };
        let chain = vec![op("layers.0.mlp.down_proj", 1e-6, &[]), norm];
        assert_eq!(judge(&chain, Tolerance::Auto).1, None);
        // Equal gains: the condition is the default gain, and the same growth is the root.
        let flat = condition("rms_norm", &x, 2, &x).unwrap();
        assert_eq!(flat, GAIN);
        let chain = vec![chain[0].clone(), OpError { carry: Carry::Largest(flat), ..chain[1].clone() }];
        assert_eq!(judge(&chain, Tolerance::Auto).1, Some(1));
    }

    /// Bounds computed outright stand as given; without any graph, each op is judged against
    /// the largest error before it.
    #[test]
    fn outright_bounds_and_graphless_chains() {
        let outright = |e, c, own| OpError { carry: Carry::Outright(c), own, ..op("layers.0.q_proj", e, &[0]) };
        let chain = [op("embed_tokens", 5e-6, &[]), outright(0.02, 0.01, 0.011)];
        let (j, root) = judge(&chain, Tolerance::Auto);
        assert_eq!(root, None, "{j:?}");
        assert!((j[1].allowed - (0.021 + 64.0 * epsilon("f32"))).abs() < 1e-12 && j[1].input_error == 5e-6, "{:?}", j[1]);
        assert_eq!(judge(&[chain[0].clone(), outright(0.02, 0.01, 0.0)], Tolerance::Auto).1, Some(1));
        let before = |e| OpError { carry: Carry::Before(GAIN), ..op("x", e, &[]) };
        let (j, root) = judge(&[before(5e-6), before(1.5e-5), before(2e-4)], Tolerance::Auto);
        assert_eq!((root, j[1].input_error), (Some(2), 5e-6), "{j:?}");
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
