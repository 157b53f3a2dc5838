//! Bit-exact digests and f64 reductions of a tensor's *logical* values.
//!
//! A tensor is read in row-major order of its shape, whatever its strides, offset or device, and
//! its elements' native little-endian bytes are hashed with xxh3-128 (the whole tensor) or xxh3-64
//! (one batch row at one token position). Two tensors with the same dtype, shape and digest hold
//! the same bits. Alongside, one pass computes f64 reductions (sum, min, max, abs-max, L2 over the
//! finite values; NaN, +Inf, -Inf counts) and picks samples at fixed positions.
//!
//! Token alignment: for tensors with a batch axis (always dim 0) and a sequence axis, one
//! [`TokenStat`] is computed per (batch row, absolute token position), so that a whole-prompt
//! prefill compares with a chunked one and batch row 0 of a batch-4 run with a batch-1 run.
//! For attention scores and probabilities (`causal`), only keys `0..=p` of query position `p` are
//! digested: the masked tail depends on the chunk's kv length, not on the numbers.

pub mod device;
pub mod masked;
mod reduce;
pub mod streams;

use candle_core::{CpuStorage, Device, Storage, Tensor};
use candle_trace_format::hash::Xxh3_64;
pub use candle_trace_format::record::{key_span, slice_ranges, token_slice, Rows, Stats, TokenAxis, TokenStat};
use half::{bf16, f16};

/// Everything recorded about one tensor's values.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    /// xxh3-128 of the logical values' little-endian bytes.
    pub digest: u128,
    /// f64 reductions over every element.
    pub stats: Stats,
    /// Up to 8 values at evenly spaced logical offsets `i * (n - 1) / 7`; when the one token
    /// slice is the whole tensor, that slice's 4 samples instead.
    pub samples: Vec<f32>,
    /// Per-token digests and reductions, row then position; empty without a token axis.
    pub tokens: Vec<TokenStat>,
}

impl Summary {
    /// A summary of nothing, to be filled by the `_into` functions.
    pub fn empty() -> Self {
        Summary { digest: 0, stats: Stats::default(), samples: Vec::new(), tokens: Vec::new() }
    }
}

/// An element type whose values can be summarised (f32, f64, f16, bf16, u8, u32, i64).
pub trait Elem: Copy + bytemuck::Pod {
    /// The value as f64 (exact for every implementing type but i64 beyond 2⁵³).
    fn to_f64(self) -> f64;
    /// True for the half types, which [`Elem::widen`] converts to f32 in blocks before reducing.
    const HALF: bool = false;
    /// Half types: converts `xs` to f32 in `out` (exact; the `half` crate's vectorised slice
    /// conversion, much faster than one element at a time). Other types: nothing.
    fn widen(_xs: &[Self], _out: &mut [f32]) {}
}
impl Elem for f32 {
    fn to_f64(self) -> f64 {
        self as f64
    }
}
impl Elem for f64 {
    fn to_f64(self) -> f64 {
        self
    }
}
impl Elem for f16 {
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    const HALF: bool = true;
    fn widen(xs: &[Self], out: &mut [f32]) {
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(xs, out);
    }
}
impl Elem for bf16 {
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    const HALF: bool = true;
    /// bf16 is the top half of an f32: widening is a 16-bit shift, written here (rather than
    /// `half`'s slice conversion) so that it inlines into the vectorised pass.
    #[inline(always)]
    fn widen(xs: &[Self], out: &mut [f32]) {
        for (o, x) in out.iter_mut().zip(xs) {
            *o = f32::from_bits(u32::from(x.to_bits()) << 16);
        }
    }
}

/// Half-type values are widened to f32 in blocks of this many (a multiple of [`LANES`], so each
/// element keeps its lane).
const BLOCK: usize = 1024;

impl Elem for u32 {
    fn to_f64(self) -> f64 {
        self as f64
    }
}
impl Elem for u8 {
    fn to_f64(self) -> f64 {
        self as f64
    }
}
impl Elem for i64 {
    fn to_f64(self) -> f64 {
        self as f64
    }
}

