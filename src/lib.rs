//! candle-trace: record what every tensor op of a candle forward pass produced, and find where two
//! runs parted ways.
//!
//! The library is split by concern (see `docs/trace-format.md` for the file layout):
//! - [`digest`]: bit-exact digests and f64 reductions of a tensor's logical values, whole and per
//!   (batch row, token position);
//! - [`record`]: the records a trace holds (op records, forward-pass markers, decode steps);
//! - [`tracer`]: the handle an instrumented forward pass calls, streaming records into a [`tracer::Sink`];
//! - [`ops`]: the small op vocabulary the instrumented models run through;
//! - [`format`]: the versioned, zstd-framed, crash-safe trace file;
//! - [`models`]: instrumented forward passes (GGUF llama family, builtin seeded model);
//! - [`tokenizer`]: tokenizers built from GGUF metadata, and the builtin byte-level one;
//! - [`generate`]: the generation loop and its knobs (prefill chunking, batch, sampling);
//! - [`bisect`]: alignment of two traces, first divergence, root cause, token flips, env diff;
//! - [`show`]: the human summary of one trace.
//!
//! The `trace` binary is a thin clap layer over these modules.

pub mod bisect;
pub mod digest;
pub mod dump;
pub mod encoder;
pub mod env;
pub mod error;
pub mod format;
pub mod generate;
pub mod kernel;
pub mod models;
pub mod nonfinite;
pub mod ops;
pub mod record;
pub mod recorder;
pub mod replay;
pub mod report;
pub mod show;
pub mod tokenizer;
pub mod tracer;

pub use error::{Error, Result};
