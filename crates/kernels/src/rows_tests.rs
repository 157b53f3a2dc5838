//! Softmax, attention, the norms, pooling and the pinned quantized matmul, each row by row
//! against itself alone, and candle's kernel on the same cases (which varies where said).

use crate::dense_tests::{bits, tensor};
use crate::values::values;
use crate::{attention, layer_norm, mean_pool, qmatmul_invariant, rms_norm, softmax_last_dim};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};

/// A row of `len` scores with `pad` masked entries before and `tail` after.
fn padded(scores: &[f32], pad: usize, tail: usize) -> Vec<f32> {
    let inf = |n| std::iter::repeat_n(f32::NEG_INFINITY, n);
    inf(pad).chain(scores.iter().copied()).chain(inf(tail)).collect()
}

/// Row lengths 1…600 with 0…7 left pads and a masked tail: the row's probabilities have the bits
/// of the row alone, and each is within its bound of an f64 softmax (printed). candle's
/// `softmax_last_dim` changes with the row length.
#[test]
fn softmax_ignores_padding_and_the_kv_length() {
    let (mut candle_differs, mut worst) = (0, 0f64);
    for len in 1..=600 {
        let scores: Vec<f32> = values(len, len as u64).iter().map(|v| v * 12.0).collect();
        let alone = softmax_last_dim(&tensor(scores.clone(), &[1, len])).unwrap();
        let width = len + 12;
        let rows: Vec<f32> = (0..8).flat_map(|pad| padded(&scores, pad, width - len - pad)).collect();
        let all = softmax_last_dim(&tensor(rows.clone(), &[8, width])).unwrap();
        for pad in 0..8 {
            assert_eq!(bits(&all.narrow(0, pad, 1).unwrap().narrow(1, pad, len).unwrap()), bits(&alone), "length {len}, {pad} pads");
        }
        let theirs = candle_nn::ops::softmax_last_dim(&tensor(rows, &[8, width])).unwrap();
        let own = candle_nn::ops::softmax_last_dim(&tensor(scores.clone(), &[1, len])).unwrap();
        candle_differs += usize::from(bits(&theirs.narrow(0, 0, 1).unwrap().narrow(1, 0, len).unwrap()) != bits(&own));
        let max = scores.iter().fold(f64::MIN, |m, &s| m.max(s as f64));
        let sum: f64 = scores.iter().map(|&s| (s as f64 - max).exp()).sum();
        for (p, s) in alone.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().zip(&scores) {
            let exact = (*s as f64 - max).exp() / sum;
            worst = worst.max((*p as f64 - exact).abs() / (exact * f32::EPSILON as f64));
        }
    }
    println!("softmax: worst relative error {worst:.2} ε (bound 2 + 600/8 + 4); candle differs with padding at {candle_differs} of 600 lengths");
    assert!(worst <= 2.0 + 75.0 + 4.0, "{worst}");
    assert!(candle_differs > 0, "candle's softmax varies with the kv length");
}

/// Queries and keys: `heads` query heads over `kv_heads` kv heads, `kv` positions of `d`.
fn qkv(heads: usize, kv_heads: usize, kv: usize, d: usize, seed: u64) -> (Tensor, Tensor, Tensor) {
    let t = |h: usize, s| tensor(values(h * kv * d, s), &[1, h, kv, d]);
    (t(heads, seed), t(kv_heads, seed + 1), t(kv_heads, seed + 2))
}

/// candle's attention as the models compose it: `softmax(q·kᵀ·scale + mask) · v`, kv heads
/// repeated.
fn candle_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Tensor {
    let (m, kv, group) = (q.dim(2).unwrap(), k.dim(2).unwrap(), q.dim(1).unwrap() / k.dim(1).unwrap());
    let rep = |t: &Tensor| Tensor::cat(&vec![t; group], 2).unwrap().reshape((1, q.dim(1).unwrap(), kv, t.dim(3).unwrap())).unwrap();
    let (k, v) = (rep(k), rep(v));
    let s = (q.matmul(&k.t().unwrap()).unwrap() * scale).unwrap();
    let mask: Vec<f32> = (0..m).flat_map(|i| (0..kv).map(move |j| if j > kv - m + i { f32::NEG_INFINITY } else { 0.0 })).collect();
    let s = s.broadcast_add(&tensor(mask, &[m, kv])).unwrap();
    candle_nn::ops::softmax_last_dim(&s).unwrap().matmul(&v).unwrap()
}

