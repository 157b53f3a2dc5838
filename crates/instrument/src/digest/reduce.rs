//! The whole-tensor pass: the xxh3-128 digest and the f64 reductions of a contiguous slice,
//! computed together in one read of the data.
//!
//! The data is read in chunks of [`CHUNK_BYTES`]: each chunk is hashed (streaming xxh3, the same
//! digest as the one-shot `xxh3_128` of the whole slice) and reduced while it is in the L1/L2
//! cache, and the next chunk is prefetched meanwhile, so the tensor crosses the memory bus once.
//! The reduction loop is compiled three times (x86-64 baseline, AVX2, AVX-512F) and picked at run
//! time; every variant does the same IEEE operations in the same order (Rust never contracts
//! `a * b + c` into an FMA), so the bits do not depend on the CPU
//! (`reduce::tests::variants_agree_bit_for_bit`).
//!
//! Reduction order, which fixes the bits of `sum` and `l2`: element `i` is accumulated in lane
//! `i % LANES`, and the lanes are added in order 0..LANES at the end. The CUDA kernels
//! (`kernels/digest.cu`) and [`super::device::reference_summary`] follow the same order.

use super::{Elem, Stats, BLOCK, LANES};
use candle_trace_format::hash::{xxh3_128, Xxh3_128};

/// Bytes of data hashed and reduced at a time: small enough to stay in L1 between the hash and
/// the reduction (8 KiB measured best on 64 MiB f32 tensors, against 2 to 32 KiB).
const CHUNK_BYTES: usize = 8 << 10;

/// Lane-wise f64 accumulators over all-finite data: element `i` of what is added goes to lane
/// `i % LANES`, so every call but the last must add a multiple of [`LANES`] values.
#[derive(Clone, Copy)]
pub(super) struct Lanes {
    pub(super) sum: [f64; LANES],
    pub(super) sq: [f64; LANES],
    pub(super) min: [f64; LANES],
    pub(super) max: [f64; LANES],
}

impl Default for Lanes {
    fn default() -> Self {
        Lanes { sum: [0.0; LANES], sq: [0.0; LANES], min: [f64::INFINITY; LANES], max: [f64::NEG_INFINITY; LANES] }
    }
}

impl Lanes {
    /// The lane loop. `min`/`max` are [`min_first`]/[`max_first`] (one vector instruction
    /// each); NaN or ±Inf make `sq` non-finite, and [`Lanes::add_chunk`] then reduces that chunk
    /// again with the finite-only loop, so no per-element finiteness test is needed here.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // lane k of each chunk: the indexed form vectorises
    fn add_any<E: Elem>(&mut self, xs: &[E]) {
        let chunks = xs.chunks_exact(LANES);
        let tail = chunks.remainder();
        for c in chunks {
            for k in 0..LANES {
                self.one(k, c[k].to_f64());
            }
        }
        for (k, x) in tail.iter().enumerate() {
            self.one(k, x.to_f64());
        }
    }

    #[inline(always)]
    fn one(&mut self, k: usize, v: f64) {
        self.sum[k] += v;
        self.sq[k] += v * v;
        self.min[k] = min_first(self.min[k], v);
        self.max[k] = max_first(self.max[k], v);
    }

    /// Adds `xs`, widening half types to f32 in blocks of [`BLOCK`] first, with the widest
    /// vector unit this CPU has.
    fn add_widened<T: Elem>(&mut self, xs: &[T]) {
        widest(AddLanes { lanes: self, xs, counts: None })
    }

    /// Adds the next chunk of a slice (a multiple of [`LANES`] long, but for the last): with the
    /// lane loop while every value so far was finite, else with the finite-only loop, which
    /// `counts` then holds the counts of (`Some` from the first chunk holding NaN or ±Inf on). A
    /// chunk that makes the lanes non-finite is added again from the lanes before it, finite
    /// only. The bits are those of the finite-only loop over the whole slice: on finite values
    /// both loops do the same operations in the same order.
    fn add_chunk<T: Elem>(&mut self, counts: &mut Option<Counts>, xs: &[T]) {
        if counts.is_none() {
            let before = *self;
            self.add_widened(xs);
            if self.all_finite() {
                return;
            }
            *self = before;
        }
        let c = counts.get_or_insert([[0; LANES]; 3]);
        widest(AddLanes { lanes: self, xs, counts: Some(c) });
    }

