//! The block-quantized kernels (Q4_1, Q5_0) against candle's `QMatMul` (bit for bit) and row by
//! row against themselves. candle's own paths for these types are already batch-invariant (a
//! per-row quantization and a sequential per-element dot product; x86 has no repacked path for
//! them), so these tests prove equality with it, not a difference from it.

use crate::blocks::{Dot1, Dot4, QK};
use crate::values::values;
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Result, Tensor};

/// Each kernel: its weight type, its entry point, the activation type and both block sizes, its
/// dot products.
struct Case {
    weight: GgmlDType,
    matmul: fn(&Tensor, &QTensor) -> Result<Option<Tensor>>,
    act: GgmlDType,
    blocks: (usize, usize),
    dot4: Dot4,
    dot1: Dot1,
}

fn cases() -> [Case; 2] {
    [
        Case {
            weight: GgmlDType::Q4_1,
            matmul: crate::q4_1::matmul,
            act: GgmlDType::Q8_1,
            blocks: (crate::q4_1::W_BLOCK, crate::q4_1::X_BLOCK),
            dot4: crate::q4_1::pick4(),
            dot1: crate::q4_1::dot_scalar,
        },
        Case {
            weight: GgmlDType::Q5_0,
            matmul: crate::q5_0::matmul,
            act: GgmlDType::Q8_0,
            blocks: (crate::q5_0::W_BLOCK, crate::q5_0::X_BLOCK),
            dot4: crate::q5_0::pick4(),
            dot1: crate::q5_0::dot_scalar,
        },
    ]
}

fn weight(n: usize, k: usize, seed: u64, dtype: GgmlDType) -> QMatMul {
    let dev = Device::Cpu;
    // Rows of different scales, a constant row (d = 0) and a zero row.
    let mut w = Tensor::from_vec(values(n * k, seed), (n, k), &dev).unwrap();
    let scale: Vec<f32> = (0..n).map(|r| ((r % 40) as f32 * 0.3 - 4.0).exp()).collect();
    let scale = Tensor::from_vec(scale, (n, 1), &dev).unwrap();
    w = w.broadcast_mul(&scale).unwrap();
    if n > 2 {
        let mut v = w.to_vec2::<f32>().unwrap();
        v[1].iter_mut().for_each(|x| *x = 0.25);
        v[2].iter_mut().for_each(|x| *x = 0.0);
        w = Tensor::new(v, &dev).unwrap();
    }
    QMatMul::from_qtensor(QTensor::quantize(&w, dtype).unwrap()).unwrap()
}

fn input(m: usize, k: usize, seed: u64) -> Tensor {
    let dev = Device::Cpu;
    let x = (Tensor::from_vec(values(m * k, seed), (m, k), &dev).unwrap() * 3.0).unwrap();
    if m > 1 {
        // A zero row: its Q8_1 scale is 0.
        let mut v = x.to_vec2::<f32>().unwrap();
        v[m - 1].iter_mut().for_each(|x| *x = 0.0);
        return Tensor::new(v, &dev).unwrap();
    }
    x
}

fn bits(t: &Tensor) -> Vec<u32> {
    let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert!(v.iter().all(|x| x.is_finite()), "the test's values stay finite");
    v.iter().map(|x| x.to_bits()).collect()
}

fn ours(c: &Case, w: &QMatMul, x: &Tensor) -> Tensor {
    let QMatMul::QTensor(q) = w else { panic!("not quantized") };
    (c.matmul)(x, q).unwrap().expect("the kernel applies")
}

