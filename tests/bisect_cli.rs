//! The `trace` binary end to end: identical runs, thread counts, prefill chunking on the builtin
//! model and on SmolLM2 (the real temperature-0 divergence), `show`, and a SIGKILLed recording.

use crate::util::{json, p, smollm2_path, tmp, trace_s, worst_layer};

#[test]
fn same_settings_bisect_identical_exit_0() {
    let d = tmp();
    let (a, b) = (d.path().join("a.trace"), d.path().join("b.trace"));
    for f in [&a, &b] {
        let (code, _, err) = trace_s(&["record", "--max-tokens", "8", "-o", p(f)]);
        assert_eq!(code, 0, "{err}");
    }
    let (code, out, _) = trace_s(&["bisect", p(&a), p(&b), "--format", "json"]);
    assert_eq!(code, 0, "{out}");
    let v = json(&out);
    assert_eq!(v["verdict"], "identical");
    assert!(v["first_divergence"].is_null() && v["first_token_divergence"].is_null());
    assert_eq!(v["differing"], 0);
    assert!(v["compared"].as_u64().unwrap() > 1000);
}

/// Thread count does not change candle's CPU results (gemm and quantized matmul split work
/// without changing reduction order): the traces are identical, only the setting differs.
#[test]
fn threads_1_vs_2_are_identical_builtin() {
    let d = tmp();
    let (a, b) = (d.path().join("t1.trace"), d.path().join("t2.trace"));
    assert_eq!(trace_s(&["record", "--threads", "1", "--max-tokens", "8", "-o", p(&a)]).0, 0);
    assert_eq!(trace_s(&["record", "--threads", "2", "--max-tokens", "8", "-o", p(&b)]).0, 0);
    let (code, out, _) = trace_s(&["bisect", p(&a), p(&b), "--format", "json"]);
    let v = json(&out);
    assert_eq!(code, 0, "{out}");
    assert_eq!(v["verdict"], "identical");
    let keys: Vec<&str> = v["env_diff"].as_array().unwrap().iter().map(|e| e["key"].as_str().unwrap()).collect();
    assert!(keys.contains(&"run.threads") && keys.contains(&"env.threads"), "{keys:?}");
}

/// SmolLM2 with 1 and with 2 CPU threads: bit-identical (candle's CPU kernels split the work
/// without reordering additions). The runs are the README check's (shared fixture).
#[test]
fn threads_1_vs_2_are_identical_smollm2() {
    let f = crate::util::smollm2_check();
    let (a, b) = (f.path("check/threads-1-1.trace"), f.path("check/threads-2-1.trace"));
    for t in [&a, &b] {
        assert!(t.is_file(), "{} missing", t.display());
    }
    let (code, out, _) = trace_s(&["bisect", p(&a), p(&b), "--format", "json"]);
    assert_eq!(code, 0, "{out}");
    let v = json(&out);
    assert_eq!(v["verdict"], "identical");
    // Both recorded what they were asked: the thread counts differ in the headers.
    assert!(v["env_diff"].as_array().unwrap().iter().any(|e| e["key"].as_str().is_some_and(|k| k.contains("threads"))), "{v}");
}

/// Whole-prompt vs one-token prefill on the builtin model: dense f32 matmuls take another kernel
/// path for M=1, so the numbers part; bisect names an op with matched inputs.
#[test]
fn builtin_prefill_chunk_diverges() {
    let d = tmp();
    let (a, b) = (d.path().join("a.trace"), d.path().join("b.trace"));
    assert_eq!(trace_s(&["record", "--max-tokens", "8", "-o", p(&a)]).0, 0);
    assert_eq!(trace_s(&["record", "--max-tokens", "8", "--prefill-chunk", "1", "-o", p(&b)]).0, 0);
    let (code, out, _) = trace_s(&["bisect", p(&a), p(&b), "--format", "json"]);
    assert_eq!(code, 1, "{out}");
    let v = json(&out);
    assert_eq!(v["verdict"], "diverged");
    let fd = &v["first_divergence"];
    assert_eq!(fd["inputs_matched"], true);
    assert!(fd["path"].as_str().unwrap().len() > 2);
    let keys: Vec<&str> = v["env_diff"].as_array().unwrap().iter().map(|e| e["key"].as_str().unwrap()).collect();
    assert_eq!(keys, vec!["run.prefill_chunk"]);
}

