//! candle-trace: record what every tensor op of a candle forward pass produced, and find where two
//! runs parted ways.
//!
//! The work is done by library crates whose dependencies point one way:
//!
//! - `candle_trace_format` (crates/format): the trace file: record types, writer, reader,
//!   limits, validation, redaction. No candle;
//! - `candle_trace_compare` (crates/compare): alignment, root causes, token flips, reports.
//!   Depends on the format only;
//! - `candle_trace_kernels` (crates/kernels): the batch-invariant CPU kernels, over candle-core;
//! - `candle_trace_instrument` (crates/instrument): the tracer, digests and the op vocabulary:
//!   what a model of one's own needs to be recorded;
//! - `candle_trace_models` (crates/models): the instrumented architectures, their loaders,
//!   tokenizers and chat templates;
//! - `candle_trace_run` (crates/run): generation, the recorder, replay and the causal search.
//!   Depends on the format, comparison, instrumentation and models crates, and re-exports the
//!   instrumentation's and the models' modules.
//!
//! This package is the `trace` CLI over them; its library only re-exports their modules under one
//! name, so `candle_trace::bisect` is `candle_trace_compare::bisect`, `candle_trace::tracer`
//! is `candle_trace_instrument::tracer` and `candle_trace::models` is `candle_trace_models`.
//!
//! # Tracing your own model
//!
//! Any candle forward pass can be recorded: make a [`tracer::Tracer`] over a sink (a
//! [`format::TraceWriter`] for a file, a [`tracer::MemorySink`] to keep it in memory), mark each
//! forward pass with [`tracer::Tracer::begin_forward`] / `end_forward`, and record each value
//! where your code computes it, by module path, with [`tracer::Tracer::probe`] (or run the ops
//! through [`ops`] to record them op by op, replayable). Give each value's token axis and the
//! recorded values it reads, and [`bisect::bisect`] two recordings in process:
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use candle_trace::record::{Header, Phase, Reads};
//! use candle_trace::tracer::{MemorySink, Tok, Tracer};
//!
//! // A one-layer model; `half` computes its MLP in bf16 (the knob that changes numbers).
//! fn run(half: bool) -> candle_trace::Result<candle_trace::format::Trace> {
//!     let dev = Device::Cpu;
//!     let sink = MemorySink::default();
//!     let mut tr = Tracer::new(Box::new(sink.clone()));
//!     let ids = Tensor::new(&[[1u32, 2, 3]], &dev)?;
//!     tr.begin_forward(Phase::Prefill, 0, &ids)?;
//!     let table = Tensor::arange(0f32, 32., &dev)?.reshape((8, 4))?.affine(0.37, -3.1)?;
//!     let x = tr.probe("embed_tokens", table.embedding(&ids.flatten_all()?)?.unsqueeze(0)?, &[], Tok::Seq(1))?;
//!     let dt = if half { DType::BF16 } else { DType::F32 };
//!     let w = Tensor::arange(0f32, 16., &dev)?.reshape((4, 4))?.affine(0.113, -0.9)?;
//!     let y = x.t.to_dtype(dt)?.broadcast_matmul(&w.to_dtype(dt)?)?.to_dtype(DType::F32)?;
//!     tr.probe("layers.0.mlp", y, &[(&x, Reads::Same)], Tok::Seq(1))?;
//!     tr.end_forward()?;
//!     Ok(sink.trace(if half { "bf16" } else { "f32" }, &Header::default()))
//! }
//!
//! let r = candle_trace::bisect::bisect(&run(false)?, &run(true)?)?;
//! let root = r.first_divergence.expect("bf16 rounds differently");
//! assert_eq!((root.path.as_str(), root.position), ("layers.0.mlp", 0));
//! # Ok::<(), candle_trace::Error>(())
//! ```
//!
//! `crates/instrument/examples/custom_model.rs` does the same for a two-layer transformer written with candle_nn
//! (`cargo run --release -p candle-trace-instrument --example custom_model`).
//!

#![deny(missing_docs)]

pub use candle_trace_compare::{across, align, bisect, bisect_file, build_diff, check, html, nonfinite, report, repro, rerun, show, text, tolerance, untrusted};
pub use candle_trace_format::{crash, dump, error, fields, format, hash, limits, record, redact, site, validate};
pub use candle_trace_format::{Error, Result};
pub use candle_trace_run::{
    bundle, candle_repro, causal, chat, device, digest, dump_size, encoder, env, generate, import, kernel, models, numerics, operand, ops, patch, recorder, replay, sampling, spm, tokenizer, tracer,
    values,
};
