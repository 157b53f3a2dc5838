//! Ground truth for bisect: `--perturb PATH@POS` flips one bit of one op's output, and bisect
//! must name exactly that op and position as the root cause — in the first, a middle and the last
//! layer, in prefill and in decode.

use crate::util::{p, record_builtin, smollm2_path, tmp, trace_s};
use candle_trace::bisect::bisect;
use candle_trace::generate::GenConfig;

const PROMPT: &str = "Hello, candle!"; // 14 bytes: prefill positions 0..=13, decode from 14

fn gen() -> GenConfig {
    GenConfig { max_tokens: 6, ..GenConfig::default() }
}

fn check(path: &str, pos: u32) {
    check_spec(path, pos, &format!("{path}@{pos}"));
}

/// Bisect of a run perturbed by `spec` against a clean one names `path` at `pos`, row 0.
fn check_spec(path: &str, pos: u32, spec: &str) {
    let dir = tmp();
    let a = record_builtin(&dir.path().join("a.trace"), PROMPT, gen(), None, None);
    let b = record_builtin(&dir.path().join("b.trace"), PROMPT, gen(), Some(spec), None);
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

/// A flipped bit among the masked keys of a mask's output (key 3 of query 1, where the fill
/// -inf becomes NaN) is left out of the query's slice, but the softmax after it reads it: the
/// mask is named, not the softmax whose input looked identical.
#[test]
fn prefill_masked_key_of_the_mask() {
    check_spec("layers.1.self_attn.mask", 1, "layers.1.self_attn.mask@1#3");
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

/// `#ELEMENT` indexes one position's values: in a prefill pass too (where the op holds many
/// positions), the last element of position 3 is flipped at position 3, and one past it is
/// refused with the per-position count.
#[test]
fn element_stays_within_its_position_in_prefill() {
    use crate::util::{p, trace_s};
    let dir = tmp();
    let out = dir.path().join("x.trace");
    let (code, _, err) = trace_s(&["record", "--prompt", PROMPT, "--max-tokens", "2", "--perturb", "layers.1.mlp_residual@3#100000", "-o", p(&out)]);
    assert_eq!(code, 2, "{err}");
    let n: u32 = err.split("is past the ").nth(1).and_then(|r| r.split(' ').next()).and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{err}"));
    let hidden = record_builtin(&dir.path().join("a.trace"), PROMPT, gen(), None, None);
    let b = record_builtin(&dir.path().join("b.trace"), PROMPT, gen(), Some(&format!("layers.1.mlp_residual@3#{}", n - 1)), None);
    let d = bisect(&hidden, &b).unwrap().first_divergence.expect("a root cause");
    assert_eq!((d.path.as_str(), d.position), ("layers.1.mlp_residual", 3), "{n} values a position");
    let (code, _, err) = trace_s(&["record", "--prompt", PROMPT, "--max-tokens", "2", "--perturb", &format!("layers.1.mlp_residual@3#{n}"), "-o", p(&out)]);
    assert!(code == 2 && err.contains(&format!("element {n} is past the {n} values ELEMENT indexes at a position")), "{err}");
    // A key its position does not see (causal attention): refused, as the trace would not show
    // the flip (it recorded two identical traces: a fresh-user trial); a visible key is flipped.
    let (code, _, err) = trace_s(&["record", "--prompt", PROMPT, "--max-tokens", "2", "--perturb", "layers.0.self_attn.softmax@1#2", "-o", p(&out)]);
    assert!(code == 2 && err.contains("key 2 is masked at position 1 (it sees keys 0 to 1)"), "{err}");
    let c = record_builtin(&dir.path().join("c.trace"), PROMPT, gen(), Some("layers.0.self_attn.softmax@1#1"), None);
    let d = bisect(&hidden, &c).unwrap().first_divergence.expect("a root cause");
    assert_eq!((d.path.as_str(), d.position), ("layers.0.self_attn.softmax", 1));
}

/// Refused before anything runs: a spec given twice (the flips would cancel), a `--dump`
/// pattern no op matches, and `-o` naming the model file (which is left as it was).
#[test]
fn self_defeating_record_options_are_refused() {
    use crate::util::{p, trace_s};
    let dir = tmp();
    let out = dir.path().join("x.trace");
    let (code, _, err) = trace_s(&["record", "--perturb", "layers.0.mlp.act@2", "--perturb", "layers.0.mlp.act@2", "-o", p(&out)]);
    assert!(code == 2 && err.contains("given twice"), "{err}");
    // The same element written two ways (element 0 implied), and through the default position
    // (the first the op writes: 0 in the prefill).
    let (code, _, err) = trace_s(&["record", "--perturb", "layers.0.mlp.act@0#0", "--perturb", "layers.0.mlp.act@0", "-o", p(&out)]);
    assert!(code == 2 && err.contains("given twice"), "{err}");
    let (code, _, err) = trace_s(&["record", "--perturb", "layers.0.mlp.act", "--perturb", "layers.0.mlp.act@0", "-o", p(&out)]);
    assert!(code == 2 && err.contains("flips the element --perturb layers.0.mlp.act flips"), "{err}");
    let (code, _, err) = trace_s(&["record", "--dump", "layers.0.*,layers.0.self_attn.flash_atn", "-o", p(&out)]);
    assert!(code == 2 && err.contains("--dump layers.0.self_attn.flash_atn: matches no op"), "{err}");
    let model = dir.path().join("m.gguf");
    std::fs::copy(smollm2_path(), &model).unwrap();
    let before = std::fs::metadata(&model).unwrap().len();
    let (code, _, err) = trace_s(&["record", "--model", p(&model), "--max-tokens", "1", "-o", p(&model)]);
    assert!(code == 2 && err.contains("is the model file"), "{err}");
    assert_eq!(std::fs::metadata(&model).unwrap().len(), before);
    // Nor over a file of prompts or texts it reads (found by a fresh-user trial).
    let prompts = dir.path().join("prompts.txt");
    for flag in ["--prompt-file", "--prompts-file"] {
        std::fs::write(&prompts, "Hello there\n").unwrap();
        let (code, _, err) = trace_s(&["record", flag, p(&prompts), "--max-tokens", "1", "-o", p(&prompts)]);
        assert!(code == 2 && err.contains(&format!("is the {flag}")), "{flag}: {err}");
        assert_eq!(std::fs::read_to_string(&prompts).unwrap(), "Hello there\n", "{flag}");
    }
}

/// Runs chunked differently (6 and 8 positions a prefill pass): in b's pass of 8, the NaN at
/// query 6's masked key reaches its layer's later keys and values at 6, and through attention's
/// zero weight every earlier query of layer 1 in that pass; in a, position 6 comes a pass later.
/// Judged when both sides hold it, layer 1's scores at position 0 looked like a root (its keys
/// up to 0 matched); once position 6 is compared, it is not, and the mask is named.
#[test]
fn a_nan_brought_back_by_a_longer_chunk_is_named_where_it_entered() {
    let dir = tmp();
    let (a, b) = (dir.path().join("a.trace"), dir.path().join("b.trace"));
    let base = ["record", "--max-tokens", "2", "--threads", "1"];
    assert_eq!(trace_s(&[&base[..], &["--prefill-chunk", "6", "-o", p(&a)]].concat()).0, 0);
    assert_eq!(trace_s(&[&base[..], &["--prefill-chunk", "8", "--perturb", "layers.0.self_attn.mask@6#7", "-o", p(&b)]].concat()).0, 0);
    for (x, y) in [(&a, &b), (&b, &a)] {
        let (code, out, err) = trace_s(&["bisect", p(x), p(y)]);
        assert_eq!(code, 1, "{err}");
        assert!(out.contains("the numbers first parted here: layers.0.self_attn.mask (where_cond)\n  layer 0, token position 6 of the row"), "{out}");
        assert!(out.contains("cause: a fault injected by --perturb"), "{out}");
    }
}

/// Two faults in different prefill passes of 8 (recorded at `--level layers`): layer 1's NaN
/// at position 2 is a root, though layer 0 holds a NaN at position 12 later: that position came
/// a pass later, so no zero attention weight brought it to position 2.
#[test]
fn a_root_stays_when_a_later_nan_came_in_a_later_pass() {
    let dir = tmp();
    let (a, b) = (dir.path().join("a.trace"), dir.path().join("b.trace"));
    let base = ["record", "--max-tokens", "2", "--threads", "1", "--level", "layers", "--prefill-chunk", "8"];
    assert_eq!(trace_s(&[&base[..], &["-o", p(&a)]].concat()).0, 0);
    assert_eq!(trace_s(&[&base[..], &["--perturb", "layers.1.self_attn.mask@2#5", "--perturb", "layers.0.self_attn.mask@12#14", "-o", p(&b)]].concat()).0, 0);
    let (code, out, err) = trace_s(&["bisect", p(&a), p(&b)]);
    assert_eq!(code, 1, "{err}");
    assert!(out.contains("the numbers first parted here: layers.1.mlp_residual (add)\n  layer 1, token position 2 of the row"), "{out}");
}

/// Two runs whose recorded outputs all match while one ran with `--perturb`: identical, with a
/// note that the fault left nothing the traces hold changed (an "identical" otherwise reads as
/// the fault gone missing).
#[test]
fn a_fault_that_changed_nothing_recorded_is_noted() {
    use candle_trace::record::{Header, Phase};
    use candle_trace::tracer::{MemorySink, Tok, Tracer};
    let run = |perturb: Option<&str>| {
        let dev = candle_core::Device::Cpu;
        let sink = MemorySink::default();
        let mut tr = Tracer::new(Box::new(sink.clone()));
        let ids = candle_core::Tensor::new(&[[1u32, 2]], &dev).unwrap();
        tr.begin_forward(Phase::Prefill, 0, &ids).unwrap();
        tr.probe("layers.0.mlp_residual", candle_core::Tensor::new(&[[[0.5f32, 1.5], [2.5, 3.5]]], &dev).unwrap(), &[], Tok::Seq(1)).unwrap();
        tr.end_forward().unwrap();
        let mut h = Header::default();
        h.run.perturb = perturb.map(String::from);
        let mut t = sink.trace("t.trace", &h);
        t.footer = Some(candle_trace::record::Footer { op_records: 1, forward_passes: 1, stop: "max_tokens".into(), ..Default::default() });
        t.truncated = false;
        t
    };
    let r = bisect(&run(None), &run(Some("layers.0.self_attn.softmax@1"))).unwrap();
    assert_eq!(r.verdict, candle_trace::bisect::Verdict::Identical);
    assert!(
        r.notes.iter().any(|n| n.text() == "b ran with --perturb layers.0.self_attn.softmax@1, and no recorded output differs: the flipped bit was rounded away before anything the traces hold"),
        "{:?}",
        r.notes
    );
    // --causal's patches are no fault.
    let r = bisect(&run(None), &run(Some("patch:layers.0.mlp_residual@0"))).unwrap();
    assert!(!r.notes.iter().any(|n| n.text().contains("--perturb")), "{:?}", r.notes);
}
