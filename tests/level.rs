//! `trace record --level layers|logits`: only each layer's output and the model's outputs (or the
//! outputs alone) are recorded, each reading its nearest recorded ancestors; bisect names the
//! first layer whose output differs, and compares an `ops` trace with a `layers` one on what both
//! hold. Ground truth from `--perturb` on an op the level does not record.

use crate::util::{fixture, json, p, trace_s};
use candle_trace::format::read_trace;
use candle_trace::record::{Item, Reads};
use candle_trace::site::Level;

const PERTURB: &str = "layers.2.self_attn.softmax@5";

/// The builtin model four ways (shared): every op and layer outputs only, each plain and with
/// one bit of layer 2's attention probabilities at position 5 flipped; and logits only.
fn runs() -> crate::util::Fixture {
    let base = ["record", "--max-tokens", "8", "--quiet"];
    fixture(&[
        &[&base[..], &["-o", "ops.trace"]].concat(),
        &[&base[..], &["--perturb", PERTURB, "-o", "ops-perturbed.trace"]].concat(),
        &[&base[..], &["--level", "layers", "-o", "layers.trace"]].concat(),
        &[&base[..], &["--level", "layers", "--perturb", PERTURB, "-o", "layers-perturbed.trace"]].concat(),
        &[&base[..], &["--level", "logits", "-o", "logits.trace"]].concat(),
        &[&base[..], &["--level", "layers", "--perturb", PERTURB, "--summary-worker", "-o", "layers-perturbed-worker.trace"]].concat(),
    ])
}

/// `--summary-worker` summarises on another thread: the same records, in the same order.
#[test]
fn the_summary_worker_records_what_the_forward_pass_thread_records() {
    let f = runs();
    let (a, b) = (read_trace(&f.path("layers-perturbed.trace")).unwrap(), read_trace(&f.path("layers-perturbed-worker.trace")).unwrap());
    assert!(a.items.iter().filter(|i| matches!(i, Item::Op(r) if r.perturbed)).count() == 0, "the perturbed op is not recorded at this level");
    assert!(a.items.len() > 50, "{} items", a.items.len());
    assert_eq!(format!("{:?}", a.items), format!("{:?}", b.items));
    assert_eq!((a.footer, a.sampling.len(), a.level), (b.footer, b.sampling.len(), b.level));
}

fn root(a: &std::path::Path, b: &std::path::Path) -> (String, u64, serde_json::Value) {
    let (code, out, err) = trace_s(&["bisect", p(a), p(b), "--format", "json"]);
    assert_eq!(code, 1, "{err}");
    let r = json(&out);
    let d = &r["first_divergence"];
    (d["path"].as_str().unwrap_or("").to_string(), d["position"].as_u64().unwrap_or(u64::MAX), r)
}

/// A layers trace holds the token ids, each layer's output and the logits; each layer's output
/// reads the previous one's over the prefix; the file is a tenth of the ops trace or less.
#[test]
fn layers_level_records_layer_outputs_reading_the_previous_layer() {
    let f = runs();
    let t = read_trace(&f.path("layers.trace")).unwrap();
    assert_eq!(t.level, Level::Layers);
    let sites: Vec<&str> = t.items.iter().filter_map(|i| if let Item::Site { path, .. } = i { Some(path.as_str()) } else { None }).collect();
    assert_eq!(sites, ["input_ids", "layers.0.mlp_residual", "layers.1.mlp_residual", "layers.2.mlp_residual", "layers.3.mlp_residual", "lm_head"]);
    let recs: Vec<_> = t.items.iter().filter_map(|i| if let Item::Op(r) = i { Some(r) } else { None }).collect();
    // Pass 0: input_ids (0), layers 0..3 (1..4), lm_head (5).
    assert_eq!(recs[1].inputs.iter().map(|i| (i.seq, i.reads)).collect::<Vec<_>>(), vec![(0, Reads::Prefix)]);
    assert_eq!(recs[2].inputs.iter().map(|i| (i.seq, i.reads)).collect::<Vec<_>>(), vec![(1, Reads::Prefix)]);
    // The logits read the last layer's output at their own position (through the final norm).
    assert_eq!(recs[5].inputs.iter().map(|i| (i.seq, i.reads)).collect::<Vec<_>>(), vec![(4, Reads::Same)]);
    let size = |n: &str| std::fs::metadata(f.path(n)).unwrap().len();
    assert!(size("layers.trace") * 10 < size("ops.trace"), "{} vs {}", size("layers.trace"), size("ops.trace"));
    let (code, shown, _) = trace_s(&["show", p(&f.path("layers.trace"))]);
    assert_eq!(code, 0);
    assert!(shown.contains("level        layers"), "{shown}");
    let logits = read_trace(&f.path("logits.trace")).unwrap();
    assert_eq!(logits.level, Level::Logits);
    assert!(logits.items.iter().all(|i| !matches!(i, Item::Site { path, .. } if path.starts_with("layers."))));
    // A trace recorded at every op has no level frame: ops.
    assert_eq!(read_trace(&f.path("ops.trace")).unwrap().level, Level::Ops);
}

