//! The candle side of candle-trace: everything that runs tensor ops. Instrumented forward passes
//! record each op's output through the [`tracer::Tracer`] into a `candle_trace_format` writer;
//! replay and the causal search re-run recorded ops and compare through `candle_trace_compare`.
//!
//! - [`tracer`]: the handle an instrumented forward pass calls, streaming records into a
//!   [`tracer::Sink`]; [`tracer::Tracer::probe`] records a tensor your own code computed;
//!   [`tracer::worker`]: summarising on a thread of its own while the forward pass runs on;
//! - [`ops`]: the op vocabulary the instrumented models run through, attention included
//!   ([`ops::attention`]); [`kernel`]: each recorded op's kernel and attributes, enough to
//!   re-execute it;
//! - [`digest`]: bit-exact digests and f64 reductions of a tensor's logical values, whole and
//!   per (batch row, token position); [`values`]: tensors as dumps and back;
//! - [`patch`]: overwrite or capture one op output's slice on the live op path;
//! - [`sampling`]: the decode-step sampler, with what it saw and drew; [`generate`]: the
//!   generation loop and its knobs (prefill chunking, batch, padding);
//! - [`recorder`]: `trace record` as a library call; [`env`](mod@env): the run's environment
//!   and the build's fingerprint;
//! - [`models`]: instrumented forward passes (llama family, Gemma 3, BERT, the builtin seeded
//!   model) and their loaders (GGUF, Hugging Face folders); [`encoder`]: sentence-transformers
//!   folders and embedding;
//! - [`tokenizer`], [`spm`], [`chat`]: tokenizers from GGUF metadata or tokenizer.json, and chat
//!   templates; [`device`]: `--device`, and how a device is named in a header;
//! - [`replay`]: re-running one recorded op; [`causal`]: `bisect --causal`, which patches one run
//!   with the other's values to find which difference changed the answer; [`bundle`]: the
//!   report, redacted traces and repro as one zip to attach to a bug report; [`candle_repro`]:
//!   a repro as a program that needs candle alone.
//!
//! Models know nothing of files: they call the tracer, and the sink decides where records go.

#![deny(missing_docs)]

pub mod bundle;
pub mod candle_repro;
pub mod causal;
pub mod chat;
pub mod device;
pub mod digest;
pub mod dump_size;
pub mod encoder;
pub mod env;
pub mod generate;
pub mod import;
pub mod kernel;
pub mod models;
pub mod numerics;
pub mod operand;
pub mod ops;
pub mod patch;
pub mod recorder;
pub mod replay;
pub mod repro_lock;
pub mod sampling;
pub mod spm;
pub mod tokenizer;
pub mod tracer;
pub mod values;
