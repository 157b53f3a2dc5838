//! The device algorithm on CUDA: the summary of a CUDA tensor computed by the kernels of
//! `crates/instrument/kernels/digest.cu` (compiled to PTX by build.rs), so that per stream only its
//! digest and reductions (80 bytes), its samples, and the bytes of streams of at most 240 bytes
//! cross to the host, never the tensor.
//!
//! Compiled under the `cuda` feature only; checked against the CPU summary by
//! `tools/gpu-check.sh` on a machine with a GPU (no machine this project is built on has one).

use super::{stats_of, token_of, token_sample_offsets, StreamOut};
use crate::digest::streams::{token_streams, Stream};
use crate::digest::Summary;
use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{DType, Storage, Tensor};
use candle_trace_format::record::{Rows, TokenAxis, TokenStat};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/digest.ptx"));
const MODULE: &str = "candle_trace_digest";
const OUT_WORDS: usize = 10;
const MID_MAX: usize = super::xxh3_blocks::MID_MAX;

fn grid(n: usize, threads: u32) -> LaunchConfig {
    let blocks = n.div_ceil(threads as usize).max(1) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

/// Summarises a CUDA tensor of dtype f32, f16, bf16 or f64 on its device: equal, bit for bit, to
/// [`crate::digest::summarize_rows`] of the same values on the CPU. Other dtypes (token ids,
/// masks: small) and non-CUDA tensors are summarised on the CPU.
///
/// # Errors
/// As [`crate::digest::summarize_rows`], and the CUDA driver's errors (module load, launch, copy).
pub fn summarize_cuda(t: &Tensor, axis: Option<&TokenAxis>, rows: &Rows) -> candle_core::Result<Summary> {
    let code: i32 = match t.dtype() {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::F64 => 3,
        _ => return crate::digest::summarize_host(t, axis, rows),
    };
    if t.elem_count() == 0 || !t.device().is_cuda() {
        return crate::digest::summarize_host(t, axis, rows);
    }
    let t = t.contiguous()?;
    let dims = t.dims().to_vec();
    let n = t.elem_count();
    let esize = t.dtype().size_in_bytes();
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else { candle_core::bail!("tensor is not on a CUDA device") };
    let (start, end) = layout.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("tensor is not contiguous".into()))?;
    let slices = match axis {
        Some(axis) => token_streams(&dims, axis, rows)?,
        None => Vec::new(),
    };
    let streams: Vec<Stream> = std::iter::once(Stream::whole(n)).chain(slices.iter().map(|s| s.stream)).collect();
    let offs = sample_offsets(n, &slices);
    let dev = &cs.device;
    let (outs, short, samples) = match t.dtype() {
        DType::F32 => launch(dev, &cs.as_cuda_slice::<f32>()?.slice(start..end), code, esize, &streams, &offs)?,
        DType::F16 => launch(dev, &cs.as_cuda_slice::<half::f16>()?.slice(start..end), code, esize, &streams, &offs)?,
        DType::BF16 => launch(dev, &cs.as_cuda_slice::<half::bf16>()?.slice(start..end), code, esize, &streams, &offs)?,
        _ => launch(dev, &cs.as_cuda_slice::<f64>()?.slice(start..end), code, esize, &streams, &offs)?,
    };
    assemble(n, &slices, &streams, esize, &outs, &short, &samples)
}

/// Offsets of the samples to gather: the whole tensor's 8, then 4 per token slice.
fn sample_offsets(n: usize, slices: &[crate::digest::streams::TokenStream]) -> Vec<u64> {
    let mut offs: Vec<u64> = crate::digest::sample_offsets(n, 8).map(|i| i as u64).collect();
    offs.resize(8, 0);
    for s in slices {
        let len = s.stream.elems();
        offs.extend(token_sample_offsets(len).map(|i| if len == 0 { 0 } else { s.stream.offset(i) as u64 }));
    }
    offs
}

