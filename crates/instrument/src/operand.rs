//! The values an op reads ([`Operand`]), apart from the kernels that run on them
//! ([`crate::kernel`] for candle's, [`crate::numerics`] for the batch-invariant ones).

use candle_core::quantized::QMatMul;
use candle_core::Tensor;

/// A value an op reads.
#[derive(Clone, Debug)]
pub enum Operand {
    /// A dense tensor: an activation, a dense weight, a mask, a rotary table.
    T(Tensor),
    /// A GGUF weight for `Kernel::QMatMul` (quantized, or kept dense by candle).
    Q(QMatMul),
}

impl Operand {
    /// The dense tensor this operand holds.
    ///
    /// # Errors
    /// A quantized weight where a tensor is expected.
    pub fn t(&self) -> candle_core::Result<&Tensor> {
        match self {
            Operand::T(t) => Ok(t),
            Operand::Q(_) => candle_core::bail!("expected a tensor operand, got a quantized weight"),
        }
    }
}
