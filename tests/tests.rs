//! The integration test binary: one module per concern, helpers in `util`.
//!
//! Tests that need the SmolLM2 GGUF file or the MiniLM folder fail when it is missing, with a
//! message naming `tools/fetch-models.sh`: run it first (the README's test command does). No
//! test passes silently for want of a file.
//!
//! A run that several tests need is recorded once: `util::fixture` keeps the results of `trace`
//! commands under `target/tmp/fixtures/<binary hash>/`, keyed by the commands, and later calls
//! (in this run or the next, with the same binary) reuse them. `.cargo/config.toml` runs the
//! tests one at a time. The quick tier while working on the code: `tools/quick.sh` (the unit
//! tests, then `format::`, `bad_input::`, `untrusted::` and one builtin record + bisect from
//! this binary).

mod util;

mod absorbed;
mod bad_input;
mod batching;
mod bert;
mod bisect_cli;
mod bundle;
mod causal;
mod check;
mod continuation;
mod crash;
mod dump;
mod format;
mod gemma3;
mod gemma3_window;
mod gguf_archs;
mod hf;
mod hf_window;
mod invariant;
mod layout;
mod level;
mod parity;
mod penalty;
mod perturb;
mod readme;
mod reference;
mod replay;
mod report_page;
mod reuse;
mod sampling;
mod summary_worker;
mod tokenizer;
mod tolerance;
mod untrusted;