    /// The finite-only lane loop: adds the finite values of `xs` as [`Lanes::add_any`] adds
    /// them and counts the others in `counts` (NaN, +Inf, -Inf, per lane). Branch-free within a
    /// group of [`LANES`] values, so it vectorises: a value that is not finite adds +0 to `sum`
    /// and `sq`, which leaves them as they were (they start at +0 and, in round-to-nearest,
    /// never become -0), and offers +Inf to `min` and -Inf to `max`, which never win. So a
    /// group that is all finite takes the plain lane step, and one that is all -Inf (a causal
    /// mask's fill: half of every masked attention row) only counts: the same bits, for about
    /// half the work on a masked tensor.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // lane k of each chunk: the indexed form vectorises
    fn add_finite<E: Elem>(&mut self, counts: &mut Counts, xs: &[E]) {
        // Locals, not `self` and `counts` through their references: the loop then keeps every
        // accumulator in a register (2.3 -> 3.8 GB/s on masked f32 in `cargo bench --bench digest`).
        let (mut l, mut n) = (*self, *counts);
        let chunks = xs.chunks_exact(LANES);
        let tail = chunks.remainder();
        for c in chunks {
            let v: [f64; LANES] = std::array::from_fn(|k| c[k].to_f64());
            if v.iter().all(|x| x.is_finite()) {
                for k in 0..LANES {
                    l.one(k, v[k]);
                }
            } else if v.iter().all(|&x| x == f64::NEG_INFINITY) {
                for k in 0..LANES {
                    n[2][k] += 1;
                }
            } else {
                for k in 0..LANES {
                    l.one_counted(&mut n, k, v[k]);
                }
            }
        }
        for (k, x) in tail.iter().enumerate() {
            l.one_counted(&mut n, k, x.to_f64());
        }
        (*self, *counts) = (l, n);
    }

    #[inline(always)]
    fn one_counted(&mut self, counts: &mut Counts, k: usize, v: f64) {
        let finite = v.is_finite();
        let z = if finite { v } else { 0.0 };
        self.sum[k] += z;
        self.sq[k] += z * z;
        self.min[k] = min_first(self.min[k], if finite { v } else { f64::INFINITY });
        self.max[k] = max_first(self.max[k], if finite { v } else { f64::NEG_INFINITY });
        counts[0][k] += u64::from(v.is_nan());
        counts[1][k] += u64::from(v == f64::INFINITY);
        counts[2][k] += u64::from(v == f64::NEG_INFINITY);
    }

    /// True when every value added was finite: a NaN makes its lane's `sq` NaN and an ±Inf
    /// makes it +Inf for good. (A finite f64 whose square overflows also answers false; the
    /// finite-only loop then gives the same sums this one did.)
    fn all_finite(&self) -> bool {
        self.sq.iter().all(|s| s.is_finite())
    }
}

/// A loop to compile for several instruction sets: [`widest`] runs it with the widest one.
trait Pass {
    type Out;
    /// The loop; `#[inline(always)]` in every impl, so that it is compiled into each of
    /// [`widest`]'s target-feature functions (a closure would be a separate baseline function).
    fn run(self) -> Self::Out;
}

/// The smaller of the running minimum `m` and `v`, `m` on a tie: of a ±0 tie the zero seen first
/// wins, on every CPU. (`f64::min` leaves the sign of a ±0 tie to the platform: x86-64 keeps the
/// first argument, aarch64's FMINNM prefers -0; the x86-64 result is this one, as recorded before
/// this function existed.)
#[inline(always)]
pub(super) fn min_first(m: f64, v: f64) -> f64 {
    if v < m {
        v
    } else {
        m
    }
}

/// The larger of the running maximum `m` and `v`, `m` on a tie (see [`min_first`]).
#[inline(always)]
pub(super) fn max_first(m: f64, v: f64) -> f64 {
    if v > m {
        v
    } else {
        m
    }
}

