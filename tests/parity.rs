//! Parity: the instrumented llama forward pass gives the same logits, bit for bit, as
//! candle-transformers' `quantized_llama::ModelWeights` on SmolLM2 (batch 1, whole and chunked
//! prefill, then decode), traced or not; and it runs batch 4 where upstream cannot.

use crate::util::smollm2_path;
use candle_core::{Device, Tensor};
use candle_trace::models::{gguf, WeightDtype};
use candle_trace::record::Phase;
use candle_trace::tracer::{MemorySink, Tracer};
use candle_transformers::models::quantized_llama::ModelWeights;

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().into_iter().map(f32::to_bits).collect()
}

fn upstream(path: &std::path::Path) -> ModelWeights {
    let (ct, mut f) = candle_trace::models::gguf::open(path).unwrap();
    ModelWeights::from_gguf(ct, &mut f, &Device::Cpu).unwrap()
}

/// Feeds `prompt` in chunks of `chunk`, then `steps` greedy decode steps, to upstream (`up`:
/// ids and position to logits) and to `ours`; every forward pass's logits must have identical
/// bits. Returns the greedy tokens.
pub fn compare_logits(up: &mut dyn FnMut(&Tensor, usize) -> Tensor, ours: &mut candle_trace::models::Decoder, prompt: &[u32], chunk: usize, steps: usize, tr: &mut Tracer) -> Vec<u32> {
    let dev = Device::Cpu;
    let (mut pos, mut last) = (0, None);
    for part in prompt.chunks(chunk) {
        let ids = Tensor::new(part, &dev).unwrap().unsqueeze(0).unwrap();
        let b = ours.forward(tr, &ids, pos, Phase::Prefill).unwrap();
        assert_eq!(bits(&up(&ids, pos)), bits(&b), "prefill logits differ at chunk starting {pos} (chunk {chunk})");
        pos += part.len();
        last = Some(b);
    }
    let (mut logits, mut out) = (last.unwrap(), Vec::new());
    for _ in 0..steps {
        let next = logits.argmax(candle_core::D::Minus1).unwrap().flatten_all().unwrap().to_vec1::<u32>().unwrap()[0];
        out.push(next);
        let ids = Tensor::new(&[next], &dev).unwrap().unsqueeze(0).unwrap();
        let b = ours.forward(tr, &ids, pos, Phase::Decode).unwrap();
        assert_eq!(bits(&up(&ids, pos)), bits(&b), "decode logits differ at position {pos}");
        pos += 1;
        logits = b;
    }
    out
}

/// SmolLM2's chat prompt in chunks of `chunk`, then 3 decode steps, against `quantized_llama`.
fn check(chunk: usize, traced: bool) {
    let path = smollm2_path();
    let mut up = upstream(&path);
    let mut ours = gguf::load(&path, WeightDtype::Quantized, &Device::Cpu).unwrap();
    let text = ours.tokenizer.apply_chat_template("Tell me about Richard Feynman.").unwrap();
    let prompt = ours.tokenizer.encode(&text).unwrap();
    let mut tr = if traced { Tracer::new(Box::new(MemorySink::default())) } else { Tracer::untraced() };
    compare_logits(&mut |ids, pos| up.forward(ids, pos).unwrap(), &mut ours.model, &prompt, chunk, 3, &mut tr);
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

/// The rope bug's signature: SmolLM2 run with the wrong rotary layout (NeoX halves instead of
/// the file's interleaved pairs, as a converter that mislabels the convention would run it)
/// against the right one. Position 0 is not rotated, so the first op whose output differs while
/// its inputs matched is the query rotation at position 1, and its difference along the
/// sequence is the drift table bisect prints.
#[test]
fn wrong_rope_layout_shows_as_drift_along_the_positions() {
    use candle_trace::models::Decoder;
    let path = smollm2_path();
    let dev = Device::Cpu;
    let run = |neox: bool| {
        let mut m = gguf::load(&path, WeightDtype::Quantized, &dev).unwrap();
        if let Decoder::Llama(l) = &mut m.model {
            l.set_rope_neox(neox);
        }
        let prompt = m.tokenizer.encode("The quick brown fox jumps over the lazy dog, then runs far away across the field.").unwrap();
        let sink = MemorySink::default();
        let mut tr = Tracer::new(Box::new(sink.clone()));
        let cfg = candle_trace::generate::GenConfig { max_tokens: 4, ..Default::default() };
        candle_trace::generate::generate(&mut m.model, &m.tokenizer, &prompt, &cfg, &mut tr).unwrap();
        sink.trace(if neox { "neox.trace" } else { "interleaved.trace" }, &candle_trace::record::Header::default())
    };
    let (right, wrong) = (run(false), run(true));
    let r = candle_trace::bisect::bisect(&right, &wrong).unwrap();
    let fd = r.first_divergence.as_ref().expect("a root");
    assert_eq!((fd.path.as_str(), fd.position, fd.inputs_matched), ("layers.0.self_attn.rope_q", 1, true), "{fd:?}");
    assert!(r.drift.len() >= 8, "{:?}", r.drift);
    assert_eq!((r.drift[0].position, r.drift[0].max_abs_diff), (0, 0.0), "position 0 is not rotated: {:?}", r.drift);
    assert!(r.drift[1..].iter().all(|d| d.max_abs_diff > 0.0), "{:?}", r.drift);
    assert!(r.drift_grows && r.drift[1..].iter().filter(|d| d.position < 18).all(|d| d.inputs_matched), "{:?}", r.drift);
    assert!(r.notes.iter().any(|n| n.contains("layers.0.self_attn.rope_q is a root cause at") && n.contains("position-dependent fault")), "{:?}", r.notes);
    let text = candle_trace::report::text(&r);
    assert!(text.contains("layers.0.self_attn.rope_q by position (row 0; * = its inputs matched there), following position:"), "{text}");
    // The same model run twice agrees: no table.
    let again = candle_trace::bisect::bisect(&run(false), &run(false)).unwrap();
    assert!(again.drift.is_empty() && again.first_divergence.is_none());
}