/// A query decoded (kv = p + 1), inside a whole prefill and inside a later chunk gives the same
/// bits (grouped kv heads, a head dim of 64 and of 40); candle's composition does not.
#[test]
fn attention_decode_equals_prefill_and_chunks() {
    let mut candle_differs = 0;
    for (heads, kv_heads, d) in [(4, 2, 64), (3, 1, 40)] {
        let seq = 40;
        let (q, k, v) = qkv(heads, kv_heads, seq, d, d as u64);
        let scale = 1.0 / (d as f32).sqrt();
        let whole = attention(&q, &k, &v, scale, true, &[]).unwrap();
        let theirs = candle_attention(&q, &k, &v, scale as f64);
        let chunk = attention(&q.narrow(2, 10, 10).unwrap(), &k.narrow(2, 0, 20).unwrap(), &v.narrow(2, 0, 20).unwrap(), scale, true, &[]).unwrap();
        assert_eq!(bits(&chunk), bits(&whole.narrow(2, 10, 10).unwrap()), "the chunk 10..20");
        for p in 0..seq {
            let (qp, kp, vp) = (q.narrow(2, p, 1).unwrap(), k.narrow(2, 0, p + 1).unwrap(), v.narrow(2, 0, p + 1).unwrap());
            let step = attention(&qp, &kp, &vp, scale, true, &[]).unwrap();
            assert_eq!(bits(&step), bits(&whole.narrow(2, p, 1).unwrap()), "query {p}, heads {heads}/{kv_heads}, d {d}");
            let their_step = candle_attention(&qp, &kp, &vp, scale as f64);
            candle_differs += usize::from(bits(&their_step) != bits(&theirs.narrow(2, p, 1).unwrap()));
        }
    }
    println!("candle's attention: {candle_differs} of 80 decoded queries differ from the prefill");
    assert!(candle_differs > 0, "candle's attention varies between decode and prefill");
}

/// A request left-padded in a batch beside a longer one (causal), and a sentence right-padded
/// beside a longer one (bidirectional, BERT), give their lone runs' bits; a query with no valid
/// key gets zeros.
#[test]
fn attention_ignores_padding_in_a_batch() {
    let (heads, d, width, len) = (2, 32, 40, 23);
    let (q, k, v) = qkv(heads, heads, len, d, 7);
    let (q2, k2, v2) = qkv(heads, heads, width, d, 8);
    let pad = |t: &Tensor, left: bool| {
        let z = Tensor::zeros((1, heads, width - len, d), DType::F32, &Device::Cpu).unwrap();
        Tensor::cat(&if left { [&z, t] } else { [t, &z] }, 2).unwrap()
    };
    for (causal, left) in [(true, true), (false, false)] {
        let batch = |a: &Tensor, b: &Tensor| Tensor::cat(&[&pad(a, left), b], 0).unwrap();
        let range = if left { (width - len, width) } else { (0, len) };
        let all = attention(&batch(&q, &q2), &batch(&k, &k2), &batch(&v, &v2), 0.2, causal, &[range, (0, width)]).unwrap();
        let alone = attention(&q, &k, &v, 0.2, causal, &[]).unwrap();
        assert_eq!(bits(&all.narrow(0, 0, 1).unwrap().narrow(2, range.0, len).unwrap()), bits(&alone), "causal {causal}");
        assert_eq!(bits(&all.narrow(0, 1, 1).unwrap()), bits(&attention(&q2, &k2, &v2, 0.2, causal, &[]).unwrap()), "its neighbour");
        if left {
            assert!(bits(&all.narrow(0, 0, 1).unwrap().narrow(2, 0, width - len).unwrap()).iter().all(|&b| b == 0), "padding queries");
        }
    }
    assert!(attention(&q, &k2, &v2, 1.0, true, &[]).is_ok(), "fewer queries than keys");
    assert!(attention(&q2, &k, &v, 1.0, true, &[]).is_err(), "more queries than keys");
    assert!(attention(&q, &k, &v, 1.0, true, &[(0, len + 1)]).is_err(), "a range past kv");
}

/// The norms: candle's fused kernels' bits (f32, f16, bf16) for every layout; candle_nn's
/// modules change a row's bits when it is read through a view (their `_slow` path).
#[test]
fn norms_take_the_fused_path_for_every_layout() {
    let (m, n) = (7, 96);
    let x = tensor(values(m * n, 90).iter().map(|v| v * 4.0).collect(), &[m, n]);
    let (a, b) = (tensor(values(n, 91), &[n]), tensor(values(n, 92), &[n]));
    let view = x.t().unwrap().contiguous().unwrap().t().unwrap();
    for dt in [DType::F32, DType::F16, DType::BF16] {
        let (x, view, a, b) = (x.to_dtype(dt).unwrap(), view.to_dtype(dt).unwrap(), a.to_dtype(dt).unwrap(), b.to_dtype(dt).unwrap());
        let fused = candle_nn::ops::rms_norm(&x, &a, 1e-5).unwrap();
        assert_eq!(bits(&rms_norm(&x, &a, 1e-5).unwrap()), bits(&fused), "rms {dt:?}");
        assert_eq!(bits(&rms_norm(&view, &a, 1e-5).unwrap()), bits(&fused), "rms {dt:?}, a view");
        let fused = candle_nn::ops::layer_norm(&x, &a, &b, 1e-5).unwrap();
        assert_eq!(bits(&layer_norm(&x, &a, &b, 1e-5).unwrap()), bits(&fused), "layer {dt:?}");
        assert_eq!(bits(&layer_norm(&view, &a, &b, 1e-5).unwrap()), bits(&fused), "layer {dt:?}, a view");
        assert_eq!(bits(&rms_norm(&x.narrow(0, 3, 1).unwrap(), &a, 1e-5).unwrap()), bits(&fused_row(&x, &a, 3)), "a row alone {dt:?}");
    }
    let module = candle_nn::RmsNorm::new(a.clone(), 1e-5);
    let differs = bits(&module.forward(&view).unwrap()) != bits(&module.forward(&x).unwrap());
    assert!(differs, "candle_nn's RmsNorm takes another path for a view");
    assert!(rms_norm(&x, &tensor(values(n + 1, 1), &[n + 1]), 1e-5).is_err(), "a wrong alpha");
}

