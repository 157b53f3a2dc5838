//! `trace bundle`: one zip to attach to a bug report. Unpacked, what it holds bisects (the flip
//! found in the redacted traces) and replays; each note it makes has a case here.

use crate::util::{json, p, tmp, trace_s};
use std::path::{Path, PathBuf};

/// The fault that flips token 8 of the builtin bf16 run (as in tests/causal.rs).
const FLIPS: &str = "layers.1.self_attn.v_proj@37";
/// The prompt (record's default, where the fault above flips a token).
const PROMPT: &str = "Tell me about Richard Feynman.";

fn rec(dir: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let out = dir.join(name);
    let mut args = vec!["record", "--dtype", "bf16", "--max-tokens", "12", "--threads", "1", "--prompt", PROMPT, "-o", p(&out)];
    args.extend(extra);
    let (code, _, err) = trace_s(&args);
    assert_eq!(code, 0, "{err}");
    out
}

/// The zip's entries: (name, bytes), unpacked into `dir`.
fn unpack(zip: &Path, dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut z = zip::ZipArchive::new(std::fs::File::open(zip).unwrap()).unwrap();
    let mut out = Vec::new();
    for i in 0..z.len() {
        let mut f = z.by_index(i).unwrap();
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut f, &mut bytes).unwrap();
        let name = f.name().unwrap().to_string();
        std::fs::write(dir.join(&name), &bytes).unwrap();
        out.push((name, bytes));
    }
    out
}

#[test]
fn a_bundle_unpacks_bisects_and_replays() {
    let d = tmp();
    let dump = ["--dump", "layers.1.*"];
    let a = rec(d.path(), "a.trace", &dump);
    let b = rec(d.path(), "b.trace", &[&dump[..], &["--perturb", FLIPS]].concat());
    let zip = d.path().join("report.zip");
    let (code, out, err) = trace_s(&["bundle", p(&a), p(&b), "-o", p(&zip)]);
    assert_eq!(code, 0, "{out}{err}");
    // One note when everything is there: what the repro's values can tell (a fresh-user trial).
    assert_eq!(err.trim(), "note: repro.trace holds the root op's operand values, which replaying it needs: values of the first layers tell their tokens to anyone with the model", "{err}");
    let u = d.path().join("unpacked");
    std::fs::create_dir(&u).unwrap();
    let entries = unpack(&zip, &u);
    let names: Vec<&str> = entries.iter().map(|e| e.0.as_str()).collect();
    assert_eq!(names, ["report.md", "a.trace", "b.trace", "repro.trace"]);
    for (name, bytes) in &entries {
        assert!(!bytes.windows(PROMPT.len()).any(|w| w == PROMPT.as_bytes()), "{name} holds the prompt");
    }
    for t in ["a.trace", "b.trace", "repro.trace"] {
        assert!(!candle_trace::redact::holds_prompt(&candle_trace::format::read_trace(&u.join(t)).unwrap().header), "{t} is redacted");
    }
    let md = String::from_utf8(entries[0].1.clone()).unwrap();
    assert!(md.contains("**First differing token:** generated token 8") && md.contains("--prompt '<redacted>'") && md.contains("--dump 'layers.1.*'"), "{md}");
    assert!(md.contains("### In this bundle") && md.contains("`trace replay repro.trace`"), "{md}");
    // The report is made from the traces with their values: the elementwise metrics are there.
    assert!(md.contains("elementwise (dumped values)") && !md.contains("for elementwise metrics"), "{md}");
    // What it holds bisects (the flip found without token ids) and replays.
    let (code, out, _) = trace_s(&["bisect", p(&u.join("a.trace")), p(&u.join("b.trace")), "--format", "json"]);
    assert_eq!(code, 1);
    let v = json(&out);
    assert_eq!((v["first_token_divergence"]["step"].as_u64(), v["first_token_divergence"]["ids_redacted"].as_bool()), (Some(8), Some(true)), "{v}");
    assert_eq!(v["first_divergence"]["class"], "perturbed");
    let (code, out, err) = trace_s(&["replay", p(&u.join("repro.trace"))]);
    assert_eq!(code, 0, "run a's op gives its recorded bits here: {out}{err}");
    assert!(out.contains("b's recording was perturbed (--perturb)"), "the injected fault, not b's environment: {out}");
}

