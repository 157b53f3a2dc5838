//! Batches of different requests: a text or prompt alone against the same text or prompt among
//! others (padded to the longest: right padding for encoders, left padding for decoders, as
//! servers and Hugging Face's `generate` pad). Bisect aligns the request's row with the solo
//! run, compares attention over the keys the mask lets it see, answers per request first, and
//! names the root op of a known perturbation in a padded row. Also: cause classes and remedies,
//! bounds that never read ">= 0", and BERT's upstream numerics.

use crate::bert::minilm_path;
use crate::util::{json, p, smollm2_path, tmp, trace_s};
use std::path::Path;

fn record(args: &[&str], out: &Path) {
    let (code, _, err) = trace_s(&[&["record"], args, &["-o", p(out)]].concat());
    assert_eq!(code, 0, "record {args:?}: {err}");
}

fn bisect_json(a: &Path, b: &Path) -> (i32, serde_json::Value) {
    let (code, out, err) = trace_s(&["bisect", p(a), p(b), "--format", "json"]);
    assert!(code == 0 || code == 1, "{err}");
    (code, json(&out))
}

/// Every root the report lists has a class, and so does every group.
fn assert_classified(v: &serde_json::Value) {
    if let Some(fd) = v["first_divergence"].as_object() {
        assert!(fd["class"].is_string(), "{v}");
    }
    for x in v["absorbed"].as_array().unwrap() {
        assert!(x["class"].is_string(), "{x}");
    }
    for g in v["groups"].as_array().unwrap() {
        assert!(g["class"].is_string() && g["remedy"].is_string(), "{g}");
    }
}

const SHORT: &str = "A man is eating food.";
const LONG1: &str = "A man is eating a piece of bread while sitting at the kitchen table.";
const LONG2: &str = "The quick brown fox jumps over the lazy dog near the river bank.";

