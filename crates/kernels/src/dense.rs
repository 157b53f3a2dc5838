//! Dense (unquantized) matrix products whose every output row depends on that row's inputs
//! alone: [`Linear`] (`x @ Wᵀ + b`, the weight packed once) and [`matmul`] (a batched `a @ b`, for
//! attention's scores and its weighted sum of values).
//!
//! The order of the sum is fixed by K alone. Output element `(r, c)` is
//!
//! ```text
//! s_j = fma-chain over k in block j (k = j·kc … min(K, (j+1)·kc) − 1, in order, from +0)
//! y   = ((s_0 + s_1) + s_2) + …                                   (f32 adds, in block order)
//! ```
//!
//! with `kc` = [`KC`] for [`Linear`] (blocks aligned at k = 0) and one block for [`matmul`] (so
//! a run of zero weights before a request's first key leaves the chain at +0 and never shifts
//! it). Work is split over rows and column panels, never over K; one row (a decode step) runs the
//! same micro-kernel as many (see [`crate::tile`]). f16 and bf16 inputs are widened to f32
//! (exactly) and the f32 result rounded once to the input's type.
//!
//! candle 0.11.1's CPU matmul (the gemm crate) is not like this: one row takes a gemv kernel
//! whose bits differ from the same row inside a larger product (measured: row 0 of
//! `[1,576]·[576,1536]` against M = 2, 8, 128).

use crate::tile::{self, Kernel, MR, NR};
use candle_core::{DType, Device, Module, Result, Tensor, D};
use rayon::prelude::*;

/// K per block of [`Linear`]'s sum: a constant, so block boundaries depend on K alone. 256 steps
/// of a 16-column panel are 16 KiB, which stays in L1 while the panel's row tiles run.
pub const KC: usize = 256;
/// Rows per parallel work item (eight tiles).
const MC: usize = 8 * MR;
/// Column panels per parallel work item (64 columns).
const NC: usize = tile::RP;

/// A weight `[k, n]` (K rows of N columns) in panels of [`NR`] columns: panel `p` holds, for each
/// `k`, the 16 weights of columns `16p … 16p + 15` (zero past N), so the micro-kernel reads it
/// in order.
#[derive(Clone, Debug)]
pub struct Packed {
    pub(crate) k: usize,
    pub(crate) n: usize,
    pub(crate) data: Vec<f32>,
}

impl Packed {
    /// From a linear layer's weight `[n, k]`, row-major (`w[c·k + k']`).
    pub fn from_nk(w: &[f32], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k, "a weight of {n}×{k}");
        let mut data = vec![0f32; n.div_ceil(NR) * k * NR];
        for (c, row) in w.chunks_exact(k.max(1)).enumerate().take(n) {
            let (p, j) = (c / NR, c % NR);
            for (kk, &v) in row.iter().enumerate() {
                data[(p * k + kk) * NR + j] = v;
            }
        }
        Packed { k, n, data }
    }

    /// Panel `p`'s weights for `k` in `ks` (`ks.len() · NR` values, in the micro-kernel's order).
    pub(crate) fn panel(&self, p: usize, ks: std::ops::Range<usize>) -> &[f32] {
        &self.data[(p * self.k + ks.start) * NR..(p * self.k + ks.end) * NR]
    }

    /// From a right-hand matrix `[k, n]`, row-major (`b[k'·n + c]`): each panel's step `k'` is
    /// a run of row `k'`, copied as one slice.
    pub fn from_kn(b: &[f32], k: usize, n: usize) -> Self {
        assert_eq!(b.len(), k * n, "a matrix of {k}×{n}");
        let panels = n.div_ceil(NR);
        let mut data = vec![0f32; panels * k * NR];
        for (kk, row) in b.chunks_exact(n.max(1)).enumerate().take(k) {
            for p in 0..panels {
                let w = NR.min(n - p * NR);
                data[(p * k + kk) * NR..][..w].copy_from_slice(&row[p * NR..p * NR + w]);
            }
        }
        Packed { k, n, data }
    }
}

/// `x @ W` for `x` `[m, k]` row-major and a packed `W` `[k, n]`: `[m, n]` row-major, the sum of
/// each element in blocks of `kc` (see the module docs), with micro-kernel `kernel`.
///
/// # Panics
/// When `x.len() != m · k` for the packed K, or `kc == 0`.
pub fn gemm(x: &[f32], m: usize, w: &Packed, kc: usize, kernel: Kernel) -> Vec<f32> {
    gemm_on(x, m, w, kc, kernel, true)
}

