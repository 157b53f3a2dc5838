//! Measures how well zstd (level 3, as the trace writer uses for frames holding dumped values)
//! compresses `--dump` values stored plain versus byte-plane shuffled, on real SmolLM2-135M
//! activations (every op output of a ChatML prefill and 8 decode steps), in f32 and converted
//! to bf16.
//!
//! `cargo run --release --example dump_compression` (needs tools/fetch-models.sh). The figures
//! are quoted in docs/trace-format.md.

use candle_core::Device;
use candle_trace::dump::{shuffle, unshuffle};
use candle_trace::generate::{generate, GenConfig};
use candle_trace::models::{gguf, WeightDtype};
use candle_trace::record::Item;
use candle_trace::tracer::{MemorySink, Tracer};

fn main() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    let mut m = gguf::load(path.as_ref(), WeightDtype::Quantized, &Device::Cpu).expect("run tools/fetch-models.sh");
    let text = m.tokenizer.apply_chat_template("Tell me about Richard Feynman.").unwrap();
    let ids = m.tokenizer.encode(&text).unwrap();
    let sink = MemorySink::default();
    let mut tr = Tracer::new(Box::new(sink.clone())).with_dump(candle_trace::dump::DumpSpec::All);
    generate(&mut m.model, &m.tokenizer, &ids, &GenConfig { max_tokens: 8, ..GenConfig::default() }, &mut tr).unwrap();
    let items = sink.items.lock().unwrap();
    let (mut raw, mut plain, mut shuffled) = ([0usize; 2], [0usize; 2], [0usize; 2]);
    for item in items.iter() {
        let Item::Dump(d) = item else { continue };
        if d.dtype != "f32" {
            continue;
        }
        let le = unshuffle(&d.data, 4);
        // bf16 of the same values (round to nearest even, as half::bf16::from_f32).
        let bf: Vec<u8> = le.chunks_exact(4).flat_map(|c| half::bf16::from_f32(f32::from_le_bytes(c.try_into().unwrap())).to_le_bytes()).collect();
        for (k, (bytes, size)) in [(le, 4usize), (bf, 2usize)].into_iter().enumerate() {
            raw[k] += bytes.len();
            plain[k] += zstd::bulk::compress(&bytes, candle_trace::format::VALUES_ZSTD_LEVEL).unwrap().len();
            shuffled[k] += zstd::bulk::compress(&shuffle(&bytes, size), candle_trace::format::VALUES_ZSTD_LEVEL).unwrap().len();
        }
    }
    for (k, name) in ["f32", "bf16"].iter().enumerate() {
        println!(
            "{name}: {} bytes raw; zstd-3 plain {} ({:.3} of raw); zstd-3 byte-shuffled {} ({:.3} of raw)",
            raw[k],
            plain[k],
            plain[k] as f64 / raw[k] as f64,
            shuffled[k],
            shuffled[k] as f64 / raw[k] as f64
        );
    }
}
