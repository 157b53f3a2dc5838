//! Comparing traces: where two runs parted ways and why. Reads traces through
//! `candle_trace_format` and runs no tensor op (no candle).
//!
//! - [`align`]: bisect's first pass, both traces read in lockstep (a frame at a time from files)
//!   and compared per (module path, row, position), keeping little;
//! - [`bisect`]: the first divergence, the root cause (the op whose output differs while its
//!   inputs matched), token flips, the environment diff; [`bisect_file`] runs it on two files
//!   read a frame at a time, in two passes; [`build_diff`] compares the builds; [`copies`]: rows
//!   of one trace holding the same request that disagree;
//! - [`nonfinite`]: the first NaN or ±Inf and the op that made it;
//! - [`check`]: `trace check`'s plan, collection and table;
//! - [`repro`]: the plan of a minimal repro (every check `trace replay` makes before it runs an
//!   op); [`shared_rows`]: whether two runs' operands of that op agree where they overlap;
//! - [`tolerance`]: two implementations compared op by op: the first op whose error its inputs'
//!   error and its dtype's rounding do not explain; [`across`] builds that chain from two traces'
//!   dumped values (`bisect --tolerance`), with what each op's inputs carry from [`carried`]
//!   (the op's function applied to both runs' inputs) or [`gains`] (bounds from the values);
//! - output: [`report`] (text and markdown), [`html`] (the self-contained HTML report),
//!   [`show`] (the summary of one trace), [`positions`] (a continuation's positions), [`text`] (escaping and number formatting they share);
//!   every string a trace holds reaches them as an [`untrusted::Untrusted`], which has no
//!   `Display`: each renderer escapes it for its own output, once.

#![deny(missing_docs)]

pub mod across;
pub mod align;
pub mod bisect;
pub mod bisect_file;
mod bound;
pub mod build_diff;
pub mod carried;
pub mod check;
pub mod copies;
pub mod gains;
pub mod head_order;
pub mod html;
mod lanes;
pub mod level;
pub mod nonfinite;
pub mod overlap;
mod passes;
pub mod positions;
pub mod report;
pub mod repro;
pub mod rerun;
mod runs;
mod seq_sites;
pub mod shared_rows;
pub mod show;
pub mod text;
pub mod tolerance;
pub mod untrusted;
