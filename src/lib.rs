//! candle-trace: record what every tensor op of a candle forward pass produced, and find where two
//! runs parted ways.
//!
//! The library is split by concern (see `docs/trace-format.md` for the file layout):
//! - [`digest`]: bit-exact digests and f64 reductions of a tensor's logical values, whole and per
//!   (batch row, token position);
//! - [`record`]: the records a trace holds (op records, forward-pass markers, decode steps);
//! - [`tracer`]: the handle an instrumented forward pass calls, streaming records into a [`tracer::Sink`];
//! - [`ops`]: the small op vocabulary the instrumented models run through;
//! - [`format`](mod@format): the versioned, zstd-framed, crash-safe trace file;
//! - [`models`]: instrumented forward passes (GGUF llama family, builtin seeded model);
//! - [`tokenizer`]: tokenizers built from GGUF metadata, and the builtin byte-level one;
//! - [`generate`]: the generation loop and its knobs (prefill chunking, batch, sampling);
//! - [`bisect`]: alignment of two traces, first divergence, root cause, token flips, env diff;
//! - [`patch`] and [`causal`]: overwrite or read one op output's slice on the live op path, and
//!   `bisect --causal`, which patches one run with the other's values to find which difference
//!   changed the answer;
//! - [`check`]: `trace check`, one input run many ways (plan, collect, the table);
//! - [`html`]: the self-contained HTML report of a bisect;
//! - [`show`]: the human summary of one trace.
//!
//! The `trace` binary is a thin clap layer over these modules.
//!
//! The trace reader — [`record`], [`format`](mod@format), [`limits`], [`show`], [`bisect`], [`report`],
//! [`nonfinite`], [`redact`] and the value decoding of [`dump`] — runs no tensor op and builds
//! without candle (`--no-default-features`); the modules that run ops need the default `run`
//! feature. A trace is untrusted input: see [`limits`] for what the reader refuses.

pub mod bisect;
pub mod check;
#[cfg(feature = "run")]
pub mod causal;
pub mod crash;
#[cfg(feature = "run")]
pub mod digest;
pub mod dump;
#[cfg(feature = "run")]
pub mod encoder;
pub mod env;
pub mod error;
pub mod format;
pub mod html;
pub mod limits;
#[cfg(feature = "run")]
pub mod generate;
#[cfg(feature = "run")]
pub mod kernel;
#[cfg(feature = "run")]
pub mod models;
pub mod nonfinite;
#[cfg(feature = "run")]
pub mod patch;
#[cfg(feature = "run")]
pub mod ops;
pub mod record;
pub mod redact;
#[cfg(feature = "run")]
pub mod recorder;
#[cfg(feature = "run")]
pub mod replay;
pub mod report;
#[cfg(feature = "run")]
pub mod sampling;
pub mod repro;
pub mod show;
#[cfg(feature = "run")]
pub mod tokenizer;
#[cfg(feature = "run")]
pub mod tracer;
pub mod validate;

pub use error::{Error, Result};