/// The flipped bit in layer 2's attention at position 5: between layers traces, and between an
/// ops trace and a layers trace either way round, the root is layer 2's output at position 5.
#[test]
fn bisect_names_the_first_layer_across_levels() {
    let f = runs();
    let (path, pos, r) = root(&f.path("layers.trace"), &f.path("layers-perturbed.trace"));
    assert_eq!((path.as_str(), pos), ("layers.2.mlp_residual", 5), "{r:#}");
    assert!(r["notes"].as_array().unwrap().iter().any(|n| n.as_str().unwrap().contains("--level layers")), "{r:#}");
    // The root is where the difference entered, between two recorded outputs: the text does not
    // say the add's inputs matched (layer 2's MLP output, which it reads, was not recorded;
    // found by a fresh-user trial), and the report names the level compared.
    assert_eq!(r["level"].as_str(), Some("layers"), "{r:#}");
    let (_, text, _) = trace_s(&["bisect", p(&f.path("layers.trace")), p(&f.path("layers-perturbed.trace"))]);
    assert!(text.contains("at --level layers the output recorded before it matched bit for bit and this one differs") && !text.contains("its inputs matched bit for bit"), "{text}");
    // A layer's output is no op to extract: extract says to re-record at --level ops, and so does
    // bisect's note (they advised a --dump at this level, whose repro replays an add whose
    // operands differ too).
    assert!(text.contains("re-record both runs at --level ops with --dump 'layers.2.*'"), "{text}");
    // The cause is said of an op inside the layer, not of the residual add recorded.
    assert!(text.contains(", in an op inside the layer (--level layers records each layer's output only)"), "{text}");
    let (code, _, err) = trace_s(&["extract", p(&f.path("layers.trace")), p(&f.path("layers-perturbed.trace")), "-o", p(&f.path("x.repro"))]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("recorded at --level layers, the root layers.2.mlp_residual is a layer's output") && err.contains("--level ops with --dump 'layers.2.*'"), "{err}");
    assert!(!f.path("x.repro").exists());
    for (a, b) in [("ops.trace", "layers-perturbed.trace"), ("ops-perturbed.trace", "layers.trace"), ("layers-perturbed.trace", "ops.trace")] {
        let (path, pos, r) = root(&f.path(a), &f.path(b));
        assert_eq!((path.as_str(), pos), ("layers.2.mlp_residual", 5), "{a} vs {b}: {r:#}");
        assert!(r["notes"].as_array().unwrap().iter().any(|n| n.as_str().unwrap().contains("compared what both hold")), "{r:#}");
        assert!(r["graph_fork"].is_null(), "{a} vs {b}: {r:#}");
        // Each side's record count is its file's, not the subset compared.
        for (side, file) in [("a", a), ("b", b)] {
            let t = read_trace(&f.path(file)).unwrap();
            let n = t.items.iter().filter(|i| matches!(i, candle_trace::record::Item::Op(_))).count();
            assert_eq!(r[side]["op_records"].as_u64(), Some(n as u64), "{side} = {file}: {r:#}");
        }
    }
    // The same runs at one level compare identical: no difference invented by the projection.
    // The levels are a setting that differs, listed with the others (a fresh-user trial read
    // "settings and environment: identical" there), and no cause.
    let (code, text, err) = trace_s(&["bisect", p(&f.path("ops.trace")), p(&f.path("layers.trace"))]);
    assert_eq!(code, 0, "{err}");
    assert!(text.contains("settings and environment that differ:\n  run.level: ops -> layers\n"), "{text}");
    let (_, _, r) = root(&f.path("layers-perturbed.trace"), &f.path("ops.trace"));
    assert!(r["env_diff"].as_array().unwrap().contains(&serde_json::json!({ "key": "run.level", "a": "layers", "b": "ops" })), "{r:#}");
    assert_eq!(r["first_divergence"]["class"], serde_json::json!("setting_differs"), "--perturb, not the level: {r:#}");
    let (code, _, err) = trace_s(&["bisect", p(&f.path("logits.trace")), p(&f.path("ops.trace"))]);
    assert_eq!(code, 0, "{err}");
    // At --level logits no layer output is recorded: the cause is said of an op before the
    // logits (it said "--level logits records the layer's output only": a fresh-user trial).
    let (code, text, err) = trace_s(&["bisect", p(&f.path("logits.trace")), p(&f.path("ops-perturbed.trace"))]);
    assert_eq!(code, 1, "{err}");
    assert!(text.contains(", in an op before the logits (--level logits records the token ids and logits only)"), "{text}");
}

