//! The candle-trace file format: what a trace holds and how it is written and read. This crate
//! runs no tensor op and does not depend on candle (its `candle` feature only lets
//! [`Error`] carry a candle error for the crates that run ops); it is what any other writer of
//! traces, such as a reference recorder for another framework, links to, and what the fuzz
//! targets build. The file is specified byte by byte in `docs/trace-format.md`, which a test
//! holds to this code.
//!
//! - [`record`]: the records a trace holds (header, op records with their digests and per-token
//!   statistics, forward-pass markers, decode steps, dumped values);
//! - [`format`](mod@format): the versioned, zstd-framed, crash-safe file: [`format::TraceWriter`]
//!   and the reader [`format::TraceReader`] / [`format::read_trace`] (format 2 stores op
//!   records compactly, in the private `compact` module; format 1 stays readable);
//! - [`limits`]: the bounds a reader enforces on untrusted traces; [`validate`]: cross-record
//!   consistency checks after decoding;
//! - [`redact`]: a copy without the prompt; [`dump`]: `--dump` selections and the decoding of
//!   dumped values; [`site`]: module paths and op names; [`crash`]: what is kept when a run dies;
//! - [`summary`]: what bisect reads of an items frame without decoding it (format 2.5);
//! - [`fields`]: the typed meaning of header and footer fields stored as words (stop reason,
//!   alterations);
//! - [`error`]: the error type every candle-trace crate returns.
//!
//! A trace is untrusted input: see [`limits`] for what the reader refuses.

#![deny(missing_docs)]

mod compact;
pub mod crash;
pub mod dump;
pub mod error;
pub mod fields;
pub mod format;
pub mod hash;
pub mod limits;
pub mod record;
pub mod redact;
pub mod site;
pub mod slice;
pub mod summary;
pub mod validate;

pub use error::{Error, Result};