/// Runs `pass` compiled for the widest vector unit this CPU has (AVX-512F, AVX2, else the x86-64
/// baseline; other targets: their baseline). The arithmetic is the same on every path.
fn widest<P: Pass>(pass: P) -> P::Out {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        fn avx512<P: Pass>(pass: P) -> P::Out {
            pass.run()
        }
        #[target_feature(enable = "avx2")]
        fn avx2<P: Pass>(pass: P) -> P::Out {
            pass.run()
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F, checked on the line above.
            return unsafe { avx512(pass) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, checked on the line above.
            return unsafe { avx2(pass) };
        }
    }
    pass.run()
}

// A half type's blocks start at multiples of the lane count, so an element's lane is its index
// in the whole slice modulo LANES, widened or not.
const _: () = assert!(BLOCK.is_multiple_of(LANES));

/// Per lane: NaNs, +Infs and -Infs seen by [`Lanes::add_finite`].
type Counts = [[u64; LANES]; 3];

/// [`Lanes::add_any`] (or, given counts, [`Lanes::add_finite`]) as a [`Pass`], half types
/// widened to f32 in blocks of [`BLOCK`] first.
struct AddLanes<'a, E> {
    lanes: &'a mut Lanes,
    xs: &'a [E],
    counts: Option<&'a mut Counts>,
}

impl<E: Elem> AddLanes<'_, E> {
    #[inline(always)]
    fn add<F: Elem>(lanes: &mut Lanes, counts: &mut Option<&mut Counts>, xs: &[F]) {
        match counts {
            Some(c) => lanes.add_finite(c, xs),
            None => lanes.add_any(xs),
        }
    }
}

impl<E: Elem> Pass for AddLanes<'_, E> {
    type Out = ();
    #[inline(always)]
    fn run(mut self) {
        if E::HALF {
            let mut buf = [0f32; BLOCK];
            for block in self.xs.chunks(BLOCK) {
                let out = &mut buf[..block.len()];
                E::widen(block, out);
                Self::add(self.lanes, &mut self.counts, out);
            }
        } else {
            Self::add(self.lanes, &mut self.counts, self.xs)
        }
    }
}

/// The per-token lane loop as a [`Pass`]: lane sums continued from `sum`, and lane abs-maxima.
struct TokenRun<'a, E> {
    sum: [f64; LANES],
    xs: &'a [E],
}

impl<E: Elem> Pass for TokenRun<'_, E> {
    type Out = ([f64; LANES], [f64; LANES]);
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // lane k of each chunk: the indexed form vectorises
    fn run(self) -> Self::Out {
        let (mut s, mut m) = (self.sum, [0f64; LANES]);
        for c in self.xs.chunks_exact(LANES) {
            for k in 0..LANES {
                let v = c[k].to_f64();
                s[k] += v;
                let a = v.abs();
                m[k] = if a > m[k] { a } else { m[k] };
            }
        }
        (s, m)
    }
}

/// Adds the all-finite run `xs` to a token slice's lane sums and abs-max; `xs` is a multiple of
/// [`LANES`] long and its first element falls in lane 0. Returns false, changing nothing, when
/// `xs` holds NaN or ±Inf (then the caller reduces it element by element): a non-finite value
/// makes its lane's sum non-finite for good, so one test at the end replaces one per element.
pub(super) fn add_token_run<E: Elem>(sum: &mut [f64; LANES], abs_max: &mut f64, xs: &[E]) -> bool {
    let (s, m) = widest(TokenRun { sum: *sum, xs });
    if !s.iter().all(|x| x.is_finite()) {
        return false;
    }
    *sum = s;
    *abs_max = m.iter().copied().fold(*abs_max, f64::max);
    true
}

