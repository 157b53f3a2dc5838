//! Parity: the instrumented llama forward pass gives the same logits, bit for bit, as
//! candle-transformers' `quantized_llama::ModelWeights` on SmolLM2 (batch 1, whole and chunked
//! prefill, then decode), traced or not; and it runs batch 4 where upstream cannot.

use crate::util::smollm2_path;
use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_trace::models::{gguf, WeightDtype};
use candle_trace::record::Phase;
use candle_trace::tracer::{MemorySink, Tracer};
use candle_transformers::models::quantized_llama::ModelWeights;

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().into_iter().map(f32::to_bits).collect()
}

fn upstream(path: &std::path::Path) -> ModelWeights {
    let mut f = std::fs::File::open(path).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    ModelWeights::from_gguf(ct, &mut f, &Device::Cpu).unwrap()
}

/// Feeds `prompt` in chunks of `chunk`, then 3 greedy decode steps, to both models; every
/// forward pass's logits must have identical bits.
fn check(chunk: usize, traced: bool) {
    let path = smollm2_path();
    let dev = Device::Cpu;
    let mut up = upstream(&path);
    let mut ours = gguf::load(&path, WeightDtype::Quantized, &dev).unwrap();
    let text = ours.tokenizer.apply_chat_template("Tell me about Richard Feynman.").unwrap();
    let prompt = ours.tokenizer.encode(&text).unwrap();
    let mut tr = if traced { Tracer::new(Box::new(MemorySink::default())) } else { Tracer::untraced() };
    let mut pos = 0;
    let mut last = None;
    for part in prompt.chunks(chunk) {
        let ids = Tensor::new(part, &dev).unwrap().unsqueeze(0).unwrap();
        let a = up.forward(&ids, pos).unwrap();
        let b = ours.model.forward(&mut tr, &ids, pos, Phase::Prefill).unwrap();
        assert_eq!(bits(&a), bits(&b), "prefill logits differ at chunk starting {pos}");
        pos += part.len();
        last = Some(b);
    }
    let mut logits = last.unwrap();
    for _ in 0..3 {
        let next = logits.argmax(candle_core::D::Minus1).unwrap().flatten_all().unwrap().to_vec1::<u32>().unwrap()[0];
        let ids = Tensor::new(&[next], &dev).unwrap().unsqueeze(0).unwrap();
        let a = up.forward(&ids, pos).unwrap();
        let b = ours.model.forward(&mut tr, &ids, pos, Phase::Decode).unwrap();
        assert_eq!(bits(&a), bits(&b), "decode logits differ at position {pos}");
        pos += 1;
        logits = b;
    }
    if traced {
        assert!(tr.op_records() > 0);
    }
}

#[test]
fn logits_bit_identical_to_quantized_llama_whole_prefill_traced() {
    check(usize::MAX, true);
}

#[test]
fn logits_bit_identical_to_quantized_llama_untraced() {
    check(usize::MAX, false);
}

#[test]
fn logits_bit_identical_to_quantized_llama_chunked_prefill() {
    check(7, true);
}

#[test]
fn batch_4_prefill_works_and_rows_agree() {
    let path = smollm2_path();
    let dev = Device::Cpu;
    let mut ours = gguf::load(&path, WeightDtype::Quantized, &dev).unwrap();
    let prompt = ours.tokenizer.encode("Tell me about Richard Feynman.").unwrap();
    let ids = Tensor::new(prompt.as_slice(), &dev).unwrap().unsqueeze(0).unwrap().repeat((4, 1)).unwrap();
    let mut tr = Tracer::new(Box::new(MemorySink::default()));
    let logits = ours.model.forward(&mut tr, &ids, 0, Phase::Prefill).unwrap();
    assert_eq!(logits.dims(), &[4, 49152]);
    let rows: Vec<Vec<u32>> = (0..4).map(|r| bits(&logits.get(r).unwrap())).collect();
    assert!(rows.iter().all(|r| *r == rows[0]), "batch rows differ");
    // Upstream fails on exactly this input (candle-transformers 0.11.1).
    let mut up = upstream(&path);
    let err = up.forward(&ids, 0).expect_err("upstream batch-4 prefill was expected to fail");
    assert!(err.to_string().contains("not contiguous"), "unexpected upstream error: {err}");
}