#[test]
fn a_bundle_says_what_it_lacks() {
    let d = tmp();
    let dump = ["--dump", "layers.1.*"];
    let a = rec(d.path(), "a.trace", &dump);
    let b_dumped = rec(d.path(), "b.trace", &[&dump[..], &["--perturb", FLIPS]].concat());
    let b_plain = rec(d.path(), "b-plain.trace", &["--perturb", FLIPS]);
    let a_plain = rec(d.path(), "a-plain.trace", &[]);
    let zip = d.path().join("r.zip");
    let note = |args: &[&str], code: i32, want: &str| {
        let (c, out, err) = trace_s(&[&["bundle"], args, &["-o", p(&zip)]].concat());
        assert_eq!(c, code, "{args:?}: {out}{err}");
        assert!(err.contains(want), "{args:?}: no note {want:?} in {err}");
        let u = tmp();
        let md = String::from_utf8(unpack(&zip, u.path()).remove(0).1).unwrap();
        assert!(md.contains(want), "{args:?}: the report does not say {want:?}:\n{md}");
        md
    };
    // The prompt kept: said, and there.
    let md = note(&[p(&a), p(&b_dumped), "--keep", "prompt"], 0, "--keep prompt");
    // Without the traces, what holds it is said (it named the traces the zip lacks).
    note(&[p(&a), p(&b_dumped), "--keep", "prompt", "--no-traces"], 0, "the report's commands to reproduce (and the repro, when there is one) hold the prompt");
    assert!(md.contains(PROMPT), "{md}");
    // b did not dump the op: the repro replays a's side only, and replay says so.
    note(&[p(&a), p(&b_plain)], 0, "run b did not dump");
    let u = tmp();
    unpack(&zip, u.path());
    let (code, text, _) = trace_s(&["replay", p(&u.path().join("repro.trace"))]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("b's op cannot be replayed here"), "{text}");
    // Neither dumped: no repro, and the pattern to re-record with; no scratch path in it.
    let md = note(&[p(&a_plain), p(&b_plain)], 0, "no repro");
    assert!(!md.contains("trace-bundle-") && !md.contains(&std::env::temp_dir().display().to_string()), "{md}");
    // Over the size limit: written, exit 1, how to cut it.
    note(&[p(&a), p(&b_dumped), "--limit", "1000"], 1, "--no-traces");
    // Already without the traces: the repro is what to shrink (it advised --no-traces again: a
    // fresh-user trial).
    let md = note(&[p(&a), p(&b_dumped), "--no-traces", "--limit", "1000"], 1, "--dump naming the root op alone");
    assert!(!md.contains("bundle without the traces"), "{md}");
    let (code, _, err) = trace_s(&["bundle", p(&a), p(&b_dumped), "--no-traces", "-o", p(&zip)]);
    assert_eq!(code, 0, "{err}");
    let u = tmp();
    let names: Vec<String> = unpack(&zip, u.path()).into_iter().map(|e| e.0).collect();
    assert_eq!(names, ["report.md", "repro.trace"]);
    // Two traces of one name, or one named as the bundle's own entries: a- and b- prefixes.
    let (x, y) = (d.path().join("x"), d.path().join("y"));
    std::fs::create_dir(&x).unwrap();
    std::fs::create_dir(&y).unwrap();
    for (src, dir, name, want) in [(&a, &x, "run.trace", ["a-run.trace", "b-run.trace"]), (&a, &y, "repro.trace", ["a-repro.trace", "b-b.trace"])] {
        std::fs::copy(src, dir.join(name)).unwrap();
        let other = if name == "run.trace" { y.join("run.trace") } else { b_dumped.clone() };
        if name == "run.trace" {
            std::fs::copy(&b_dumped, &other).unwrap();
        }
        let (code, _, err) = trace_s(&["bundle", p(&dir.join(name)), p(&other), "-o", p(&zip)]);
        assert_eq!(code, 0, "{err}");
        let u = tmp();
        let names: Vec<String> = unpack(&zip, u.path()).into_iter().map(|e| e.0).collect();
        assert_eq!(names, ["report.md", want[0], want[1], "repro.trace"]);
    }
    // An input as the output is refused.
    let (code, _, err) = trace_s(&["bundle", p(&a), p(&b_dumped), "-o", p(&a)]);
    assert_eq!(code, 2, "{err}");
}