/// Little-endian bytes of a slice: the slice itself on little-endian targets.
pub fn le_bytes<T: Elem>(xs: &[T]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        std::borrow::Cow::Borrowed(bytemuck::cast_slice(xs))
    } else {
        let mut out = Vec::with_capacity(std::mem::size_of_val(xs));
        for x in xs {
            let mut b = bytemuck::bytes_of(x).to_vec();
            b.reverse();
            out.extend_from_slice(&b);
        }
        std::borrow::Cow::Owned(out)
    }
}

/// Summarises a tensor: digest, reductions, samples, and per-token stats when `axis` is given.
///
/// The tensor may live on any device and have any layout; non-CPU tensors are copied to the CPU
/// and non-contiguous ones made contiguous first.
///
/// # Errors
/// Returns candle's error for unsupported dtypes (f8 and the packed types) or a `TokenAxis` that
/// does not fit the tensor's rank.
pub fn summarize(t: &Tensor, axis: Option<&TokenAxis>) -> candle_core::Result<Summary> {
    summarize_rows(t, axis, &Rows::default())
}

/// [`summarize`] for a batch of padded rows (see [`Rows`]). Under the `cuda` feature a CUDA
/// tensor is summarised on its device ([`device`]): the same bits, without copying
/// the tensor to the host.
///
/// # Errors
/// As [`summarize`].
pub fn summarize_rows(t: &Tensor, axis: Option<&TokenAxis>, rows: &Rows) -> candle_core::Result<Summary> {
    let mut s = Summary::empty();
    summarize_rows_into(t, axis, rows, &mut s)?;
    Ok(s)
}

/// [`summarize_rows`] into `out`, whose lists are cleared and refilled (their memory reused).
///
/// # Errors
/// As [`summarize`]; `out` then holds a partial summary.
pub fn summarize_rows_into(t: &Tensor, axis: Option<&TokenAxis>, rows: &Rows, out: &mut Summary) -> candle_core::Result<()> {
    #[cfg(feature = "cuda")]
    if t.device().is_cuda() {
        *out = device::cuda::summarize_cuda(t, axis, rows)?;
        return Ok(());
    }
    summarize_host_into(t, axis, rows, out)
}

/// [`summarize_rows`] of op `op`'s output, the per-token stats of attention scores and
/// probabilities also counting the values among their masked keys that poison what reads them
/// ([`masked`]): the summary every recorded op output gets.
///
/// # Errors
/// As [`summarize`], and [`masked::fold_masked_keys`]'.
pub fn summarize_op(t: &Tensor, axis: Option<&TokenAxis>, rows: &Rows, op: candle_trace_format::site::Op) -> candle_core::Result<Summary> {
    let mut s = Summary::empty();
    summarize_op_into(t, axis, rows, op, &mut s)?;
    Ok(s)
}

/// [`summarize_op`] into `out`, whose lists are cleared and refilled (their memory reused): the
/// tracer's path, which refills the lists of records already written.
///
/// # Errors
/// As [`summarize_op`]; `out` then holds a partial summary.
pub fn summarize_op_into(t: &Tensor, axis: Option<&TokenAxis>, rows: &Rows, op: candle_trace_format::site::Op, out: &mut Summary) -> candle_core::Result<()> {
    summarize_rows_into(t, axis, rows, out)?;
    if let Some(axis) = axis {
        masked::fold_masked_keys(out, t, axis, rows, masked::reads_masked_keys(op))?;
    }
    Ok(())
}

/// [`summarize_rows`] on the host: a tensor on another device is copied to the CPU first.
///
/// # Errors
/// As [`summarize`].
pub fn summarize_host(t: &Tensor, axis: Option<&TokenAxis>, rows: &Rows) -> candle_core::Result<Summary> {
    let mut s = Summary::empty();
    summarize_host_into(t, axis, rows, &mut s)?;
    Ok(s)
}