/// Runs the four kernels; returns per stream [`OUT_WORDS`] words, the short-stream bytes
/// ([`MID_MAX`] per stream) and the gathered samples.
fn launch<T>(dev: &CudaDevice, data: &CudaView<'_, T>, code: i32, esize: usize, streams: &[Stream], samples: &[u64]) -> candle_core::Result<(Vec<u64>, Vec<u8>, Vec<f32>)> {
    let ns = streams.len();
    let desc: Vec<u64> = streams.iter().flat_map(|s| [s.first, s.stride, s.seg, s.segs].map(|v| v as u64)).collect();
    let mut starts = vec![0u64];
    for s in streams {
        let len = s.elems() * esize;
        let full = if len > MID_MAX { super::xxh3_blocks::full_blocks(len) } else { 0 };
        starts.push(starts.last().copied().unwrap_or(0) + full as u64);
    }
    let blocks = starts[ns] as usize;
    let stream = dev.cuda_stream();
    let desc_d = stream.clone_htod(&desc).w()?;
    let starts_d = stream.clone_htod(&starts).w()?;
    let offs_d = stream.clone_htod(samples).w()?;
    let mut deltas = stream.alloc_zeros::<u64>(8 * blocks.max(1)).w()?;
    let mut lanes = stream.alloc_zeros::<f64>(40 * ns).w()?;
    let mut counts = stream.alloc_zeros::<u64>(24 * ns).w()?;
    let mut out = stream.alloc_zeros::<u64>(OUT_WORDS * ns).w()?;
    let mut short = stream.alloc_zeros::<u8>(MID_MAX * ns).w()?;
    let mut picked = stream.alloc_zeros::<u64>(samples.len().max(1)).w()?;
    let (esize, ns_i, wide) = (esize as u64, ns as i32, 1i32);
    let func = |name| dev.get_or_load_custom_func(name, MODULE, PTX);
    // SAFETY: every pointer is a live device allocation of the size each kernel indexes: the
    // tensor's contiguous bytes (streams address elements below `n`), 4 words per stream, `ns + 1`
    // block starts, 8 words per block, 40 doubles and 24 counts per stream, OUT_WORDS words and
    // MID_MAX bytes per stream, one offset and one u64 per sample.
    unsafe {
        if blocks > 0 {
            let f = func("ct_block_deltas")?;
            let mut b = f.builder();
            b.arg(data).arg(&esize).arg(&desc_d).arg(&ns_i).arg(&starts_d).arg(&mut deltas);
            b.launch(grid(blocks, 128)).w()?;
        }
        let f = func("ct_lane_stats")?;
        let mut b = f.builder();
        b.arg(data).arg(&code).arg(&desc_d).arg(&ns_i).arg(&mut lanes).arg(&mut counts);
        b.launch(grid(8 * ns, 128)).w()?;
        let f = func("ct_finish")?;
        let mut b = f.builder();
        b.arg(data).arg(&esize).arg(&desc_d).arg(&ns_i).arg(&wide).arg(&starts_d).arg(&deltas).arg(&lanes).arg(&counts).arg(&mut out).arg(&mut short);
        b.launch(grid(ns, 128)).w()?;
        let f = func("ct_gather")?;
        let n_samples = samples.len() as i32;
        let mut b = f.builder();
        b.arg(data).arg(&esize).arg(&offs_d).arg(&n_samples).arg(&mut picked);
        b.launch(grid(samples.len(), 128)).w()?;
    }
    let out = stream.clone_dtoh(&out).w()?;
    // The short-stream bytes cross only when some stream is short.
    let short = if streams.iter().any(|s| s.elems() * esize as usize <= MID_MAX) { stream.clone_dtoh(&short).w()? } else { Vec::new() };
    let picked: Vec<f32> = stream.clone_dtoh(&picked).w()?.into_iter().map(|bits| sample_value(code, bits)).collect();
    Ok((out, short, picked))
}

/// A sampled element's value from its raw bits (dtype `code` as [`summarize_cuda`] numbers them),
/// converted as the CPU summary converts it (`to_f64() as f32`): NaNs keep sign and payload.
fn sample_value(code: i32, bits: u64) -> f32 {
    match code {
        0 => f32::from_bits(bits as u32) as f64 as f32,
        1 => half::f16::from_bits(bits as u16).to_f64() as f32,
        2 => half::bf16::from_bits(bits as u16).to_f64() as f32,
        _ => f64::from_bits(bits) as f32,
    }
}

