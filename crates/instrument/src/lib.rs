//! What a candle user puts in their own model to record it: every tensor op's output as a
//! bit-exact digest plus f64 reductions, streamed into a `candle_trace_format` writer (or kept in
//! memory and bisected in process with `candle_trace_compare`). It depends on candle-core,
//! candle-nn, the format, the comparison and the batch-invariant kernels; no tokenizer, chat
//! template, sampler or model loader (the tokenizers, chat templates and loaders are
//! `candle-trace-models`', the sampler `candle-trace-run`'s).
//!
//! - [`tracer`]: the handle an instrumented forward pass calls, streaming records into a
//!   [`tracer::Sink`]; [`tracer::Tracer::probe`] records a tensor your own code computed;
//!   [`tracer::worker`]: summarising on a thread of its own while the forward pass runs on;
//! - [`ops`]: the op vocabulary instrumented models run through, attention included
//!   ([`ops::attention`]); [`kernel`]: each recorded op's kernel and attributes, enough to
//!   re-execute it; [`operand`]: an op's inputs; [`numerics`]: which kernels an op runs on
//!   (`--numerics`: fixed, upstream, the batch-invariant ones);
//! - [`digest`]: bit-exact digests and f64 reductions of a tensor's logical values, whole and
//!   per (batch row, token position), on the CPU or on the device; [`values`]: tensors as dumps
//!   and back; [`patch`]: overwrite or capture one op output's slice on the live op path;
//! - [`env`](mod@env): the run's environment and the build's fingerprint; [`device`]:
//!   `--device`, and how a device is named in a header;
//! - re-exported, so that a model of one's own depends on this crate alone: [`record`] (the
//!   record types: `Header`, `Phase`, `Reads`), [`format`](mod@format) (the trace: `Trace`,
//!   `TraceWriter`), [`error`] ([`Error`], [`Result`]) from the format crate, and [`bisect`]
//!   from the comparison.
//!
//! Models know nothing of files: they call the tracer, and the sink decides where records go.

#![deny(missing_docs)]

pub mod device;
pub mod digest;
pub mod env;
pub mod kernel;
pub mod numerics;
pub mod operand;
pub mod ops;
pub mod patch;
pub mod tracer;
pub mod values;

// What a model of one's own needs besides the tracer, so that it depends on this crate alone:
// the record types it passes (`record::Phase`, `record::Reads`, `record::Header`), the trace it
// gets back (`format::Trace`, `format::TraceWriter` for a file), the error type, and bisect.
pub use candle_trace_compare::bisect;
pub use candle_trace_format::{error, format, record, Error, Result};