/// The repro falls back to an earlier op whose difference died out (the live root was not
/// dumped): the bundle says so, and which root to dump. SmolLM2's whole prompt vs chunks of 7,
/// `--dump 'layers.0.*'`: the root is in layer 26, layer 0's score matmul died out.
#[test]
fn a_bundle_says_when_its_repro_died_out() {
    let m = crate::util::smollm2_path();
    let d = tmp();
    let (a, b, zip) = (d.path().join("a.trace"), d.path().join("b.trace"), d.path().join("r.zip"));
    let base = ["record", "--model", p(&m), "--chat", "--max-tokens", "2", "--dump", "layers.0.*"];
    assert_eq!(trace_s(&[&base[..], &["-o", p(&a)]].concat()).0, 0);
    assert_eq!(trace_s(&[&base[..], &["--prefill-chunk", "7", "-o", p(&b)]].concat()).0, 0);
    let (code, out, err) = trace_s(&["bundle", p(&a), p(&b), "-o", p(&zip)]);
    assert_eq!(code, 0, "{out}{err}");
    let want = "whose difference died out within its layer: the root cause layers.26.self_attn.scores was not dumped";
    assert!(err.contains(want), "{err}");
    let u = tmp();
    let md = String::from_utf8(unpack(&zip, u.path()).remove(0).1).unwrap();
    assert!(md.contains(want), "{md}");
}

/// The README walkthrough's pair (SmolLM2 Q4_1, whole prompt vs prefill chunks of 18, 16 tokens),
/// recorded with `--dump` of its root cause: the bundle is under GitHub's 25 MB, and what it
/// holds bisects (the flip at token 11 found in the redacted traces, the root named) and
/// replays (both runs' op reproduce from their own operands, whose shared rows are identical).
#[test]
fn the_walkthrough_pair_bundles_bisects_and_replays() {
    let m = crate::util::smollm2_path();
    let d = tmp();
    let (a, b, zip) = (d.path().join("whole.trace"), d.path().join("chunk18.trace"), d.path().join("report.zip"));
    let base = ["record", "--model", p(&m), "--chat", "--prompt", PROMPT, "--max-tokens", "16", "--dump", "layers.17.self_attn.softmax"];
    assert_eq!(trace_s(&[&base[..], &["-o", p(&a)]].concat()).0, 0);
    assert_eq!(trace_s(&[&base[..], &["--prefill-chunk", "18", "-o", p(&b)]].concat()).0, 0);
    let (code, out, err) = trace_s(&["bundle", p(&a), p(&b), "-o", p(&zip)]);
    assert_eq!(code, 0, "{out}{err}");
    let size = std::fs::metadata(&zip).unwrap().len();
    assert!(size < 25_000_000, "{size} bytes");
    let u = tmp();
    let names: Vec<String> = unpack(&zip, u.path()).into_iter().map(|e| e.0).collect();
    assert_eq!(names, ["report.md", "whole.trace", "chunk18.trace", "repro.trace"]);
    let (code, out, _) = trace_s(&["bisect", p(&u.path().join("whole.trace")), p(&u.path().join("chunk18.trace")), "--format", "json"]);
    assert_eq!(code, 1);
    let v = json(&out);
    assert_eq!((v["first_token_divergence"]["step"].as_u64(), v["first_token_divergence"]["ids_redacted"].as_bool()), (Some(11), Some(true)), "{v}");
    assert_eq!((v["first_divergence"]["path"].as_str(), v["first_divergence"]["position"].as_u64()), (Some("layers.17.self_attn.softmax"), Some(15)), "{v}");
    let (code, out, err) = trace_s(&["replay", p(&u.path().join("repro.trace")), "--format", "json"]);
    assert_eq!(code, 0, "{out}{err}");
    let r = json(&out);
    assert_eq!((r["matches_recording"].as_bool(), r["counterpart_replay_matches"].as_bool()), (Some(true), Some(true)), "{r}");
    assert!(r["shared_operands"].as_array().unwrap().iter().all(|o| o["differing"] == 0 && o["compared"].as_u64().unwrap() > 0), "{r}");
}

