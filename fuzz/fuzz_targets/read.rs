//! (a) The whole read path on arbitrary bytes: decode, then everything `show`, `bisect` and
//! `replay` do with a trace before running an op, and the streaming bisect (`trace bisect`'s
//! two passes over files) of the file with itself. Must never panic, read out of bounds, leak,
//! or allocate past the reader's budget.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    if let Ok(t) = candle_trace_format::format::decode_trace(data, Path::new("fuzz.trace")) {
        candle_trace_fuzz_common::consume(&t, &t);
    }
    candle_trace_fuzz_common::consume_files(data, data);
});

#[path = "common.rs"]
mod candle_trace_fuzz_common;
