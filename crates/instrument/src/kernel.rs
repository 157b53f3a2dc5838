//! Op descriptors and their execution: the one place where an instrumented model's ops compute.
//!
//! A [`Kernel`] names an op and the attributes that decide its result (eps, rope layout, divisor,
//! dims, dtype…); [`Kernel::run`] executes it on [`Operand`]s — activations, weights, masks,
//! rotary tables — by calling the same candle function the candle-transformers model calls. Live
//! forward passes run every op through here (via [`crate::tracer::Tracer::run`]), and so does
//! `trace replay`: a replayed op is the op that ran. Descriptors are stored in the trace with each
//! op record.

use crate::numerics::Numerics;
use candle_core::{DType, Module, Tensor, D};

pub use candle_trace_format::record::Kernel;

pub use crate::operand::Operand;

/// A float dtype by candle's name for it (`f32`, `f16`, `bf16`, `f64`).
fn parse_dtype(s: &str) -> candle_core::Result<DType> {
    match s.parse::<DType>() {
        Ok(d) if d.is_float() => Ok(d),
        _ => candle_core::bail!("unknown dtype {s}"),
    }
}

/// Running a recorded [`Kernel`] on candle (the format crate describes kernels; this crate runs
/// them).
pub trait Execute {
    /// Executes the op on operands `xs` (listed per variant in `docs/trace-format.md`).
    ///
    /// # Errors
    /// Candle errors, or operands that do not fit the variant (count or kind).
    fn run(&self, xs: &[Operand]) -> candle_core::Result<Tensor>;

    /// [`Execute::run`] under `numerics`: [`Numerics::Invariant`] takes the batch-invariant
    /// kernel where the op has one ([`crate::numerics::run_invariant`]), every other numerics
    /// candle's.
    ///
    /// # Errors
    /// As [`Execute::run`].
    fn run_as(&self, xs: &[Operand], numerics: Numerics) -> candle_core::Result<Tensor>;
}

impl Execute for Kernel {
    fn run_as(&self, xs: &[Operand], numerics: Numerics) -> candle_core::Result<Tensor> {
        if numerics == Numerics::Invariant {
            if let Some(y) = crate::numerics::run_invariant(self, xs)? {
                return Ok(y);
            }
        }
        self.run(xs)
    }

    fn run(&self, xs: &[Operand]) -> candle_core::Result<Tensor> {
        let t = |i: usize| -> candle_core::Result<&Tensor> { xs.get(i).ok_or_else(|| candle_core::Error::Msg(format!("{self:?}: missing operand {i}")))?.t() };
        Ok(match self {
            Kernel::Input => t(0)?.clone(),
            Kernel::Embedding => {
                let table = t(1)?;
                candle_nn::Embedding::new(table.clone(), table.dim(1)?).forward(t(0)?)?
            }
            Kernel::RmsNorm { eps } => candle_nn::RmsNorm::new(t(1)?.clone(), *eps).forward(t(0)?)?,
            Kernel::LayerNorm { eps } => candle_nn::LayerNorm::new(t(1)?.clone(), t(2)?.clone(), *eps).forward(t(0)?)?,
            Kernel::QMatMul => match (xs.get(1), xs.get(2)) {
                // candle's bits; Q4_1 weights on the CPU take candle-trace-kernels' AVX2 kernel.
                (Some(Operand::Q(q)), None) => candle_trace_kernels::qmatmul(q, t(0)?)?,
                (Some(Operand::Q(q)), Some(_)) => candle_trace_kernels::qmatmul(q, t(0)?)?.broadcast_add(t(2)?)?,
                _ => candle_core::bail!("qmatmul: operand 1 must be a quantized weight"),
            },
            Kernel::Linear => {
                let bias = if xs.len() > 2 { Some(t(2)?.clone()) } else { None };
                candle_nn::Linear::new(t(1)?.clone(), bias).forward(t(0)?)?
            }
            Kernel::Matmul { rhs_t: true } => t(0)?.matmul(&t(1)?.t()?)?,
            Kernel::Matmul { rhs_t: false } => t(0)?.matmul(&t(1)?.contiguous()?)?,
            Kernel::Scale { divisor } => (t(0)? / *divisor)?,
            Kernel::Affine { mul, add } => t(0)?.affine(*mul, *add)?,
            Kernel::WhereCond => {
                let x = t(0)?;
                let shape = x.shape();
                t(1)?.broadcast_as(shape)?.where_cond(&t(2)?.broadcast_as(shape.dims())?, x)?
            }
            Kernel::BroadcastAdd => t(0)?.broadcast_add(t(1)?)?,
            Kernel::Softmax { fused: true } => candle_nn::ops::softmax_last_dim(t(0)?)?,
            Kernel::Softmax { fused: false } => candle_nn::ops::softmax(t(0)?, D::Minus1)?,
            Kernel::SoftmaxWide => candle_nn::ops::softmax_last_dim(&t(0)?.to_dtype(DType::F32)?)?.to_dtype(t(0)?.dtype())?,
            Kernel::Rope { interleaved } => {
                let x = t(0)?.contiguous()?;
                if *interleaved {
                    candle_nn::rotary_emb::rope_i(&x, t(1)?, t(2)?)?
                } else {
                    candle_nn::rotary_emb::rope(&x, t(1)?, t(2)?)?
                }
            }
            Kernel::Cat { dim } => match xs.len() {
                1 => t(0)?.clone(),
                _ => Tensor::cat(&[t(0)?, t(1)?], *dim as usize)?,
            },
            Kernel::Silu => candle_nn::ops::silu(t(0)?)?,
            Kernel::Gelu { erf: true } => t(0)?.gelu_erf()?,
            Kernel::Gelu { erf: false } => t(0)?.gelu()?,
            Kernel::Mul => (t(0)? * t(1)?)?,
            Kernel::Add => (t(0)? + t(1)?)?,
            Kernel::ToDtype { dtype } => t(0)?.to_dtype(parse_dtype(dtype)?)?,
            Kernel::MeanPool => {
                let m = t(1)?.to_dtype(DType::F32)?.unsqueeze(2)?;
                let sum = t(0)?.broadcast_mul(&m)?.sum(1)?;
                sum.broadcast_div(&m.sum(1)?)?
            }
            Kernel::Normalize => {
                let x = t(0)?;
                let norm = x.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.maximum(1e-12)?;
                x.broadcast_div(&norm)?
            }
            Kernel::FlashAttn { scale } => flash_attention(t(0)?, t(1)?, t(2)?, *scale)?,
        })
    }
}

