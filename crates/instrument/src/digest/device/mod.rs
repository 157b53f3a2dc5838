//! The summary as a GPU computes it, without copying the tensor to the host.
//!
//! The CPU summary ([`crate::digest::summarize`]) hashes and reduces each stream (the whole
//! tensor, each token slice) front to back. The device algorithm computes the *same bits* in a
//! form with parallel work:
//!
//! - **Digest.** XXH3 of a stream longer than 240 bytes as independent 1024-byte block deltas,
//!   then one ordered fold ([`xxh3_blocks`]). A stream of at most 240 bytes is copied out as is
//!   (no more bytes than its digest and stats) and hashed on the host.
//! - **Reductions.** Eight lanes per stream, lane `k` summing elements `k, k + 8, …` of the
//!   stream in order, in f64, finite values only, then lanes combined in order `0..8`: the order
//!   the CPU's lane loop uses, so the f64 sums agree bit for bit (the kernel must not contract
//!   `v * v + s` into a fused multiply-add).
//!
//! [`reference_summary`] runs the device algorithm on the CPU; the tests pin it to
//! [`crate::digest::summarize`] on f32, f16 and bf16 tensors with token axes, causal attention,
//! padded rows and non-finite values. Under the `cuda` feature, `cuda::summarize_cuda` runs it
//! on the device (`crates/instrument/kernels/digest.cu`); `tools/gpu-check.sh` compares the two there.

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod xxh3_blocks;

use super::streams::{token_streams, Stream};
use crate::digest::{Elem, Summary};
use candle_trace_format::record::{Rows, Stats, TokenAxis, TokenStat};
use xxh3_blocks::{Words, MID_MAX};

/// What the device returns for one stream: its digest and lane-combined reductions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StreamOut {
    /// XXH3 of the stream: 128-bit for the whole tensor, 64-bit (in the low half) for a token.
    pub digest: u128,
    /// Sum of the finite values, lanes combined in order.
    pub sum: f64,
    /// Sum of squares of the finite values, lanes combined in order (L2 is its square root).
    pub sq: f64,
    /// Smallest and largest finite value (`+inf`, `-inf` when none).
    pub min: f64,
    /// See `min`.
    pub max: f64,
    /// Largest |v| over the finite values (0 when none).
    pub abs_max: f64,
    /// NaN, +Inf and -Inf counts.
    pub nonfinite: [u64; 3],
}

/// The per-lane reductions of one stream, before lanes are combined.
#[derive(Clone, Copy)]
pub(crate) struct Lanes {
    sum: [f64; 8],
    sq: [f64; 8],
    min: [f64; 8],
    max: [f64; 8],
    abs_max: f64,
    nonfinite: [u64; 3],
}

impl Lanes {
    /// Lane `k` takes elements `k, k + 8, …` of the stream, in order; non-finite values are
    /// counted, not summed.
    fn of<T: Elem>(data: &[T], s: &Stream) -> Self {
        let mut l = Lanes { sum: [0.0; 8], sq: [0.0; 8], min: [f64::INFINITY; 8], max: [f64::NEG_INFINITY; 8], abs_max: 0.0, nonfinite: [0; 3] };
        for i in 0..s.elems() {
            let v = data[s.offset(i)].to_f64();
            let k = i % 8;
            if v.is_finite() {
                l.sum[k] += v;
                l.sq[k] += v * v;
                l.min[k] = l.min[k].min(v);
                l.max[k] = l.max[k].max(v);
                l.abs_max = l.abs_max.max(v.abs());
            } else {
                l.nonfinite[usize::from(!v.is_nan()) + usize::from(v < 0.0)] += 1;
            }
        }
        l
    }
    /// Lanes combined in order `0..8`, as the CPU summary combines them.
    fn combine(&self, digest: u128) -> StreamOut {
        let min = self.min.iter().copied().fold(f64::INFINITY, f64::min);
        let max = self.max.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        StreamOut { digest, sum: self.sum.iter().sum(), sq: self.sq.iter().sum(), min, max, abs_max: self.abs_max, nonfinite: self.nonfinite }
    }
}

/// The whole tensor's [`Stats`] from its stream's output (`count` elements).
pub fn stats_of(o: &StreamOut, count: usize) -> Stats {
    let mut stats = Stats { count: count as u64, sum: o.sum, l2: o.sq.sqrt(), nan: o.nonfinite[0], pos_inf: o.nonfinite[1], neg_inf: o.nonfinite[2], ..Stats::default() };
    if o.min <= o.max {
        stats.min = o.min;
        stats.max = o.max;
        stats.abs_max = o.min.abs().max(o.max.abs());
    }
    stats
}

/// A token slice's [`TokenStat`] from its stream's output.
pub fn token_of(o: &StreamOut, row: usize, pos: u32, samples: [f32; 4]) -> TokenStat {
    let nonfinite = o.nonfinite.iter().fold(0u64, |a, &n| a.saturating_add(n)).min(u64::from(u32::MAX)) as u32;
    TokenStat { row: row as u32, pos, digest: o.digest as u64, sum: o.sum, abs_max: o.abs_max, nonfinite, samples }
}

