//! The integration test binary: one module per concern, helpers in `util`.
//!
//! Tests that need the SmolLM2 GGUF file skip (saying so) when it is missing, and fail when
//! `CI=true`: run `tools/fetch-models.sh` first.

mod util;

mod bad_input;
mod bert;
mod bisect_cli;
mod dump;
mod format;
mod hf;
mod parity;
mod perturb;
mod replay;
mod tokenizer;
