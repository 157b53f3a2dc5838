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

/// Probes outputs until one fails to summarise (its token axis is past its rank), or with
/// `last` until that one only, ends the forward pass as the recorder does after an error, drops
/// the tracer; returns the file and the op records it holds.
fn failing_run(worker: bool, last: bool) -> (Vec<u8>, usize) {
    use candle_core::Tensor;
    use candle_trace::record::{Item, Phase, Reads};
    use candle_trace::tracer::Tok;
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("t.trace");
    let w = TraceWriter::create(&out, &Header::default(), None).expect("create");
    let mut tr = Tracer::new(Box::new(w)).with_summary_worker(worker).expect("worker");
    let dev = Device::Cpu;
    tr.begin_forward(Phase::Prefill, 0, &Tensor::new(&[[1u32, 2]], &dev).expect("ids")).expect("begin");
    let x = tr.probe("embed", Tensor::ones((1, 2, 4), DType::F32, &dev).expect("t"), &[], Tok::Seq(1)).expect("embed");
    let mut failed = false;
    for i in 0..if last { 6 } else { 200 } {
        // The sixth probe has no dim 3 to be its token axis.
        let tok = if i == 5 { Tok::Seq(3) } else { Tok::Seq(1) };
        if tr.probe(&format!("layers.{i}.mlp"), (x.t.clone() * i as f64).expect("t"), &[(&x, Reads::Same)], tok).is_err() {
            failed = true;
            break;
        }
    }
    if failed {
        let _ = tr.end_forward(); // as the recorder does after an error
    } else {
        // With the worker, the error may not be seen before the pass ends: ending it returns
        // the error, or queues the end and finishing returns it (and writes no footer).
        let err = match tr.end_forward() {
            Ok(()) => tr.finish(&Footer::default()).expect_err("the failed summary is reported"),
            Err(e) => e,
        };
        assert!(err.to_string().contains("token axis 3 does not fit"), "{err}");
    }
    drop(tr);
    let t = candle_trace::format::read_trace(&out).expect("a truncated trace reads");
    assert!(t.truncated);
    let ops = t.items.iter().filter(|i| matches!(i, Item::Op(_))).count();
    (std::fs::read(&out).expect("read"), ops)
}

#[test]
fn a_failed_summary_leaves_the_records_before_it_on_disk_as_without_the_worker() {
    let (inline, ops) = failing_run(false, false);
    assert_eq!(ops, 6, "embed and layers 0 to 4");
    // Probing on after the failure, or ending the pass right after it (the worker then
    // ends it after its error).
    for last in [false, true] {
        let (worker, _) = failing_run(true, last);
        assert!(inline == worker, "last {last}: files differ: {} vs {} bytes", inline.len(), worker.len());
    }
}