/// The walkthrough's pair cut at 12 tokens flips at its last token (11), which a redacted trace
/// never feeds back: bisect of the redacted traces says token 11 was not compared, and the
/// bundle's issue body still names the flip (found by id in the unredacted traces, without the
/// tokens), where it said the tokens agree (found by a fresh-user trial).
#[test]
fn a_flip_at_the_last_token_reaches_the_bundle() {
    let m = crate::util::smollm2_path();
    let d = tmp();
    let (a, b, zip) = (d.path().join("whole.trace"), d.path().join("chunk18.trace"), d.path().join("report.zip"));
    let base = ["record", "--model", p(&m), "--chat", "--prompt", PROMPT, "--max-tokens", "12", "--dump", "layers.17.self_attn.softmax"];
    assert_eq!(trace_s(&[&base[..], &["-o", p(&a)]].concat()).0, 0);
    assert_eq!(trace_s(&[&base[..], &["--prefill-chunk", "18", "-o", p(&b)]].concat()).0, 0);
    let (_, plain, _) = trace_s(&["bisect", p(&a), p(&b), "--format", "json"]);
    assert_eq!(json(&plain)["first_token_divergence"]["step"].as_u64(), Some(11), "the pair flips at its last token: {plain}");
    let (code, out, err) = trace_s(&["bundle", p(&a), p(&b), "-o", p(&zip)]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("bisect diverged"), "{out}");
    let u = tmp();
    let md = String::from_utf8(unpack(&zip, u.path()).remove(0).1).unwrap();
    assert!(md.contains("**First differing token:** generated token 11") && md.contains("found by id in the unredacted traces"), "{md}");
    assert!(!md.contains(" lived") && !md.contains(" made"), "the tokens stay out: {md}");
    let (_, text, _) = trace_s(&["bisect", p(&u.path().join("whole.trace")), p(&u.path().join("chunk18.trace"))]);
    assert!(text.contains("generated tokens: identical (11 compared; token 11, the last, is not"), "{text}");
}

/// A root op that reads token ids (the embedding, f32 against bf16): the bundle's redaction
/// zeroes the ids, so a repro cut from its traces would replay other ids and differ. The
/// bundle holds no repro and says why, and replaying the op from a redacted trace is refused
/// (found by a fresh-user trial: the repro said the op differs on every element).
#[test]
fn a_root_that_reads_token_ids_gets_no_redacted_repro() {
    let d = tmp();
    let (a, b, zip, r) = (d.path().join("a.trace"), d.path().join("b.trace"), d.path().join("r.zip"), d.path().join("a-r.trace"));
    let base = ["record", "--max-tokens", "2", "--dump", "all"];
    assert_eq!(trace_s(&[&base[..], &["-o", p(&a)]].concat()).0, 0);
    assert_eq!(trace_s(&[&base[..], &["--dtype", "bf16", "-o", p(&b)]].concat()).0, 0);
    let (code, out, err) = trace_s(&["bundle", p(&a), p(&b), "-o", p(&zip)]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(err.contains("no repro: repro.trace: op record 0 (embed_tokens) reads token ids, which redaction zeroed") && !err.contains(&d.path().display().to_string()), "{err}");
    let u = tmp();
    let names: Vec<String> = unpack(&zip, u.path()).into_iter().map(|e| e.0).collect();
    assert!(!names.iter().any(|n| n == "repro.trace"), "{names:?}");
    // The environment table says what each run computed in beside how the file stores the
    // weights (it showed "weights f32" for both: a fresh-user trial).
    let md = std::fs::read_to_string(u.path().join("report.md")).unwrap();
    assert!(md.contains("| weights in the file | f32 | f32 |") && md.contains("| computed in | f32 | bf16 |"), "{md}");
    // Its values kept: the ids are zeroed, and replay says so.
    assert_eq!(trace_s(&["redact", p(&a), "--keep", "values", "-o", p(&r)]).0, 0);
    let (code, _, err) = trace_s(&["replay", p(&r), "--op", "1"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("reads token ids, which redaction zeroed") && err.lines().count() == 1, "{err}");
    // The unredacted trace replays the same op.
    assert_eq!(trace_s(&["replay", p(&a), "--op", "1"]).0, 0);
}
