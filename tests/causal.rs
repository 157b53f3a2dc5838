//! `trace bisect --causal`: which difference changed the answer, found by patching run a with
//! run b's values. Ground truth from `--perturb`: two faults in one run, only one of which flips
//! a generated token; `--causal` must name exactly that one.

use crate::util::{json, p, smollm2_path, tmp, trace_s};
use candle_trace::bisect::bisect;
use candle_trace::format::read_trace;
use std::path::{Path, PathBuf};

/// The fault that flips token 8 of the builtin bf16 run (its top-1 margin there is 1 ULP).
const FLIPS: &str = "layers.1.self_attn.v_proj@37";
/// A fault that reaches later positions but changes no generated token.
const HARMLESS: &str = "layers.0.mlp.down_proj@30";

/// Records the builtin model in bf16, 12 tokens, with `perturbs`.
fn rec(dir: &Path, name: &str, perturbs: &[&str]) -> PathBuf {
    rec_in(dir, name, "bf16", perturbs)
}

fn rec_in(dir: &Path, name: &str, dtype: &str, perturbs: &[&str]) -> PathBuf {
    rec_with(dir, name, dtype, perturbs, &[])
}

fn rec_with(dir: &Path, name: &str, dtype: &str, perturbs: &[&str], extra: &[&str]) -> PathBuf {
    let out = dir.join(name);
    let mut args = vec!["record", "--dtype", dtype, "--max-tokens", "12", "--threads", "1", "-o", p(&out)];
    args.extend(extra);
    for x in perturbs {
        args.extend(["--perturb", x]);
    }
    let (code, _, err) = trace_s(&args);
    assert_eq!(code, 0, "{err}");
    out
}

#[test]
fn names_the_one_fault_that_flipped_the_token() {
    let d = tmp();
    let a = rec(d.path(), "a.trace", &[]);
    let b = rec(d.path(), "b.trace", &[HARMLESS, FLIPS]);
    let patched = d.path().join("patched.trace");
    let (code, out, err) = trace_s(&["bisect", p(&a), p(&b), "--causal", "--format", "json", "--causal-out", p(&patched)]);
    assert_eq!(code, 1, "{err}");
    let v = json(&out);
    assert_eq!(v["verdict"], "found", "{out}");
    assert_eq!(v["flip"]["step"], 8);
    // Both faults are entry points; the set is exactly the one that flips the token.
    let cands = v["candidates"].as_array().unwrap();
    let at = |c: &serde_json::Value| format!("{}@{}", c["path"].as_str().unwrap(), c["position"]);
    let all: Vec<String> = cands.iter().map(at).collect();
    assert!(all.contains(&HARMLESS.to_string()) && all.contains(&FLIPS.to_string()), "{all:?}");
    let set: Vec<String> = v["set"].as_array().unwrap().iter().map(|i| at(&cands[i.as_u64().unwrap() as usize])).collect();
    assert_eq!(set, vec![FLIPS.to_string()]);
    assert_eq!(v["minimal"], true);
    assert_eq!(cands[v["set"][0].as_u64().unwrap() as usize]["class"], "perturbed");
    assert_eq!(v["reverse"], true, "a's value there, patched into b, gives a's token back");
    // The re-run log: both runs reproduced, patched runs with their outcome, the written trace.
    let runs = v["runs"].as_array().unwrap();
    let kinds: Vec<&str> = runs.iter().map(|r| r["kind"].as_str().unwrap()).collect();
    assert_eq!(&kinds[..2], &["reproduce_a", "reproduce_b"]);
    assert!(kinds.contains(&"patch") && kinds.contains(&"reverse") && kinds.last() == Some(&"write"), "{kinds:?}");
    assert!(runs.iter().all(|r| r["seconds"].as_f64().is_some()));
    let last_patch = runs.iter().rev().find(|r| r["kind"] == "patch").unwrap();
    assert_eq!(last_patch["flipped"], true);
    // The patched run is a trace: it generates b's tokens, and its header names the patch.
    let t = read_trace(&patched).unwrap();
    assert_eq!(t.header.run.perturb.as_deref(), Some(&*format!("patch:{FLIPS}")));
    let r = bisect(&t, &read_trace(&b).unwrap()).unwrap();
    assert!(r.first_token_divergence.is_none(), "the patched run generates b's tokens");
    // Text: the set and the run count.
    let (_, text, _) = trace_s(&["bisect", p(&a), p(&b), "--causal"]);
    assert!(text.contains(&format!("  {} (linear) at position 37", FLIPS.split('@').next().unwrap())), "{text}");
    assert!(text.contains("re-runs: "), "{text}");
}

