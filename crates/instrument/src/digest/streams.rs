//! The byte streams a summary hashes and reduces: the whole tensor, and one per token slice.
//!
//! A token slice of a row-major tensor `[batch][mid][seq][inner]` at one (row, position) is `mid`
//! runs of the same length, one per `mid` index, a fixed stride apart ([`Stream`]). The CPU
//! digest ([`crate::digest`]) and the device digest read the same streams, so they agree on what
//! a token slice is.

use candle_trace_format::record::{key_span, Rows, TokenAxis};

/// A logical run of elements of a contiguous tensor: `segs` runs of `seg` elements, run `m`
/// starting at element `first + m * stride`. Elements are read in run order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stream {
    /// Element offset of the first run.
    pub first: usize,
    /// Elements from one run's start to the next's.
    pub stride: usize,
    /// Elements per run.
    pub seg: usize,
    /// Number of runs.
    pub segs: usize,
}

impl Stream {
    /// The whole tensor of `n` elements.
    pub fn whole(n: usize) -> Self {
        Stream { first: 0, stride: n, seg: n, segs: 1 }
    }
    /// Elements in the stream.
    pub fn elems(&self) -> usize {
        self.seg * self.segs
    }
    /// Flat offset of the stream's element `i` (`i < elems()`).
    pub fn offset(&self, i: usize) -> usize {
        self.first + (i / self.seg) * self.stride + i % self.seg
    }
    /// The flat element ranges of the runs, in order.
    pub fn runs(&self) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
        (0..self.segs).map(|m| self.first + m * self.stride..self.first + m * self.stride + self.seg)
    }
}

/// One token slice: batch row, position (as [`candle_trace_format::record::TokenStat::pos`]) and
/// its elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenStream {
    /// Batch row.
    pub row: usize,
    /// Token position (absolute, or from the row's first real token in a padded batch).
    pub pos: u32,
    /// The slice's elements.
    pub stream: Stream,
}

/// The token slices of a tensor of shape `dims` (row-major, dim 0 the batch axis) for `axis`,
/// row by row and position by position: positions below `axis.keep_from` and outside a row's
/// window are left out; causal and encoder attention keep only the keys the query sees
/// ([`key_span`]).
///
/// # Errors
/// A scalar tensor, or a sequence dim that does not fit `dims` (dim 0, out of range, or causal
/// but not the second-to-last dim).
pub fn token_streams(dims: &[usize], axis: &TokenAxis, rows: &Rows) -> candle_core::Result<Vec<TokenStream>> {
    let mut out = Vec::new();
    each_token_stream(dims, axis, rows, |t| out.push(t))?;
    Ok(out)
}

/// Calls `f` on each of [`token_streams`], in its order, without collecting them.
///
/// # Errors
/// As [`token_streams`], before `f` is called.
pub fn each_token_stream(dims: &[usize], axis: &TokenAxis, rows: &Rows, mut f: impl FnMut(TokenStream)) -> candle_core::Result<()> {
    let rank = dims.len();
    if rank == 0 {
        candle_core::bail!("token axis on a scalar tensor");
    }
    let batch = dims[0];
    let row_len: usize = dims[1..].iter().product();
    let Some(sd) = axis.seq_dim.map(|d| d as usize) else {
        if axis.first_pos >= axis.keep_from {
            for b in 0..batch {
                let (lo, hi) = rows.window(b);
                if axis.first_pos >= lo && axis.first_pos < hi {
                    let stream = Stream { first: b * row_len, stride: row_len, seg: row_len, segs: 1 };
                    f(TokenStream { row: b, pos: axis.first_pos - lo, stream });
                }
            }
        }
        return Ok(());
    };
    if sd == 0 || sd >= rank || (axis.causal && sd + 2 != rank) {
        candle_core::bail!("token axis {sd} does not fit shape {dims:?}");
    }
    let mid: usize = dims[1..sd].iter().product();
    let seq = dims[sd];
    let inner: usize = dims[sd + 1..].iter().product();
    for b in 0..batch {
        let (lo, hi) = rows.window(b);
        for s in 0..seq {
            let pos = axis.first_pos + s as u32;
            if pos < axis.keep_from || pos < lo || pos >= hi {
                continue;
            }
            let (k0, k1) = key_span(axis, rows, (lo, hi), pos, inner);
            let stream = Stream { first: (b * mid * seq + s) * inner + k0, stride: seq * inner, seg: k1 - k0, segs: mid };
            f(TokenStream { row: b, pos: pos - lo, stream });
        }
    }
    Ok(())
}
