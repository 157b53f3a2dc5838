//! Each kernel of this crate against candle's own on SmolLM2-135M's projection shapes (576×576,
//! 576→1536, 1536→576, and the 576→49152 output head), for one row (a decode step) and 128 (a
//! prefill): the two interleaved call by call, `BENCH_ROUNDS` rounds (default 15), the median of
//! each, and their ratio. One line per kernel and shape:
//!
//! `matmul f32 576x1536 m=1: invariant 0.101 ms, candle 0.436 ms, invariant/candle 0.23x`
//!
//! Dense f32 runs [`candle_trace_kernels::Linear`] against `candle_nn::Linear` (the same weight);
//! Q4_1 and Q5_0 run [`candle_trace_kernels::qmatmul`] against candle's `QMatMul` (and check the
//! bits are the same). Run: `cargo bench -p candle-trace-kernels --bench invariant_kernels`.

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

fn main() -> candle_core::Result<()> {
    let rounds: usize = std::env::var("BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(15).max(1);
    let dev = Device::Cpu;
    for (k, n) in SHAPES {
        let w = Tensor::from_vec(values(n * k, 1), (n, k), &dev)?;
        let (ours, theirs) = (candle_trace_kernels::Linear::new(&w, None)?, candle_nn::Linear::new(w, None));
        for m in [1, 128] {
            let x = Tensor::from_vec(values(m * k, 2), (1, m, k), &dev)?;
            line(&format!("matmul f32 {k}x{n} m={m}"), rounds, || ours.forward(&x), || theirs.forward(&x))?;
        }
    }
    for (dtype, (k, n)) in [GgmlDType::Q4_1, GgmlDType::Q5_0].into_iter().flat_map(|d| SHAPES.map(|s| (d, s))) {
        let name = format!("{dtype:?}").to_lowercase();
        let w = QMatMul::from_qtensor(QTensor::quantize(&Tensor::from_vec(values(n * k, 1), (n, k), &dev)?, dtype)?)?;
        for m in [1, 128] {
            let x = Tensor::from_vec(values(m * k, 2), (1, m, k), &dev)?;
            assert_eq!(bits(&candle_trace_kernels::qmatmul(&w, &x)?)?, bits(&w.forward(&x)?)?, "same bits");
            line(&format!("qmatmul {name} {k}x{n} m={m}"), rounds, || candle_trace_kernels::qmatmul(&w, &x), || w.forward(&x))?;
        }
    }
    Ok(())
}
