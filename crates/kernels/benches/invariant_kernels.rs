//! Each kernel of this crate (Q4_1, Q5_0) against candle's own on SmolLM2-135M's projection shapes (576×576,
//! 576→1536, 1536→576, and the 576→49152 output head), for one row (a decode step) and 128 (a
//! prefill): the two interleaved call by call, `BENCH_ROUNDS` rounds (default 15), the median of
//! each, and their ratio. One line per shape:
//!
//! `qmatmul q4_1 576x1536 m=1: invariant 0.101 ms, candle 0.436 ms, invariant/candle 0.23x`
//!
//! Run: `cargo bench -p candle-trace-kernels --bench invariant_kernels`.

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use std::time::Instant;

#[path = "../src/values.rs"]
mod values;
use values::values;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> candle_core::Result<()> {
    let rounds: usize = std::env::var("BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(15).max(1);
    let dev = Device::Cpu;
    for (dtype, (k, n)) in [GgmlDType::Q4_1, GgmlDType::Q5_0].into_iter().flat_map(|d| [(576, 576), (576, 1536), (1536, 576), (576, 49152)].map(|s| (d, s))) {
        let name = format!("{dtype:?}").to_lowercase();
        let w = QMatMul::from_qtensor(QTensor::quantize(&Tensor::from_vec(values(n * k, 1), (n, k), &dev)?, dtype)?)?;
        for m in [1, 128] {
            let x = Tensor::from_vec(values(m * k, 2), (1, m, k), &dev)?;
            let (mut ours, mut theirs) = (Vec::new(), Vec::new());
            for _ in 0..rounds {
                let t = Instant::now();
                let a = candle_trace_kernels::qmatmul(&w, &x)?;
                ours.push(t.elapsed().as_secs_f64());
                let t = Instant::now();
                let b = w.forward(&x)?;
                theirs.push(t.elapsed().as_secs_f64());
                assert_eq!(
                    a.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    b.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "same bits"
                );
            }
            let (a, b) = (median(ours), median(theirs));
            println!("qmatmul {name} {k}x{n} m={m}: invariant {:.3} ms, candle {:.3} ms, invariant/candle {:.2}x", a * 1e3, b * 1e3, a / b);
        }
    }
    Ok(())
}