/// The real divergence of the issue: SmolLM2 Q4_1, ChatML prompt, greedy, 48 tokens, whole
/// prefill vs one token per forward pass.
#[test]
fn smollm2_whole_vs_chunk1_prefill() {
    let m = smollm2_path();
    let d = tmp();
    let (a, b) = (d.path().join("a.trace"), d.path().join("b.trace"));
    let base = ["record", "--model", p(&m), "--chat", "--prompt", "Tell me about Richard Feynman.", "--max-tokens", "48"];
    let (code, text_a, err) = trace_s(&[&base[..], &["-o", p(&a)]].concat());
    assert_eq!(code, 0, "{err}");
    let (code, text_b, err) = trace_s(&[&base[..], &["--prefill-chunk", "1", "-o", p(&b)]].concat());
    assert_eq!(code, 0, "{err}");
    assert!(text_a.contains("discoveries in quantum mechanics"), "{text_a}");
    assert!(text_b.contains("discoveries in physics, particularly"), "{text_b}");
    let (code, out, _) = trace_s(&["bisect", p(&a), p(&b), "--format", "json"]);
    assert_eq!(code, 1, "{out}");
    let v = json(&out);
    let t = &v["first_token_divergence"];
    assert_eq!(t["step"], 45, "{t}");
    assert_eq!(t["a_text"], " quantum");
    assert_eq!(t["b_text"], " physics");
    let fd = &v["first_divergence"];
    assert_eq!(fd["inputs_matched"], true, "{fd}");
    assert!(fd["layer"].is_u64(), "{fd}");
    assert!(fd["position"].as_u64().unwrap() < 31, "root cause should be in the prompt: {fd}");
    // The text report names the same things.
    let (_, txt, _) = trace_s(&["bisect", p(&a), p(&b)]);
    // Earlier differences died out within their layers: the headline says this is the first
    // that reached the residual stream, and names the earliest right under it.
    assert!(v["absorbed_count"].as_u64().unwrap() > 0, "{v}");
    assert!(txt.contains(&format!("the first difference that reached its layer's output: {}", fd["path"].as_str().unwrap())), "{txt}");
    assert!(txt.contains(&format!("(the earliest entered before it, at {}", v["absorbed"][0]["path"].as_str().unwrap())), "{txt}");
}

#[test]
fn show_prints_run_env_text_and_layers() {
    let d = tmp();
    let a = d.path().join("a.trace");
    let (_, text, _) = trace_s(&["record", "--prompt", "abc", "--max-tokens", "5", "-o", p(&a)]);
    let (code, out, err) = trace_s(&["show", p(&a)]);
    assert_eq!(code, 0, "{err}");
    for needle in ["model        builtin", "prompt       \"abc\"", "candle 0.11.1", "cpu ", "layers.0", "layers.3", "lm_head", "row 0:"] {
        assert!(out.contains(needle), "missing {needle:?} in\n{out}");
    }
    assert!(out.contains(&format!("{:?}", text.trim_end_matches('\n'))), "generated text not shown:\n{out}");
    let (code, out, _) = trace_s(&["show", p(&a), "--format", "json"]);
    assert_eq!(code, 0);
    assert_eq!(json(&out)["header"]["run"]["prompt"], "abc");
}