/// A NaN among a mask's masked keys (-inf flipped to NaN) makes the query's probabilities NaN.
/// The entry point is the mask; its slice holds only the keys the query sees, so the patch
/// writes b's whole query rows (masked keys too), key by key by their own position: rows of the
/// same length, of other lengths (a chunked by 6, b by 8), and at other offsets (a padded in a
/// batch of two and chunked by 11, b alone). The flip is reproduced, and the patched run's mask
/// slice equals b's.
#[test]
fn a_nan_among_masked_keys_is_patched_with_its_whole_rows() {
    let d = tmp();
    let patched = d.path().join("patched.trace");
    let pairs = [
        ((&[][..], &[][..]), "layers.0.self_attn.mask@2", "bf16", "5"),
        ((&["--prefill-chunk", "6"][..], &["--prefill-chunk", "8"][..]), "layers.0.self_attn.mask@6", "f32", "7"),
        ((&["--prompt", "The quick brown", "--prompt", "Hello world", "--prefill-chunk", "11"][..], &["--prompt", "Hello world"][..]), "layers.0.self_attn.mask@2", "f32", "5"),
    ];
    for (k, ((ea, eb), mask, dtype, element)) in pairs.into_iter().enumerate() {
        let a = rec_with(d.path(), &format!("a{k}.trace"), dtype, &[], ea);
        let b = rec_with(d.path(), &format!("b{k}.trace"), dtype, &[&format!("{mask}#{element}")], eb);
        let (code, out, err) = trace_s(&["bisect", p(&a), p(&b), "--causal", "--format", "json", "--causal-out", p(&patched)]);
        assert_eq!(code, 1, "{err}");
        let v = json(&out);
        assert_eq!((&v["verdict"], &v["reverse"]), (&serde_json::json!("found"), &serde_json::json!(true)), "{out}");
        let cands = v["candidates"].as_array().unwrap();
        let set: Vec<String> = v["set"].as_array().unwrap().iter().map(|i| &cands[i.as_u64().unwrap() as usize]).map(|c| format!("{}@{}", c["path"].as_str().unwrap(), c["position"])).collect();
        assert_eq!(set, vec![mask.to_string()], "{out}");
        let (r, entries) = candle_trace::bisect::bisect_with_entries(&read_trace(&patched).unwrap(), &read_trace(&b).unwrap()).unwrap();
        assert!(r.first_token_divergence.is_none(), "pair {k}");
        let masks: Vec<String> = entries.iter().map(|e| e.path.text()).filter(|p| p.contains("mask")).collect();
        assert!(masks.is_empty(), "pair {k}: {masks:?}");
    }
}

/// With b's entry points dumped (`--dump`), their values come from the trace: b is not re-run
/// for them, only later for the reverse check.
#[test]
fn takes_b_values_from_its_dumps() {
    let d = tmp();
    let a = rec(d.path(), "a.trace", &[]);
    let b = rec_with(d.path(), "b.trace", "bf16", &[HARMLESS, FLIPS], &["--dump", "layers.0.mlp.*,layers.1.self_attn.*"]);
    let (code, out, err) = trace_s(&["bisect", p(&a), p(&b), "--causal", "--format", "json"]);
    assert_eq!(code, 1, "{err}");
    let v = json(&out);
    let cands = v["candidates"].as_array().unwrap();
    let set: Vec<String> = v["set"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            let c = &cands[i.as_u64().unwrap() as usize];
            format!("{}@{}", c["path"].as_str().unwrap(), c["position"])
        })
        .collect();
    assert_eq!(set, vec![FLIPS.to_string()]);
    let kinds: Vec<&str> = v["runs"].as_array().unwrap().iter().map(|r| r["kind"].as_str().unwrap()).collect();
    assert_eq!(&kinds[..2], &["reproduce_a", "patch"], "b not re-run before patching: {kinds:?}");
    assert!(v["notes"].to_string().contains("from its dumps"), "{out}");
    assert_eq!(v["reverse"], true);
}