/// The xxh3-128 digest of `data`'s little-endian bytes and its f64 reductions (see [`Stats`]),
/// in one pass over the data. All-finite data (the common case) takes the branch-free lane loop;
/// from the first chunk holding NaN or ±Inf on, a finite-only loop in the same lane order
/// ([`Lanes::add_chunk`]), which also counts the NaNs and infinities.
pub(super) fn hash_and_reduce<T: Elem>(data: &[T]) -> (u128, Stats) {
    let (mut l, mut counts) = (Lanes::default(), None);
    let per_chunk = CHUNK_BYTES / std::mem::size_of::<T>().max(1);
    let digest = if data.len() <= per_chunk {
        l.add_chunk(&mut counts, data);
        xxh3_128(&super::le_bytes(data))
    } else {
        let mut hasher = Xxh3_128::new();
        let mut chunks = data.chunks(per_chunk).peekable();
        while let Some(chunk) = chunks.next() {
            if let Some(next) = chunks.peek() {
                prefetch(next);
            }
            hasher.update(&super::le_bytes(chunk));
            l.add_chunk(&mut counts, chunk);
        }
        hasher.digest()
    };
    (digest, stats_of(l, counts, data.len()))
}

/// Asks the CPU to start loading `xs` into the cache (a hint: no effect on results).
fn prefetch<T>(xs: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        let bytes = std::mem::size_of_val(xs);
        let p = xs.as_ptr().cast::<i8>();
        for off in (0..bytes).step_by(64) {
            // SAFETY: `off < bytes`, so `p + off` points into `xs`; a prefetch reads nothing
            // architecturally and cannot fault.
            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.add(off)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = xs;
}

/// [`Stats`] of `count` values from the lanes of [`Lanes::add_chunk`] and its NaN, +Inf and
/// -Inf counts (`None`: none).
fn stats_of(l: Lanes, counts: Option<Counts>, count: usize) -> Stats {
    let mut stats = Stats { count: count as u64, ..Stats::default() };
    if let Some(c) = counts {
        [stats.nan, stats.pos_inf, stats.neg_inf] = c.map(|c| c.iter().sum());
    }
    let Lanes { sum, sq, min, max } = l;
    let (lo, hi) = (min.iter().copied().fold(f64::INFINITY, min_first), max.iter().copied().fold(f64::NEG_INFINITY, max_first));
    if lo <= hi {
        stats.min = lo;
        stats.max = hi;
        stats.abs_max = lo.abs().max(hi.abs());
    }
    stats.sum = sum.iter().sum();
    stats.l2 = sq.iter().sum::<f64>().sqrt();
    stats
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in about [-20, 20] with ±0 among them.
    fn values(n: usize) -> Vec<f32> {
        (0..n).map(|i| if i % 101 == 3 { -0.0 } else { ((i as u64).wrapping_mul(2_654_435_761) % 40_001) as f32 / 1000.0 - 20.0 }).collect()
    }

    /// The baseline lane loop and the widest one this CPU has give the same bits.
    #[test]
    fn variants_agree_bit_for_bit() {
        let v = values(10_007);
        let bits = |l: &Lanes| [l.sum, l.sq, l.min, l.max].map(|a| a.map(f64::to_bits));
        let mut base = Lanes::default();
        base.add_any(&v);
        let mut best = Lanes::default();
        best.add_widened(&v);
        assert_eq!(bits(&base), bits(&best));
    }

    /// The element-by-element finite-only reduction (the loop [`Lanes::add_finite`] replaced):
    /// lane sums, squares, minima and maxima of the finite values, and the NaN, +Inf, -Inf
    /// counts.
    fn element_loop<T: Elem>(data: &[T]) -> ([[u64; LANES]; 4], [u64; 3]) {
        let mut l = Lanes::default();
        let mut n = [0u64; 3];
        for (i, x) in data.iter().enumerate() {
            let (v, k) = (x.to_f64(), i % LANES);
            if v.is_finite() {
                l.sum[k] += v;
                l.sq[k] += v * v;
                l.min[k] = min_first(l.min[k], v);
                l.max[k] = max_first(l.max[k], v);
            } else if v.is_nan() {
                n[0] += 1;
            } else if v > 0.0 {
                n[1] += 1;
            } else {
                n[2] += 1;
            }
        }
        ([l.sum, l.sq, l.min, l.max].map(|a| a.map(f64::to_bits)), n)
    }

    /// The vectorised finite-only pass gives the element loop's bits and counts, for every
    /// element type that takes it, at lengths around the lanes and the half types' blocks, with
    /// NaN, ±Inf and ±0 in every lane and a tail.
    #[test]
    fn finite_only_pass_matches_the_element_loop() {
        let odd = |i: usize| -> f64 {
            match i % 13 {
                2 => f64::NAN,
                5 => f64::INFINITY,
                7 => f64::NEG_INFINITY,
                9 => -0.0,
                11 => 0.0,
                _ => ((i as u64).wrapping_mul(2_654_435_761) % 40_001) as f64 / 1000.0 - 20.0,
            }
        };
        fn check<T: Elem>(data: &[T]) {
            let (mut l, mut c) = (Lanes::default(), [[0u64; LANES]; 3]);
            widest(AddLanes { lanes: &mut l, xs: data, counts: Some(&mut c) });
            let got = ([l.sum, l.sq, l.min, l.max].map(|a| a.map(f64::to_bits)), c.map(|c| c.iter().sum::<u64>()));
            assert_eq!(got, element_loop(data), "{} values", data.len());
        }
        // A causal mask's shape: rows of 37 keys, row r finite up to key r, -Inf after it (groups
        // of LANES values all finite, all -Inf, and mixed), with a NaN and a +Inf among them.
        let masked = |i: usize| -> f64 {
            let (row, key) = (i / 37 % 37, i % 37);
            match i {
                500 => f64::NAN,
                901 => f64::INFINITY,
                _ if key > row => f64::NEG_INFINITY,
                _ => ((i as u64).wrapping_mul(2_654_435_761) % 40_001) as f64 / 1000.0 - 20.0,
            }
        };
        for (n, f) in [1, 7, 8, 9, 100, BLOCK - 1, BLOCK + 3, 3 * BLOCK + 17].into_iter().map(|n| (n, odd as fn(usize) -> f64)).chain([(37 * 37 * 3 + 5, masked as fn(usize) -> f64)]) {
            let v: Vec<f64> = (0..n).map(f).collect();
            check(&v);
            check(&v.iter().map(|&x| x as f32).collect::<Vec<_>>());
            check(&v.iter().map(|&x| half::f16::from_f64(x)).collect::<Vec<_>>());
            check(&v.iter().map(|&x| half::bf16::from_f64(x)).collect::<Vec<_>>());
            let (_, s) = hash_and_reduce(&v);
            let (_, counts) = element_loop(&v);
            assert_eq!([s.nan, s.pos_inf, s.neg_inf], counts, "{n} values");
        }
    }

    /// The whole-tensor pass switches to the finite-only loop at the chunk holding the first NaN
    /// or ±Inf, redoing that chunk: its lanes (each lane's bits) and counts are the element
    /// loop's over the whole slice, wherever the first such value falls (first element, a middle
    /// chunk, the last chunk's tail, nowhere), for f64 (full mantissas, and a finite value whose
    /// square overflows), f32, f16 and bf16 (whose chunks hold 1024, 2048 and 4096 values); and
    /// [`hash_and_reduce`]'s stats are those lanes' and counts'.
    #[test]
    fn switching_at_the_first_non_finite_chunk_matches_the_element_loop() {
        fn check<T: Elem>(data: &[T], what: &str) {
            let per_chunk = CHUNK_BYTES / std::mem::size_of::<T>();
            let (mut l, mut counts) = (Lanes::default(), None);
            for chunk in data.chunks(per_chunk) {
                l.add_chunk(&mut counts, chunk);
            }
            let (bits, totals) = element_loop(data);
            let got = ([l.sum, l.sq, l.min, l.max].map(|a| a.map(f64::to_bits)), counts.map_or([0; 3], |c| c.map(|c| c.iter().sum::<u64>())));
            assert_eq!(got, (bits, totals), "{what}, {} values", data.len());
            let (_, stats) = hash_and_reduce(data);
            assert_eq!(stats, stats_of(l, counts, data.len()), "{what}");
        }
        let n = 7 * CHUNK_BYTES / 8 + 13; // f64: 7 chunks of 1024 and 13; f32: 3 of 2048 and 1037; f16, bf16: 1 of 4096 and 3085
        let full = |i: usize| ((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 11) as f64 / (1u64 << 53) as f64 * 40.0 - 20.0;
        for (at, bad) in [
            (None, 0.0),
            (Some(0), f64::NAN),
            (Some(CHUNK_BYTES / 8 + 9), f64::NEG_INFINITY),
            (Some(n - 3), f64::INFINITY),
            (Some(5 * CHUNK_BYTES / 8 + 1), f64::NAN),
            (Some(2 * CHUNK_BYTES / 8 + 4), 1e200),
        ] {
            let mut v: Vec<f64> = (0..n).map(full).collect();
            if let Some(i) = at {
                v[i] = bad;
                v[n - 1] = f64::NEG_INFINITY;
            }
            check(&v, &format!("f64, {bad} at {at:?}"));
            check(&v.iter().map(|&x| x as f32).collect::<Vec<_>>(), &format!("f32, {bad} at {at:?}"));
            check(&v.iter().map(|&x| half::f16::from_f64(x)).collect::<Vec<_>>(), &format!("f16, {bad} at {at:?}"));
            check(&v.iter().map(|&x| half::bf16::from_f64(x)).collect::<Vec<_>>(), &format!("bf16, {bad} at {at:?}"));
        }
    }

    /// Of a ±0 tie for the minimum or maximum, the zero seen first (by lane, then lane order)
    /// wins, in the vectorised loop and in the finite-only one (data holding a NaN) alike.
    #[test]
    fn min_max_keep_the_first_zero_of_a_tie() {
        let (p, n) = (0.0f64.to_bits(), (-0.0f64).to_bits());
        // Each value fills all 8 lanes, so every lane sees the same sequence.
        let cases: [(&[f64], u64, u64); 5] = [
            (&[0.0, -0.0, 1.0, -0.0], p, 1.0f64.to_bits()),
            (&[-0.0, 0.0, 0.0, 2.0], n, 2.0f64.to_bits()),
            (&[-1.0, 0.0, -0.0, -1.0], (-1.0f64).to_bits(), p),
            (&[-0.0, 0.0], n, n),
            (&[0.0, -0.0], p, p),
        ];
        for (xs, min, max) in cases {
            let v: Vec<f64> = xs.iter().flat_map(|&x| [x; LANES]).collect();
            let (_, s) = hash_and_reduce(&v);
            assert_eq!((s.min.to_bits(), s.max.to_bits()), (min, max), "{xs:?}");
            let with_nan: Vec<f64> = v.iter().copied().chain([f64::NAN]).collect();
            let (_, s) = hash_and_reduce(&with_nan);
            assert_eq!((s.min.to_bits(), s.max.to_bits(), s.nan), (min, max, 1), "{xs:?} and a NaN");
        }
        // Across lanes: lane 0 holds +0, lane 1 -0; the lanes are folded in order.
        let (_, s) = hash_and_reduce(&[0.0f32, -0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]);
        assert_eq!(s.min.to_bits(), p);
    }

    /// The chunked pass hashes as the one-shot xxh3-128 does and reduces as one lane loop does,
    /// across chunk boundaries, for data with and without non-finite values.
    #[test]
    fn chunked_pass_equals_one_pass() {
        let n = 3 * CHUNK_BYTES / 4 + 5;
        for bad in [None, Some(f32::NAN), Some(f32::NEG_INFINITY)] {
            let mut v = values(n);
            if let Some(x) = bad {
                v[n - 7] = x;
            }
            let (digest, s) = hash_and_reduce(&v);
            assert_eq!(digest, xxh3_128(bytemuck::cast_slice(&v)));
            let finite: Vec<(usize, f64)> = v.iter().map(|&x| x as f64).enumerate().filter(|(_, x)| x.is_finite()).collect();
            let mut sum = [0.0; LANES];
            for (i, x) in &finite {
                sum[i % LANES] += x;
            }
            assert_eq!(s.sum.to_bits(), sum.iter().sum::<f64>().to_bits(), "{bad:?}");
            assert_eq!(s.nan + s.pos_inf + s.neg_inf, u64::from(bad.is_some()));
        }
    }
}
