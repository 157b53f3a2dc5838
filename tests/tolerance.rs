//! `bisect --tolerance auto` on the pairs people compare most, on one file (SmolLM2's Q4_1 GGUF,
//! a 95-token prompt, every op's output dumped): quantized against dequantized and bf16 against
//! f32 report no root and print the error by layer, while real faults are named where they are —
//! candle's half-precision softmax, which sums in bf16 (`--numerics upstream`), and a block scale
//! altered in a copy of the file. The tolerance model is docs/tolerance.md.

use crate::util::{across, fixture, p, smollm2_path, tmp, trace_s, worst_layer, Fixture};

/// The first two sentences of the reference tests' long prompt: 95 tokens, enough keys for
/// candle's bf16 softmax to round small terms away at the attention sink.
const PROMPT: &str = "Richard Feynman was an American theoretical physicist, known for his work in the path integral formulation of quantum mechanics, the theory of quantum electrodynamics, the physics of the superfluidity of supercooled liquid helium, and in particle physics, for which he proposed the parton model. For his contributions to the development of quantum electrodynamics, Feynman received the Nobel Prize in Physics in 1965 jointly with Julian Schwinger and Shin'ichirō Tomonaga.";

/// `record` arguments for SmolLM2 (`model`) in `dtype` with every output dumped, writing `out`.
fn args<'a>(model: &'a str, dtype: &'a str, out: &'a str) -> Vec<&'a str> {
    vec!["record", "--model", model, "--dtype", dtype, "--prompt", PROMPT, "--max-tokens", "2", "--dump", "outputs:all", "--quiet", "-o", out]
}

/// The runs of one file: f32, q (Q4_1 with Q8_1 activations), bf16, bf16 under candle's own
/// numerics, and f32 and q on the batch-invariant kernels; recorded once for the suite.
pub(crate) fn runs() -> Fixture {
    let m = smollm2_path();
    let m = p(&m);
    let numerics = |dtype, out, n| [&args(m, dtype, out)[..], &["--numerics", n]].concat();
    let upstream = numerics("bf16", "bf16-upstream.trace", "upstream");
    // tests/invariant.rs compares the batch-invariant kernels' runs with these.
    let (f32_inv, q_inv) = (numerics("f32", "f32-invariant.trace", "invariant"), numerics("q", "q-invariant.trace", "invariant"));
    fixture(&[&args(m, "f32", "f32.trace"), &args(m, "q", "q.trace"), &args(m, "bf16", "bf16.trace"), &upstream, &f32_inv, &q_inv])
}

/// Quantized against dequantized: the Q8_1 activation quantization moves every layer by 1-10 %
/// of its scale, and the per-op bounds (the linear layers' from their weight norms) explain it:
/// no root, and the error by layer printed. Before, layer 12's v_proj was named the root.
#[test]
fn quantized_against_dequantized_has_no_root() {
    let f = runs();
    let (code, rep) = across(&f.path("f32.trace"), &f.path("q.trace"));
    assert_eq!((code, &rep["root"]), (0, &serde_json::Value::Null), "{rep:#}");
    assert_eq!(rep["first_token_differs"], serde_json::Value::Null);
    let w = worst_layer(&rep);
    assert!(w > 1e-2 && w < 0.5, "quantization-level errors: {w}");
    assert_eq!(rep["layers"].as_array().unwrap().len(), 34, "{rep:#}");
    let (_, text, _) = trace_s(&["bisect", p(&f.path("f32.trace")), p(&f.path("q.trace")), "--tolerance", "auto"]);
    assert!(text.contains("no root") && text.contains("error by layer") && text.contains("  layers.29 "), "{text}");
}

/// bf16 against f32 of one file: no root. Under candle's numerics the bf16 softmax sums its
/// exponentials in bf16, where the small terms added to a sum near 1 are rounded away: an
/// attention probability comes out over 10 % high, far past what rounding once explains, and
/// that softmax is the root.
#[test]
fn bf16_against_f32_has_no_root_and_a_softmax_summed_in_bf16_is_named() {
    let f = runs();
    let (code, rep) = across(&f.path("f32.trace"), &f.path("bf16.trace"));
    assert_eq!((code, &rep["root"]), (0, &serde_json::Value::Null), "{rep:#}");
    let w = worst_layer(&rep);
    assert!(w > 1e-2 && w < 0.5, "bf16-level errors: {w}");
    let (code, rep) = across(&f.path("f32.trace"), &f.path("bf16-upstream.trace"));
    assert_eq!(code, 1, "{rep:#}");
    let root = &rep["root"];
    assert!(root["path"].as_str().unwrap().ends_with(".self_attn.softmax"), "{root:#}");
    assert!(root["judged"]["error"].as_f64().unwrap() > 0.05 && root["judged"]["amplification"].as_f64().unwrap() > 2.0, "{root:#}");
}

/// A Q4_1 block whose scale was multiplied by 16 in a copy of the file (layer 9's up_proj, block
/// 300: row 6, inputs 384..416): the quantized run of the copy against the f32 run of the
/// original names that projection at the prefill, its inputs agreeing within quantization.
#[test]
fn an_altered_block_scale_is_named_at_its_projection() {
    use candle_core::quantized::gguf_file::Content;
    let f = runs();
    let d = tmp();
    let copy = d.path().join("altered.gguf");
    std::fs::copy(smollm2_path(), &copy).unwrap();
    let mut file = std::fs::OpenOptions::new().read(true).write(true).open(&copy).unwrap();
    let content = Content::read(&mut file).unwrap();
    let info = &content.tensor_infos["blk.9.ffn_up.weight"];
    assert_eq!(format!("{:?}", info.ggml_dtype), "Q4_1");
    // A Q4_1 block is 20 bytes: the scale d (f16), the minimum m (f16), 32 four-bit weights.
    let at = content.tensor_data_offset + info.offset + 300 * 20;
    let mut d16 = [0u8; 2];
    std::io::Seek::seek(&mut file, std::io::SeekFrom::Start(at)).unwrap();
    std::io::Read::read_exact(&mut file, &mut d16).unwrap();
    let scaled = half::f16::from_f32(half::f16::from_le_bytes(d16).to_f32() * 16.0);
    std::io::Seek::seek(&mut file, std::io::SeekFrom::Start(at)).unwrap();
    std::io::Write::write_all(&mut file, &scaled.to_le_bytes()).unwrap();
    drop(file);
    // Layers 0 to 9 suffice, and keep the run small.
    let out = d.path().join("altered.trace");
    let layers: Vec<String> = (0..10).map(|l| format!("layers.{l}.*")).collect();
    let dump = format!("outputs:embed_tokens,{}", layers.join(","));
    let mut cmd = args(p(&copy), "q", p(&out));
    let at_dump = cmd.iter().position(|a| *a == "outputs:all").unwrap();
    cmd[at_dump] = &dump;
    let (code, _, err) = trace_s(&cmd);
    assert_eq!(code, 0, "{err}");
    let (code, rep) = across(&f.path("f32.trace"), &out);
    assert_eq!(code, 1, "{rep:#}");
    let root = &rep["root"];
    assert_eq!((root["path"].as_str(), root["step"].as_u64()), (Some("layers.9.mlp.up_proj"), Some(0)), "{root:#}");
    assert!(root["judged"]["input_error"].as_f64().unwrap() < 0.05 && root["judged"]["amplification"].as_f64().unwrap() > 5.0, "{root:#}");
}