/// Element offsets (into the stream) of a token slice's 4 samples: `0, L/3, 2L/3, L-1`.
pub fn token_sample_offsets(len: usize) -> [usize; 4] {
    [0, len / 3, 2 * len / 3, len.saturating_sub(1)]
}

/// The bytes of a stream of elements of `esize` bytes over a contiguous buffer.
struct StreamBytes<'a> {
    bytes: &'a [u8],
    esize: usize,
    stream: Stream,
}

impl Words for StreamBytes<'_> {
    fn len(&self) -> usize {
        self.stream.elems() * self.esize
    }
    fn word(&self, at: usize) -> u64 {
        let mut w = [0u8; 8];
        for (j, b) in w.iter_mut().enumerate() {
            let (e, r) = ((at + j) / self.esize, (at + j) % self.esize);
            *b = self.bytes[self.stream.offset(e) * self.esize + r];
        }
        u64::from_le_bytes(w)
    }
}

/// XXH3 of a stream the device way: short streams copied out and hashed, long ones as block
/// deltas and a fold.
fn stream_digest(src: &StreamBytes<'_>, wide: bool) -> u128 {
    let len = src.len();
    if len <= MID_MAX {
        let bytes: Vec<u8> = (0..len).map(|j| src.bytes[src.stream.offset(j / src.esize) * src.esize + j % src.esize]).collect();
        return if wide { candle_trace_format::hash::xxh3_128(&bytes) } else { u128::from(candle_trace_format::hash::xxh3_64(&bytes)) };
    }
    let deltas: Vec<_> = (0..xxh3_blocks::full_blocks(len)).map(|b| xxh3_blocks::block_delta(src, b)).collect();
    let acc = xxh3_blocks::fold(src, deltas);
    if wide {
        xxh3_blocks::finish128(&acc, len)
    } else {
        u128::from(xxh3_blocks::finish64(&acc, len))
    }
}

/// The device algorithm run on the CPU (its reference): the [`Summary`] of tensor `t` (f32, f16,
/// bf16 or f64, any device and layout; copied to the CPU), equal to
/// [`crate::digest::summarize_rows`] bit for bit.
///
/// # Errors
/// Another dtype, and as [`token_streams`].
pub fn reference_summary(t: &candle_core::Tensor, axis: Option<&TokenAxis>, rows: &Rows) -> candle_core::Result<Summary> {
    fn run<T: Elem + candle_core::WithDType>(t: &candle_core::Tensor, axis: Option<&TokenAxis>, rows: &Rows) -> candle_core::Result<Summary> {
        let data: Vec<T> = t.flatten_all()?.to_device(&candle_core::Device::Cpu)?.to_vec1()?;
        summary_of(&data, t.dims(), axis, rows)
    }
    match t.dtype() {
        candle_core::DType::F32 => run::<f32>(t, axis, rows),
        candle_core::DType::F16 => run::<half::f16>(t, axis, rows),
        candle_core::DType::BF16 => run::<half::bf16>(t, axis, rows),
        candle_core::DType::F64 => run::<f64>(t, axis, rows),
        d => candle_core::bail!("the device digest takes f32, f16, bf16 and f64, not {}", d.as_str()),
    }
}

/// [`reference_summary`] of the contiguous elements `data` of shape `dims`.
fn summary_of<T: Elem>(data: &[T], dims: &[usize], axis: Option<&TokenAxis>, rows: &Rows) -> candle_core::Result<Summary> {
    let bytes: &[u8] = bytemuck::cast_slice(data);
    let esize = std::mem::size_of::<T>();
    let run = |stream: Stream, wide: bool| Lanes::of(data, &stream).combine(stream_digest(&StreamBytes { bytes, esize, stream }, wide));
    let n = data.len();
    let whole = run(Stream::whole(n), true);
    let slices = match axis {
        Some(axis) => token_streams(dims, axis, rows)?,
        None => Vec::new(),
    };
    let tokens: Vec<TokenStat> = slices
        .iter()
        .map(|t| {
            let offs = token_sample_offsets(t.stream.elems());
            let samples = if t.stream.elems() == 0 { [0.0; 4] } else { offs.map(|i| data[t.stream.offset(i)].to_f64() as f32) };
            token_of(&run(t.stream, false), t.row, t.pos, samples)
        })
        .collect();
    let samples = match tokens.as_slice() {
        [t] if slices[0].stream.elems() == n => t.samples.to_vec(),
        _ => crate::digest::sample_offsets(n, 8).map(|i| data[i].to_f64() as f32).collect(),
    };
    Ok(Summary { digest: whole.digest, stats: stats_of(&whole, n), samples, tokens })
}

#[cfg(test)]
pub(crate) mod tests;
