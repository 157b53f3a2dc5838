//! Which numerics a run follows, and the invariant kernels an op runs on under `--numerics
//! invariant`.
//!
//! [`Numerics::Fixed`] (the default) and [`Numerics::Upstream`] run every op on candle's kernels
//! (they differ in what the models compute, not in the kernels). [`Numerics::Invariant`] runs
//! each op whose candle kernel rounds differently with the batch, the prefill chunk, padding or
//! the decode step on `candle-trace-kernels` instead ([`run_invariant`]), so that the bits of an
//! op's output for a request at a position depend only on that request's tokens up to there.
//! The choice is made once, where ops execute ([`crate::kernel::Execute::run_as`]); the trace
//! header records it (`numerics` in the run's config) and `trace replay` takes the same path.

use crate::operand::Operand;
use candle_core::quantized::QMatMul;
use candle_core::{DType, Module, Result, Tensor, TensorId};
use candle_trace_format::record::Kernel;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The numerics of a run (`--numerics`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Numerics {
    /// The model as defined, on candle's kernels.
    #[default]
    Fixed,
    /// candle-transformers' own numerics where they depart from the definition, bit for bit.
    Upstream,
    /// The model as defined, on batch-invariant kernels.
    Invariant,
}

impl Numerics {
    /// The name `--numerics` and the trace header use.
    pub fn name(self) -> &'static str {
        match self {
            Numerics::Fixed => "fixed",
            Numerics::Upstream => "upstream",
            Numerics::Invariant => "invariant",
        }
    }

    /// The numerics a trace header's run config names (`numerics`, a JSON string; absent:
    /// fixed). `None` for a name this build does not know.
    pub fn of_config(config: &[(String, String)]) -> Option<Self> {
        match config.iter().find(|(k, _)| k == "numerics").map(|(_, v)| v.trim_matches('"')) {
            None | Some("fixed") => Some(Numerics::Fixed),
            Some("upstream") => Some(Numerics::Upstream),
            Some("invariant") => Some(Numerics::Invariant),
            Some(_) => None,
        }
    }
}

/// Packed dense weights by tensor: a weight is packed once for the life of the model that holds
/// it. Cleared when it holds [`PACKED_MAX`] weights (a process that loads model after model).
static PACKED: Mutex<Option<HashMap<TensorId, Arc<candle_trace_kernels::Linear>>>> = Mutex::new(None);
const PACKED_MAX: usize = 4096;

/// The invariant linear layer of weight `w` `[n, k]` (no bias), packed on first use.
fn packed(w: &Tensor) -> Result<Arc<candle_trace_kernels::Linear>> {
    if let Some(l) = PACKED.lock().unwrap_or_else(|e| e.into_inner()).as_ref().and_then(|m| m.get(&w.id())) {
        return Ok(l.clone());
    }
    let l = Arc::new(candle_trace_kernels::Linear::new(w, None)?);
    let mut guard = PACKED.lock().unwrap_or_else(|e| e.into_inner());
    let map = guard.get_or_insert_with(HashMap::new);
    if map.len() >= PACKED_MAX {
        map.clear();
    }
    map.insert(w.id(), l.clone());
    Ok(l)
}

/// `x @ wᵀ (+ bias)` on the invariant dense kernel, in `x`'s dtype (a weight of another dtype,
/// such as candle's f16 `QMatMul`, computed with `x` converted to it, as candle does).
fn dense(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let y = packed(w)?.forward(&x.to_dtype(w.dtype())?)?.to_dtype(x.dtype())?;
    match bias {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// `kernel` on `xs` on the invariant kernels: `Some(output)` for the ops whose candle kernel
/// varies (matmuls, softmax, norms, attention), `None` for those candle computes per element or
/// per row already (elementwise ops, rope, embedding, concatenation, dtype conversion), which
/// run as under the default numerics. Operands as [`crate::kernel::Execute::run`] takes them.
///
/// # Errors
/// Operands that do not fit the kernel; the kernels' errors (a device other than the CPU).
pub fn run_invariant(kernel: &Kernel, xs: &[Operand]) -> Result<Option<Tensor>> {
    let t = |i: usize| -> Result<&Tensor> { xs.get(i).ok_or_else(|| candle_core::Error::Msg(format!("{kernel:?}: missing operand {i}")))?.t() };
    Ok(Some(match kernel {
        Kernel::RmsNorm { eps } => candle_trace_kernels::rms_norm(t(0)?, t(1)?, *eps as f32)?,
        Kernel::LayerNorm { eps } => candle_trace_kernels::layer_norm(t(0)?, t(1)?, t(2)?, *eps as f32)?,
        Kernel::QMatMul => {
            let bias = if xs.len() > 2 { Some(t(2)?) } else { None };
            let y = match xs.get(1) {
                Some(Operand::Q(q @ QMatMul::QTensor(_))) => candle_trace_kernels::qmatmul_invariant(q, t(0)?)?,
                Some(Operand::Q(QMatMul::Tensor(w) | QMatMul::TensorF16(w))) => dense(t(0)?, w, None)?,
                _ => candle_core::bail!("qmatmul: operand 1 must be a quantized weight"),
            };
            match bias {
                Some(b) => y.broadcast_add(b)?,
                None => y,
            }
        }
        Kernel::Linear => dense(t(0)?, t(1)?, if xs.len() > 2 { Some(t(2)?) } else { None })?,
        Kernel::Matmul { rhs_t: true } => candle_trace_kernels::matmul_t(t(0)?, t(1)?)?,
        Kernel::Matmul { rhs_t: false } => candle_trace_kernels::matmul(t(0)?, t(1)?)?,
        Kernel::Softmax { .. } | Kernel::SoftmaxWide => candle_trace_kernels::softmax_last_dim(t(0)?)?,
        Kernel::FlashAttn { scale } => {
            let (q, k, v) = (t(0)?, t(1)?, t(2)?);
            if q.rank() != 4 || k.rank() != 4 || q.dtype() != DType::F32 {
                candle_core::bail!("flash attention needs f32 q (1, S, H, D) and k, v (1, KV, H_kv, D); got q {:?} {:?}, k {:?}", q.dims(), q.dtype(), k.dims())
            }
            candle_trace_kernels::attention(&q.transpose(1, 2)?, &k.transpose(1, 2)?, &v.transpose(1, 2)?, *scale, true, &[])?
        }
        Kernel::MeanPool => candle_trace_kernels::mean_pool(t(0)?, &sentence_lengths(t(1)?)?)?,
        _ => return Ok(None),
    }))
}

/// Each sentence's token count from an attention mask `[b, t]` (1 for a token, 0 for padding,
/// padding after the tokens as BERT tokenizers pad).
///
/// # Errors
/// A mask not of rank 2, or one whose padding comes before a token.
fn sentence_lengths(mask: &Tensor) -> Result<Vec<usize>> {
    let rows = mask.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    rows.iter()
        .map(|r| {
            let len = r.iter().take_while(|&&m| m != 0.0).count();
            if r[len..].iter().any(|&m| m != 0.0) {
                candle_core::bail!("mean pooling: the attention mask has padding before a token ({r:?}); the invariant kernel needs padding after")
            }
            Ok(len)
        })
        .collect()
}
