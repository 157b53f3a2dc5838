//! KV-cache decoding vs recomputing the sequence: run a generates 12 tokens from a prompt, one
//! decode step at a time; run b is given a's prompt followed by a's first 11 generated tokens as
//! its prompt and generates 1. Both feed the same ids at every position, so bisect reports no
//! input difference, compares each of positions P-1..P+10 as itself (decode step vs prefill),
//! finds a root whose inputs matched with operand shapes differing, and pairs a's token 11 with
//! b's token 0 (the same position). A b whose prompt changes one of a's tokens is an input
//! difference at that position. Expected values come from the recorded token ids.

use crate::util::{json, p, smollm2_path, tmp, trace_s};
use std::path::Path;

fn record(args: &[&str], out: &Path) -> candle_trace::format::Trace {
    let (code, _, err) = trace_s(&[&["record"], args, &["-o", p(out)]].concat());
    assert_eq!(code, 0, "record {args:?}: {err}");
    candle_trace::format::read_trace(out).unwrap()
}

/// Row 0's generated (token id, text) per step.
fn generated(t: &candle_trace::format::Trace) -> Vec<(u32, String)> {
    t.items.iter().filter_map(|i| if let candle_trace::record::Item::Token(e) = i { Some((e.rows[0].token, e.rows[0].text.clone())) } else { None }).collect()
}

/// Records the pair for `base` (model arguments) and `prompt`, checks the report, and returns
/// b's prompt ids (for a caller that wants to alter one).
fn continuation(base: &[&str], prompt: &str, dir: &Path) {
    let (a, b, c) = (dir.join("a.trace"), dir.join("b.trace"), dir.join("c.trace"));
    let ta = record(&[base, &["--prompt", prompt, "--max-tokens", "12"]].concat(), &a);
    let gen = generated(&ta);
    assert_eq!(gen.len(), 12, "a runs its 12 tokens");
    let cont: String = gen[..11].iter().map(|g| g.1.as_str()).collect();
    let tb = record(&[base, &["--prompt", &format!("{prompt}{cont}"), "--max-tokens", "1"]].concat(), &b);
    let (pa, pb) = (&ta.header.run.prompt_tokens, &tb.header.run.prompt_tokens);
    let fed_a: Vec<u32> = pa.iter().copied().chain(gen.iter().map(|g| g.0)).collect();
    assert_eq!(&fed_a[..pb.len()], &pb[..], "b's prompt ids are a's prompt and first 11 tokens (the text re-tokenizes to them)");
    let n = pa.len() as u64;
    let (code, out, err) = trace_s(&["bisect", p(&a), p(&b), "--format", "json"]);
    assert!(code <= 1, "{err}");
    let v = json(&out);
    assert!(v["inputs_differ"].is_null(), "the fed ids agree: {}", v["inputs_differ"]);
    let fd = &v["first_divergence"];
    assert_eq!((fd["inputs_matched"].as_bool(), fd["class"].as_str()), (Some(true), Some("shapes_differ")), "{fd}");
    // Positions n-1 ..= n+10: how each run computed them, a's predictions, and b's at the last.
    let ps = v["positions"].as_array().expect("positions");
    let at: Vec<u64> = ps.iter().map(|x| x["position"].as_u64().unwrap()).collect();
    assert_eq!(at, (n - 1..=n + 10).collect::<Vec<_>>());
    for (i, x) in ps.iter().enumerate() {
        assert_eq!(x["a_next"].as_u64(), Some(gen[i].0 as u64), "{x}");
        assert_eq!(x["b_next"].as_u64(), (i == 11).then_some(generated(&tb)[0].0 as u64), "{x}");
        assert!(x["max_abs_diff"].is_number(), "a difference (or 0) at every position: {x}");
        assert!(x["b_pass"].as_str().unwrap().starts_with("prefill"), "{x}");
        assert!(x["a_pass"].as_str().unwrap().starts_with(if i == 0 { "prefill" } else { "decode step" }), "{x}");
    }
    // a's token 11 and b's token 0 sit at the same position: compared, and only they.
    assert_eq!(v["tokens"]["compared"].as_u64(), Some(1), "{}", v["tokens"]);
    let flips = gen[11].0 != generated(&tb)[0].0;
    assert_eq!(v["first_token_divergence"].is_null(), !flips, "{}", v["first_token_divergence"]);
    if flips {
        assert_eq!(v["first_token_divergence"]["step"].as_u64(), Some(11));
    }
    let (_, text, _) = trace_s(&["bisect", p(&a), p(&b)]);
    assert!(text.contains("positions one run decoded step by step and the other prefilled") && !text.contains("inputs differ"), "{text}");
    // Redacted copies (no token ids): the same relation, found from the input-id digests.
    let (ra, rb) = (dir.join("a.red"), dir.join("b.red"));
    for (x, y) in [(&a, &ra), (&b, &rb)] {
        assert_eq!(trace_s(&["redact", p(x), "-o", p(y)]).0, 0);
    }
    let (_, out, _) = trace_s(&["bisect", p(&ra), p(&rb), "--format", "json"]);
    let v = json(&out);
    assert!(v["inputs_differ"].is_null() && v["verdict"] == "diverged", "{out}");
    assert_eq!(v["positions"].as_array().unwrap().len(), 12, "{out}");
    assert!(v["positions"][0]["a_next"].is_null(), "no ids to show in a redacted trace: {out}");
    // Nothing compared (a's one token left is its last, never fed back): no "agree" either.
    assert!(v["tokens"]["compared"] == 0 && !v["notes"].to_string().contains("compared agree"), "{out}");
    // The same, with one of a's tokens changed in b's prompt: an input difference right there.
    let k = 4;
    let changed: String = gen[..11].iter().enumerate().map(|(i, g)| if i == k { " zebra" } else { g.1.as_str() }).collect();
    let tc = record(&[base, &["--prompt", &format!("{prompt}{changed}"), "--max-tokens", "1"]].concat(), &c);
    let first = fed_a.iter().zip(&tc.header.run.prompt_tokens).position(|(x, y)| x != y).expect("the prompt changed") as u64;
    let (_, out, _) = trace_s(&["bisect", p(&a), p(&c), "--format", "json"]);
    let v = json(&out);
    assert_eq!(v["inputs_differ"]["position"].as_u64(), Some(first), "{}", v["inputs_differ"]);
    assert!(v["positions"].as_array().unwrap().is_empty());
    // The generated tokens answer different inputs: not compared, and said so.
    assert!(v["first_token_divergence"].is_null() && v["notes"].to_string().contains("generated tokens not compared"), "{out}");
    // Redacted, the same: found from the input-id digests at a prompt position of c (a
    // fresh-user trial read "the sampling chose differently" there).
    let rc = dir.join("c.red");
    assert_eq!(trace_s(&["redact", p(&c), "-o", p(&rc)]).0, 0);
    let (_, out, _) = trace_s(&["bisect", p(&ra), p(&rc), "--format", "json"]);
    let v = json(&out);
    assert_eq!(v["inputs_differ"]["position"].as_u64(), Some(first), "{out}");
    let why = v["inputs_differ"]["explanation"].as_str().unwrap();
    assert!(why.contains("the prompts differ") && !why.contains("sampling"), "{why}");
    assert!(v["first_token_divergence"].is_null() && v["tokens"]["compared"] == 0, "{out}");
}

