//! Digest + reductions throughput: `digest::summarize` (xxh3-128 digest, f64 reductions,
//! samples; and with a token axis, per-token digests and stats too) on f32, f16 and bf16 tensors
//! of 4 KiB to 64 MiB, next to a plain copy of the same bytes (the bound: one read of the data),
//! and on the same tensors under a causal mask's -inf (`masked`: the finite-only pass).
//!
//! Run: `cargo bench --bench digest`. Prints GB/s (10^9 bytes of tensor data a second), the
//! median of `BENCH_RUNS` (default 7) timings.

use candle_core::{DType, Device, Tensor};
use candle_trace::digest::summarize;
use candle_trace::record::TokenAxis;
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn time(mut f: impl FnMut()) -> f64 {
    let runs = std::env::var("BENCH_RUNS").ok().and_then(|v| v.parse().ok()).filter(|&n| n > 0).unwrap_or(7);
    f();
    median(
        (0..runs)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

fn main() {
    println!("{:>6} {:>9} {:>10} {:>12} {:>10} {:>10}", "dtype", "bytes", "copy GB/s", "summary GB/s", "per-token GB/s", "masked GB/s");
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for bytes in [4usize << 10, 256 << 10, 4 << 20, 64 << 20] {
            let n = bytes / dtype.size_in_bytes();
            let v: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 1e-3 - 0.5).collect();
            let t = Tensor::from_vec(v, n, &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            let src: Vec<u8> = vec![7u8; bytes];
            let mut dst = vec![0u8; bytes];
            let copy = time(|| {
                dst.copy_from_slice(std::hint::black_box(&src));
                std::hint::black_box(&dst);
            });
            let whole = time(|| {
                std::hint::black_box(summarize(&t, None).unwrap());
            });
            // [1, positions, 256]: one slice per 256 elements, as a [batch, seq, hidden] activation.
            let seq = t.reshape((1, n / 256, 256)).unwrap();
            let axis = TokenAxis { seq_dim: Some(1), first_pos: 0, keep_from: 0, causal: false };
            let per_token = time(|| {
                std::hint::black_box(summarize(&seq, Some(&axis)).unwrap());
            });
            // The same values as rows of 256 under a causal mask (-inf right of the diagonal of
            // each 256 x 256 block), as a masked attention-scores tensor: the whole-tensor
            // summary takes the finite-only pass.
            let m: Vec<f32> = (0..n).map(|i| if i % 256 > (i / 256) % 256 { f32::NEG_INFINITY } else { (i % 1000) as f32 * 1e-3 - 0.5 }).collect();
            let m = Tensor::from_vec(m, n, &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            let masked = time(|| {
                std::hint::black_box(summarize(&m, None).unwrap());
            });
            let gbs = |s: f64| bytes as f64 / s / 1e9;
            println!("{:>6} {:>9} {:>10.2} {:>12.2} {:>10.2} {:>10.2}", dtype.as_str(), bytes, gbs(copy), gbs(whole), gbs(per_token), gbs(masked));
        }
    }
}