/// Different prompts: bisect says the inputs differ and blames no op (even when one prompt
/// extends the other, which also changes kernel shapes).
#[test]
fn different_prompts_are_inputs_not_an_op() {
    let d = tmp();
    let (a, b) = (d.path().join("a.trace"), d.path().join("b.trace"));
    assert_eq!(trace_s(&["record", "--prompt", "Hello world", "--max-tokens", "4", "-o", p(&a)]).0, 0);
    assert_eq!(trace_s(&["record", "--prompt", "Hello world, longer", "--max-tokens", "4", "-o", p(&b)]).0, 0);
    let (code, out, _) = trace_s(&["bisect", p(&a), p(&b), "--format", "json"]);
    assert_eq!(code, 1, "{out}");
    let v = json(&out);
    assert!(v["first_divergence"].is_null(), "{out}");
    assert_eq!(v["inputs_differ"]["position"], 11);
    assert!(v["inputs_differ"]["explanation"].as_str().unwrap().contains("prompts differ"));
    // The text says why no token was compared: the inputs, not a redaction (neither trace is).
    let (_, text, _) = trace_s(&["bisect", p(&a), p(&b)]);
    assert!(text.contains("generated tokens: not compared (the runs were fed different token sequences") && !text.contains("redacted"), "{text}");
}