#[test]
fn builtin_kv_cache_vs_recompute() {
    let d = tmp();
    continuation(&["--threads", "1"], "Tell me about Richard Feynman.", d.path());
}

#[test]
fn smollm2_f32_kv_cache_vs_recompute() {
    let m = smollm2_path();
    let d = tmp();
    continuation(&["--model", p(&m), "--dtype", "f32"], "The capital of France is", d.path());
}

/// Redacted runs of two prompts of one length (and of two lengths, the longer not continuing
/// the shorter's output): the input-id digests differ in the prompts, so the generated tokens
/// answer different inputs and are not compared (a fresh-user trial read "generated tokens:
/// identical" for runs whose tokens differ, and "the sampling chose differently").
#[test]
fn redacted_runs_of_different_prompts_compare_no_tokens() {
    let d = tmp();
    let run = |prompt: &str, name: &str| {
        let (t, r) = (d.path().join(format!("{name}.trace")), d.path().join(format!("{name}.red")));
        record(&["--prompt", prompt, "--max-tokens", "6"], &t);
        assert_eq!(trace_s(&["redact", p(&t), "-o", p(&r)]).0, 0);
        r
    };
    let (a, b, c) = (run("Hello world", "a"), run("Jello world", "b"), run("Hello world!", "c"));
    for (other, at, whose) in [(&b, 0, "both 11 tokens"), (&c, 11, "a token of b's prompt where a had generated one")] {
        let (code, out, err) = trace_s(&["bisect", p(&a), p(other), "--format", "json"]);
        assert_eq!(code, 1, "{err}");
        let v = json(&out);
        assert_eq!(v["inputs_differ"]["position"].as_u64(), Some(at), "{out}");
        let why = v["inputs_differ"]["explanation"].as_str().unwrap();
        assert!(why.contains(whose) && !why.contains("sampling"), "{why}");
        assert!(v["tokens"]["compared"] == 0 && v["first_token_divergence"].is_null() && v["first_divergence"].is_null(), "{out}");
        let (_, text, _) = trace_s(&["bisect", p(&a), p(other)]);
        assert!(text.contains("generated tokens: not compared (the runs were fed different token sequences") && !text.contains("generated tokens: identical"), "{text}");
    }
}