fn fused_row(x: &Tensor, a: &Tensor, r: usize) -> Tensor {
    candle_nn::ops::rms_norm(&x.contiguous().unwrap(), a, 1e-5).unwrap().narrow(0, r, 1).unwrap()
}

/// Mean pooling reads each sentence's own tokens: a sentence padded in a batch gives its lone
/// run's bits, whatever the padding holds.
#[test]
fn mean_pool_reads_a_sentence_s_tokens_only() {
    let (t, h) = (11, 24);
    let x = tensor(values(3 * t * h, 95), &[3, t, h]);
    let all = mean_pool(&x, &[4, 11, 0]).unwrap();
    assert_eq!(bits(&all.narrow(0, 0, 1).unwrap()), bits(&mean_pool(&x.narrow(0, 0, 1).unwrap().narrow(1, 0, 4).unwrap(), &[4]).unwrap()));
    assert_eq!(bits(&all.narrow(0, 2, 1).unwrap()), vec![0; h], "an empty sentence");
    let first = x.narrow(0, 0, 1).unwrap().narrow(1, 0, 4).unwrap().mean(1).unwrap();
    let ours = all.narrow(0, 0, 1).unwrap().to_vec2::<f32>().unwrap();
    for (o, e) in ours[0].iter().zip(first.to_vec2::<f32>().unwrap()[0].iter()) {
        assert!((o - e).abs() <= 1e-6, "{o} vs candle's mean {e}");
    }
    assert!(mean_pool(&x, &[12, 0, 0]).is_err(), "a length past t");
}

/// The pinned quantized matmul: row r of an M-row call has the bits of the row alone, for every
/// M of the issue (K a multiple of the k-quants' 256-value superblock), on pools of 1 and 2
/// threads. candle's Q6K path changes with M (tiles for M > 1, `vec_dot` for M = 1) where its
/// tiles apply (N a multiple of 16); the other types' candle paths are invariant on this kind of
/// CPU and the test says so rather than assuming they differ.
#[test]
fn pinned_qmatmul_rows_do_not_depend_on_the_others() {
    let mut candle_differs = Vec::new();
    for dtype in [GgmlDType::Q6K, GgmlDType::Q4K, GgmlDType::Q8_0, GgmlDType::Q4_1] {
        for (k, n) in [(256, 64), (1536, 80), (512, 40)] {
            let w = QMatMul::from_qtensor(QTensor::quantize(&tensor(values(n * k, 3), &[n, k]), dtype).unwrap()).unwrap();
            let x = tensor(values(257 * k, 4), &[257, k]);
            for threads in [1, 2] {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                let alone: Vec<Vec<u32>> = (0..257).map(|r| bits(&pool.install(|| qmatmul_invariant(&w, &x.narrow(0, r, 1).unwrap())).unwrap())).collect();
                for m in [2, 3, 7, 8, 16, 17, 33, 64, 65, 257] {
                    let all = pool.install(|| qmatmul_invariant(&w, &x.narrow(0, 0, m).unwrap())).unwrap();
                    for (r, alone) in alone.iter().take(m).enumerate() {
                        assert_eq!(&bits(&all.narrow(0, r, 1).unwrap()), alone, "{dtype:?} row {r} of {m}, K {k} N {n}, {threads} threads");
                    }
                }
            }
            let two = w.forward(&x.narrow(0, 0, 2).unwrap()).unwrap();
            if bits(&two.narrow(0, 0, 1).unwrap()) != bits(&w.forward(&x.narrow(0, 0, 1).unwrap()).unwrap()) {
                candle_differs.push((dtype, k, n));
            }
        }
    }
    println!("candle's QMatMul: row 0 alone differs from row 0 of two at {candle_differs:?}");
    assert!(candle_differs.iter().any(|c| c.0 == GgmlDType::Q6K), "candle's Q6K varies with M");
}
