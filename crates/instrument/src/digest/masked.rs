//! Masked keys that poison what the model reads next.
//!
//! A per-token slice of attention scores or probabilities (`[batch, heads, q, keys]`) leaves out
//! the keys its query does not see ([`key_span`]): what they hold depends on the pass's key
//! count, not on the numbers. But the model still reads them. A softmax reads its whole input
//! row: one NaN or +Inf among the masked keys of a mask's output makes every probability of that
//! query NaN. The `@ V` matmul reads every probability: a NaN among the masked keys of a
//! softmax's output makes the attention output NaN. An additive mask adds -inf to the scores'
//! masked keys: a NaN (from a later key holding NaN) stays NaN. Left out of the slice, such a
//! value would make the op after it look like the op where two runs parted (its inputs matched),
//! and the guilty op look identical.
//!
//! So each slice of such an output also counts, per query row (head) whose own keys hold none,
//! the poisoning values among the keys it leaves out: NaN for every op; +Inf too for the ops
//! whose masked keys are read whole ([`reads_masked_keys`]: the mask ops, softmax), where it
//! makes a NaN (-Inf is the mask's fill; the scores' +Inf from an f16 overflow at a later key is
//! replaced by a `where_cond` mask). A row whose own keys already hold one is left as it is:
//! it differs from a clean run anyway, and its masked keys' count would depend on the pass's
//! key count. A count `c > 0` is added to the slice's `nonfinite` and folded into its digest:
//! `xxh3-64(digest as 8 LE bytes ‖ c as 4 LE bytes)` (docs/trace-format.md, "Per-token stats").
//! A slice without such values keeps the bits earlier builds wrote.
//!
//! The count is only taken when the whole tensor holds a NaN or +Inf (its [`Stats`]), so a run
//! without them pays one comparison per record; the values are read where they lie (a tensor
//! on a device is first copied to the host in its own dtype).

use super::streams::token_streams;
use super::{Elem, Summary};
use candle_core::{CpuStorage, Storage, Tensor};
use candle_trace_format::record::{key_span, Rows, Stats, TokenAxis, TokenStat};
use candle_trace_format::site::Op;

/// Whether the model reads the masked keys of op `op`'s output whole, so that +Inf there
/// poisons too: a mask's output (the softmax reads its whole row) and a softmax's output (the
/// `@ V` matmul reads every probability). Of the scores before the mask only a NaN counts.
pub fn reads_masked_keys(op: Op) -> bool {
    candle_trace_format::summary::is_mask(Some(op)) || op == Op::Softmax
}

/// Folds into `summary`'s per-token stats the poisoning values (NaN; +Inf too when `pos_inf`)
/// among the keys each slice of `t` leaves out (`t`: shape `[batch, …, q, keys]`, any dtype and
/// device; the tensor `summary` was made from with `axis` and `rows`). Nothing to do for an
/// axis that keeps every key, or when `summary.stats` counts none.
///
/// # Errors
/// Candle's, copying a device tensor to the host; an axis that does not fit `t`'s shape, or a
/// summary whose slices are not the axis's.
pub fn fold_masked_keys(summary: &mut Summary, t: &Tensor, axis: &TokenAxis, rows: &Rows, pos_inf: bool) -> candle_core::Result<()> {
    if !poisons(&summary.stats, pos_inf) || axis.seq_dim.is_none() || !(axis.causal || rows.keys_last) {
        return Ok(());
    }
    let t = if t.device().is_cpu() { t.contiguous()? } else { t.to_device(&candle_core::Device::Cpu)?.contiguous()? };
    let (storage, layout) = t.storage_and_layout();
    let (start, end) = layout.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("tensor is not contiguous".into()))?;
    let (dims, s) = (t.dims(), &mut summary.tokens);
    match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => fold_all(s, &v[start..end], dims, axis, rows, pos_inf),
        Storage::Cpu(CpuStorage::F16(v)) => fold_all(s, &v[start..end], dims, axis, rows, pos_inf),
        Storage::Cpu(CpuStorage::BF16(v)) => fold_all(s, &v[start..end], dims, axis, rows, pos_inf),
        Storage::Cpu(CpuStorage::F64(v)) => fold_all(s, &v[start..end], dims, axis, rows, pos_inf),
        _ => Ok(()), // integer outputs hold no NaN
    }
}