/// [`summarize_host`] into `out` (see [`summarize_rows_into`]).
///
/// # Errors
/// As [`summarize`].
pub fn summarize_host_into(t: &Tensor, axis: Option<&TokenAxis>, rows: &Rows, out: &mut Summary) -> candle_core::Result<()> {
    let copied;
    let t = if matches!(t.device(), Device::Cpu) {
        t
    } else {
        copied = t.to_device(&Device::Cpu)?;
        &copied
    };
    // `contiguous_offsets` says whether the layout is contiguous (candle's `is_contiguous`
    // allocates its strides each call: asked once).
    let (storage, layout) = t.storage_and_layout();
    if let Some((start, end)) = layout.contiguous_offsets() {
        return summarize_storage(&storage, start..end, t.dims(), axis, rows, out);
    }
    drop(storage);
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let offsets = layout.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("tensor is not contiguous".into()))?;
    summarize_storage(&storage, offsets.0..offsets.1, t.dims(), axis, rows, out)
}

/// [`summarize_host_into`] of the contiguous elements `at` of `storage`, shaped `dims`.
fn summarize_storage(storage: &Storage, at: std::ops::Range<usize>, dims: &[usize], axis: Option<&TokenAxis>, rows: &Rows, out: &mut Summary) -> candle_core::Result<()> {
    let cpu = match storage {
        Storage::Cpu(cpu) => cpu,
        _ => candle_core::bail!("tensor is not on the cpu"),
    };
    match cpu {
        CpuStorage::F32(v) => summarize_slice(&v[at], dims, axis, rows, out),
        CpuStorage::F16(v) => summarize_slice(&v[at], dims, axis, rows, out),
        CpuStorage::BF16(v) => summarize_slice(&v[at], dims, axis, rows, out),
        CpuStorage::F64(v) => summarize_slice(&v[at], dims, axis, rows, out),
        CpuStorage::U32(v) => summarize_slice(&v[at], dims, axis, rows, out),
        CpuStorage::U8(v) => summarize_slice(&v[at], dims, axis, rows, out),
        CpuStorage::I64(v) => summarize_slice(&v[at], dims, axis, rows, out),
        other => candle_core::bail!("cannot summarise dtype {}", candle_core::backend::BackendStorage::dtype(other).as_str()),
    }
}

fn summarize_slice<T: Elem>(data: &[T], dims: &[usize], axis: Option<&TokenAxis>, rows: &Rows, out: &mut Summary) -> candle_core::Result<()> {
    let (digest, stats) = reduce::hash_and_reduce(data);
    (out.digest, out.stats) = (digest, stats);
    out.tokens.clear();
    out.samples.clear();
    let one_whole_slice = match axis {
        None => false,
        Some(axis) => token_stats(data, dims, axis, rows, &out.stats, digest, &mut out.tokens)?,
    };
    // A record whose one token slice is the whole tensor (a batch-1 decode step) keeps that
    // slice's four samples as its own, so format 2 stores them once (docs/trace-format.md).
    match out.tokens.as_slice() {
        [t] if one_whole_slice => out.samples.extend_from_slice(&t.samples),
        _ => out.samples.extend(sample_offsets(data.len(), 8).map(|i| data[i].to_f64() as f32)),
    }
    Ok(())
}

/// Lanes of the reduction: element `i` is accumulated in lane `i % LANES`; lanes are combined in
/// order 0..LANES at the end. Independent lanes let the compiler vectorise the loop.
const LANES: usize = 8;

/// `k` evenly spaced offsets into `n` values (fewer when `n < k`).
pub(crate) fn sample_offsets(n: usize, k: usize) -> impl Iterator<Item = usize> {
    let m = n.min(k);
    (0..m).map(move |i| if m == 1 { 0 } else { i * (n - 1) / (m - 1) })
}

/// Accumulates one token slice that arrives in chunks. Small, so that making one a slice costs
/// little: a slice of several runs is hashed by a streaming hasher the caller keeps and resets
/// ([`TokenAcc::feed`]); a slice of one run in one call ([`TokenAcc::feed_all`]), which costs far
/// less for the short slices of a decode step.
struct TokenAcc<'s> {
    digest: Option<u64>,
    /// Finite values summed in [`LANES`] lanes by their index in the slice, combined in lane
    /// order at the end: the order [`reduce::hash_and_reduce`] uses, so a slice that is the whole tensor has the
    /// whole tensor's sum, bit for bit.
    sum: [f64; LANES],
    abs_max: f64,
    nonfinite: u32,
    seen: usize,
    targets: [usize; 4],
    samples: [f32; 4],
    /// The slice is the whole tensor, already reduced: hash and sample only, and take the sum,
    /// abs-max and non-finite count from the tensor's [`Stats`] (the same values: same lanes).
    whole: Option<&'s Stats>,
}

