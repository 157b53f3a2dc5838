//! A trace file's op records are filled into the records of frames already written
//! (`TraceWriter::push_op`): a decode step's record lands where a prefill record with dozens of
//! token entries, a dumped op's operands, a kernel or a perturbation flag was. What the file
//! holds must be what the run recorded, field for field, as the same run recorded into memory.

use candle_core::{DType, Device};
use candle_trace::dump::DumpSpec;
use candle_trace::format::{read_trace, TraceWriter};
use candle_trace::generate::{generate_rows, GenConfig};
use candle_trace::models::{builtin, WeightDtype};
use candle_trace::record::{Footer, Header, Item};
use candle_trace::site::Level;
use candle_trace::tracer::{MemorySink, Sink, Tracer};

/// One run's settings.
struct Run {
    prompts: Vec<Vec<u32>>,
    chunk: usize,
    dump: &'static str,
    perturb: &'static str,
    level: Level,
}

/// Records `run` of the builtin model into `sink` and returns the tracer's op record count.
fn record(run: &Run, sink: Box<dyn Sink>) -> u64 {
    let mut m = builtin::load(WeightDtype::Dense(DType::F32), &Device::Cpu).expect("builtin");
    let perturbs = if run.perturb.is_empty() { vec![] } else { vec![run.perturb.parse().expect("perturb")] };
    let mut tr = Tracer::new(sink).with_level(run.level).expect("level").with_dump(DumpSpec::parse(run.dump).expect("dump")).with_perturbs(perturbs);
    let cfg = GenConfig { max_tokens: 7, prefill_chunk: run.chunk, ..GenConfig::default() };
    generate_rows(&mut m.model, &m.tokenizer, &run.prompts, &cfg, &mut tr).expect("generate");
    tr.finish(&Footer { op_records: tr.op_records(), forward_passes: tr.forward_passes(), ..Footer::default() }).expect("finish");
    tr.op_records()
}

#[test]
fn records_filled_into_written_frames_are_the_records_made_afresh() {
    let long: Vec<u32> = (0..40u32).map(|i| (i * 37 + 11) % 250 + 3).collect();
    let runs = [
        // A 40-token prefill frame (40 token entries a record), then decode steps into it.
        Run { prompts: vec![long.clone()], chunk: 0, dump: "none", perturb: "", level: Level::Ops },
        // Dumped ops (operand ids, value items among the records) and a perturbed output.
        Run { prompts: vec![long.clone()], chunk: 16, dump: "layers.1.*", perturb: "layers.0.mlp.act@2", level: Level::Ops },
        // A padded batch of two requests, and the layers level (other records, fewer of them).
        Run { prompts: vec![long[..9].to_vec(), long[5..30].to_vec()], chunk: 0, dump: "outputs:lm_head", perturb: "", level: Level::Ops },
        Run { prompts: vec![long.clone()], chunk: 8, dump: "none", perturb: "", level: Level::Layers },
    ];
    let dir = tempfile::tempdir().expect("temp dir");
    for (i, run) in runs.iter().enumerate() {
        let mem = MemorySink::default();
        let ops = record(run, Box::new(mem.clone()));
        let expected = mem.trace("memory", &Header::default()).items;
        assert!(ops > 50, "run {i}: {ops} op records");
        // Frames written on the forward pass's thread come back at once: every frame after the
        // first is filled into the one before it. On the writing thread, whenever they do.
        for here in [true, false] {
            let path = dir.path().join(format!("run{i}-{here}.trace"));
            let w = if here { TraceWriter::create_here(&path, &Header::default(), None) } else { TraceWriter::create(&path, &Header::default(), None) };
            assert_eq!(record(run, Box::new(w.expect("create"))), ops, "run {i}");
            let got = read_trace(&path).expect("read").items;
            assert_eq!(got.len(), expected.len(), "run {i}, here {here}: item count");
            for (k, (a, b)) in got.iter().zip(&expected).enumerate() {
                assert!(a == b, "run {i}, here {here}: item {k} differs:\n{a:?}\nrecorded:\n{b:?}");
            }
            let rich = got.iter().filter(|it| matches!(it, Item::Op(r) if r.tokens.len() > 1 || !r.operands.is_empty() || r.perturbed)).count();
            assert!(rich > 0, "run {i}: no record for a later one to be filled into");
        }
    }
}
