//! Quantized matmul with one path per weight type for every row count: [`qmatmul_invariant`].
//!
//! candle 0.11.1's x86 dispatch (`quantized/repack.rs`, `try_matmul_f32`, and
//! `repack_x86::select`) picks a kernel by the row count M:
//! - Q6K weights (K a multiple of 256, N of 16) take repacked tiles when M > 1 and the per-row
//!   `vec_dot` when M = 1, and the two round differently (a decode step against its prefill);
//! - Q4K weights take repacked tiles, or an AMX path at M ≥ 32 on CPUs with AMX;
//! - Q8_0 weights take repacked tiles on CPUs with AVX-VNNI or AVX512-VNNI (all M).
//!
//! The tiles path gives a row the same bits for every M from 2 to 31 (`tests::pinned`). So these
//! weight types run in calls of 2 to [`CHUNK`] rows: a lone row is paired with a copy of itself,
//! longer inputs split into chunks (a last chunk of one row paired likewise). Every other weight
//! type already takes one path for every M (`k_quants::matmul`, a per-row quantization and a
//! sequential dot product per element), and runs [`crate::qmatmul`].

use candle_core::quantized::{GgmlDType, QMatMul};
use candle_core::{Module, Result, Tensor, D};

/// Rows per call for the weight types pinned to candle's tiles: at most 31, under the AMX
/// threshold.
pub const CHUNK: usize = 16;

/// Whether candle's row-count dispatch can change the kernel for weights of `dtype` on this CPU.
fn needs_pin(dtype: GgmlDType) -> bool {
    match dtype {
        GgmlDType::Q6K | GgmlDType::Q4K => true,
        #[cfg(target_arch = "x86_64")]
        GgmlDType::Q8_0 => std::arch::is_x86_feature_detected!("avx512vnni") || std::arch::is_x86_feature_detected!("avxvnni"),
        _ => false,
    }
}

/// `x @ Wᵀ` for a quantized weight `[n, k]` and f32 `x` `[.., k]`, each output row a function of
/// its input row alone (see the module docs): `[.., n]` f32. For Q4_1 and Q5_0 the bits are
/// [`crate::qmatmul`]'s (candle's); for Q6K and Q4K candle's tiles' (which at M = 1 are not
/// candle's own); for the rest candle's.
///
/// # Errors
/// candle's errors for inputs `QMatMul::forward` refuses (a last dim other than `k`, a weight on
/// another device).
pub fn qmatmul_invariant(w: &QMatMul, x: &Tensor) -> Result<Tensor> {
    let QMatMul::QTensor(q) = w else { return crate::qmatmul(w, x) };
    if !needs_pin(q.dtype()) || x.rank() == 0 || x.elem_count() == 0 {
        return crate::qmatmul(w, x);
    }
    let k = x.dim(D::Minus1)?;
    let m = x.elem_count() / k.max(1);
    let rows = x.contiguous()?.reshape((m, k))?;
    let mut parts = Vec::with_capacity(m.div_ceil(CHUNK));
    for start in (0..m).step_by(CHUNK) {
        let chunk = rows.narrow(0, start, CHUNK.min(m - start))?;
        parts.push(if chunk.dim(0)? == 1 { w.forward(&Tensor::cat(&[&chunk, &chunk], 0)?)?.narrow(0, 0, 1)? } else { w.forward(&chunk)? });
    }
    let mut dims = x.dims().to_vec();
    let n = parts[0].dim(1)?;
    *dims.last_mut().expect("rank ≥ 1") = n;
    Tensor::cat(&parts, 0)?.reshape(dims)
}
