//! Tensors as dumps and back: the values `--dump` writes and `trace replay` and `--causal` read
//! (the dump layout and its decoding are `candle_trace_format::dump`'s).

use candle_core::{DType, Device, Tensor};
use candle_trace_format::dump::{check, shuffle, unshuffle};
use candle_trace_format::error::Result;
use candle_trace_format::record::Dump;

/// Little-endian bytes of a tensor's logical values (any device, any layout).
fn logical_le_bytes(t: &Tensor) -> candle_core::Result<Vec<u8>> {
    let flat = t.to_device(&Device::Cpu)?.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => flat.to_vec1::<f32>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F16 => flat.to_vec1::<half::f16>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::BF16 => flat.to_vec1::<half::bf16>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F64 => flat.to_vec1::<f64>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::U32 => flat.to_vec1::<u32>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::I64 => flat.to_vec1::<i64>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::U8 => flat.to_vec1::<u8>()?,
        other => candle_core::bail!("cannot dump dtype {}", other.as_str()),
    })
}

/// Dumps tensor `t` as record `seq`'s values.
///
/// # Errors
/// Candle errors; unsupported dtypes.
pub fn encode(seq: u64, t: &Tensor) -> Result<Dump> {
    let k = t.dtype().size_in_bytes();
    Ok(Dump { seq, dtype: t.dtype().as_str().into(), shape: t.dims().iter().map(|&d| d as u32).collect(), shuffled: true, data: shuffle(&logical_le_bytes(t)?, k) })
}

/// Encodes an operand value with id `id` (see [`candle_trace_format::record::OperandValue`]).
///
/// # Errors
/// Candle errors reading the value.
pub fn encode_operand(id: u64, o: &crate::kernel::Operand) -> Result<candle_trace_format::record::OperandValue> {
    use crate::kernel::Operand;
    use candle_core::quantized::QMatMul;
    use candle_trace_format::record::OperandValue;
    Ok(match o {
        Operand::T(t) => OperandValue::Tensor(encode(id, t)?),
        Operand::Q(QMatMul::QTensor(q)) => {
            OperandValue::Quantized { id, ggml_dtype: format!("{:?}", q.dtype()), shape: q.shape().dims().iter().map(|&d| d as u32).collect(), data: q.data()?.into_owned() }
        }
        Operand::Q(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => OperandValue::QMatMulTensor(encode(id, t)?),
    })
}

/// The size of a linear op's weight operand `o` (`[rows, cols]`; a quantized one dequantized to
/// f32, as the op multiplies it) for the op at site `site`: its largest row L2 norm, summed in
/// f64. `None` for a weight not of rank 2.
///
/// # Errors
/// Candle errors reading or dequantizing the weight.
pub fn weight_norm(site: u32, o: &crate::kernel::Operand) -> Result<Option<candle_trace_format::record::WeightNorm>> {
    use crate::kernel::Operand;
    use candle_core::quantized::QMatMul;
    let w = match o {
        Operand::T(t) | Operand::Q(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => t.clone(),
        Operand::Q(QMatMul::QTensor(q)) => q.dequantize(&Device::Cpu)?,
    };
    let &[rows, cols] = w.dims() else { return Ok(None) };
    let v = w.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
    let max_row_l2 = v.chunks(cols.max(1)).map(|r| r.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt()).fold(0.0f64, f64::max);
    Ok(Some(candle_trace_format::record::WeightNorm { site, rows: rows as u32, cols: cols as u32, max_row_l2 }))
}

/// Rebuilds a dense tensor from a dump, on `device`.
///
/// # Errors
/// A dump whose dtype or length does not fit its shape; candle errors.
pub fn to_tensor(d: &Dump, device: &Device) -> Result<Tensor> {
    let (k, _) = check(d)?;
    let shape: Vec<usize> = d.shape.iter().map(|&x| x as usize).collect();
    let b = if d.shuffled { unshuffle(&d.data, k) } else { d.data.clone() };
    macro_rules! from {
        ($ty:ty, $conv:expr) => {{
            let v: Vec<$ty> = b.chunks_exact(k).map(|c| $conv(c.try_into().expect("element bytes"))).collect();
            Tensor::from_vec(v, shape, device)?
        }};
    }
    Ok(match d.dtype.as_str() {
        "f32" => from!(f32, f32::from_le_bytes),
        "f16" => from!(half::f16, half::f16::from_le_bytes),
        "bf16" => from!(half::bf16, half::bf16::from_le_bytes),
        "f64" => from!(f64, f64::from_le_bytes),
        "u32" => from!(u32, u32::from_le_bytes),
        "i64" => from!(i64, i64::from_le_bytes),
        _ => Tensor::from_vec(b, shape, device)?,
    })
}

#[cfg(test)]
mod tests {
    use super::encode;
    use candle_core::{DType, Device, Tensor};

    #[test]
    fn values_and_ulps() -> candle_trace_format::Result<()> {
        let t = Tensor::new(&[1f32, -2.0, 0.0, f32::from_bits(1f32.to_bits() + 1)], &Device::Cpu)?;
        let v = candle_trace_format::dump::decode(&encode(7, &t)?)?;
        assert_eq!(v.f64[..3], [1.0, -2.0, 0.0]);
        assert_eq!(v.ordered[3] - v.ordered[0], 1);
        assert!(v.ordered[1] < v.ordered[2] && v.ordered[2] < v.ordered[0]);
        let h = candle_trace_format::dump::decode(&encode(8, &t.to_dtype(DType::BF16)?)?)?;
        assert_eq!(h.f64[..3], [1.0, -2.0, 0.0]);
        Ok(())
    }

    /// The reader's table of GGML block sizes (`candle_trace_format::limits::ggml_block`, which
    /// checks quantized operands before candle reads them) is candle's.
    #[test]
    fn ggml_blocks_match_candle() {
        use candle_core::quantized::GgmlDType::*;
        for t in [F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2K, Q3K, Q4K, Q5K, Q6K, Q8K] {
            let (block, size) = candle_trace_format::limits::ggml_block(&format!("{t:?}")).expect("known type");
            assert_eq!((block as usize, size as usize), (t.block_size(), t.type_size()), "{t:?}");
        }
    }
}