impl<'s> TokenAcc<'s> {
    /// An accumulator for a slice of `len` elements; `whole` holds the tensor's stats when the
    /// slice is every element of it.
    fn new(len: usize, whole: Option<&'s Stats>) -> Self {
        let last = len.saturating_sub(1);
        TokenAcc { whole, digest: None, sum: [0.0; LANES], abs_max: 0.0, nonfinite: 0, seen: 0, targets: [0, len / 3, 2 * len / 3, last], samples: [0.0; 4] }
    }
    /// Feeds the whole slice at once.
    fn feed_all<T: Elem>(&mut self, slice: &[T]) {
        self.digest = Some(candle_trace_format::hash::xxh3_64(&le_bytes(slice)));
        self.accumulate(slice);
    }
    /// Feeds the next run of the slice, hashing it with `hasher` (reset before the slice's
    /// first run; its digest is the slice's, [`TokenAcc::finish`]).
    fn feed<T: Elem>(&mut self, hasher: &mut Xxh3_64, chunk: &[T]) {
        hasher.update(&le_bytes(chunk));
        self.accumulate(chunk);
    }
    fn accumulate<T: Elem>(&mut self, chunk: &[T]) {
        for (k, &target) in self.targets.iter().enumerate() {
            if target >= self.seen && target < self.seen + chunk.len() {
                self.samples[k] = chunk[target - self.seen].to_f64() as f32;
            }
        }
        if self.whole.is_some() {
            self.seen += chunk.len();
            return;
        }
        // Lane `(seen + i) % LANES` for element `i` of the chunk. An all-finite run aligned to
        // the lanes (the common case: slices of whole rows of a hidden size divisible by 8)
        // takes a branch-free lane loop the compiler vectorises; the rest, element by element.
        let skip = (LANES - self.seen % LANES) % LANES;
        let (head, rest) = chunk.split_at(skip.min(chunk.len()));
        self.feed_slow(head, self.seen);
        let body = rest.len() / LANES * LANES;
        let (mid, tail) = rest.split_at(body);
        let at = self.seen + head.len();
        if T::HALF {
            let mut buf = [0f32; BLOCK];
            for (i, block) in mid.chunks(BLOCK).enumerate() {
                let out = &mut buf[..block.len()];
                T::widen(block, out);
                self.feed_aligned(out, at + i * BLOCK);
            }
        } else {
            self.feed_aligned(mid, at);
        }
        self.feed_slow(tail, self.seen + head.len() + mid.len());
        self.seen += chunk.len();
    }
    /// Reduces `xs` (a multiple of [`LANES`] long), whose first element is element `at` of the
    /// slice, `at` a multiple of [`LANES`]: all finite, in the vectorised lane loop; else one by one.
    fn feed_aligned<E: Elem>(&mut self, xs: &[E], at: usize) {
        if !reduce::add_token_run(&mut self.sum, &mut self.abs_max, xs) {
            self.feed_slow(xs, at);
        }
    }

    /// Reduces `xs`, whose first element is element `at` of the slice, one by one.
    fn feed_slow<T: Elem>(&mut self, xs: &[T], at: usize) {
        for (i, &x) in xs.iter().enumerate() {
            let v = x.to_f64();
            if v.is_finite() {
                self.sum[(at + i) % LANES] += v;
                self.abs_max = self.abs_max.max(v.abs());
            } else {
                self.nonfinite += 1;
            }
        }
    }

    /// The slice's stats; `hasher` holds its runs when it was fed run by run.
    fn finish(&self, hasher: &Xxh3_64, row: usize, pos: u32) -> TokenStat {
        let digest = self.digest.unwrap_or_else(|| hasher.digest());
        if let Some(s) = self.whole {
            let nonfinite = s.nan.saturating_add(s.pos_inf).saturating_add(s.neg_inf).min(u32::MAX as u64) as u32;
            return TokenStat { row: row as u32, pos, digest, sum: s.sum, abs_max: s.abs_max, nonfinite, samples: self.samples };
        }
        TokenStat { row: row as u32, pos, digest, sum: self.sum.iter().sum(), abs_max: self.abs_max, nonfinite: self.nonfinite, samples: self.samples }
    }
}

