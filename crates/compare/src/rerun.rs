//! What a command that re-runs a recorded run from its trace (`trace bisect --causal`, `trace
//! check --golden`) checks of the trace first. Pure functions over the header and items, kept
//! free of candle so the fuzz targets drive them on crafted files.

use candle_trace_format::error::{Error, Result};
use candle_trace_format::fields::{Alteration, Perturb};
use candle_trace_format::format::Trace;
use candle_trace_format::record::{Header, Item};

/// The weight dtypes a header may name for a re-run (`RunInfo::dtype`).
pub const DTYPES: [&str; 4] = ["q", "f32", "f16", "bf16"];

/// The `--perturb` specs to apply again when `h`'s run is re-run from its header.
///
/// # Errors
/// [`Error::Usage`] for an encoder run (only generation is re-run), a redacted trace (no
/// prompt), a patched re-run (`--causal-out`), an alteration that does not parse, or a dtype
/// outside [`DTYPES`].
pub fn rerun_perturbs(h: &Header) -> Result<Vec<Perturb>> {
    let r = &h.run;
    if !r.pooling.is_empty() {
        return Err(Error::usage("an encoder run: only decoder runs (generation) are re-run from a header"));
    }
    if !candle_trace_format::redact::holds_prompt(h) {
        return Err(Error::usage("a redacted trace holds no prompt, so its run cannot be re-run; use the unredacted trace"));
    }
    if r.patched() {
        return Err(Error::usage("this trace is a patched re-run (--causal-out): it cannot be re-run from its header"));
    }
    if !DTYPES.contains(&r.dtype.as_str()) {
        return Err(Error::usage(format!("dtype {:?}: expected one of {}", r.dtype, DTYPES.join(", "))));
    }
    Ok(r.alterations()?.into_iter().filter_map(|a| if let Alteration::Perturb(p) = a { Some(p) } else { None }).collect())
}

/// Whether `t`'s generated tokens were redacted: redaction clears the forward passes' ids
/// (unless the prompt is kept) and every generated token's id and top-5 (a recorded choice
/// always has a top-5).
pub fn tokens_redacted(t: &Trace) -> bool {
    t.items.iter().any(|i| match i {
        Item::Forward(f) => f.ids.is_empty() && f.seq_len > 0,
        Item::Token(e) => e.rows.iter().any(|c| c.top.is_empty()),
        _ => false,
    })
}

/// Generated tokens of `t`'s batch row `row`, in order: (token id, position).
pub fn row_tokens(t: &Trace, row: u32) -> Vec<(u32, u32)> {
    t.items
        .iter()
        .filter_map(|i| match i {
            Item::Token(e) => e.rows.iter().find(|c| c.row == row).map(|c| (c.token, e.pos)),
            _ => None,
        })
        .collect()
}

/// The positions at which runs a and b generated token `step` (`ta`, `tb`: [`row_tokens`] of
/// each). The step comes from bisect's reading of the files, so a crafted trace can name one
/// past either list: that is refused, not indexed.
///
/// # Errors
/// [`Error::Mismatch`] when `step` is past either list.
pub fn step_positions(ta: &[(u32, u32)], tb: &[(u32, u32)], step: usize) -> Result<(u32, u32)> {
    match (ta.get(step), tb.get(step)) {
        (Some(x), Some(y)) => Ok((x.1, y.1)),
        _ => Err(Error::Mismatch(format!("--causal: the traces hold {} and {} generated tokens, so token {step} cannot be followed", ta.len(), tb.len()))),
    }
}
