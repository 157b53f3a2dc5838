//! (b) Structured inputs: two traces built from arbitrary records (so past the reader's byte
//! checks), written with the reference writer and read back; then `show` of each, `bisect` of the
//! two (same model, so alignment runs), `redact`, and every check `replay` makes before it
//! executes an op.
#![no_main]

use candle_trace_format::format::{decode_trace, encode_trace};
use candle_trace_format::record::{Footer, Header, Item};
use libfuzzer_sys::fuzz_target;
use std::path::Path;

#[derive(Debug, arbitrary::Arbitrary)]
struct Input {
    a: (Header, Vec<Item>, Option<Footer>),
    b: (Vec<Item>, Option<Footer>),
}

fuzz_target!(|input: Input| {
    let (ha, ia, fa) = input.a;
    let (ib, fb) = input.b;
    let Ok(bytes_a) = encode_trace(&ha, &ia, fa.as_ref()) else { return };
    let Ok(bytes_b) = encode_trace(&ha, &ib, fb.as_ref()) else { return };
    let ta = decode_trace(&bytes_a, Path::new("a.trace"));
    let tb = decode_trace(&bytes_b, Path::new("b.trace"));
    if let (Ok(a), Ok(b)) = (&ta, &tb) {
        candle_trace_fuzz_common::consume(a, b);
    }
    candle_trace_fuzz_common::consume_files(&bytes_a, &bytes_b);
});

#[path = "common.rs"]
mod candle_trace_fuzz_common;
