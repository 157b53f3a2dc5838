//! The dense kernels ([`crate::Linear`], [`crate::matmul`]) row by row against themselves, against
//! an f64 reference, and candle's own matmul on the same cases (which varies: the tests would
//! fail on it).

use crate::tile;
use crate::values::values;
use crate::{matmul, Linear};
use candle_core::{DType, Device, Module, Tensor};

const MS: [usize; 11] = [1, 2, 3, 7, 8, 16, 17, 33, 64, 65, 257];
const KS: [usize; 4] = [64, 576, 1536, 2051];
/// Four and a half panels: two column work items, the last panel partial.
const N: usize = 72;

/// An f32 CPU tensor of `v` (the kernels' tests share it).
pub(crate) fn tensor(v: Vec<f32>, dims: &[usize]) -> Tensor {
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

/// The bits of `t`'s values as f32, asserting they are finite (the kernels' tests share it).
pub(crate) fn bits(t: &Tensor) -> Vec<u32> {
    let v = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert!(v.iter().all(|x| x.is_finite()), "the test's values stay finite");
    v.iter().map(|x| x.to_bits()).collect()
}

fn row(t: &Tensor, r: usize) -> Tensor {
    t.narrow(0, r, 1).unwrap()
}

/// Row r of an M-row product has the bits of row r computed alone, for every M and K of the
/// issue, on pools of 1 and 2 threads. candle's matmul on the same cases differs somewhere (its
/// one-row gemv against its gemm), so this test would fail on it.
#[test]
fn a_row_does_not_depend_on_the_others() {
    let mut candle_differs = Vec::new();
    for (i, k) in KS.into_iter().enumerate() {
        let w = tensor(values(N * k, 10 + i as u64), &[N, k]);
        let x = tensor(values(257 * k, 20 + i as u64), &[257, k]);
        let layer = Linear::new(&w, None).unwrap();
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let alone: Vec<Vec<u32>> = (0..257).map(|r| bits(&pool.install(|| layer.forward(&row(&x, r))).unwrap())).collect();
            for m in MS {
                let all = pool.install(|| layer.forward(&x.narrow(0, 0, m).unwrap())).unwrap();
                for (r, alone) in alone.iter().take(m).enumerate() {
                    assert_eq!(&bits(&row(&all, r)), alone, "row {r} of {m}, K {k}, {threads} threads");
                }
            }
        }
        let wt = w.t().unwrap();
        for m in MS.into_iter().skip(1) {
            let all = x.narrow(0, 0, m).unwrap().matmul(&wt).unwrap();
            if (0..m).any(|r| bits(&row(&all, r)) != bits(&row(&x, r).matmul(&wt).unwrap())) {
                candle_differs.push((k, m));
            }
        }
    }
    println!("candle's matmul: a row differs from itself alone at (K, M) {candle_differs:?}");
    assert!(!candle_differs.is_empty(), "candle's matmul varies with M on these cases");
}

/// Each element within the error bound of its summation order against an f64 reference: at most
/// `(KC + blocks) · u · Σ|x·w|` (u = 2⁻²⁴). The observed worst case is printed, in those units
/// and in ULPs of the result.
#[test]
fn within_the_bound_of_an_f64_reference() {
    let u = f64::powi(2.0, -24);
    for (i, k) in KS.into_iter().enumerate() {
        let (m, wv, xv) = (5, values(N * k, 30 + i as u64), values(5 * k, 40 + i as u64));
        let y = Linear::new(&tensor(wv.clone(), &[N, k]), None).unwrap().forward(&tensor(xv.clone(), &[m, k])).unwrap();
        let y = y.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (mut worst, mut ulps) = (0f64, 0f64);
        for r in 0..m {
            for c in 0..N {
                let terms = (0..k).map(|j| xv[r * k + j] as f64 * wv[c * k + j] as f64);
                let (exact, mass) = terms.fold((0f64, 0f64), |(s, a), t| (s + t, a + t.abs()));
                let err = (y[r * N + c] as f64 - exact).abs();
                worst = worst.max(err / (u * mass));
                ulps = ulps.max(err / (f32::EPSILON as f64 * (exact.abs() as f32).max(f32::MIN_POSITIVE) as f64));
            }
        }
        let bound = (crate::dense::KC + k.div_ceil(crate::dense::KC)) as f64;
        println!("K {k}: worst error {worst:.2} u·Σ|x·w| (bound {bound}), {ulps:.1} ULP of the result");
        assert!(worst <= bound, "K {k}: {worst} > {bound}");
    }
}

/// The scalar micro-kernel and the AVX2 one give the same bits (on a CPU without AVX2 both are
/// the scalar one).
#[test]
fn every_cpu_path_gives_the_same_bits() {
    for (i, (m, k)) in [(1, 64), (1, 2051), (7, 2051), (65, 576), (13, 300), (49, 600)].into_iter().enumerate() {
        let w = tensor(values(N * k, 50 + i as u64), &[N, k]);
        let x = tensor(values(m * k, 60 + i as u64), &[m, k]);
        let picked = Linear::new(&w, None).unwrap().forward(&x).unwrap();
        let scalar = Linear::new(&w, None).unwrap().with_kernel(tile::SCALAR).forward(&x).unwrap();
        assert_eq!(bits(&picked), bits(&scalar), "m {m} k {k}");
    }
}

