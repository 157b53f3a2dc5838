//! Ground truth for bisect: `--perturb PATH@POS` flips one bit of one op's output, and bisect
//! must name exactly that op and position as the root cause — in the first, a middle and the last
//! layer, in prefill and in decode.

use crate::util::{record_builtin, smollm2_path, tmp};
use candle_trace::bisect::bisect;
use candle_trace::generate::GenConfig;

const PROMPT: &str = "Hello, candle!"; // 14 bytes: prefill positions 0..=13, decode from 14

fn gen() -> GenConfig {
    GenConfig { max_tokens: 6, ..GenConfig::default() }
}

fn check(path: &str, pos: u32) {
    let dir = tmp();
    let a = record_builtin(&dir.path().join("a.trace"), PROMPT, gen(), None, None);
    let b = record_builtin(&dir.path().join("b.trace"), PROMPT, gen(), Some(&format!("{path}@{pos}")), None);
    let r = bisect(&a, &b).unwrap();
    assert_eq!(r.verdict, "diverged");
    let d = r.first_divergence.expect("a root cause");
    assert_eq!((d.path.as_str(), d.position, d.row), (path, pos, 0));
    assert!(d.inputs_matched);
    assert!(r.env_diff.iter().any(|e| e.key == "run.perturb"));
}

#[test]
fn prefill_first_layer_softmax() {
    check("layers.0.self_attn.softmax", 5);
}

#[test]
fn prefill_middle_layer_down_proj() {
    check("layers.2.mlp.down_proj", 9);
}

#[test]
fn prefill_last_layer_residual() {
    check("layers.3.mlp_residual", 13);
}

#[test]
fn prefill_embedding() {
    check("embed_tokens", 0);
}

#[test]
fn decode_first_layer_norm() {
    check("layers.0.input_layernorm", 16);
}

#[test]
fn decode_middle_layer_kv_cache() {
    check("layers.2.self_attn.k_cache", 15);
}

#[test]
fn decode_last_layer_scores() {
    check("layers.3.self_attn.scores", 17);
}

#[test]
fn decode_lm_head() {
    check("lm_head", 18);
}

#[test]
fn smollm2_middle_layer_prefill_and_decode() {
    let model = smollm2_path();
    let dir = tmp();
    let g = GenConfig { max_tokens: 3, ..GenConfig::default() };
    let prompt = "Tell me about Richard Feynman."; // 8 tokens
    let a = record_builtin(&dir.path().join("a.trace"), prompt, g.clone(), None, Some(&model));
    for (path, pos) in [("layers.15.self_attn.softmax", 4u32), ("layers.29.mlp.up_proj", 9)] {
        let b = record_builtin(&dir.path().join("b.trace"), prompt, g.clone(), Some(&format!("{path}@{pos}")), Some(&model));
        let d = bisect(&a, &b).unwrap().first_divergence.expect("a root cause");
        assert_eq!((d.path.as_str(), d.position, d.layer), (path, pos, candle_trace::bisect::layer_of(path)));
    }
}