/// MiniLM f32: a short text alone vs the same text in a batch with two longer texts (so padded):
/// the text's embedding is reported first, wherever the text sits in the batch. With these
/// texts it changes (the attention-score matmul runs with another M), and the root has its
/// inputs matched over the unmasked keys; with shorter companions it is identical.
#[test]
fn minilm_text_alone_vs_padded_batch() {
    let m = minilm_path();
    let d = tmp();
    let (a, b, c) = (d.path().join("alone.trace"), d.path().join("batch.trace"), d.path().join("last.trace"));
    record(&["--model", p(&m), "--text", SHORT], &a);
    record(&["--model", p(&m), "--text", SHORT, "--text", LONG1, "--text", LONG2], &b);
    record(&["--model", p(&m), "--text", LONG1, "--text", LONG2, "--text", SHORT], &c);
    for (other, row) in [(&b, 0), (&c, 2)] {
        let (code, v) = bisect_json(&a, other);
        assert_eq!(code, 1, "{v}");
        let rows = v["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 1, "{v}");
        assert_eq!((rows[0]["a_row"].as_u64(), rows[0]["b_row"].as_u64()), (Some(0), Some(row)));
        let e = &rows[0]["embedding"];
        assert_eq!(e["identical"], false, "{v}");
        assert!(e["cosine"].as_f64().unwrap() > 0.999_999 && e["max_abs_diff"].as_f64().unwrap() < 1e-5, "{v}");
        let fd = &v["first_divergence"];
        assert_eq!(fd["inputs_matched"], true, "{v}");
        assert_eq!(fd["class"], "shapes_differ");
        assert_eq!(fd["row"].as_u64(), Some(0), "rows are reported as a's");
        assert_eq!(rows[0]["first_root"].as_str().unwrap(), format!("{} @ {}", fd["path"].as_str().unwrap(), fd["position"]));
        assert!(v["compared"].as_u64().unwrap() > 500, "{v}");
        assert_classified(&v);
    }
    let (_, text, _) = trace_s(&["bisect", p(&a), p(&c)]);
    assert!(text.contains("a row 0 = b row 2 \"A man is eating food.\": embedding differs: max |a-b|"), "{text}");
    // Shorter companions: the same text's embedding is bit-identical.
    let e = d.path().join("short.trace");
    record(&["--model", p(&m), "--text", "A dog runs.", "--text", SHORT, "--text", "A man is eating."], &e);
    let (code, v) = bisect_json(&a, &e);
    assert_eq!(v["rows"][0]["embedding"]["identical"], true, "{v}");
    assert_eq!(code, 0, "{v}");
}

/// A known fault in a padded row: the short text in a padded batch, one bit flipped in layer 2's
/// softmax at its position 3. Bisect against the same batch unperturbed names that op and
/// position in that row, with its inputs matched, and says the text's embedding changed.
#[test]
fn minilm_perturbation_in_a_padded_row() {
    let m = minilm_path();
    let d = tmp();
    let (a, b) = (d.path().join("batch.trace"), d.path().join("perturbed.trace"));
    let batch = ["--model", p(&m), "--text", SHORT, "--text", LONG1, "--text", LONG2];
    record(&batch, &a);
    let site = "encoder.layer.2.attention.self.softmax";
    record(&[&batch[..], &["--perturb", &format!("{site}@3")]].concat(), &b);
    let (code, v) = bisect_json(&a, &b);
    assert_eq!(code, 1, "{v}");
    let fd = &v["first_divergence"];
    assert_eq!((fd["path"].as_str(), fd["position"].as_u64(), fd["row"].as_u64()), (Some(site), Some(3), Some(0)), "{v}");
    assert_eq!(fd["inputs_matched"], true);
    assert_eq!(v["rows"][0]["embedding"]["identical"], false, "{v}");
    assert_eq!(v["rows"][1]["embedding"]["identical"], true, "other rows untouched: {v}");
    assert_classified(&v);
}

/// Builtin decoder: a prompt alone vs the same prompt in a left-padded batch of three different
/// prompts. The row is found by its prompt, aligns position by position (the first op it
/// differs at has matching inputs and is classified), and its tokens are compared first.
#[test]
fn builtin_prompt_alone_vs_left_padded_batch() {
    let d = tmp();
    let (a, b) = (d.path().join("alone.trace"), d.path().join("batch.trace"));
    let mine = "Hi there";
    record(&["--prompt", mine, "--max-tokens", "6"], &a);
    record(&["--prompt", "A much longer prompt than mine", "--prompt", mine, "--prompt", "Another, longer one", "--max-tokens", "6"], &b);
    let (_, v) = bisect_json(&a, &b);
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{v}");
    assert_eq!((rows[0]["a_row"].as_u64(), rows[0]["b_row"].as_u64()), (Some(0), Some(1)));
    assert_eq!(rows[0]["tokens_compared"].as_u64(), Some(6), "{v}");
    // The embedding and the first layer's norm see the same values: alignment is exact.
    assert!(v["compared"].as_u64().unwrap() > 300, "{v}");
    if let Some(fd) = v["first_divergence"].as_object() {
        assert_eq!(fd["inputs_matched"], true);
        assert_eq!(fd["class"], "shapes_differ", "{v}");
        assert!(fd["path"].as_str().unwrap() != "input_ids" && fd["path"].as_str().unwrap() != "embed_tokens");
    }
    assert!(v["inputs_differ"].is_null(), "{v}");
    assert_classified(&v);
    let (_, show, _) = trace_s(&["show", p(&b)]);
    assert!(show.contains("prompts      3 rows, left-padded") && show.contains("[1] \"Hi there\""), "{show}");
    // The batch itself, recorded again from a prompts file (a JSON-string line is decoded):
    // identical.
    let f = d.path().join("prompts.txt");
    std::fs::write(&f, "A much longer prompt than mine\n\"Hi there\"\n\nAnother, longer one\n").unwrap();
    let c = d.path().join("again.trace");
    record(&["--prompts-file", p(&f), "--max-tokens", "6"], &c);
    assert_eq!(bisect_json(&b, &c).0, 0);
}

/// A known fault in a left-padded row (row 0 holds the shortest prompt): bisect of two runs of
/// the same padded batch names the perturbed op at the row's own position.
#[test]
fn builtin_perturbation_in_a_left_padded_row() {
    let d = tmp();
    let (a, b) = (d.path().join("a.trace"), d.path().join("b.trace"));
    let batch = ["--prompt", "Hi", "--prompt", "A much longer prompt than the first", "--max-tokens", "3"];
    record(&batch, &a);
    let site = "layers.2.mlp.down_proj";
    record(&[&batch[..], &["--perturb", &format!("{site}@1")]].concat(), &b);
    let (code, v) = bisect_json(&a, &b);
    assert_eq!(code, 1);
    let fd = &v["first_divergence"];
    assert_eq!((fd["path"].as_str(), fd["position"].as_u64(), fd["row"].as_u64()), (Some(site), Some(1), Some(0)), "{v}");
    assert_eq!(fd["inputs_matched"], true);
    assert_eq!(fd["class"], "perturbed", "the injected fault is named as such: {v}");
}

/// SmolLM2: a prompt alone vs that prompt in a left-padded batch of three different prompts.
#[test]
fn smollm2_prompt_alone_vs_left_padded_batch() {
    let m = smollm2_path();
    let d = tmp();
    let (a, b) = (d.path().join("alone.trace"), d.path().join("batch.trace"));
    let mine = "Tell me about Richard Feynman.";
    let base = ["--model", p(&m), "--chat", "--max-tokens", "2"];
    record(&[&base[..], &["--prompt", mine]].concat(), &a);
    record(&[&base[..], &["--prompt", "What is the capital of France? Answer in one short sentence please.", "--prompt", mine, "--prompt", "Write a haiku about the sea."]].concat(), &b);
    let (code, v) = bisect_json(&a, &b);
    assert_eq!(code, 1, "{v}");
    let row = &v["rows"][0];
    assert_eq!((row["a_row"].as_u64(), row["b_row"].as_u64()), (Some(0), Some(1)), "{v}");
    assert!(row["tokens_compared"].as_u64().unwrap() >= 1);
    let fd = &v["first_divergence"];
    assert_eq!(fd["inputs_matched"], true, "{v}");
    assert_eq!(fd["class"], "shapes_differ");
    assert!(fd["path"].as_str().unwrap().contains("self_attn"), "padding changes attention first: {v}");
    assert_classified(&v);
}

/// Each row of a batch stops at its own end-of-sequence token, as the request does alone: each of
/// three chat requests, padded into one batch, gives the text it gives alone, and the short one
/// between them generates no token after its end of turn (the expected tokens and texts are
/// read from the runs alone).
#[test]
fn smollm2_batch_rows_stop_at_their_own_eos() {
    let m = smollm2_path();
    let d = tmp();
    // 16 tokens: "Hi!" alone ends at its 10th; the README walkthrough's whole-prompt run is the
    // Feynman request alone (the same settings), shared rather than recorded again.
    let base = ["--model", p(&m), "--chat", "--max-tokens", "16"];
    let prompts = ["Write a short poem about the sea, the wind and the boats coming home at night.", "Hi!", "Tell me about Richard Feynman."];
    let batch = d.path().join("batch.trace");
    record(&[&base[..], &["--prompt", prompts[0], "--prompt", prompts[1], "--prompt", prompts[2]]].concat(), &batch);
    let tb = candle_trace::format::read_trace(&batch).unwrap();
    let steps = |t: &candle_trace::format::Trace, row: u32| -> Vec<u32> {
        t.items.iter().filter_map(|i| if let candle_trace::record::Item::Token(e) = i { e.rows.iter().find(|c| c.row == row).map(|c| c.token) } else { None }).collect()
    };
    let walkthrough = crate::util::smollm2_walkthrough();
    for (row, prompt) in prompts.iter().enumerate() {
        let a = if row == 2 {
            walkthrough.path("whole.trace")
        } else {
            let a = d.path().join(format!("alone-{row}.trace"));
            record(&[&base[..], &["--prompt", prompt]].concat(), &a);
            a
        };
        let ta = candle_trace::format::read_trace(&a).unwrap();
        assert_eq!(ta.header.run.prompt, *prompt, "{}", a.display());
        let alone = steps(&ta, 0);
        if row == 1 {
            assert_eq!(ta.footer.as_ref().unwrap().stop, "eos", "the short request alone ends before --max-tokens ({} tokens)", alone.len());
        }
        // Its tokens, no choice after its EOS, and its text.
        assert_eq!(steps(&tb, row as u32), alone, "row {row} of the batch generates what its request alone does, and stops there");
        assert_eq!(tb.footer.as_ref().unwrap().texts[row], ta.footer.as_ref().unwrap().texts[0], "row {row}");
    }
    assert!(steps(&tb, 0).len() > steps(&tb, 1).len() && steps(&tb, 2).len() > steps(&tb, 1).len(), "the other rows go on after row 1's EOS");
    // Bisect says how each compared request stopped: "Hi!" stopped at its EOS alone and in the
    // batch (which ran to --max-tokens), so no stop is a difference; cut at 8 tokens alone, it
    // stopped otherwise.
    let notes = |a: &Path| -> Vec<String> {
        let (_, out, err) = trace_s(&["bisect", p(a), p(&batch), "--format", "json"]);
        let v = json(&out);
        assert_eq!(v["rows"][0]["b_row"], 1, "{out}{err}");
        v["notes"].as_array().unwrap().iter().map(|n| n.as_str().unwrap().to_string()).collect()
    };
    let eos = notes(&d.path().join("alone-1.trace"));
    assert!(!eos.iter().any(|n| n.contains("stopped differently")), "{eos:?}");
    assert!(eos.iter().any(|n| n == "the compared requests stopped alike (eos); b's other rows ran to max_tokens"), "{eos:?}");
    let cut = d.path().join("cut.trace");
    record(&["--model", p(&m), "--chat", "--max-tokens", "8", "--prompt", prompts[1]], &cut);
    let cut = notes(&cut);
    assert!(cut.iter().any(|n| n == "the requests stopped differently: a row 0 max_tokens, b row 1 eos"), "{cut:?}");
}

/// The SmolLM2 chunked-prefill pair (chunks of 7): every root is the attention-score matmul with
/// another M, one group whose class is that operand shapes differ, with its remedy.
#[test]
fn smollm2_chunked_prefill_roots_form_one_group() {
    let m = smollm2_path();
    let d = tmp();
    let (a, b) = (d.path().join("whole.trace"), d.path().join("chunk7.trace"));
    let base = ["--model", p(&m), "--chat", "--prompt", "Tell me about Richard Feynman.", "--max-tokens", "2"];
    record(&base, &a);
    record(&[&base[..], &["--prefill-chunk", "7"]].concat(), &b);
    let (_, v) = bisect_json(&a, &b);
    let groups = v["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 1, "{v}");
    assert_eq!(groups[0]["kind"], "self_attn.scores (matmul)");
    assert_eq!(groups[0]["class"], "shapes_differ");
    // Every root counts, those after the reported one too (the roots of later chunks).
    assert!(groups[0]["count"].as_u64().unwrap() > v["absorbed_count"].as_u64().unwrap() + 1, "{v}");
    assert!(groups[0]["remedy"].as_str().unwrap().contains("prefill chunk"));
    assert_classified(&v);
    let (_, text, _) = trace_s(&["bisect", p(&a), p(&b)]);
    assert!(text.contains("x self_attn.scores (matmul): operand shapes differ"), "{text}");
}

/// No report prints a lower bound of 0 for an output that differs (bf16, whole prefill vs one
/// token a pass, where samples and reductions can match while the digest differs).
#[test]
fn no_bound_of_zero_for_a_differing_output() {
    let d = tmp();
    let (a, b) = (d.path().join("a.trace"), d.path().join("b.trace"));
    record(&["--dtype", "bf16", "--max-tokens", "8"], &a);
    record(&["--dtype", "bf16", "--max-tokens", "8", "--prefill-chunk", "1"], &b);
    for format in ["text", "markdown"] {
        let (_, out, _) = trace_s(&["bisect", p(&a), p(&b), "--format", format]);
        assert!(!out.contains(">= 0 ") && !out.contains(">= 0\n") && !out.contains("≥ 0 ") && !out.contains(">= 0 ("), "{format}:\n{out}");
    }
}

/// BERT f16 with padding and `--numerics upstream`: show places the first NaN at the mask
/// addition, which made it from finite inputs; bisect against the fixed mask names that op and
/// lists the setting.
#[test]
fn minilm_f16_upstream_numerics_first_nan() {
    let m = minilm_path();
    let d = tmp();
    let (fixed, up) = (d.path().join("fixed.trace"), d.path().join("upstream.trace"));
    let texts = ["--text", SHORT, "--text", LONG1];
    record(&[&["--model", p(&m), "--dtype", "f16"], &texts[..]].concat(), &fixed);
    record(&[&["--model", p(&m), "--dtype", "f16", "--numerics", "upstream"], &texts[..]].concat(), &up);
    let (_, show, _) = trace_s(&["show", p(&up)]);
    assert!(show.contains("numerics     upstream"), "{show}");
    assert!(show.contains("first non-finite value: encoder.layer.0.attention.self.mask_add (mask_add)") && show.contains("its inputs were all finite: this op made it"), "{show}");
    let (_, show, _) = trace_s(&["show", p(&fixed)]);
    assert!(show.contains("first non-finite value: none"), "{show}");
    let (code, v) = bisect_json(&fixed, &up);
    assert_eq!(code, 1);
    assert_eq!(v["first_divergence"]["path"], "encoder.layer.0.attention.self.mask_add");
    assert!(v["env_diff"].as_array().unwrap().iter().any(|e| e["key"] == "run.model.config.numerics"), "{v}");
    // A run setting, named in the remedy with both values.
    assert_eq!(v["first_divergence"]["class"], "setting_differs", "{v}");
    assert!(v["groups"][0]["remedy"].as_str().unwrap().contains("run.model.config.numerics (a "), "{v}");
    // One side is all NaN there: no misleading bound from finite-only statistics.
    let (_, text, _) = trace_s(&["bisect", p(&fixed), p(&up)]);
    assert!(text.contains("max |a-b| not bounded: one side holds NaN or ±Inf there"), "{text}");
    // Decoders take the flag too (their half-precision softmax), and the header says so.
    let x = d.path().join("x.trace");
    let (code, _, err) = trace_s(&["record", "--numerics", "upstream", "--max-tokens", "1", "-o", p(&x)]);
    assert_eq!(code, 0, "{err}");
    let config = json(&trace_s(&["show", p(&x), "--format", "json"]).1)["header"]["run"]["model"]["config"].clone();
    assert!(config.as_array().unwrap().iter().any(|kv| kv[0] == "numerics" && kv[1] == "\"upstream\""), "{config}");
}

/// Copies of one request (`--batch 2`) against it alone: one request in two rows, not two
/// requests (a fresh-user trial read "2 requests"), and each row with the rows holding its
/// request on the other side.
#[test]
fn copies_of_one_request_are_rows_not_requests() {
    let d = tmp();
    let (a, b) = (d.path().join("alone.trace"), d.path().join("copies.trace"));
    record(&["--prompt", "Hi there", "--max-tokens", "2"], &a);
    record(&["--prompt", "Hi there", "--max-tokens", "2", "--batch", "2"], &b);
    let (_, v) = bisect_json(&a, &b);
    let req = v["env_diff"].as_array().unwrap().iter().find(|e| e["key"] == "run.requests").cloned().unwrap_or_default();
    assert_eq!((req["a"].as_str(), req["b"].as_str()), (Some("1 request, row 0 is b's rows 0, 1"), Some("2 rows, 1 request, row 0 is a's row 0; row 1 is a's row 0")), "{v:#}");
}
