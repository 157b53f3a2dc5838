//! Each kernel of this crate against candle's own on SmolLM2-135M's projection shapes (576×576,
//! 576→1536, 1536→576, and the 576→49152 output head), for one row (a decode step) and 128 (a
//! prefill): the two interleaved call by call, `BENCH_ROUNDS` rounds (default 15), the median of
//! each, and their ratio. One line per kernel and shape:
//!
//! `matmul f32 576x1536 m=1: invariant 0.101 ms, candle 0.436 ms, invariant/candle 0.23x`
//!
//! Dense f32 runs [`candle_trace_kernels::Linear`] against `candle_nn::Linear` (the same weight);
//! the quantized types [`candle_trace_kernels::qmatmul_invariant`] against candle's `QMatMul`
//! (Q4_1 and Q5_0 checked bit for bit); then softmax and causal attention at kv lengths 128 and
//! 512. Run: `cargo bench -p candle-trace-kernels --bench invariant_kernels`.

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use std::time::Instant;

#[path = "../src/values.rs"]
mod values;
use values::values;

/// SmolLM2-135M's projections as (K, N).
const SHAPES: [(usize, usize); 4] = [(576, 576), (576, 1536), (1536, 576), (576, 49152)];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Times `ours` and `theirs` interleaved, `rounds` times each, and prints their medians and ratio.
fn line(name: &str, rounds: usize, mut ours: impl FnMut() -> candle_core::Result<Tensor>, mut theirs: impl FnMut() -> candle_core::Result<Tensor>) -> candle_core::Result<()> {
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let t = Instant::now();
        ours()?;
        a.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        theirs()?;
        b.push(t.elapsed().as_secs_f64());
    }
    let (a, b) = (median(a), median(b));
    println!("{name}: invariant {:.3} ms, candle {:.3} ms, invariant/candle {:.2}x", a * 1e3, b * 1e3, a / b);
    Ok(())
}

fn bits(t: &Tensor) -> candle_core::Result<Vec<u32>> {
    Ok(t.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
}

fn tensor(v: Vec<f32>, dims: &[usize]) -> candle_core::Result<Tensor> {
    Tensor::from_vec(v, dims, &Device::Cpu)
}

/// Dense f32: `Linear` against `candle_nn::Linear`.
fn dense(rounds: usize) -> candle_core::Result<()> {
    for (k, n) in SHAPES {
        let w = tensor(values(n * k, 1), &[n, k])?;
        let (ours, theirs) = (candle_trace_kernels::Linear::new(&w, None)?, candle_nn::Linear::new(w, None));
        for m in [1, 128] {
            let x = tensor(values(m * k, 2), &[1, m, k])?;
            line(&format!("matmul f32 {k}x{n} m={m}"), rounds, || ours.forward(&x), || theirs.forward(&x))?;
        }
    }
    Ok(())
}

/// Quantized: `qmatmul` (Q4_1, Q5_0: candle's bits, checked) and `qmatmul_invariant` (Q8_0, and
/// Q6K where K is a multiple of its 256-value superblock: 1536×576 only) against `QMatMul`.
fn quantized(rounds: usize) -> candle_core::Result<()> {
    let cases = [GgmlDType::Q4_1, GgmlDType::Q5_0, GgmlDType::Q8_0, GgmlDType::Q6K].into_iter().flat_map(|d| SHAPES.map(|s| (d, s)));
    for (dtype, (k, n)) in cases.filter(|(d, (k, _))| *d != GgmlDType::Q6K || k % 256 == 0) {
        let name = format!("{dtype:?}").to_lowercase();
        let w = QMatMul::from_qtensor(QTensor::quantize(&tensor(values(n * k, 1), &[n, k])?, dtype)?)?;
        for m in [1, 128] {
            let x = tensor(values(m * k, 2), &[1, m, k])?;
            if matches!(dtype, GgmlDType::Q4_1 | GgmlDType::Q5_0) {
                assert_eq!(bits(&candle_trace_kernels::qmatmul(&w, &x)?)?, bits(&w.forward(&x)?)?, "same bits");
            }
            line(&format!("qmatmul {name} {k}x{n} m={m}"), rounds, || candle_trace_kernels::qmatmul_invariant(&w, &x), || w.forward(&x))?;
        }
    }
    Ok(())
}

/// Softmax over SmolLM2's 9 heads × `m` queries × `kv` keys, and causal attention (9 query heads
/// over 3 kv heads of 64) against candle's composition as the llama model runs it (kv heads
/// repeated, `q·kᵀ` scaled, masked, `softmax_last_dim`, `· v`): a decode step (m = 1) and a whole
/// prefill (m = kv).
fn attention(rounds: usize) -> candle_core::Result<()> {
    for kv in [128, 512] {
        for m in [1, kv] {
            let s = tensor(values(9 * m * kv, 3), &[1, 9, m, kv])?;
            line(&format!("softmax kv={kv} m={m}"), rounds, || candle_trace_kernels::softmax_last_dim(&s), || candle_nn::ops::softmax_last_dim(&s))?;
            let q = tensor(values(9 * m * 64, 4), &[1, 9, m, 64])?;
            let (k, v) = (tensor(values(3 * kv * 64, 5), &[1, 3, kv, 64])?, tensor(values(3 * kv * 64, 6), &[1, 3, kv, 64])?);
            let mask: Vec<f32> = (0..m).flat_map(|i| (0..kv).map(move |j| if j > kv - m + i { f32::NEG_INFINITY } else { 0.0 })).collect();
            let mask = tensor(mask, &[m, kv])?;
            let theirs = || -> candle_core::Result<Tensor> {
                let rep = |t: &Tensor| t.unsqueeze(2)?.expand((1, 3, 3, kv, 64))?.reshape((1, 9, kv, 64));
                let s = (q.matmul(&rep(&k)?.t()?)? * 0.125)?.broadcast_add(&mask)?;
                candle_nn::ops::softmax_last_dim(&s)?.matmul(&rep(&v)?)
            };
            line(&format!("attention kv={kv} m={m}"), rounds, || candle_trace_kernels::attention(&q, &k, &v, 0.125, true, &[]), theirs)?;
        }
    }
    Ok(())
}

fn main() -> candle_core::Result<()> {
    let rounds: usize = std::env::var("BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(15).max(1);
    dense(rounds)?;
    quantized(rounds)?;
    attention(rounds)
}
