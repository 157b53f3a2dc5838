//! Running whole models under candle-trace, over the instrumentation crate
//! (`candle_trace_instrument`, whose modules are re-exported here under the same names:
//! [`tracer`], [`ops`], [`kernel`], [`operand`], [`numerics`], [`digest`], [`values`],
//! [`patch`], [`env`](mod@env), [`device`]) and the models crate (`candle_trace_models`,
//! re-exported as [`models`], with its [`tokenizer`], [`spm`] and [`chat`]). This crate holds
//! what runs a model from end to end: generation and sampling records, the recorder, replay and
//! the causal search.
//!
//! - [`sampling`]: the decode-step sampler, with what it saw and drew; [`generate`]: the
//!   generation loop and its knobs (prefill chunking, batch, padding, the repeat penalty);
//! - [`recorder`]: `trace record` as a library call; [`dump_size`]: a `--dump`'s expected size;
//! - [`models`] (the models crate): instrumented forward passes (llama family, Gemma 3, BERT,
//!   the builtin seeded model) and their loaders (GGUF, Hugging Face folders); [`tokenizer`],
//!   [`spm`], [`chat`]: tokenizers from GGUF metadata or tokenizer.json, and chat templates;
//!   [`encoder`]: sentence-transformers folders and embedding;
//! - [`replay`]: re-running one recorded op; [`causal`]: `bisect --causal`, which patches one run
//!   with the other's values to find which difference changed the answer; [`bundle`]: the
//!   report, redacted traces and repro as one zip to attach to a bug report; [`candle_repro`]:
//!   a repro as a program that needs candle alone ([`repro_lock`]: its Cargo.lock); [`import`]:
//!   a Python reference run as a trace.
//!
//! Models know nothing of files: they call the tracer, and the sink decides where records go.

#![deny(missing_docs)]

pub use candle_trace_instrument::{device, digest, env, kernel, numerics, operand, ops, patch, tracer, values};
pub use candle_trace_models as models;
pub use candle_trace_models::{chat, spm, tokenizer};

pub mod bundle;
pub mod candle_repro;
pub mod causal;
pub mod dump_size;
pub mod encoder;
pub mod generate;
pub mod import;
pub mod recorder;
pub mod replay;
pub mod repro_lock;
pub mod sampling;