/// `--level` takes ops, layers or logits only.
#[test]
fn an_unknown_level_is_refused() {
    let (code, _, err) = trace_s(&["record", "--level", "heads", "-o", "x.trace"]);
    assert_eq!(code, 2);
    assert!(err.contains("expected ops, layers or logits"), "{err}");
}

/// A `--dump` pattern matching only ops the level does not record would dump nothing: refused
/// before the run, in one line; one matching an op it records is taken and dumps that op.
#[test]
fn a_dump_of_ops_the_level_skips_is_refused() {
    let d = crate::util::tmp();
    let out = d.path().join("x.trace");
    for (level, pattern) in [("layers", "layers.0.self_attn.*"), ("logits", "layers.1.*")] {
        let (code, _, err) = trace_s(&["record", "--max-tokens", "2", "--level", level, "--dump", pattern, "-o", p(&out)]);
        assert_eq!(code, 2, "{level} {pattern}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains(&format!("--dump {pattern}: matches only ops --level {level} does not record")), "{err}");
        assert!(!out.exists(), "no trace written for a refused run");
    }
    let (code, _, err) = trace_s(&["record", "--max-tokens", "2", "--level", "layers", "--dump", "layers.0.*", "--quiet", "-o", p(&out)]);
    assert_eq!(code, 0, "{err}");
    let dumped: Vec<u64> = read_trace(&out).unwrap().items.iter().filter_map(|i| if let Item::Dump(v) = i { Some(v.seq) } else { None }).collect();
    assert_eq!(dumped.len(), 2, "layers.0.mlp_residual, once a forward pass: {dumped:?}");
}

/// `--perturb` on a layer output the level records: the difference entered at that output
/// itself, which the text and markdown reports say, rather than sending the reader to an op
/// inside the layer.
#[test]
fn a_perturbed_layer_output_is_the_root_itself() {
    let d = crate::util::tmp();
    let (a, b) = (d.path().join("a.trace"), d.path().join("b.trace"));
    let base = ["record", "--max-tokens", "4", "--level", "layers", "--quiet"];
    assert_eq!(trace_s(&[&base[..], &["-o", p(&a)]].concat()).0, 0);
    assert_eq!(trace_s(&[&base[..], &["--perturb", "layers.1.mlp_residual@31", "-o", p(&b)]].concat()).0, 0);
    for format in ["text", "markdown"] {
        let (code, out, err) = trace_s(&["bisect", p(&a), p(&b), "--format", format]);
        assert_eq!(code, 1, "{err}");
        assert!(out.contains("layers.1.mlp_residual"), "{out}");
        assert!(out.contains("--perturb flipped a bit of this recorded output itself"), "{format}: {out}");
        assert!(out.contains("a fault injected by --perturb"), "{format}: {out}");
        assert!(!out.contains("in an op this level does not record") && !out.contains("in an op inside the layer"), "{format}: {out}");
    }
}

/// A chunked prefill against a whole one at `layers` and at `logits`: the reported root is at
/// the first position that differs, and the decode steps after the prompt, whose layers read a
/// KV cache the chunking changed but no recorded input shows, are not roots of their own (they
/// were reported as "a different run setting").
#[test]
fn a_chunked_prefills_decode_steps_are_not_roots_at_a_coarse_level() {
    let d = crate::util::tmp();
    for level in ["layers", "logits"] {
        let (a, b) = (d.path().join(format!("{level}-whole.trace")), d.path().join(format!("{level}-chunked.trace")));
        let base = ["record", "--max-tokens", "4", "--level", level, "--quiet"];
        assert_eq!(trace_s(&[&base[..], &["-o", p(&a)]].concat()).0, 0);
        assert_eq!(trace_s(&[&base[..], &["--prefill-chunk", "7", "-o", p(&b)]].concat()).0, 0);
        let (code, out, err) = trace_s(&["bisect", p(&a), p(&b), "--format", "json"]);
        assert_eq!(code, 1, "{err}");
        let r = json(&out);
        assert_eq!(r["first_divergence"]["class"], "shapes_differ", "{level}: {out}");
        let groups = r["groups"].as_array().expect("root groups");
        assert_eq!(groups.len(), 1, "{level}: one group of roots, the prefill's: {out}");
        assert_eq!(groups[0]["class"], "shapes_differ", "{level}: {out}");
    }
}

/// An encoder at `layers`: its inputs, each encoder layer's output (not the attention block's
/// LayerNorm inside it) and the pooled embeddings.
#[test]
fn an_encoder_at_layers_level_keeps_each_layer_output() {
    let m = crate::bert::minilm_path();
    let f = fixture(&[&["record", "--model", p(&m), "--text", "hello world", "--level", "layers", "--quiet", "-o", "m.trace"]]);
    let t = read_trace(&f.path("m.trace")).unwrap();
    let sites: Vec<&str> = t.items.iter().filter_map(|i| if let Item::Site { path, .. } = i { Some(path.as_str()) } else { None }).collect();
    let layers: Vec<String> = (0..6).map(|n| format!("encoder.layer.{n}.output.LayerNorm")).collect();
    let want: Vec<&str> = ["input_ids", "token_type_ids", "attention_mask"].into_iter().chain(layers.iter().map(String::as_str)).chain(["pooler.mean", "pooler.normalize"]).collect();
    assert_eq!(sites, want);
}

/// `trace check --level layers` records every run at that level; `--write-golden` with it writes
/// a layers golden, and `--golden` re-records at the golden's level, so the bisect compares two
/// layers traces (not a fresh ops trace projected onto the golden's layers).
#[test]
fn check_records_at_the_level_and_golden_keeps_the_goldens_level() {
    let d = crate::util::tmp();
    let out = d.path().join("check");
    let (code, stdout, err) = trace_s(&["check", "--level", "layers", "--max-tokens", "4", "--runs", "1", "--vary", "threads", "--out", p(&out), "--quiet"]);
    assert_eq!(code, 0, "{stdout}{err}");
    let traces: Vec<_> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().path()).filter(|f| f.extension().is_some_and(|x| x == "trace")).collect();
    assert!(traces.len() >= 4, "baseline, repeat and the thread counts: {traces:?}");
    for t in &traces {
        assert_eq!(read_trace(t).unwrap().level, Level::Layers, "{}", t.display());
    }
    // A run of the folder replaced by one at every op is another run: --collect names it.
    let repeat = traces.iter().find(|t| t.file_name().unwrap().to_string_lossy().contains("repeat")).expect("a repeat run");
    let (code, _, err) = trace_s(&["record", "--max-tokens", "4", "--quiet", "-o", p(repeat)]);
    assert_eq!(code, 0, "{err}");
    let (_, stdout, err) = trace_s(&["check", "--collect", p(&out)]);
    assert!(stdout.contains("holds another run (--level ops, the job has layers)"), "{stdout}{err}");
    let golden = d.path().join("golden.trace");
    let (code, stdout, err) = trace_s(&["check", "--level", "layers", "--max-tokens", "4", "--write-golden", p(&golden)]);
    assert_eq!(code, 0, "{stdout}{err}");
    assert_eq!(read_trace(&golden).unwrap().level, Level::Layers);
    let (code, stdout, err) = trace_s(&["check", "--golden", p(&golden), "--format", "json", "--quiet"]);
    assert_eq!(code, 0, "{stdout}{err}");
    let notes = json(&stdout)["notes"].to_string();
    assert!(notes.contains("both runs recorded each layer's output"), "the fresh run took the golden's level: {notes}");
    // Another level asked for: what both hold is compared, and the level is listed among the
    // settings that differ (it read "settings and environment: identical").
    let (code, stdout, err) = trace_s(&["check", "--golden", p(&golden), "--level", "logits", "--quiet"]);
    assert_eq!(code, 0, "{stdout}{err}");
    assert!(stdout.contains("run.level: layers -> logits") && !stdout.contains("settings and environment: identical"), "{stdout}");
}