/// Same bits as candle's `QMatMul::forward` for every shape tried, from one row (a decode step)
/// to 65, with K from one block to 1536 (SmolLM2's 576 and 1536 among them), for each kernel.
#[test]
fn same_bits_as_candle() {
    for c in cases() {
        for (i, &(m, k, n)) in [(1, 32, 1), (1, 576, 576), (2, 576, 1536), (3, 1536, 576), (7, 64, 5), (8, 96, 4), (17, 576, 3), (33, 128, 64), (65, 576, 67)].iter().enumerate() {
            let w = weight(n, k, i as u64, c.weight);
            let x = input(m, k, 100 + i as u64);
            assert_eq!(bits(&ours(&c, &w, &x)), bits(&w.forward(&x).unwrap()), "{:?} m {m} k {k} n {n}", c.weight);
            // A 3-d input, as the models pass it.
            let x3 = x.unsqueeze(0).unwrap();
            let y3 = ours(&c, &w, &x3);
            assert_eq!((y3.dims(), bits(&y3)), (&[1, m, n][..], bits(&w.forward(&x3).unwrap())));
            // A view starting inside its storage (the last row of the batch).
            let last = x.narrow(0, m - 1, 1).unwrap();
            assert_eq!(bits(&ours(&c, &w, &last)), bits(&w.forward(&last).unwrap()), "{:?} m {m} k {k} n {n}, last row", c.weight);
        }
    }
}

/// Row r of an M-row call has the bits of the same row computed alone, on pools of 1 and 2
/// threads.
#[test]
fn a_row_does_not_depend_on_the_others() {
    for c in cases() {
        let (k, n) = (576, 131);
        let w = weight(n, k, 7, c.weight);
        for m in [1, 2, 3, 7, 8, 16, 17, 33, 64, 65] {
            let x = input(m, k, m as u64);
            for threads in [1, 2] {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                let all = pool.install(|| ours(&c, &w, &x));
                for r in [0, m / 2, m - 1] {
                    let alone = pool.install(|| ours(&c, &w, &x.narrow(0, r, 1).unwrap().contiguous().unwrap()));
                    assert_eq!(bits(&all.narrow(0, r, 1).unwrap()), bits(&alone), "{:?} row {r} of {m}, {threads} threads", c.weight);
                }
            }
        }
    }
}

/// The four-column AVX2 dot products and the scalar ones agree bit for bit (the integer sums
/// are exact; the f32 steps are the same operations lane by lane).
#[test]
fn simd_and_scalar_agree() {
    for c in cases() {
        let (k, n, m) = (1536, 8, 4);
        let QMatMul::QTensor(q) = weight(n, k, 3, c.weight) else { panic!() };
        let xq = QTensor::quantize(&input(m, k, 4), c.act).unwrap();
        let (wb, xb) = (q.data().unwrap(), xq.data().unwrap());
        let (wr, xr) = (k / QK * c.blocks.0, k / QK * c.blocks.1);
        let w = |i: usize| &wb[i * wr..(i + 1) * wr];
        for col in (0..n).step_by(4) {
            for r in 0..m {
                let x = &xb[r * xr..(r + 1) * xr];
                let got = (c.dot4)([w(col), w(col + 1), w(col + 2), w(col + 3)], x);
                let want = [0, 1, 2, 3].map(|i| (c.dot1)(w(col + i), x));
                assert_eq!(got.map(f32::to_bits), want.map(f32::to_bits), "{:?} row {r}, columns {col}..{}", c.weight, col + 4);
            }
        }
    }
}

/// Where a kernel does not apply it says so, and `qmatmul` falls back to candle.
#[test]
fn other_inputs_fall_back() {
    for c in cases() {
        let w = weight(8, 64, 1, c.weight);
        let QMatMul::QTensor(q) = &w else { panic!() };
        let x = input(4, 64, 2);
        assert!((c.matmul)(&x.t().unwrap(), q).unwrap().is_none(), "not contiguous");
        assert!((c.matmul)(&x.to_dtype(DType::F16).unwrap(), q).unwrap().is_none(), "f16");
        assert!((c.matmul)(&input(4, 32, 2), q).unwrap().is_none(), "wrong K");
        let q8 = QTensor::quantize(&Tensor::ones((8, 64), DType::F32, &Device::Cpu).unwrap(), GgmlDType::Q8_0).unwrap();
        assert!((c.matmul)(&x, &q8).unwrap().is_none(), "Q8_0");
        assert!(crate::qmatmul(&w, &input(4, 32, 2)).is_err(), "candle's error for a wrong K");
    }
}