/// [`Kernel::FlashAttn`]: candle_nn's CPU flash attention, dispatched as candle-transformers'
/// `quantized_qwen3` dispatches it (the prefill kernel for several queries, the interleaved
/// decode kernel for one). Shapes, dtypes and the device are checked here, before any slice
/// reaches the kernels' unchecked indexing: a replayed trace supplies them.
fn flash_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> candle_core::Result<Tensor> {
    let bad = || {
        candle_core::Error::Msg(format!(
            "flash attention needs f32 CPU tensors q (1, S, H, D) and k, v (1, KV, H_kv, D) with H a multiple of H_kv and KV ≥ S ≥ 1; got q {:?} {:?}, k {:?} {:?}, v {:?} {:?}",
            q.dims(),
            q.dtype(),
            k.dims(),
            k.dtype(),
            v.dims(),
            v.dtype()
        ))
    };
    let (&[b, s, h, d], &[bk, kv, h_kv, dk]) = (q.dims(), k.dims()) else { return Err(bad()) };
    let fits = b == 1 && bk == 1 && k.dims() == v.dims() && d == dk && d > 0 && h_kv > 0 && h % h_kv == 0 && s >= 1 && kv >= s;
    let f32_cpu = [q, k, v].iter().all(|x| x.dtype() == DType::F32 && x.device().is_cpu());
    if !fits || !f32_cpu {
        return Err(bad());
    }
    if s > 1 {
        return candle_nn::attention::flash_attn::<f32>(q, k, v, scale, candle_nn::attention::AttnMask::causal_with_offset(kv - s), None, None);
    }
    // One query: the decode kernel reads K and V interleaved per head, `(KV, H_kv, 2D)`, as
    // quantized_qwen3's raw cache holds them.
    let q = q.contiguous()?;
    let kv_il = Tensor::cat(&[&k.squeeze(0)?, &v.squeeze(0)?], 2)?;
    let out = f32_slice(&q, |q_data| f32_slice(&kv_il, |kv_data| candle_nn::attention::cpu_flash::causal::causal_decode_f32_interleaved(q_data, kv_data, h, h_kv, d, kv, scale)))???;
    out.reshape((1, h, 1, d))
}

/// Calls `f` with the values of `t`, a contiguous f32 CPU tensor, without copying them.
fn f32_slice<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match (&*storage, layout.contiguous_offsets()) {
        (candle_core::Storage::Cpu(cpu), Some((start, end))) => Ok(f(&cpu.as_slice::<f32>()?[start..end])),
        _ => candle_core::bail!("expected a contiguous f32 CPU tensor"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn z(dims: &[usize], dtype: DType) -> Operand {
        Operand::T(Tensor::zeros(dims, dtype, &Device::Cpu).unwrap())
    }

    /// A replayed trace supplies the operands: shapes the kernels would index past are refused
    /// before they reach them; fitting ones run, prefill and decode, to `(1, H, S, D)`.
    #[test]
    fn flash_attention_checks_its_operands() {
        let k = Kernel::FlashAttn { scale: 0.25 };
        let f = DType::F32;
        for bad in [
            [z(&[1, 2, 3, 8], f), z(&[1, 2, 2, 8], f), z(&[1, 2, 2, 8], f)],
            [z(&[1, 3, 4, 8], f), z(&[1, 2, 2, 8], f), z(&[1, 2, 2, 8], f)],
            [z(&[2, 1, 4, 8], f), z(&[2, 2, 2, 8], f), z(&[2, 2, 2, 8], f)],
            [z(&[1, 1, 4, 8], f), z(&[1, 2, 2, 8], f), z(&[1, 3, 2, 8], f)],
            [z(&[1, 1, 4, 8], f), z(&[1, 2, 0, 8], f), z(&[1, 2, 0, 8], f)],
            [z(&[1, 1, 4, 8], DType::F16), z(&[1, 2, 2, 8], DType::F16), z(&[1, 2, 2, 8], DType::F16)],
            [z(&[1, 4, 8], f), z(&[1, 2, 2, 8], f), z(&[1, 2, 2, 8], f)],
        ] {
            assert!(k.run(&bad).is_err(), "{:?}", bad.iter().map(|o| o.t().unwrap().dims().to_vec()).collect::<Vec<_>>());
        }
        for s in [1, 3] {
            let out = k.run(&[z(&[1, s, 4, 8], f), z(&[1, 5, 2, 8], f), z(&[1, 5, 2, 8], f)]).unwrap();
            assert_eq!(out.dims(), &[1, 4, s, 8]);
        }
    }
}