/// Whether a tensor with these stats holds a poisoning value.
fn poisons(s: &Stats, pos_inf: bool) -> bool {
    s.nan > 0 || (pos_inf && s.pos_inf > 0)
}

/// [`fold`]s each of `tokens` (in [`token_streams`]' order) by its slice's count of poisoning
/// values among the masked keys of `values` (shape `dims`, row-major).
fn fold_all<T: Elem>(tokens: &mut [TokenStat], values: &[T], dims: &[usize], axis: &TokenAxis, rows: &Rows, pos_inf: bool) -> candle_core::Result<()> {
    let inner = dims.last().copied().unwrap_or(0);
    let bad = |x: &T| {
        let v = x.to_f64();
        v.is_nan() || (pos_inf && v == f64::INFINITY)
    };
    let slices = token_streams(dims, axis, rows)?;
    if slices.len() != tokens.len() {
        candle_core::bail!("{} token slices summarised, {} cut", tokens.len(), slices.len());
    }
    for (stat, t) in tokens.iter_mut().zip(slices) {
        let (lo, hi) = rows.window(t.row);
        let (k0, k1) = key_span(axis, rows, (lo, hi), t.pos.saturating_add(lo), inner);
        let mut c = 0usize;
        for run in t.stream.runs() {
            // The run is keys k0..k1 of one query row of `inner` keys.
            let row = run.start - k0;
            let keys = values.get(row..row + inner).ok_or_else(|| candle_core::Error::Msg(format!("token slice past the {} values", values.len())))?;
            if !keys[k0..k1].iter().any(bad) {
                c += keys[..k0].iter().chain(&keys[k1..]).filter(|x| bad(x)).count();
            }
        }
        fold(stat, c.min(u32::MAX as usize) as u32);
    }
    Ok(())
}