#[test]
fn without_a_flip_ranks_entry_points_by_their_effect_on_the_logits() {
    let d = tmp();
    // f32: one fault dies out in its layer, the other reaches the logits of step 5; no token flips.
    let reaches = "layers.3.mlp_residual@35";
    let a = rec_in(d.path(), "a.trace", "f32", &[]);
    let b = rec_in(d.path(), "b.trace", "f32", &[HARMLESS, reaches]);
    let (code, out, err) = trace_s(&["bisect", p(&a), p(&b), "--causal", "--format", "json"]);
    assert_eq!(code, 1, "{err}");
    let v = json(&out);
    assert_eq!(v["verdict"], "no_flip", "{out}");
    assert!(v["flip"].is_null());
    let at = |r: &serde_json::Value| {
        let c = &v["candidates"][r["candidate"].as_u64().unwrap() as usize];
        format!("{}@{}", c["path"].as_str().unwrap(), c["position"])
    };
    let ranking = v["ranking"].as_array().unwrap();
    assert_eq!(ranking.iter().map(at).collect::<Vec<_>>(), vec![reaches.to_string(), HARMLESS.to_string()]);
    assert!(ranking[0]["moved"].as_f64().unwrap() > 0.0, "{out}");
    assert_eq!(ranking[0]["remaining"].as_f64().unwrap(), 0.0, "b's value there is all that reaches the logits: {out}");
    assert_eq!(ranking[1]["moved"].as_f64().unwrap(), 0.0, "the absorbed fault moves nothing: {out}");
    assert_eq!(v["logits_max_abs_diff"].as_f64(), ranking[0]["moved"].as_f64());
}

/// A redacted trace holds no generated token ids; bisect still finds the flip, through the
/// digests of the input ids that fed each token back, whichever side is redacted (also with
/// the prompt kept), and never calls the tokens identical. The expected step is read from the
/// unredacted traces' token ids.
#[test]
fn a_redacted_pair_that_flips_reports_the_flip() {
    let d = tmp();
    let a = rec(d.path(), "a.trace", &[]);
    let b = rec(d.path(), "b.trace", &[FLIPS]);
    let ids = |t: &Path| -> Vec<u32> { read_trace(t).unwrap().items.iter().filter_map(|i| if let candle_trace::record::Item::Token(e) = i { Some(e.rows[0].token) } else { None }).collect() };
    let (ia, ib) = (ids(&a), ids(&b));
    let step = ia.iter().zip(&ib).position(|(x, y)| x != y).expect("the fault flips a token");
    assert!(step + 1 < ia.len(), "the flipped token is fed back (step {step} of {})", ia.len());
    let redact = |t: &Path, name: &str, keep: &[&str]| {
        let out = d.path().join(name);
        let mut args = vec!["redact", p(t), "-o", p(&out)];
        args.extend(keep);
        assert_eq!(trace_s(&args).0, 0);
        out
    };
    let (ra, rb) = (redact(&a, "ra.trace", &[]), redact(&b, "rb.trace", &[]));
    let (ka, kb) = (redact(&a, "ka.trace", &["--keep", "prompt"]), redact(&b, "kb.trace", &["--keep", "prompt"]));
    for (x, y) in [(&ra, &rb), (&a, &rb), (&ra, &b), (&ka, &kb)] {
        let (code, out, err) = trace_s(&["bisect", p(x), p(y), "--format", "json"]);
        assert_eq!(code, 1, "{err}");
        let v = json(&out);
        let f = &v["first_token_divergence"];
        assert_eq!((f["step"].as_u64(), f["ids_redacted"].as_bool()), (Some(step as u64), Some(true)), "{x:?} vs {y:?}: {f}");
        // A side that holds its ids gives its token; a redacted side's is null, never 0.
        let held = |t: &Path| !t.file_name().unwrap().to_str().unwrap().starts_with(['r', 'k']);
        assert_eq!(f["a_token"].as_u64(), held(x).then_some(ia[step] as u64), "{f}");
        assert_eq!(f["b_token"].as_u64(), held(y).then_some(ib[step] as u64), "{f}");
        assert!(held(x) || f["a_token"].is_null(), "{f}");
        assert_eq!((v["tokens"]["by"].as_str(), v["tokens"]["compared"].as_u64()), (Some("input_digests"), Some(ia.len() as u64 - 1)));
        // The request's own answer agrees with the flip.
        assert_eq!((v["rows"][0]["first_flip"].as_u64(), v["rows"][0]["tokens_compared"].as_u64()), (Some(step as u64), Some(step as u64 + 1)), "{}", v["rows"]);
        let (_, text, _) = trace_s(&["bisect", p(x), p(y)]);
        assert!(text.contains(&format!("first generated token that differs: token {step}")) && !text.contains("generated tokens: identical"), "{text}");
    }
    // The redacted ids are labelled so in show and on the report page, never shown as token 0.
    let (_, shown, _) = trace_s(&["show", p(&ra)]);
    assert!(shown.contains("row 0: (redacted") && shown.contains("? redacted") && !shown.contains("       0 \"\""), "{shown}");
    let html = d.path().join("r.html");
    trace_s(&["report", p(&ra), p(&rb), "-o", p(&html)]);
    let page = std::fs::read_to_string(&html).unwrap();
    assert_eq!(page.matches(&format!("({} tokens; ids and texts redacted by trace redact)", ia.len())).count(), 2, "{page}");
    // Identical redacted runs: the tokens fed back are compared, the last one is not.
    let (code, text, _) = trace_s(&["bisect", p(&ra), p(&redact(&a, "ra2.trace", &[]))]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains(&format!("generated tokens: identical ({} compared; token {}, the last, is not", ia.len() - 1, ia.len() - 1)), "{text}");
}