/// Appends the per-token stats of `data` (shape `dims`) to `out`; returns whether the one slice
/// is the whole tensor. `stats` and `digest` are the whole tensor's: a slice that is the whole
/// tensor takes its sum, abs-max and non-finite count, and over 240 bytes its xxh3-64 digest is
/// the low half of the tensor's xxh3-128 one (XXH3's long inputs end with the same accumulator
/// merge for both widths; `tests::whole_slice_digest_is_the_low_half_over_240_bytes`), so it is
/// not hashed again.
fn token_stats<T: Elem>(data: &[T], dims: &[usize], axis: &TokenAxis, rows: &Rows, stats: &Stats, digest: u128, out: &mut Vec<TokenStat>) -> candle_core::Result<bool> {
    // A slice as long as the tensor is the whole tensor (and then the only slice).
    let mut one_whole = false;
    let mut hasher = Xxh3_64::new();
    // Room for a slice per row and position kept at once (a prefill record's list grows to
    // hundreds of entries; doubling it would copy them and touch new pages each time). A KV
    // cache keeps only the positions this pass wrote (`keep_from`), not its whole length.
    let positions = axis.seq_dim.and_then(|d| dims.get(d as usize)).copied().unwrap_or(1);
    let kept = positions.saturating_sub(axis.keep_from.saturating_sub(axis.first_pos) as usize);
    out.reserve(dims.first().copied().unwrap_or(0).saturating_mul(kept).min(candle_trace_format::limits::MAX_TOKEN_STATS));
    streams::each_token_stream(dims, axis, rows, |t| {
        let len = t.stream.elems();
        let whole = len == data.len();
        one_whole |= whole;
        let mut acc = TokenAcc::new(len, whole.then_some(stats));
        if whole && std::mem::size_of_val(data) > 240 {
            acc.digest = Some(digest as u64);
            acc.accumulate(data);
        } else if t.stream.segs == 1 {
            acc.feed_all(&data[t.stream.first..t.stream.first + len]);
        } else {
            hasher.reset();
            for run in t.stream.runs() {
                acc.feed(&mut hasher, &data[run]);
            }
        }
        out.push(acc.finish(&hasher, t.row, t.pos));
    })?;
    Ok(one_whole)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Tensor};

    /// A slice that is the whole tensor (batch 1, one position) takes the tensor's sum, abs-max
    /// and non-finite count without reducing again: the same bits a full per-slice reduction
    /// gives (row 1 of a batch of 2 holding the same values goes through the full path).
    #[test]
    fn whole_slice_shortcut_matches_the_full_reduction() -> candle_core::Result<()> {
        for tail in [vec![], vec![f32::NAN, f32::INFINITY]] {
            let v: Vec<f32> = (0..37).map(|i| ((i * 7919) % 101) as f32 * 0.37 - 11.0).chain(tail.iter().copied()).collect();
            let n = v.len();
            let axis = TokenAxis { seq_dim: Some(1), first_pos: 4, keep_from: 0, causal: false };
            let one = summarize(&Tensor::from_vec(v.clone(), (1, 1, n), &Device::Cpu)?, Some(&axis))?;
            // Row 1 starts at an offset that is not a multiple of 8 (n = 37 or 39): the lane
            // loop's unaligned head, body and tail all run.
            let two = summarize(&Tensor::from_vec([vec![0f32; n], v].concat(), (2, 1, n), &Device::Cpu)?, Some(&axis))?;
            let (a, b) = (&one.tokens[0], &two.tokens[1]);
            assert_eq!((a.digest, a.sum.to_bits(), a.abs_max.to_bits(), a.nonfinite, a.samples), (b.digest, b.sum.to_bits(), b.abs_max.to_bits(), b.nonfinite, b.samples));
            assert_eq!((a.sum.to_bits(), a.nonfinite), (one.stats.sum.to_bits(), tail.len() as u32));
        }
        Ok(())
    }

    /// Half types are widened to f32 in blocks before reducing: the reductions equal those of
    /// the same values held as f32, whole and per token, across block boundaries and NaNs.
    #[test]
    fn half_types_reduce_as_their_f32_values() -> candle_core::Result<()> {
        let v: Vec<f32> = (0..3001).map(|i| if i == 2500 { f32::NAN } else { ((i * 37) % 211) as f32 * 0.125 - 13.0 }).collect();
        let axis = TokenAxis { seq_dim: Some(1), first_pos: 0, keep_from: 0, causal: false };
        for dt in [DType::F16, DType::BF16] {
            let h = Tensor::from_vec(v.clone(), (1, 1, 3001), &Device::Cpu)?.to_dtype(dt)?;
            let f = h.to_dtype(DType::F32)?;
            let h2 = h.reshape((1, 3001, 1))?.broadcast_as((1, 3001, 3))?.contiguous()?.reshape((1, 9003))?.reshape((1, 3, 3001))?;
            let f2 = h2.to_dtype(DType::F32)?;
            for (a, b) in [(summarize(&h, None)?, summarize(&f, None)?), (summarize(&h2, Some(&axis))?, summarize(&f2, Some(&axis))?)] {
                let bits = |s: &Stats| [s.sum, s.l2, s.min, s.max, s.abs_max].map(f64::to_bits);
                assert_eq!(bits(&a.stats), bits(&b.stats), "{dt:?}");
                assert!(a.stats.nan >= 1 && a.stats.nan == b.stats.nan, "{dt:?}");
                for (x, y) in a.tokens.iter().zip(&b.tokens) {
                    assert_eq!((x.sum.to_bits(), x.abs_max.to_bits(), x.nonfinite), (y.sum.to_bits(), y.abs_max.to_bits(), y.nonfinite), "{dt:?}");
                }
            }
        }
        Ok(())
    }

    /// A batch-1 decode step's one token slice is the whole tensor: over 240 bytes its xxh3-64
    /// digest is the low half of the tensor's xxh3-128 one, which format 2.4 then does not
    /// store again (`candle_trace_format`'s compact records); at 240 bytes and under, XXH3's
    /// short paths differ, and the writer stores it.
    #[test]
    fn whole_slice_digest_is_the_low_half_over_240_bytes() -> candle_core::Result<()> {
        let axis = TokenAxis { seq_dim: Some(1), first_pos: 3, keep_from: 0, causal: false };
        for n in [16usize, 60, 61, 121, 576, 5000] {
            let v: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let t = Tensor::from_vec(v.clone(), (1, 1, n), &Device::Cpu)?;
            // f32, f16 (two bytes a value) and u8 (one): over 240 bytes the slice's digest is
            // taken from the tensor's, not hashed again; it must still be the slice's xxh3-64,
            // as a slice that is not the whole tensor (row 1 of a batch of two) gets it.
            for t in [t.clone(), t.to_dtype(candle_core::DType::F16)?, (t.abs()? * 100.0)?.to_dtype(candle_core::DType::U8)?] {
                let s = summarize(&t, Some(&axis))?;
                let bytes = t.dtype().size_in_bytes() * n;
                assert_eq!(s.tokens[0].digest == s.digest as u64, bytes > 240, "{n} {:?} values", t.dtype());
                let own = match t.dtype() {
                    candle_core::DType::F32 => candle_trace_format::hash::xxh3_64(bytemuck::cast_slice(&t.flatten_all()?.to_vec1::<f32>()?)),
                    candle_core::DType::F16 => candle_trace_format::hash::xxh3_64(bytemuck::cast_slice(&t.flatten_all()?.to_vec1::<half::f16>()?)),
                    _ => candle_trace_format::hash::xxh3_64(&t.flatten_all()?.to_vec1::<u8>()?),
                };
                assert_eq!(s.tokens[0].digest, own, "{n} {:?} values", t.dtype());
                let two = summarize(&Tensor::cat(&[&t.zeros_like()?, &t], 0)?, Some(&axis))?;
                assert_eq!(two.tokens[1].digest, own, "{n} {:?} values, row 1 of 2", t.dtype());
            }
        }
        Ok(())
    }

    /// A KV cache's record keeps a slice for each position the pass wrote, not for its whole
    /// length: its list is sized for those (a decode step's cache record of 600 positions
    /// holds one entry and has room for a few, not 600).
    #[test]
    fn a_cache_record_has_room_for_the_positions_it_keeps() -> candle_core::Result<()> {
        let t = Tensor::ones((1, 3, 600, 8), DType::F32, &Device::Cpu)?;
        for (keep_from, kept) in [(599, 1usize), (590, 10), (0, 600)] {
            let axis = TokenAxis { seq_dim: Some(2), first_pos: 0, keep_from, causal: false };
            let s = summarize(&t, Some(&axis))?;
            assert_eq!(s.tokens.len(), kept);
            assert!(s.tokens.capacity() <= kept.max(4), "room for {} entries, {kept} kept", s.tokens.capacity());
        }
        Ok(())
    }

    #[test]
    fn digest_ignores_layout() -> candle_core::Result<()> {
        let a = Tensor::arange(0f32, 24., &Device::Cpu)?.reshape((2, 3, 4))?;
        let t = a.transpose(1, 2)?; // non-contiguous view
        let c = t.contiguous()?;
        assert_eq!(summarize(&t, None)?.digest, summarize(&c, None)?.digest);
        assert_ne!(summarize(&a, None)?.digest, summarize(&c, None)?.digest);
        Ok(())
    }

    #[test]
    fn stats_count_nonfinite() -> candle_core::Result<()> {
        let t = Tensor::new(&[1f32, -3.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 2.0], &Device::Cpu)?;
        let s = summarize(&t, None)?.stats;
        assert_eq!((s.nan, s.pos_inf, s.neg_inf, s.count), (1, 1, 1, 6));
        assert_eq!((s.sum, s.min, s.max, s.abs_max), (0.0, -3.0, 2.0, 3.0));
        assert_eq!(s.l2, 14f64.sqrt());
        assert_eq!(s.mean(), 0.0);
        Ok(())
    }

    #[test]
    fn per_token_digests_align_chunks() -> candle_core::Result<()> {
        // [batch 1, seq 4, 3]: positions 0..4 in one tensor vs positions 2..4 in another.
        let whole = Tensor::arange(0f32, 12., &Device::Cpu)?.reshape((1, 4, 3))?;
        let tail = whole.narrow(1, 2, 2)?;
        let ax = |first| TokenAxis { seq_dim: Some(1), first_pos: first, keep_from: 0, causal: false };
        let w = summarize(&whole, Some(&ax(0)))?.tokens;
        let t = summarize(&tail, Some(&ax(2)))?.tokens;
        assert_eq!(w.len(), 4);
        assert_eq!(t.len(), 2);
        assert_eq!(w[2], t[0]);
        assert_eq!(w[3], t[1]);
        assert_ne!(w[0].digest, w[1].digest);
        assert_eq!(w[3].samples, [9.0, 10.0, 11.0, 11.0]);
        Ok(())
    }

    #[test]
    fn causal_digest_ignores_masked_tail() -> candle_core::Result<()> {
        // scores [1 batch, 1 head, 2 queries, kv]: same causal part, different masked tail.
        let a = Tensor::new(&[[[[1f32, 9.0, 9.0], [2.0, 3.0, 9.0]]]], &Device::Cpu)?;
        let b = Tensor::new(&[[[[1f32, 0.0], [2.0, 3.0]]]], &Device::Cpu)?;
        let ax = TokenAxis { seq_dim: Some(2), first_pos: 0, keep_from: 0, causal: true };
        let sa = summarize(&a, Some(&ax))?.tokens;
        let sb = summarize(&b, Some(&ax))?.tokens;
        assert_eq!(sa, sb);
        Ok(())
    }

    #[test]
    fn dtypes_hash_native_bits() -> candle_core::Result<()> {
        let a = Tensor::new(&[1f32, 2.0], &Device::Cpu)?;
        let h = a.to_dtype(DType::F16)?;
        let expect = candle_trace_format::hash::xxh3_128(&[0x00, 0x3c, 0x00, 0x40]);
        assert_eq!(summarize(&h, None)?.digest, expect);
        Ok(())
    }
}