/// The [`Summary`] from the kernels' outputs (see [`launch`]).
fn assemble(n: usize, slices: &[crate::digest::streams::TokenStream], streams: &[Stream], esize: usize, outs: &[u64], short: &[u8], samples: &[f32]) -> candle_core::Result<Summary> {
    let stream_out = |i: usize, wide: bool| {
        let o = &outs[OUT_WORDS * i..OUT_WORDS * (i + 1)];
        let len = streams[i].elems() * esize;
        let digest = if len <= MID_MAX {
            let bytes = &short[MID_MAX * i..MID_MAX * i + len];
            if wide {
                candle_trace_format::hash::xxh3_128(bytes)
            } else {
                u128::from(candle_trace_format::hash::xxh3_64(bytes))
            }
        } else {
            (u128::from(o[1]) << 64) | u128::from(o[0])
        };
        let f = |k: usize| f64::from_bits(o[k]);
        StreamOut { digest, sum: f(2), sq: f(3), min: f(4), max: f(5), abs_max: f(6), nonfinite: [o[7], o[8], o[9]] }
    };
    let whole = stream_out(0, true);
    let tokens: Vec<TokenStat> = slices
        .iter()
        .enumerate()
        .map(|(j, s)| {
            let pick: [f32; 4] = samples[8 + 4 * j..12 + 4 * j].try_into().expect("4 samples");
            token_of(&stream_out(j + 1, false), s.row, s.pos, if s.stream.elems() == 0 { [0.0; 4] } else { pick })
        })
        .collect();
    let whole_samples = match tokens.as_slice() {
        [t] if slices[0].stream.elems() == n => t.samples.to_vec(),
        _ => samples[..n.min(8)].to_vec(),
    };
    Ok(Summary { digest: whole.digest, stats: stats_of(&whole, n), samples: whole_samples, tokens })
}

#[cfg(test)]
mod tests {
    use super::summarize_cuda;
    use crate::digest::device::tests::{assert_same, cases, values};
    use crate::digest::summarize_host;
    use candle_core::{DType, Device, Tensor};
    use candle_trace_format::record::{Rows, TokenAxis};

    /// On a GPU: the device summary equals the host summary of the same tensor, bit for bit, on
    /// every dtype the kernels take: the CPU reference's cases, with and without NaN/Inf, a
    /// 16 MiB tensor, and transposed views. Without a GPU it says so and passes, unless
    /// `CANDLE_TRACE_GPU_CHECK` is set (tools/gpu-check.sh).
    #[test]
    fn device_summary_equals_host_summary() -> candle_core::Result<()> {
        let dev = match Device::new_cuda(0) {
            Ok(d) => d,
            Err(e) if std::env::var_os("CANDLE_TRACE_GPU_CHECK").is_none() => {
                eprintln!("skipped: no CUDA device ({})", e.to_string().lines().next().unwrap_or(""));
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        let big = (vec![4, 1024, 1024], Some(TokenAxis { seq_dim: Some(1), first_pos: 0, keep_from: 0, causal: false }), Rows::default());
        for (dims, axis, rows) in cases().iter().chain([&big]) {
            let n: usize = dims.iter().product();
            for nonfinite in [false, true] {
                let cpu = Tensor::from_vec(values(n, nonfinite), dims.as_slice(), &Device::Cpu)?;
                for dt in [DType::F32, DType::F16, DType::BF16, DType::F64] {
                    let host = cpu.to_dtype(dt)?;
                    let gpu = host.to_device(&dev)?;
                    let what = format!("{dims:?} {axis:?} {dt:?} nonfinite={nonfinite}");
                    assert_same(&summarize_cuda(&gpu, axis.as_ref(), rows)?, &summarize_host(&host, axis.as_ref(), rows)?, &what);
                    if dims.len() == 3 {
                        let (tg, th) = (gpu.transpose(1, 2)?, host.transpose(1, 2)?);
                        assert_same(&summarize_cuda(&tg, None, rows)?, &summarize_host(&th, None, rows)?, &format!("{what} transposed"));
                    }
                }
            }
        }
        Ok(())
    }
}