/// Adds `c` masked poisoning values to `stat`: to its count, and into its digest.
fn fold(stat: &mut TokenStat, c: u32) {
    if c == 0 {
        return;
    }
    stat.nonfinite = stat.nonfinite.saturating_add(c);
    let mut bytes = [0u8; 12];
    bytes[..8].copy_from_slice(&stat.digest.to_le_bytes());
    bytes[8..].copy_from_slice(&c.to_le_bytes());
    stat.digest = candle_trace_format::hash::xxh3_64(&bytes);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digest::summarize_rows;
    use candle_core::Device;

    /// The summary of `t` with its masked keys folded in.
    fn folded(t: &Tensor, axis: &TokenAxis, rows: &Rows, pos_inf: bool) -> candle_core::Result<Summary> {
        let mut s = summarize_rows(t, Some(axis), rows)?;
        fold_masked_keys(&mut s, t, axis, rows, pos_inf)?;
        Ok(s)
    }

    fn causal(first_pos: u32) -> TokenAxis {
        TokenAxis { seq_dim: Some(2), first_pos, keep_from: 0, causal: true }
    }

    /// Scores `[1 batch, 1 head, 3 queries, 3 keys]` after a causal mask, with `tail` at query
    /// 0's key 2 (masked).
    fn masked(tail: f32) -> candle_core::Result<Tensor> {
        let ninf = f32::NEG_INFINITY;
        Tensor::from_vec(vec![0.5f32, ninf, tail, 0.25, 0.75, ninf, 0.1, 0.2, 0.3], (1, 1, 3, 3), &Device::Cpu)
    }

    /// A NaN or +Inf among a query's masked keys changes that query's slice (count and digest)
    /// and no other; -Inf, the mask's fill, changes nothing; +Inf counts only where asked; and
    /// the bits of a slice without one are those of the plain summary.
    #[test]
    fn a_poisoning_masked_key_changes_its_querys_slice_only() -> candle_core::Result<()> {
        let (axis, rows) = (causal(0), Rows::default());
        let clean = folded(&masked(f32::NEG_INFINITY)?, &axis, &rows, true)?;
        assert_eq!(clean, summarize_rows(&masked(f32::NEG_INFINITY)?, Some(&axis), &rows)?);
        for (tail, pos_inf, counted) in [(f32::NAN, true, true), (f32::NAN, false, true), (f32::INFINITY, true, true), (f32::INFINITY, false, false)] {
            let s = folded(&masked(tail)?, &axis, &rows, pos_inf)?;
            let plain = summarize_rows(&masked(tail)?, Some(&axis), &rows)?;
            assert_eq!(s.tokens[0].nonfinite, counted as u32, "{tail} {pos_inf}");
            assert_eq!(s.tokens[0].digest != clean.tokens[0].digest, counted, "{tail} {pos_inf}");
            assert_eq!((s.tokens[0].sum, s.tokens[0].samples), (clean.tokens[0].sum, clean.tokens[0].samples));
            assert_eq!((&s.tokens[1..], s.digest, &s.stats), (&clean.tokens[1..], plain.digest, &plain.stats), "{tail}");
        }
        Ok(())
    }

    /// A query row whose own keys already hold a NaN is left as it is (its masked keys' count
    /// would depend on the pass's key count), while another head's row of the same slice counts;
    /// batch rows and chunked positions (`first_pos` 2: queries 2 and 3 of 4 keys) line up.
    #[test]
    fn rows_already_poisoned_are_left_and_heads_rows_and_chunks_line_up() -> candle_core::Result<()> {
        let nan = f32::NAN;
        // [2 batch, 2 heads, 2 queries (positions 2, 3), 4 keys]; query 2 sees keys 0..=2.
        #[rustfmt::skip]
        let v: Vec<f32> = vec![
            // row 0, head 0: query 2 all NaN (left), query 3 clean
            nan, nan, nan, nan,   0.1, 0.2, 0.3, 0.4,
            // row 0, head 1: query 2 clean with a NaN at masked key 3 (counts)
            0.1, 0.2, 0.3, nan,   0.1, 0.2, 0.3, 0.4,
            // row 1, head 0: clean
            0.1, 0.2, 0.3, 0.0,   0.1, 0.2, 0.3, 0.4,
            // row 1, head 1: query 2 with +Inf at masked key 3
            0.1, 0.2, 0.3, f32::INFINITY,   0.1, 0.2, 0.3, 0.4,
        ];
        let t = Tensor::from_vec(v, (2, 2, 2, 4), &Device::Cpu)?;
        let rows = Rows::default();
        let s = folded(&t, &causal(2), &rows, true)?;
        let plain = summarize_rows(&t, Some(&causal(2)), &rows)?;
        let at = |s: &Summary| s.tokens.iter().map(|x| (x.row, x.pos, x.nonfinite)).collect::<Vec<_>>();
        assert_eq!(at(&plain), [(0, 2, 3), (0, 3, 0), (1, 2, 0), (1, 3, 0)]);
        assert_eq!(at(&s), [(0, 2, 4), (0, 3, 0), (1, 2, 1), (1, 3, 0)]);
        Ok(())
    }

    /// A left-padded row's query also leaves out the padding keys before its first real token,
    /// and an encoder's (`keys_last`) the keys past its last: a NaN there counts too, at the
    /// slice of the query that reads it.
    #[test]
    fn padding_keys_count_as_masked() -> candle_core::Result<()> {
        // Row 0 real from position 1: query 2 (own position 1) sees keys 1..=2, not key 0.
        let padded = Rows { windows: vec![(1, u32::MAX)], keys_last: false };
        // Encoder row 0 of 2 real tokens: every query sees keys 0..2, not key 2.
        let keys = TokenAxis { causal: false, ..causal(0) };
        let encoder = Rows { windows: vec![(0, 2)], keys_last: true };
        let nan = f32::NAN;
        let v = |x: [f32; 9]| Tensor::from_vec(x.to_vec(), (1, 1, 3, 3), &Device::Cpu);
        for (axis, rows, t, want) in
            [(&causal(0), &padded, v([0.0, 0.0, 0.0, 0.0, 0.5, 0.0, nan, 0.25, 0.75])?, vec![0, 1]), (&keys, &encoder, v([0.5, 0.5, 0.0, 0.5, 0.5, nan, 0.0, 0.0, 0.0])?, vec![0, 1])]
        {
            let s = folded(&t, axis, rows, true)?;
            assert_eq!(s.tokens.iter().map(|t| t.nonfinite).collect::<Vec<_>>(), want, "{rows:?}");
        }
        Ok(())
    }

    /// Only the mask ops and softmax read their masked keys whole.
    #[test]
    fn the_mask_ops_and_softmax_read_their_masked_keys() {
        let read: Vec<Op> = [Op::WhereCond, Op::MaskAdd, Op::Softmax, Op::Matmul, Op::Scale].into_iter().filter(|&o| reads_masked_keys(o)).collect();
        assert_eq!(read, [Op::WhereCond, Op::MaskAdd, Op::Softmax]);
    }
}