/// f16 and bf16: widened, computed in f32, rounded once; the bias added after, as candle_nn's
/// Linear adds it. A 3-d input and a transposed view give the contiguous input's bits.
#[test]
fn half_types_round_once_and_layouts_do_not_matter() {
    let (m, k) = (9, 576);
    let w = tensor(values(N * k, 70), &[N, k]);
    let x = tensor(values(m * k, 71), &[m, k]);
    let b = tensor(values(N, 72), &[N]);
    for dt in [DType::F16, DType::BF16] {
        let (wh, xh, bh) = (w.to_dtype(dt).unwrap(), x.to_dtype(dt).unwrap(), b.to_dtype(dt).unwrap());
        let ours = Linear::new(&wh, Some(&bh)).unwrap().forward(&xh).unwrap();
        let wide = Linear::new(&wh.to_dtype(DType::F32).unwrap(), None).unwrap().forward(&xh.to_dtype(DType::F32).unwrap()).unwrap();
        let expected = wide.to_dtype(dt).unwrap().broadcast_add(&bh).unwrap();
        assert_eq!((ours.dtype(), bits(&ours)), (dt, bits(&expected)), "{dt:?}");
    }
    let layer = Linear::new(&w, Some(&b)).unwrap();
    let flat = layer.forward(&x).unwrap();
    let x3 = x.reshape((3, 3, k)).unwrap();
    let y3 = layer.forward(&x3).unwrap();
    assert_eq!((y3.dims(), bits(&y3)), (&[3, 3, N][..], bits(&flat)));
    let xt = x.t().unwrap().contiguous().unwrap().t().unwrap();
    assert!(!xt.is_contiguous());
    assert_eq!(bits(&layer.forward(&xt).unwrap()), bits(&flat));
    assert!(layer.forward(&tensor(values(k + 1, 1), &[1, k + 1])).is_err(), "a wrong K");
    assert!(layer.forward(&x.to_dtype(DType::F64).unwrap()).is_err(), "f64");
}

/// Attention's batched products: a query row's scores (`Q·Kᵀ`, K = head dim) and its weighted
/// values (`P·V`, K = kv length) have the same bits alone (a decode step) and among the prompt's
/// other queries (a prefill), with zero probabilities for left padding before its first key, and
/// with masked keys after its last (the same query in a longer prefill chunk). candle's matmul
/// differs for a query alone against the same query among others.
#[test]
fn attention_products_ignore_padding_and_the_kv_length() {
    let (heads, m, d, kv) = (3, 9, 64, 37);
    let q = tensor(values(heads * m * d, 80), &[heads, m, d]);
    let keys = tensor(values(heads * kv * d, 81), &[heads, kv, d]).transpose(1, 2).unwrap();
    let p = tensor(values(heads * m * kv, 82).iter().map(|v| v.abs() / kv as f32).collect(), &[heads, m, kv]);
    let v = tensor(values(heads * kv * d, 83), &[heads, kv, d]);
    let mut candle_differs = 0;
    for (a, b) in [(&q, &keys), (&p, &v)] {
        let all = matmul(a, b).unwrap();
        assert_eq!(all.dims(), &[heads, m, b.dim(2).unwrap()]);
        for r in 0..m {
            let alone = a.narrow(1, r, 1).unwrap();
            assert_eq!(bits(&matmul(&alone, b).unwrap()), bits(&all.narrow(1, r, 1).unwrap()), "query {r}");
            candle_differs += usize::from(bits(&alone.matmul(b).unwrap()) != bits(&a.matmul(b).unwrap().narrow(1, r, 1).unwrap()));
        }
    }
    println!("candle's matmul: {candle_differs} of {} queries differ alone", 2 * m);
    assert!(candle_differs > 0, "candle's matmul varies with the query count");
    let plain = bits(&matmul(&p, &v).unwrap());
    for (pad, tail) in [(1, 0), (5, 0), (0, 1), (0, 11), (3, 7)] {
        let zeros = |n| Tensor::zeros((heads, m, n), DType::F32, &Device::Cpu).unwrap();
        let noise = |n, s| tensor(values(heads * n * d, s), &[heads, n, d]);
        let pp = Tensor::cat(&[zeros(pad), p.clone(), zeros(tail)], 2).unwrap();
        let vv = Tensor::cat(&[noise(pad, 84), v.clone(), noise(tail, 85)], 1).unwrap();
        assert_eq!(bits(&matmul(&pp, &vv).unwrap()), plain, "{pad} left pads, {tail} masked keys");
    }
    assert!(matmul(&q, &v).is_err(), "inner dims differ");
    // The transposed form: the same bits without the transposed view's copy.
    let stored = tensor(values(heads * kv * d, 81), &[heads, kv, d]);
    assert_eq!(bits(&crate::matmul_t(&q, &stored).unwrap()), bits(&matmul(&q, &keys).unwrap()));
    assert!(crate::matmul_t(&q, &v.transpose(1, 2).unwrap()).is_err(), "inner dims differ");
}