#[test]
fn refuses_what_it_cannot_explain() {
    let d = tmp();
    let a = rec(d.path(), "a.trace", &[]);
    let b = rec(d.path(), "b.trace", &[FLIPS]);
    let other = d.path().join("other.trace");
    let (code, _, err) = trace_s(&["record", "--dtype", "bf16", "--max-tokens", "12", "--prompt", "Something else", "-o", p(&other)]);
    assert_eq!(code, 0, "{err}");
    let refused = |args: &[&str], want: &str| {
        let (code, out, err) = trace_s(args);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert_eq!(err.lines().count(), 1, "one line: {err}");
        assert!(err.starts_with("trace: error:") && err.contains(want), "{args:?}: {err}");
    };
    refused(&["bisect", p(&a), p(&other), "--causal"], "prompts differ");
    refused(&["bisect", p(&a), p(&b), "--causal", "--model", p(&a)], "builtin model");
    refused(&["bisect", p(&a), p(&b), "--causal", "--max-runs", "2"], "--max-runs 2");
    // The run --causal-out writes counts: three runs leave it no room.
    let out = d.path().join("patched.trace");
    refused(&["bisect", p(&a), p(&b), "--causal", "--max-runs", "3", "--causal-out", p(&out)], "--max-runs 3: at least 4");
    refused(&["bisect", p(&a), p(&b), "--max-runs", "5"], "--causal");
    refused(&["bisect", p(&a), p(&b), "--causal", "--causal-out", p(&b)], "input trace");
    // Identical runs: nothing to explain, exit 0, no re-run.
    let (code, out, _) = trace_s(&["bisect", p(&a), p(&a), "--causal"]);
    assert_eq!(code, 0);
    assert!(out.contains("identical"), "{out}");
}

#[test]
fn smollm2_needs_the_runs_model_file() {
    let m = smollm2_path();
    let d = tmp();
    let base = ["record", "--model", p(&m), "--max-tokens", "2", "--prompt", "Hi"];
    let a = d.path().join("a.trace");
    let b = d.path().join("b.trace");
    assert_eq!(trace_s(&[&base[..], &["-o", p(&a)]].concat()).0, 0);
    assert_eq!(trace_s(&[&base[..], &["--perturb", "layers.3.mlp.up_proj@0", "-o", p(&b)]].concat()).0, 0);
    let (code, _, err) = trace_s(&["bisect", p(&a), p(&b), "--causal"]);
    assert_eq!(code, 2);
    assert!(err.contains("give --model") && err.contains("SmolLM2-135M-Instruct.Q4_1.gguf"), "{err}");
    // Another file (the same bytes plus one): its sha256 is not the traces'.
    let copy = d.path().join("other.gguf");
    let mut bytes = std::fs::read(&m).unwrap();
    bytes.push(0);
    std::fs::write(&copy, bytes).unwrap();
    let (code, _, err) = trace_s(&["bisect", p(&a), p(&b), "--causal", "--model", p(&copy)]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("other.gguf") && err.contains("sha256") && err.lines().count() == 1, "{err}");
}

