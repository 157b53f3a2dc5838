//! `trace record --summary-worker`: summarising on a thread of its own writes the same trace
//! file, byte for byte, as summarising on the forward pass's thread.

use candle_core::{DType, Device};
use candle_trace::dump::DumpSpec;
use candle_trace::format::TraceWriter;
use candle_trace::generate::{generate_rows, GenConfig};
use candle_trace::models::{builtin, WeightDtype};
use candle_trace::record::{Footer, Header};
use candle_trace::tracer::Tracer;

/// Records the builtin model on `prompts` (one row each, left-padded) into a file, with or
/// without the worker, and returns the file's bytes.
fn recorded(prompts: &[Vec<u32>], chunk: usize, dump: &str, worker: bool) -> Vec<u8> {
    let mut m = builtin::load(WeightDtype::Dense(DType::F32), &Device::Cpu).expect("builtin");
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("t.trace");
    let w = TraceWriter::create(&out, &Header::default(), None).expect("create");
    let mut tr = Tracer::new(Box::new(w)).with_dump(DumpSpec::parse(dump).expect("dump")).with_summary_worker(worker).expect("worker");
    let cfg = GenConfig { max_tokens: 6, prefill_chunk: chunk, ..GenConfig::default() };
    generate_rows(&mut m.model, &m.tokenizer, prompts, &cfg, &mut tr).expect("generate");
    tr.finish(&Footer { op_records: tr.op_records(), forward_passes: tr.forward_passes(), ..Footer::default() }).expect("finish");
    std::fs::read(&out).expect("read")
}

#[test]
fn a_run_traced_with_the_worker_writes_the_same_file() {
    let one = vec![vec![5u32, 9, 14, 3, 27, 8]];
    let padded = vec![vec![5u32, 9, 14, 3, 27, 8], vec![11u32, 2]];
    for (prompts, chunk, dump) in [(&one, 0, "none"), (&one, 4, "layers.1.*"), (&padded, 0, "outputs:lm_head")] {
        let inline = recorded(prompts, chunk, dump, false);
        let worker = recorded(prompts, chunk, dump, true);
        assert!(inline.len() > 10_000, "{} bytes", inline.len());
        assert!(inline == worker, "rows {}, chunk {chunk}, dump {dump}: files differ ({} vs {} bytes)", prompts.len(), inline.len(), worker.len());
    }
}
