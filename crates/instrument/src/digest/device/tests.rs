//! The device algorithm, run on the CPU, against the CPU summary: same bits on every dtype the
//! device computes (f32, f16, bf16, f64), with and without token axes.

use super::reference_summary;
use crate::digest::{summarize_rows, Summary};
use candle_core::{DType, Device, Tensor};
use candle_trace_format::record::{Rows, TokenAxis};

/// Deterministic values in about [-20, 20], with NaN and ±Inf at a few places when `nonfinite`.
pub(super) fn values(n: usize, nonfinite: bool) -> Vec<f32> {
    (0..n)
        .map(|i| match (nonfinite, i % 997) {
            (true, 13) => f32::NAN,
            (true, 500) => f32::INFINITY,
            (true, 811) => f32::NEG_INFINITY,
            _ => ((i as u64).wrapping_mul(2_654_435_761) % 40_001) as f32 / 1000.0 - 20.0 + (i % 7) as f32 * 1e-6,
        })
        .collect()
}

/// Compares every field bit for bit (NaN samples compare by bits too).
pub(super) fn assert_same(a: &Summary, b: &Summary, what: &str) {
    let stats = |s: &Summary| {
        let t = &s.stats;
        ([t.sum, t.l2, t.min, t.max, t.abs_max].map(f64::to_bits), [t.count, t.nan, t.pos_inf, t.neg_inf])
    };
    assert_eq!(a.digest, b.digest, "{what}: digest");
    assert_eq!(stats(a), stats(b), "{what}: stats");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&a.samples), bits(&b.samples), "{what}: samples");
    assert_eq!(a.tokens.len(), b.tokens.len(), "{what}: token count");
    for (x, y) in a.tokens.iter().zip(&b.tokens) {
        let key = |t: &candle_trace_format::record::TokenStat| (t.row, t.pos, t.digest, t.sum.to_bits(), t.abs_max.to_bits(), t.nonfinite, bits(&t.samples));
        assert_eq!(key(x), key(y), "{what}: token row {} pos {}", x.row, x.pos);
    }
}

/// (shape, token axis, rows): hidden states with short and long token slices, runs of an odd
/// length (words straddle runs), causal attention with a KV-cache prefix, padded batch rows, one
/// slice that is the whole tensor, no token axis, a row per position, a tensor of several chunks.
pub(super) fn cases() -> Vec<(Vec<usize>, Option<TokenAxis>, Rows)> {
    let ax = |seq_dim: Option<u32>, first_pos, keep_from, causal| TokenAxis { seq_dim, first_pos, keep_from, causal };
    let padded = Rows { windows: vec![(0, 9), (3, 9)], keys_last: false };
    vec![
        (vec![2, 5, 96], Some(ax(Some(1), 0, 0, false)), Rows::default()),
        (vec![2, 5, 24], Some(ax(Some(1), 3, 4, false)), Rows::default()),
        (vec![1, 3, 7, 701], Some(ax(Some(2), 10, 0, false)), Rows::default()),
        (vec![1, 4, 9, 300], Some(ax(Some(2), 291, 291, true)), Rows::default()),
        (vec![2, 2, 9, 9], Some(ax(Some(2), 0, 0, true)), padded.clone()),
        (vec![2, 9, 130], Some(ax(Some(1), 0, 0, false)), padded),
        (vec![1, 1, 2600], Some(ax(Some(1), 7, 0, false)), Rows::default()),
        (vec![3, 1500], None, Rows::default()),
        (vec![3, 70], Some(ax(None, 5, 0, false)), Rows::default()),
        // Larger than the CPU pass's 8 KiB chunk in every dtype: hashed and reduced in chunks.
        (vec![1, 5, 9001], Some(ax(Some(1), 0, 0, false)), Rows::default()),
    ]
}

#[test]
fn device_algorithm_equals_the_cpu_summary() -> candle_core::Result<()> {
    for (dims, axis, rows) in &cases() {
        let n: usize = dims.iter().product();
        for nonfinite in [false, true] {
            let t = Tensor::from_vec(values(n, nonfinite), dims.as_slice(), &Device::Cpu)?;
            for dt in [DType::F32, DType::F16, DType::BF16, DType::F64] {
                let t = t.to_dtype(dt)?;
                let what = format!("{dims:?} {axis:?} {dt:?} nonfinite={nonfinite}");
                let cpu = summarize_rows(&t, axis.as_ref(), rows)?;
                assert!(axis.is_none() || !cpu.tokens.is_empty(), "{what}: the case has token slices");
                assert_same(&reference_summary(&t, axis.as_ref(), rows)?, &cpu, &what);
            }
        }
    }
    Ok(())
}
