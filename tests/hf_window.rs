//! Sliding windows of Hugging Face folders: a mistral folder's `sliding_window` (6 positions in
//! the seeded folder, an 11-token prompt) applies as the model defines it in every pass, so a
//! decode step past the window sees what a prefill of the same tokens sees, and a chunked
//! prefill what a whole one sees; upstream's numerics (candle-transformers' `mistral`: no mask
//! in a decode step) do not, and `tests/hf.rs` checks them bit for bit. A qwen2 folder whose
//! window applies on some layers only is refused in one line.

use crate::hf::{mistral_config, qwen2_config, seeded_folder, PROMPT};
use crate::util::{max_diff, tmp};
use candle_core::{DType, Device, Tensor, D};
use candle_trace::models::hf;
use candle_trace::record::Phase;
use candle_trace::tracer::Tracer;
use std::path::Path;

fn row(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// `prompt` prefilled in chunks of `chunk`, then `steps` greedy decode steps, on a fresh load:
/// the tokens and the last pass's logits.
fn generate(dir: &Path, upstream: bool, prompt: &[u32], chunk: usize, steps: usize) -> (Vec<u32>, Vec<f32>) {
    let (mut m, _, _) = hf::load_decoder(dir, DType::F32, &Device::Cpu).unwrap();
    if upstream {
        m.set_upstream_numerics();
    }
    let mut tr = Tracer::untraced();
    let (mut pos, mut logits) = (0, None);
    for part in prompt.chunks(chunk) {
        logits = Some(m.forward(&mut tr, &Tensor::new(part, &Device::Cpu).unwrap().unsqueeze(0).unwrap(), pos, Phase::Prefill).unwrap());
        pos += part.len();
    }
    let (mut logits, mut out) = (logits.unwrap(), Vec::new());
    for _ in 0..steps {
        let next = logits.argmax(D::Minus1).unwrap().flatten_all().unwrap().to_vec1::<u32>().unwrap()[0];
        out.push(next);
        logits = m.forward(&mut tr, &Tensor::new(&[next], &Device::Cpu).unwrap().unsqueeze(0).unwrap(), pos, Phase::Decode).unwrap();
        pos += 1;
    }
    (out, row(&logits))
}

#[test]
fn mistral_window_holds_in_decode_steps_and_chunked_prefill() {
    let d = tmp();
    seeded_folder(d.path(), mistral_config(), false, true);
    assert_eq!(mistral_config()["sliding_window"], 6);
    for upstream in [false, true] {
        let (tokens, decoded) = generate(d.path(), upstream, &PROMPT, usize::MAX, 4);
        let fed: Vec<u32> = PROMPT.iter().chain(&tokens[..3]).copied().collect();
        let (_, prefilled) = generate(d.path(), upstream, &fed, usize::MAX, 1);
        let diff = max_diff(&decoded, &prefilled);
        eprintln!("numerics upstream: {upstream}: 4th decode step vs prefill of the same tokens: max |diff| {diff}");
        if upstream {
            assert!(diff > 0.05, "upstream's decode step was expected to see past the window: {diff}");
            continue;
        }
        assert!(diff < 1e-4, "decode step and prefill part past the window: {diff}");
        let (chunked, last) = generate(d.path(), false, &PROMPT, 4, 4);
        assert_eq!(chunked, tokens);
        assert!(max_diff(&last, &decoded) < 1e-4, "chunked prefill part: {}", max_diff(&last, &decoded));
    }
}

#[test]
fn qwen2_window_on_some_layers_is_refused_in_one_line() {
    let d = tmp();
    let mut cfg = qwen2_config();
    cfg["use_sliding_window"] = true.into();
    cfg["sliding_window"] = 6.into();
    cfg["max_window_layers"] = 1.into();
    seeded_folder(d.path(), cfg.clone(), true, false);
    let err = hf::load_decoder(d.path(), DType::F32, &Device::Cpu).err().expect("refused").to_string();
    assert!(err.contains("config.json") && err.contains("use_sliding_window") && err.contains("max_window_layers") && !err.contains('\n'), "{err}");
    // From layer 2 on, of 2 layers: no layer slides, and the folder loads.
    cfg["max_window_layers"] = 2.into();
    seeded_folder(d.path(), cfg, true, false);
    assert!(hf::load_decoder(d.path(), DType::F32, &Device::Cpu).is_ok());
}