/// [`gemm`], its work items in parallel or (`parallel` false: a caller that is itself parallel
/// over many small products) one after the other. The bits are the same either way.
pub fn gemm_on(x: &[f32], m: usize, w: &Packed, kc: usize, kernel: Kernel, parallel: bool) -> Vec<f32> {
    let (k, n) = (w.k, w.n);
    assert!(x.len() == m * k && kc > 0, "{} activations for {m}×{k}", x.len());
    let mut out = vec![0f32; m * n];
    if m == 0 || n == 0 || k == 0 {
        return out;
    }
    let panels = n.div_ceil(NR);
    let items: Vec<(usize, usize)> = (0..m.div_ceil(MC)).flat_map(|i| (0..panels.div_ceil(NC)).map(move |j| (i, j))).collect();
    let run = |&(i, j): &(usize, usize)| item(x, w, kc, kernel, i * MC..m.min((i + 1) * MC), j * NC..panels.min((j + 1) * NC));
    let parts: Vec<Vec<f32>> = if parallel { items.par_iter().map(run).collect() } else { items.iter().map(run).collect() };
    for (&(i, j), part) in items.iter().zip(parts) {
        let (rows, cols) = (i * MC..m.min((i + 1) * MC), j * NC * NR..n.min((j + 1) * NC * NR));
        for (r, src) in rows.zip(part.chunks_exact(cols.len())) {
            out[r * n + cols.start..r * n + cols.end].copy_from_slice(src);
        }
    }
    out
}

/// One work item: rows `rows` against panels `panels`, returned row-major over the item's columns.
fn item(x: &[f32], w: &Packed, kc: usize, kernel: Kernel, rows: std::ops::Range<usize>, panels: std::ops::Range<usize>) -> Vec<f32> {
    let (k, n) = (w.k, w.n);
    let c0 = panels.start * NR;
    let width = n.min(panels.end * NR) - c0;
    let mut out = vec![0f32; rows.len() * width];
    for k0 in (0..k).step_by(kc) {
        let k1 = k.min(k0 + kc);
        let wblock = |p: usize| &w.data[(p * k + k0) * NR..(p * k + k1) * NR];
        let mut merge = |r: usize, p: usize, s: &[f32; NR]| {
            let o = &mut out[(r - rows.start) * width + p * NR - c0..][..NR.min(n - p * NR)];
            for (o, &s) in o.iter_mut().zip(s) {
                *o = if k0 == 0 { s } else { *o + s };
            }
        };
        if rows.len() == 1 {
            // A lone row: every panel of the item at once (NC ≤ RP).
            let ws: Vec<&[f32]> = panels.clone().map(wblock).collect();
            let sums = (kernel.row)(&x[rows.start * k + k0..rows.start * k + k1], &ws);
            for (p, s) in panels.clone().zip(&sums) {
                merge(rows.start, p, s);
            }
            continue;
        }
        for p in panels.clone() {
            for t in rows.clone().step_by(MR) {
                let count = MR.min(rows.end - t);
                let mut tile: [&[f32]; MR] = [&[]; MR];
                for (i, row) in tile.iter_mut().take(count).enumerate() {
                    *row = &x[(t + i) * k + k0..(t + i) * k + k1];
                }
                let sums = (kernel.tile)(&tile[..count], wblock(p));
                for (i, s) in sums.iter().take(count).enumerate() {
                    merge(t + i, p, s);
                }
            }
        }
    }
    out
}

/// A tensor's values as f32 (f16 and bf16 widened exactly), row-major.
///
/// # Errors
/// A tensor off the CPU or of another dtype than f32, f16 and bf16.
pub(crate) fn values(t: &Tensor) -> Result<Vec<f32>> {
    if !matches!(t.device(), Device::Cpu) {
        candle_core::bail!("the invariant dense kernels run on the CPU, not {:?}", t.device())
    }
    match t.dtype() {
        DType::F32 | DType::F16 | DType::BF16 => t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>(),
        d => candle_core::bail!("the invariant dense kernels take f32, f16 or bf16, not {d:?}"),
    }
}

/// Calls `f` with `t`'s values as f32, row-major: a contiguous f32 tensor's own storage, without
/// a copy (a KV cache read at every decode step), anything else through [`values`].
///
/// # Errors
/// As [`values`].
fn with_values<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    if t.dtype() == DType::F32 {
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) {
            return Ok(f(&cpu.as_slice::<f32>()?[start..end]));
        }
    }
    Ok(f(&values(t)?))
}

/// A linear layer `y = x @ Wᵀ + b` whose output rows depend on their own input rows alone: the
/// weight `[n, k]` packed once (as f32) when the layer is built, each element summed in blocks of
/// [`KC`] along K (see the module docs). A drop-in for `candle_nn::Linear`:
///
/// ```
/// use candle_core::{Device, Module, Tensor};
/// let dev = Device::Cpu;
/// let w = Tensor::randn(0f32, 1.0, (96, 64), &dev)?;
/// let layer = candle_nn::Linear::new(w, None);
/// // The same weights, batch-invariant:
/// let inv = candle_trace_kernels::Linear::new(layer.weight(), layer.bias())?;
/// let x = Tensor::randn(0f32, 1.0, (2, 5, 64), &dev)?;
/// let y = inv.forward(&x)?;
/// assert_eq!(y.dims(), &[2, 5, 96]);
/// // Row 3 of the first batch entry, computed alone, has the same bits.
/// let alone = inv.forward(&x.narrow(0, 0, 1)?.narrow(1, 3, 1)?)?;
/// assert_eq!(alone.flatten_all()?.to_vec1::<f32>()?, y.narrow(0, 0, 1)?.narrow(1, 3, 1)?.flatten_all()?.to_vec1::<f32>()?);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct Linear {
    w: Packed,
    bias: Option<Tensor>,
    kernel: Kernel,
}

