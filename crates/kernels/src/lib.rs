//! CPU kernels for candle tensors whose every output row depends on that row's own inputs alone:
//! not on how many rows are in the call (batch size, prefill chunk, padding), nor on the thread
//! count. This crate depends on candle-core only (no tracer, no tokenizer).
//!
//! What is here:
//! - [`qmatmul`]: `x @ Wᵀ` for a GGUF-quantized weight. Q4_1 and Q5_0 weights run
//!   [`q4_1::matmul`] and [`q5_0::matmul`], AVX2 kernels (scalar elsewhere) giving the same bits
//!   as candle 0.11.1's CPU path (`k_quants::matmul`, whose dot products for these two types are
//!   scalar) several times faster; every other weight type runs candle's `QMatMul`.
//!
//! What is guaranteed: row `r` of the output is a function of row `r` of `x` and the weight,
//! computed in one order fixed by K alone. What stays variant: the CPU's features pick the
//! integer dot product's instructions, which are exact, so they change no bit; a different
//! candle version may quantize activations differently.
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

pub mod blocks;
pub mod q4_1;
pub mod q5_0;

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
mod tests;
#[cfg(test)]
mod values;
