//! Scaled dot-product attention whose output for a query depends only on that query, its own
//! keys and values: not on the batch, padding, the kv length around them, or the thread count.
//!
//! For query `i` of batch entry `b` and head `h` (kv head `h / (heads / kv_heads)`, grouped-query
//! attention), with valid keys `lo ≤ j < hi` (`keys[b]`, and under `causal` also `j ≤ kv − m + i`,
//! the query's own position when the last `m` of the `kv` positions are the queries):
//!
//! ```text
//! s_j = scale · (q · k_j)       the dot product one FMA chain over the head dim, from +0
//! p   = softmax(s_lo … s_hi−1)  crate::softmax::softmax_row: the sum in lanes from the first key
//! o   = Σ_j p_j · v_j           one FMA chain per output element over j = lo … hi − 1, in order
//! ```
//!
//! Keys outside `[lo, hi)` are never read, so a decode step (kv = p + 1) and the same query in a
//! prefill (kv longer, its tail masked) give the same bits, and so do a request alone and the
//! same request left-padded in a batch. A query with no valid key gets zeros.

use crate::dense::{gemm, values, Packed};
use crate::tile::{self, RP};
use candle_core::{Device, Result, Tensor};
use rayon::prelude::*;

/// Attention of `q` `[b, heads, m, d]` over `k`, `v` `[b, kv_heads, kv, d]` (f32, f16 or bf16, on
/// the CPU, any layout): `[b, heads, m, d]` of `q`'s dtype, each output row as the module docs
/// define it. `keys` holds each batch entry's valid key range `(lo, hi)` (empty: every key);
/// `causal` also ends query `i`'s keys at position `kv − m + i`.
///
/// # Errors
/// Shapes that do not fit (ranks other than 4, batch or head dims that differ, heads not a
/// multiple of kv heads, `m > kv` under `causal`, a `keys` of another length than the batch or a
/// range past `kv`), dtypes that differ, tensors off the CPU.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, causal: bool, keys: &[(usize, usize)]) -> Result<Tensor> {
    let (b, heads, m, d) = q.dims4()?;
    let (kb, kv_heads, kv, kd) = k.dims4()?;
    let fits = kb == b
        && kd == d
        && v.dims() == k.dims()
        && kv_heads > 0
        && heads % kv_heads == 0
        && (!causal || m <= kv)
        && (keys.is_empty() || keys.len() == b)
        && keys.iter().all(|&(lo, hi)| lo <= hi && hi <= kv);
    if !fits || k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        candle_core::bail!("attention of q {:?} k {:?} v {:?} (causal {causal}, key ranges {keys:?}): q [b, heads, m, d], k and v [b, kv heads, kv, d] of one dtype", q.dims(), k.dims(), v.dims())
    }
    let (qv, kvv, vv) = (values(q)?, values(k)?, values(v)?);
    let kernel = tile::pick();
    let group = heads / kv_heads;
    let heads_out: Vec<Vec<f32>> = (0..b * heads)
        .into_par_iter()
        .map(|bh| {
            let (bi, hi) = (bh / heads, bh % heads);
            let at = (bi * kv_heads + hi / group) * kv * d;
            let range = keys.get(bi).copied().unwrap_or((0, kv));
            let head = Head { q: &qv[bh * m * d..(bh + 1) * m * d], k: &kvv[at..at + kv * d], v: &vv[at..at + kv * d], m, kv, d };
            head.attend(scale, causal, range, kernel)
        })
        .collect();
    Tensor::from_vec(heads_out.concat(), (b, heads, m, d), &Device::Cpu)?.to_dtype(q.dtype())
}

/// One (batch entry, head): `m` queries and `kv` keys and values of `d` values each, row-major.
struct Head<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    m: usize,
    kv: usize,
    d: usize,
}

impl Head<'_> {
    /// The head's `m × d` outputs (see the module docs).
    fn attend(&self, scale: f32, causal: bool, (lo, hi): (usize, usize), kernel: tile::Kernel) -> Vec<f32> {
        let (m, kv, d) = (self.m, self.kv, self.d);
        // Kᵀ as a [d, kv] right-hand matrix (a key per column), V as [kv, d].
        let scores = gemm(self.q, m, &Packed::from_nk(self.k, kv, d), d.max(1), kernel);
        let values = Packed::from_kn(self.v, kv, d);
        let panels = d.div_ceil(tile::NR);
        let mut out = vec![0f32; m * d];
        for (i, o) in out.chunks_exact_mut(d.max(1)).enumerate().take(m) {
            let end = if causal { hi.min(kv - m + i + 1) } else { hi };
            if end <= lo {
                continue;
            }
            let mut p: Vec<f32> = scores[i * kv + lo..i * kv + end].iter().map(|s| s * scale).collect();
            crate::softmax::softmax_row(&mut p);
            for first in (0..panels).step_by(RP) {
                let ws: Vec<&[f32]> = (first..panels.min(first + RP)).map(|p| values.panel(p, lo..end)).collect();
                let sums = (kernel.row)(&p, &ws);
                for (j, s) in sums.iter().take(ws.len()).enumerate() {
                    let c = (first + j) * tile::NR;
                    let width = tile::NR.min(d - c);
                    o[c..c + width].copy_from_slice(&s[..width]);
                }
            }
        }
        out
    }
}