/// The markdown report stays a valid table whatever the prompt holds.
#[test]
fn markdown_escapes_newlines_and_pipes() {
    let d = tmp();
    let (a, b) = (d.path().join("a.trace"), d.path().join("b.trace"));
    assert_eq!(trace_s(&["record", "--prompt", "x|y\n", "--max-tokens", "2", "-o", p(&a)]).0, 0);
    assert_eq!(trace_s(&["record", "--prompt", "x|y", "--max-tokens", "2", "-o", p(&b)]).0, 0);
    let (_, md, _) = trace_s(&["bisect", p(&a), p(&b), "--format", "markdown"]);
    let row = md.lines().find(|l| l.starts_with("| run.prompt |")).expect(&md);
    assert_eq!(row, r#"| run.prompt | \"x\|y\\n\" | \"x\|y\" |"#);
}

/// `trace bisect` reads both files a frame at a time and keeps only what its report names; the
/// library's in-memory `bisect` reads them whole. Both reports are the same, value for value, on
/// every kind of pair: chunked prefill, a perturbed op (with its dump), a request alone against
/// the same request in a padded batch (in both orders), different prompts, a run cut short, and
/// identical runs.
#[test]
fn streaming_bisect_reports_what_the_in_memory_one_does() {
    let d = tmp();
    let rec = |name: &str, args: &[&str]| {
        let f = d.path().join(name);
        let (code, _, err) = trace_s(&[&["record", "--max-tokens", "6"], args, &["-o", p(&f)]].concat());
        assert_eq!(code, 0, "{args:?}: {err}");
        f
    };
    let base = rec("base.trace", &[]);
    let chunked = rec("chunked.trace", &["--prefill-chunk", "3"]);
    let perturbed = rec("perturbed.trace", &["--perturb", "layers.1.mlp.act@4", "--dump", "layers.1.*"]);
    let dumped = rec("dumped.trace", &["--dump", "layers.1.*"]);
    let alone = rec("alone.trace", &["--prompt", "Hi there"]);
    let batch = rec("batch.trace", &["--prompt", "A much longer prompt than mine", "--prompt", "Hi there", "--prompt", "Another, longer one"]);
    let other = rec("other.trace", &["--prompt", "Something else entirely"]);
    let cut = d.path().join("cut.trace");
    let bytes = std::fs::read(&base).unwrap();
    std::fs::write(&cut, &bytes[..bytes.len() - 400]).unwrap();
    let again = rec("again.trace", &[]);
    let pairs = [(&base, &chunked), (&dumped, &perturbed), (&alone, &batch), (&batch, &alone), (&base, &other), (&base, &cut), (&base, &again)];
    let mut verdicts = Vec::new();
    for (a, b) in pairs {
        let (code, out, err) = trace_s(&["bisect", p(a), p(b), "--format", "json"]);
        assert!(code == 0 || code == 1, "{err}");
        let streamed = json(&out);
        let (ta, tb) = (candle_trace::format::read_trace(a).unwrap(), candle_trace::format::read_trace(b).unwrap());
        let whole = json(&serde_json::to_string(&candle_trace::bisect::bisect(&ta, &tb).unwrap()).unwrap());
        assert_eq!(streamed, whole, "{} vs {}", p(a), p(b));
        verdicts.push((streamed["verdict"].as_str().unwrap().to_string(), streamed["first_divergence"]["path"].as_str().map(str::to_string)));
        if (a, b) == (&dumped, &perturbed) {
            assert!(streamed["first_divergence"]["elementwise"]["max_ulp"].is_u64(), "{streamed}");
        }
    }
    // The pairs are what they claim to be: the perturbed op is the root, with its elementwise
    // metrics read back from the dump; the cut run is incomplete; the same settings agree.
    assert_eq!(verdicts[1], ("diverged".to_string(), Some("layers.1.mlp.act".to_string())), "{verdicts:?}");
    assert_eq!(verdicts[5].0, "incomplete", "{verdicts:?}");
    assert_eq!(verdicts[6], ("identical".to_string(), None), "{verdicts:?}");
    assert!(verdicts[0].1.is_some() && verdicts[2].0 == "diverged", "{verdicts:?}");
}

/// `--tolerance`: f32 against bf16 (both `--dump all`) differ in every op but within bf16's
/// rounding carried through: no root, exit 0; bit-identical runs likewise. Bad tolerances and
/// traces without values are refused.
#[test]
fn tolerance_judges_by_value() {
    let d = tmp();
    let (a, b) = (d.path().join("f32.trace"), d.path().join("bf16.trace"));
    assert_eq!(trace_s(&["record", "--max-tokens", "2", "--dump", "all", "-o", p(&a)]).0, 0);
    assert_eq!(trace_s(&["record", "--max-tokens", "2", "--dump", "all", "--dtype", "bf16", "-o", p(&b)]).0, 0);
    let (code, out, err) = trace_s(&["bisect", p(&a), p(&b), "--tolerance", "auto", "--format", "json"]);
    assert_eq!(code, 0, "{out}{err}");
    let v = json(&out);
    assert!(v["root"].is_null() && v["compared"].as_u64().unwrap() > 100, "{v}");
    let worst = worst_layer(&v);
    assert!(worst > 1e-4 && worst < 0.05, "bf16-level errors: {worst}");
    assert_eq!(trace_s(&["bisect", p(&a), p(&a), "--tolerance", "1e-6"]).0, 0);
    for bad in ["0", "-1", "-1e-4", "nan"] {
        let (code, _, err) = trace_s(&["bisect", p(&a), p(&b), "--tolerance", bad]);
        assert!(code == 2 && err.contains("expected auto"), "--tolerance {bad}: {err}");
    }
    // Another prefill chunk splits the prompt into other passes: the decode step, over the same
    // position, pairs (its 88 ops; no root), and the prefills' records are counted apart.
    let chunked = d.path().join("chunked.trace");
    assert_eq!(trace_s(&["record", "--max-tokens", "2", "--dump", "all", "--prefill-chunk", "3", "-o", p(&chunked)]).0, 0);
    let (code, out, err) = trace_s(&["bisect", p(&a), p(&chunked), "--tolerance", "auto", "--format", "json"]);
    assert_eq!(code, 0, "{out}{err}");
    let v = json(&out);
    assert_eq!((&v["compared"], &v["unmatched"], &v["root"]), (&serde_json::json!(88), &serde_json::json!([92, 920]), &serde_json::Value::Null), "{v:#}");
    let (_, text, _) = trace_s(&["bisect", p(&a), p(&chunked), "--tolerance", "auto"]);
    assert!(text.contains("not compared: 920 records of b in passes over positions the other run split otherwise"), "{text}");
    // Another prompt from the first pass: nothing pairs, and the error says why.
    let other = d.path().join("other.trace");
    assert_eq!(trace_s(&["record", "--max-tokens", "2", "--dump", "all", "--prompt", "Another prompt", "-o", p(&other)]).0, 0);
    let (code, _, err) = trace_s(&["bisect", p(&a), p(&other), "--tolerance", "auto"]);
    assert!(code == 2 && err.contains("fed different token ids from their first forward pass") && err.lines().count() == 1, "{err}");
    let plain = d.path().join("plain.trace");
    assert_eq!(trace_s(&["record", "--max-tokens", "2", "-o", p(&plain)]).0, 0);
    let (code, _, err) = trace_s(&["bisect", p(&plain), p(&plain), "--tolerance", "auto"]);
    assert!(code == 2 && err.contains("--dump all"), "{err}");
}