/// The README walkthrough's pair (shared fixture): whole prefill vs chunks of 18 tokens. The
/// token bisect finds flipped is the one `--causal` explains, and the set it returns, patched
/// into the whole-prefill run (`patched.trace`), gives b's tokens through that token.
#[test]
fn smollm2_chunked_prefill_flip_is_reproduced_by_the_set() {
    let f = crate::util::smollm2_walkthrough();
    let (a, b, patched) = (f.path("whole.trace"), f.path("chunk18.trace"), f.path("patched.trace"));
    let (ta, tb) = (read_trace(&a).unwrap(), read_trace(&b).unwrap());
    let flip = bisect(&ta, &tb).unwrap().first_token_divergence.expect("the two runs' tokens differ").step;
    let (code, out, err) = f.run(3);
    assert_eq!(code, 1, "{err}");
    assert!(out.contains(&format!("which difference changed token {flip} (row 0)")), "{out}");
    assert!(out.contains("leaving any one out loses the flip"), "a minimal set: {out}");
    // Patched into a, the set gives b's token at the flip and every token before it.
    let tp = read_trace(&patched).unwrap();
    let r = bisect(&tp, &tb).unwrap();
    assert!(r.first_token_divergence.as_ref().is_none_or(|f| f.step > flip), "{:?}", r.first_token_divergence);
    let marks = tp.header.run.perturb.clone().expect("the patched run names its patches");
    let listed = out.lines().filter(|l| l.starts_with("  layers.") && l.contains(") at position ")).count();
    assert_eq!(marks.split(',').count(), listed, "{marks}\n{out}");
    let reruns: usize = out.lines().find_map(|l| l.strip_prefix("re-runs: ")).and_then(|l| l.split(' ').next()).and_then(|n| n.parse().ok()).expect("re-run count");
    assert!(reruns <= candle_trace::causal::DEFAULT_MAX_RUNS, "{out}");
}

/// Cases a fresh reader found: a fault past the flip (a re-run stops at the flip, so it never
/// applies), a shorter or truncated run, a redacted trace, a padded batch as run a, and a bad
/// `--causal-out` (refused before any re-run).
#[test]
fn shorter_reruns_redaction_padding_and_bad_output() {
    let d = tmp();
    let a = rec(d.path(), "a.trace", &[]);
    let late = rec(d.path(), "late.trace", &[FLIPS, "layers.0.mlp.up_proj@40"]);
    let (code, out, err) = trace_s(&["bisect", p(&a), p(&late), "--causal", "--format", "json"]);
    assert_eq!(code, 1, "{err}");
    let v = json(&out);
    assert_eq!(v["verdict"], "found", "{out}");
    assert_eq!(v["candidates"][v["set"][0].as_u64().unwrap() as usize]["path"], FLIPS.split('@').next().unwrap());
    // A redacted trace has no generated ids to compare.
    let red = d.path().join("red.trace");
    assert_eq!(trace_s(&["redact", p(&late), "--keep", "prompt", "-o", p(&red)]).0, 0);
    let (code, _, err) = trace_s(&["bisect", p(&a), p(&red), "--causal"]);
    assert_eq!(code, 2);
    assert!(err.contains("red.trace") && err.contains("redacted"), "{err}");
    // --causal-out into a folder: refused at once.
    let (code, _, err) = trace_s(&["bisect", p(&a), p(&late), "--causal", "--causal-out", p(d.path())]);
    assert_eq!(code, 2);
    assert!(err.contains("--causal-out") && err.contains("directory"), "{err}");
    // Run a is a padded batch holding run b's request in row 1.
    let one = d.path().join("one.trace");
    let two = d.path().join("two.trace");
    assert_eq!(trace_s(&["record", "--dtype", "bf16", "--max-tokens", "12", "--prompt", "Hi", "-o", p(&one)]).0, 0);
    assert_eq!(trace_s(&["record", "--dtype", "bf16", "--max-tokens", "12", "--prompt", "A much longer prompt about quantum physics", "--prompt", "Hi", "-o", p(&two)]).0, 0);
    let (code, out, err) = trace_s(&["bisect", p(&two), p(&one), "--causal", "--format", "json"]);
    assert!(code <= 1, "{err}");
    let v = json(&out);
    if v["verdict"] != "identical" {
        assert!(v["candidates"].as_array().unwrap().iter().all(|c| c["row"] == 1), "row 1 of a is the request: {out}");
        assert_eq!(v["logits_max_abs_diff"].as_f64(), Some(0.0), "the request's logits agree, as bisect says: {out}");
    }
}
