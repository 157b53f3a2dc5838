//! candle-trace: record what every tensor op of a candle forward pass produced, and find where two
//! runs parted ways.
//!
//! The library is split by concern, one module per job (see `docs/trace-format.md` for the file
//! layout). Modules marked (run) need the default `run` feature; the rest is the trace reader.
//!
//! Recording:
//! - [`tracer`] (run): the handle an instrumented forward pass calls, streaming records into a
//!   [`tracer::Sink`]; [`tracer::Tracer::probe`] records a tensor your own code computed;
//! - [`ops`] (run): the op vocabulary the instrumented models run through, attention included
//!   ([`ops::attention`]);
//! - [`kernel`] (run): each recorded op's kernel and attributes, enough to re-execute it;
//! - [`digest`] (run): bit-exact digests and f64 reductions of a tensor's logical values, whole and
//!   per (batch row, token position);
//! - [`site`]: module paths and op names ([`site::Site`]), and the layer a path belongs to;
//! - [`patch`] (run): overwrite or capture one op output's slice on the live op path;
//! - [`sampling`] (run): the decode-step sampler, with what it saw and drew;
//! - [`generate`] (run): the generation loop and its knobs (prefill chunking, batch, padding);
//! - [`recorder`] (run): `trace record` as a library call;
//! - [`models`] (run): instrumented forward passes (llama family, Gemma 3, BERT, the builtin seeded model)
//!   and their loaders (GGUF, Hugging Face folders through [`models::folder`]);
//! - [`encoder`] (run): sentence-transformers folders and embedding;
//! - [`tokenizer`] (run): tokenizers from GGUF metadata or tokenizer.json, streaming detokenizing;
//!   [`spm`] (run) builds SentencePiece ones from a GGUF file's pieces and scores;
//! - [`device`] (run): `--device`, and how a device is named in a header;
//! - [`env`](mod@env): the run's environment and the build's fingerprint;
//! - [`dump`]: `--dump` selections, and decoding of dumped values;
//! - [`crash`]: what is kept when a run dies.
//!
//! The trace file:
//! - [`record`]: the records a trace holds (header, op records, forward-pass markers, decode steps);
//! - [`format`](mod@format): the versioned, zstd-framed, crash-safe trace file (format 2 stores op
//!   records compactly, in the private `compact` module; format 1 stays readable);
//! - [`limits`]: the bounds a reader enforces on untrusted traces;
//! - [`validate`]: cross-record consistency checks after decoding;
//! - [`redact`]: a copy without the prompt.
//!
//! Analysis:
//! - [`align`]: bisect's first pass, both traces read in lockstep (a frame at a time from files)
//!   and compared per (module path, row, position), keeping little;
//! - [`bisect`]: alignment of two traces, first divergence, root cause, token flips, env diff;
//!   [`bisect_file`] runs it on two files read a frame at a time, in two passes;
//! - [`causal`] (run): `bisect --causal`, which patches one run with the other's values to find
//!   which difference changed the answer;
//! - [`check`]: `trace check`, one input run many ways (plan, collect, the table);
//! - [`nonfinite`]: the first NaN or ±Inf and the op that made it;
//! - [`replay`] (run) and [`repro`]: re-running one recorded op, and the minimal repro file.
//!
//! Output: [`report`] (text and markdown), [`html`] (the self-contained HTML report), [`show`]
//! (the summary of one trace), [`text`] (escaping and number formatting they share), [`error`]
//! (the error type and exit codes).
//!
//! The `trace` binary is a thin clap layer over these modules.
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
//! `examples/custom_model.rs` does the same for a two-layer transformer written with candle_nn
//! (`cargo run --release --example custom_model`).
//!
//! The trace reader — [`record`], [`format`](mod@format), [`limits`], [`show`], [`bisect`], [`report`],
//! [`nonfinite`], [`redact`] and the value decoding of [`dump`] — runs no tensor op and builds
//! without candle (`--no-default-features`); the modules that run ops need the default `run`
//! feature. A trace is untrusted input: see [`limits`] for what the reader refuses.

#![deny(missing_docs)]

pub mod align;
pub mod bisect;
pub mod bisect_file;
#[cfg(feature = "run")]
pub mod causal;
#[cfg(feature = "run")]
pub mod chat;
pub mod check;
mod compact;
pub mod crash;
#[cfg(feature = "run")]
pub mod device;
#[cfg(feature = "run")]
pub mod digest;
pub mod dump;
#[cfg(feature = "run")]
pub mod encoder;
pub mod env;
pub mod error;
pub mod format;
#[cfg(feature = "run")]
pub mod generate;
pub mod html;
#[cfg(feature = "run")]
pub mod kernel;
pub mod limits;
#[cfg(feature = "run")]
pub mod models;
pub mod nonfinite;
#[cfg(feature = "run")]
pub mod ops;
#[cfg(feature = "run")]
pub mod patch;
pub mod record;
#[cfg(feature = "run")]
pub mod recorder;
pub mod redact;
#[cfg(feature = "run")]
pub mod replay;
pub mod report;
pub mod repro;
#[cfg(feature = "run")]
pub mod sampling;
pub mod show;
pub mod site;
#[cfg(feature = "run")]
pub mod spm;
pub mod text;
#[cfg(feature = "run")]
pub mod tokenizer;
#[cfg(feature = "run")]
pub mod tracer;
pub mod validate;

pub use error::{Error, Result};
