//! Gemma 3 past its 512-token sliding window (a 591-token prompt, decoding past it): by default
//! a sliding layer sees the window the model defines in every pass (so a decode step sees what
//! a prefill of the same tokens sees, and the logits are those transformers gives), and
//! `--numerics upstream` reproduces candle-transformers' `quantized_gemma3`, which shows one key
//! more in a prefill and every cached key in a decode step, bit for bit.

use crate::gemma3::upstream;
use crate::util::{gemma3_path, json, max_diff, p, tmp, trace_s};
use candle_core::{Device, Tensor};
use candle_trace::models::{gguf, Decoder, WeightDtype};
use candle_trace::record::Phase;
use candle_trace::tracer::{MemorySink, Tracer};

/// 32 numbered lines (591 tokens with BOS): longer than the 512-token window, and a pattern the
/// model continues only if it still sees the lines it should.
pub(crate) fn long_prompt() -> String {
    (1..=32).map(|i| format!("Line {i}: the quick brown fox jumps over the lazy dog number {i}.")).collect::<Vec<_>>().join(" ")
}

fn load(dtype: WeightDtype, upstream_numerics: bool) -> (Decoder, Vec<u32>) {
    let mut m = gguf::load(&gemma3_path(), dtype, &Device::Cpu).unwrap();
    let Decoder::Gemma3(g) = &mut m.model else { panic!("not gemma3") };
    if upstream_numerics {
        g.set_upstream_numerics();
    }
    assert_eq!(g.config().sliding_window, 512);
    let mut ids = m.tokenizer.encode(&long_prompt()).unwrap();
    ids.insert(0, m.tokenizer.bos_id().unwrap());
    assert_eq!(ids.len(), 591);
    (m.model, ids)
}

fn row(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn argmax(v: &[f32]) -> u32 {
    v.iter().enumerate().fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &x)| if x > bv { (i, x) } else { (bi, bv) }).0 as u32
}

/// `prompt` prefilled in chunks of `chunk`, then `steps` greedy decode steps: the tokens and the
/// last decode step's logits.
fn generate(m: &mut Decoder, prompt: &[u32], chunk: usize, steps: usize) -> (Vec<u32>, Vec<f32>) {
    let mut tr = Tracer::untraced();
    let (mut pos, mut logits) = (0, Vec::new());
    m.clear_kv_cache();
    for part in prompt.chunks(chunk) {
        logits = row(&m.forward(&mut tr, &Tensor::new(part, &Device::Cpu).unwrap().unsqueeze(0).unwrap(), pos, Phase::Prefill).unwrap());
        pos += part.len();
    }
    let mut out = Vec::new();
    for _ in 0..steps {
        let next = argmax(&logits);
        out.push(next);
        logits = row(&m.forward(&mut tr, &Tensor::new(&[next], &Device::Cpu).unwrap().unsqueeze(0).unwrap(), pos, Phase::Decode).unwrap());
        pos += 1;
    }
    (out, logits)
}

/// Upstream's numerics past the window: every pass's logits bit for bit against
/// `quantized_gemma3` (whole prefill of 591 tokens, 3 decode steps), traced.
#[test]
fn gemma3_upstream_past_the_window_is_bit_identical_to_quantized_gemma3() {
    let (mut ours, prompt) = load(WeightDtype::Quantized, true);
    let mut up = upstream();
    let mut tr = Tracer::new(Box::new(MemorySink::default()));
    crate::parity::compare_logits(&mut |ids, pos| up.forward(ids, pos).unwrap(), &mut ours, &prompt, usize::MAX, 3, &mut tr);
    assert!(tr.op_records() > 0);
}

/// By default a decode step past the window sees the keys a prefill of the same tokens sees:
/// the logits of the 4th decode step and of a prefill of the prompt and the 4 tokens fed agree
/// to rounding (f32 weights: the matmuls' shapes differ; Q4_K_M would add its activations'
/// quantization, up to a whole logit here), and a prefill in chunks of 100 decodes the same
/// tokens. Under upstream's numerics the decode step attends to every cached key, and the two
/// part by whole logits: what the default fixes.
#[test]
fn gemma3_decode_past_the_window_sees_what_a_prefill_sees() {
    for upstream_numerics in [false, true] {
        let (mut m, prompt) = load(WeightDtype::Dense(candle_core::DType::F32), upstream_numerics);
        let (tokens, decoded) = generate(&mut m, &prompt, usize::MAX, 4);
        let fed: Vec<u32> = prompt.iter().chain(&tokens).copied().collect();
        let (_, prefilled) = generate(&mut m, &fed, usize::MAX, 0);
        let d = max_diff(&decoded, &prefilled);
        eprintln!("numerics upstream: {upstream_numerics}; tokens {tokens:?}; decode vs prefill: max |diff| {d}");
        if upstream_numerics {
            assert!(d > 1.0, "upstream's decode step was expected to see more than the window: {d}");
            continue;
        }
        assert!(d < 1e-3, "decode step and prefill part past the window: {d}");
        assert_eq!(argmax(&decoded), argmax(&prefilled));
        let (chunked, _) = generate(&mut m, &prompt, 100, 4);
        assert_eq!(chunked, tokens, "a prefill in chunks of 100 decoded other tokens");
    }
}