impl Linear {
    /// Packs `weight` `[n, k]` (f32, f16 or bf16, on the CPU); `bias` `[n]` is added after the
    /// product is rounded to the input's dtype, as `candle_nn::Linear` adds it.
    ///
    /// # Errors
    /// A weight that is not two-dimensional, off the CPU or of another dtype.
    pub fn new(weight: &Tensor, bias: Option<&Tensor>) -> Result<Self> {
        let (n, k) = weight.dims2()?;
        Ok(Linear { w: Packed::from_nk(&values(weight)?, n, k), bias: bias.cloned(), kernel: tile::pick() })
    }

    /// The same layer with micro-kernel `kernel` (tests: the scalar one against the AVX2 one).
    pub fn with_kernel(self, kernel: Kernel) -> Self {
        Linear { kernel, ..self }
    }
}

impl Module for Linear {
    /// `x` `[.., k]` (f32, f16 or bf16, on the CPU, any layout) to `[.., n]` of `x`'s dtype.
    ///
    /// # Errors
    /// A last dim other than K; `x` off the CPU or of another dtype; candle's errors adding the
    /// bias.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let k = x.dim(D::Minus1)?;
        if k != self.w.k {
            candle_core::bail!("an input of {k} features for a linear layer of {}", self.w.k)
        }
        let m = x.elem_count() / k.max(1);
        let y = with_values(x, |xv| gemm(xv, m, &self.w, KC, self.kernel))?;
        let mut dims = x.dims().to_vec();
        *dims.last_mut().expect("rank ≥ 1") = self.w.n;
        let y = Tensor::from_vec(y, dims, &Device::Cpu)?.to_dtype(x.dtype())?;
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// `a @ b` for `a` `[.., m, k]` and `b` `[.., k, n]` with the same leading dims (f32, f16 or bf16,
/// on the CPU, any layout): `[.., m, n]` of `a`'s dtype. Each element is one chain over K from
/// k = 0 (no blocks), so in attention's `P @ V` zero probabilities before a request's first key
/// (left padding) leave it at +0 and masked keys after its last add zeros: a query's bits do not
/// depend on padding or on the kv length around it.
///
/// # Errors
/// Ranks below 2, leading dims or inner dims that differ, dtypes that differ, tensors off the CPU.
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    batched(a, b, false)
}

/// `a @ bᵀ` for `a` `[.., m, k]` and `b` `[.., n, k]` (attention's scores `Q·Kᵀ` with the keys as
/// they are stored): [`matmul`]'s bits for `matmul(a, bᵀ)`, without copying the transposed view.
///
/// # Errors
/// As [`matmul`].
pub fn matmul_t(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    batched(a, b, true)
}

/// [`matmul`] (`b` `[.., k, n]`) or [`matmul_t`] (`b` `[.., n, k]`).
fn batched(a: &Tensor, b: &Tensor, b_t: bool) -> Result<Tensor> {
    let (rank, dt) = (a.rank(), a.dtype());
    if rank < 2 || b.rank() != rank || a.dims()[..rank - 2] != b.dims()[..rank - 2] || b.dtype() != dt {
        candle_core::bail!("matmul of {:?} {:?} and {:?} {:?}: [.., m, k] @ [.., k, n] of one dtype", a.dims(), dt, b.dims(), b.dtype())
    }
    let (m, k) = (a.dims()[rank - 2], a.dims()[rank - 1]);
    let (k2, n) = if b_t { (b.dims()[rank - 1], b.dims()[rank - 2]) } else { (b.dims()[rank - 2], b.dims()[rank - 1]) };
    if k != k2 {
        candle_core::bail!("matmul of {:?} and {:?}{}: inner dims {k} and {k2}", a.dims(), b.dims(), if b_t { "ᵀ" } else { "" })
    }
    let kernel = tile::pick();
    let batches = a.dims()[..rank - 2].iter().product::<usize>();
    let parts = with_values(a, |av| {
        with_values(b, |bv| {
            // Many small products (heads): parallel over them, each one sequential.
            let one = |i: usize, parallel: bool| {
                let bi = &bv[i * k * n..(i + 1) * k * n];
                let packed = if b_t { Packed::from_nk(bi, n, k) } else { Packed::from_kn(bi, k, n) };
                gemm_on(&av[i * m * k..(i + 1) * m * k], m, &packed, k.max(1), kernel, parallel)
            };
            if batches == 1 {
                vec![one(0, true)]
            } else {
                (0..batches).into_par_iter().map(|i| one(i, false)).collect::<Vec<_>>()
            }
        })
    })??;
    let mut dims = a.dims().to_vec();
    dims[rank - 1] = n;
    Tensor::from_vec(parts.concat(), dims, &Device::Cpu)?.to_dtype(dt)
}
