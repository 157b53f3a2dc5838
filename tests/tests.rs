//! The integration test binary: one module per concern, helpers in `util`.
//!
//! Tests that need the SmolLM2 GGUF file or the MiniLM folder fail when it is missing, with a
//! message naming `tools/fetch-models.sh`: run it first (the README's test command does). No
//! test passes silently for want of a file.

mod util;

mod bad_input;
mod batching;
mod bert;
mod bisect_cli;
mod causal;
mod check;
mod crash;
mod dump;
mod format;
mod gemma3;
mod gguf_archs;
mod hf;
mod layout;
mod parity;
mod perturb;
mod readme;
mod replay;
mod sampling;
mod tokenizer;
mod untrusted;