/// `trace record` (f32) on the 591-token prompt, 12 tokens: the text and each step's top logit
/// are those transformers 5.24 gives on the same file and ids (its `generate`, eager attention,
/// rolling sliding-window cache: measured by hand, 4 decimals); upstream's numerics lose the
/// pattern.
#[test]
fn gemma3_past_the_window_agrees_with_transformers() {
    let want = [
        (10452, 25.9501),
        (236743, 23.1403),
        (236800, 30.2188),
        (236800, 30.3194),
        (236787, 26.1265),
        (506, 26.6879),
        (3823, 23.3636),
        (8864, 28.0982),
        (37423, 26.7192),
        (38167, 26.8997),
        (1024, 32.8261),
        (506, 30.4733),
    ];
    let d = tmp();
    let model = gemma3_path();
    let prompt = long_prompt();
    let base = ["record", "--model", p(&model), "--dtype", "f32", "--prompt", &prompt, "--max-tokens", "12"];
    let out = d.path().join("fixed.trace");
    let (code, text, err) = trace_s(&[&base[..], &["-o", p(&out)]].concat());
    assert_eq!(code, 0, "{err}");
    assert_eq!(text.trim_end(), " Line 33: the quick brown fox jumps over the");
    let (_, shown, _) = trace_s(&["show", p(&out), "--format", "json"]);
    let v = json(&shown);
    for (i, (id, logit)) in want.iter().enumerate() {
        let top = &v["tokens"][i]["rows"][0]["top"][0];
        assert_eq!(top[0].as_u64(), Some(*id), "step {i}: {top}");
        assert!((top[1].as_f64().unwrap() - logit).abs() < 2e-3, "step {i}: {top}");
    }
    let (code, text, _) = trace_s(&[&base[..], &["--numerics", "upstream", "-o", p(&d.path().join("up.trace"))]].concat());
    assert_eq!(code, 0);
    assert!(!text.contains("Line 33"), "{text:?}");
}

/// A bounded dump of the 591-token prompt: `--dump outputs:all@decode` keeps the values of the
/// decode steps only (2 of them here): under 60 MB where the whole dump of 12 tokens takes
/// 1.1 GB, most of it the prefill's. Compared with itself by value, every decode op is compared
/// and the prefill's records are counted as not dumped.
#[test]
fn gemma3_long_prompt_dump_bounded_to_decode_steps_stays_small() {
    let d = tmp();
    let model = gemma3_path();
    let out = d.path().join("bounded.trace");
    let (code, _, err) = trace_s(&["record", "--model", p(&model), "--dtype", "f32", "--prompt", &long_prompt(), "--max-tokens", "3", "--dump", "outputs:all@decode", "-o", p(&out)]);
    assert_eq!(code, 0, "{err}");
    let size = std::fs::metadata(&out).unwrap().len();
    eprintln!("bounded dump: {size} bytes");
    assert!(size < 60_000_000, "{size} bytes");
    // Said before the run: the values' size, near the file's (the file: compressed values and
    // the records' digests).
    let note = err.lines().find(|l| l.starts_with("note: --dump outputs:all@decode: about ")).unwrap_or_else(|| panic!("no size note: {err}"));
    let said: Vec<&str> = note["note: --dump outputs:all@decode: about ".len()..].split(' ').take(2).collect();
    let mb = said[0].parse::<f64>().unwrap() * if said[1] == "MB" { 1.0 } else { f64::NAN };
    assert!(note.contains("(2 decode steps ") && !note.contains("prefill") && !note.contains("bound it"), "{note}");
    assert!((0.8..1.3).contains(&(mb * 1e6 / size as f64)), "{note}: the file has {size} bytes");
    let (_, shown, _) = trace_s(&["show", p(&out)]);
    assert!(shown.contains("dump         outputs:all@decode ("), "{shown}");
    let (code, out_json, _) = trace_s(&["bisect", p(&out), p(&out), "--tolerance", "auto", "--format", "json"]);
    assert_eq!(code, 0, "{out_json}");
    let v = json(&out_json);
    // The prefill's 473 records (18 layers' masks among them); a decode step's 470 (the 3
    // global layers run unmasked in a decode step, the 15 sliding ones masked past the window).
    assert_eq!((&v["not_dumped"], &v["compared"]), (&serde_json::json!([473, 473]), &serde_json::json!(940)), "{v:#}");
}
