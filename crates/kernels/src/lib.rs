//! CPU kernels for candle tensors whose every output row depends on that row's own inputs alone:
//! not on how many rows are in the call (batch size, prefill chunk, padding), nor on the thread
//! count. This crate depends on candle-core only (no tracer, no tokenizer).
//!
//! What is here:
//! - [`Linear`]: a drop-in for `candle_nn::Linear` (f32, f16, bf16), the weight packed once, each
//!   output element summed along K in blocks of [`dense::KC`] aligned at k = 0, one fused
//!   multiply-add chain per block; one row (a decode step) runs the same chains as 257.
//!   candle's own matmul does not: its one-row gemv rounds differently from its gemm.
//! - [`matmul`]: a batched `a @ b` for attention (`Q·Kᵀ`, `P·V`), one chain over the whole K,
//!   so zero probabilities before a request's first key (left padding) or after its last (a
//!   longer kv length) leave a query's bits as they were.
//! - [`qmatmul`]: `x @ Wᵀ` for a GGUF-quantized weight. Q4_1 and Q5_0 weights run
//!   [`q4_1::matmul`] and [`q5_0::matmul`], AVX2 kernels (scalar elsewhere) giving the same bits
//!   as candle 0.11.1's CPU path (`k_quants::matmul`, whose dot products for these two types are
//!   scalar) several times faster; every other weight type runs candle's `QMatMul`.
//! - [`qmatmul_invariant`]: the same, with one path per weight type for every row count: candle
//!   picks Q6K's kernel by M (tiles for M > 1, `vec_dot` for one row), Q4K's by M and AMX, Q8_0's
//!   by VNNI; those run in calls of 2 to 16 rows (see [`pinned`]).
//! - [`softmax_last_dim`]: the row sum in eight lanes aligned at the row's first nonzero term,
//!   so masked keys before (left padding) or after (a longer kv length) change no bit.
//! - [`attention()`]: causal or bidirectional attention with grouped kv heads and per-entry valid
//!   key ranges, reading only a query's own keys: a decode step, the same query in a prefill or
//!   a chunk, and a left-padded batch give the same bits.
//! - [`rms_norm`], [`layer_norm`]: candle's fused per-row arithmetic for every layout (candle_nn's
//!   modules take another path for views); [`mean_pool`] over each sentence's own tokens.
//!
//! What is guaranteed: row `r` of the output is a function of row `r` of the input and the
//! weight, computed in one order fixed by K alone, with the same bits on every CPU path of one
//! kernel (AVX2 and scalar; the dense kernels' fused multiply-add is correctly rounded on both).
//! What stays variant: the dtype; the device (these are CPU kernels); the CPU's features where
//! candle's kernels run (the quantized types other than Q4_1 and Q5_0 pick their instructions,
//! and so their rounding, by AVX2, AVX-VNNI or AVX512-VNNI); `exp` from the platform's libm; a
//! different compiler or candle version; and across kernels, [`Linear`] (blocked), [`matmul`]
//! (one chain) and candle's own need not agree with each other.
//!
//! Swapping a `candle_nn::Linear` for the invariant one: `candle_trace_kernels::Linear::new(
//! layer.weight(), layer.bias())?` (see [`Linear`]). A quantized projection:
//!
//! ```
//! use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
//! use candle_core::{Device, Module, Tensor};
//! let dev = Device::Cpu;
//! let w = QTensor::quantize(&Tensor::randn(0f32, 1.0, (64, 96), &dev)?, GgmlDType::Q4_1)?;
//! let w = QMatMul::from_qtensor(w)?;
//! let x = Tensor::randn(0f32, 1.0, (3, 96), &dev)?;
//! let ours = candle_trace_kernels::qmatmul(&w, &x)?;
//! let candles = w.forward(&x)?;
//! assert_eq!(ours.to_vec2::<f32>()?, candles.to_vec2::<f32>()?);
//! # Ok::<(), candle_core::Error>(())
//! ```

pub mod attention;
pub mod blocks;
pub mod dense;
pub mod norm;
pub mod pinned;
pub mod q4_1;
pub mod q5_0;
pub mod softmax;
pub mod tile;

pub use attention::attention;
pub use dense::{matmul, matmul_t, Linear};
pub use norm::{layer_norm, mean_pool, rms_norm};
pub use pinned::qmatmul_invariant;
pub use softmax::softmax_last_dim;

use candle_core::quantized::QMatMul;
use candle_core::{Module, Result, Tensor};

/// `x @ Wᵀ` for a quantized weight `w` of shape `[n, k]`: `x` is `[.., k]` (f32, contiguous, as
/// candle's `QMatMul` takes it), the result `[.., n]` f32. Same bits as `w.forward(x)`.
///
/// # Errors
/// candle's errors for inputs `QMatMul::forward` refuses (a last dim other than `k`, a
/// non-contiguous `x`, a weight on another device).
pub fn qmatmul(w: &QMatMul, x: &Tensor) -> Result<Tensor> {
    if let QMatMul::QTensor(q) = w {
        for kernel in [q4_1::matmul, q5_0::matmul] {
            if let Some(y) = kernel(x, q)? {
                return Ok(y);
            }
        }
    }
    w.forward(x)
}

#[cfg(test)]
mod dense_tests;
#[cfg(test)]
mod rows_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod values;
