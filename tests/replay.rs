//! `trace replay` and `trace extract`: a dumped op re-executes to the recorded bits, a repro trace
//! is self-contained and small, and what cannot be replayed says why.

use crate::util::{json, p, smollm2_path, tmp, trace_s};

#[test]
fn extract_then_replay_with_nothing_else_present() {
    let d = tmp();
    let (a, b, repro) = (d.path().join("a.trace"), d.path().join("b.trace"), d.path().join("repro.trace"));
    assert_eq!(trace_s(&["record", "--max-tokens", "3", "--dump", "layers.0.*", "-o", p(&a)]).0, 0);
    assert_eq!(trace_s(&["record", "--max-tokens", "3", "--prefill-chunk", "1", "--dump", "layers.0.*", "-o", p(&b)]).0, 0);
    let (code, out, err) = trace_s(&["extract", p(&a), p(&b), "-o", p(&repro)]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("layers.0.self_attn.q_proj (linear) at position 0"), "{out}");
    // The runs' headers hold the prompt, and so does the repro: said before it is attached.
    assert!(err.contains("note: the repro holds the prompt") && err.contains("`trace redact` it"), "{err}");
    std::fs::remove_file(&a).unwrap();
    std::fs::remove_file(&b).unwrap();
    assert!(std::fs::metadata(&repro).unwrap().len() < 1 << 20);
    let (code, out, err) = trace_s(&["replay", p(&repro), "--format", "json"]);
    assert_eq!(code, 0, "{out}{err}");
    let v = json(&out);
    assert_eq!((v["matches_recording"].as_bool(), v["deterministic"].as_bool(), v["matches_counterpart"].as_bool()), (Some(true), Some(true), Some(false)), "{v}");
    // Replaying in another dtype is a different computation: not the recorded bits, and how far
    // its result lies from the recorded values, read back in the recording's dtype.
    let (code, out, _) = trace_s(&["replay", p(&repro), "--dtype", "bf16"]);
    assert_eq!(code, 1);
    assert!(out.contains("verdict: deterministic here; in bf16 the op's result differs from the f32 recording (") && out.contains("the rounding of bf16, not the environment"), "{out}");
    let (_, out, _) = trace_s(&["replay", p(&repro), "--dtype", "bf16", "--format", "json"]);
    let v = json(&out);
    assert!(v["differing_elements"].as_u64().unwrap() > 0 && v["max_ulp"].as_u64().unwrap() >= 1 << 13, "bf16 keeps 8 of f32's 24 mantissa bits: {v}");
    // In the output's units: above zero, and small beside the output's scale (bf16 rounds to 2^-9 of each value).
    let (dmax, xmax) = (v["max_abs_diff"].as_f64().unwrap(), v["recorded_abs_max"].as_f64().unwrap());
    assert!(dmax > 0.0 && dmax < 0.1 * xmax, "{v}");
    // ULPs across zero (~1e9 for a value near zero whose sign flipped, as a fresh-user trial
    // read it) come with the count of elements that changed sign, in the text too.
    let (k, n, u) = (v["sign_changes"].as_u64().unwrap(), v["differing_elements"].as_u64().unwrap(), v["max_ulp"].as_u64().unwrap());
    assert!(k <= n && (u < 1 << 28 || k > 0), "{v}");
    let (_, out, _) = trace_s(&["replay", p(&repro), "--dtype", "bf16"]);
    assert_eq!(out.contains("counted through zero"), k > 0, "{out}");
}

#[test]
fn replay_every_kind_of_decoder_op() {
    let d = tmp();
    let a = d.path().join("a.trace");
    assert_eq!(trace_s(&["record", "--max-tokens", "2", "--dump", "all", "-o", p(&a)]).0, 0);
    // One op through the CLI, every kind in process.
    assert_eq!(trace_s(&["replay", p(&a), "--op", "5"]).0, 0);
    let kinds = replay_each_kind(&a);
    assert!(kinds.len() >= 13, "{kinds:?}");
}

#[test]
fn replay_refusals_and_perturbed_records() {
    let d = tmp();
    let (a, b) = (d.path().join("a.trace"), d.path().join("b.trace"));
    assert_eq!(trace_s(&["record", "--max-tokens", "2", "-o", p(&a)]).0, 0);
    let (code, _, err) = trace_s(&["replay", p(&a), "--op", "7"]);
    assert_eq!(code, 2);
    assert!(err.contains("was not dumped") && err.contains("--dump '"), "{err}");
    let (code, _, err) = trace_s(&["extract", p(&a), p(&a), "-o", p(&d.path().join("x.trace"))]);
    assert_eq!(code, 2, "{err}");
    // A perturbed record: the replay computes the unperturbed value, one ULP away.
    assert_eq!(trace_s(&["record", "--max-tokens", "2", "--dump", "layers.1.mlp.act", "--perturb", "layers.1.mlp.act@3", "-o", p(&b)]).0, 0);
    let t = candle_trace::format::read_trace(&b).unwrap();
    let seq = t.items.iter().find_map(|i| match i {
        candle_trace::record::Item::Op(r) if r.perturbed => Some(r.seq),
        _ => None,
    });
    let (code, out, _) = trace_s(&["replay", p(&b), "--op", &seq.unwrap().to_string()]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("DIFFERS from the recording") && out.contains("perturbed"), "{out}");
    // The flipped lowest mantissa bit is one element, one ULP.
    assert!(out.contains("against the recorded values: 1 elements differ, max 1 ULP"), "{out}");
}

/// Replays, in process, one op of each kind of a trace recorded with `--dump`; returns the kinds.
pub fn replay_each_kind(path: &std::path::Path) -> std::collections::BTreeSet<String> {
    let t = candle_trace::format::read_trace(path).unwrap();
    let mut sites = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for item in &t.items {
        match item {
            candle_trace::record::Item::Site { op, .. } => sites.push(op.clone()),
            candle_trace::record::Item::Op(r) if !r.operands.is_empty() => {
                let kind = format!("{:?}", r.kernel.as_ref().unwrap());
                if seen.insert(kind.clone()) {
                    let rep = candle_trace::replay::replay(&t, Some(r.seq), None, &candle_core::Device::Cpu).unwrap();
                    assert!(rep.matches_recording && rep.deterministic, "{} {kind}: {rep:?}", sites[r.site as usize]);
                }
            }
            _ => {}
        }
    }
    seen
}

/// SmolLM2 (GGUF, quantized): every op kind of the model replays to the recorded bits.
#[test]
fn smollm2_every_op_kind_replays() {
    let m = smollm2_path();
    let d = tmp();
    let a = d.path().join("a.trace");
    let (code, _, err) = trace_s(&["record", "--model", p(&m), "--chat", "--max-tokens", "2", "--dump", "input_ids,embed_tokens,layers.0.*,norm,lm_head", "-o", p(&a)]);
    assert_eq!(code, 0, "{err}");
    let kinds = replay_each_kind(&a);
    assert!(kinds.len() >= 13 && kinds.iter().any(|k| k == "QMatMul"), "{kinds:?}");
}

/// Whole prefill vs chunks of 7 with `--dump 'layers.0.*'`: extract, remove the model from disk, replay: both
/// runs' results reproduce, so the difference is the op's input shape, not the machine.
#[test]
fn smollm2_pair_extract_replay_without_the_model() {
    let m = smollm2_path();
    let d = tmp();
    let model = d.path().join("model.gguf");
    std::fs::copy(&m, &model).unwrap();
    let (a, b, repro) = (d.path().join("a.trace"), d.path().join("b.trace"), d.path().join("repro.trace"));
    let base = ["record", "--model", p(&model), "--chat", "--max-tokens", "2", "--dump", "layers.0.*"];
    assert_eq!(trace_s(&[&base[..], &["-o", p(&a)]].concat()).0, 0);
    assert_eq!(trace_s(&[&base[..], &["--prefill-chunk", "7", "-o", p(&b)]].concat()).0, 0);
    let (code, out, err) = trace_s(&["extract", p(&a), p(&b), "-o", p(&repro)]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("layers.0.self_attn.scores (matmul) at position 0"), "{out}");
    assert!(err.contains("the root cause layers.26.self_attn.scores was not dumped"), "{err}");
    for f in [&model, &a, &b] {
        std::fs::remove_file(f).unwrap();
    }
    let (code, out, _) = trace_s(&["replay", p(&repro), "--format", "json"]);
    assert_eq!(code, 0, "{out}");
    let v = json(&out);
    assert_eq!((v["matches_recording"].as_bool(), v["counterpart_replay_matches"].as_bool(), v["matches_counterpart"].as_bool()), (Some(true), Some(true), Some(false)), "{v}");
    assert!(
        v["verdict"].as_str().unwrap().contains("not from the environment") && v["verdict"].as_str().unwrap().contains("which differ in shape (operand 0: a [1, 9, 38, 64], b [1, 9, 7, 64])"),
        "{v}"
    );
    // By how much a and b differ, both replayed here, where their recordings first differ.
    let x = &v["a_vs_b"];
    assert_eq!(x["position"].as_u64(), Some(0), "{v}");
    let (n, k, u) = (x["elements"].as_u64().unwrap(), x["differing"].as_u64().unwrap(), x["max_ulp"].as_u64().unwrap());
    assert!(n > 0 && (1..=n).contains(&k) && u >= 1, "{x}");
    let (_, text, _) = trace_s(&["replay", p(&repro)]);
    assert!(text.contains(&format!("a vs b, both replayed here, at position 0: {k} of {n} elements differ, max {u} ULP")), "{text}");
    // The claim's core: the rows both runs fed the op (the chunk's 7 query positions; keys 0..6,
    // which here are positions 0..6 too) are bit-identical.
    let ops = v["shared_operands"].as_array().unwrap();
    let spans: Vec<&str> = ops.iter().map(|o| o["span"].as_str().unwrap()).collect();
    assert_eq!(spans, ["positions 0..6 (dim 2)"; 2], "{v}");
    assert!(ops.iter().all(|o| o["differing"] == 0 && o["compared"].as_u64().unwrap() > 0), "{v}");
    assert!(text.contains("every operand's shared rows are bit-identical in a and b"), "{text}");
}

/// The size target: SmolLM2's root-cause op as a repro trace is under 1 MB.
#[test]
fn smollm2_repro_is_small() {
    let m = smollm2_path();
    let d = tmp();
    let (a, b, repro) = (d.path().join("a.trace"), d.path().join("b.trace"), d.path().join("repro.trace"));
    let base = ["record", "--model", p(&m), "--chat", "--max-tokens", "2", "--dump", "layers.26.self_attn.scores"];
    assert_eq!(trace_s(&[&base[..], &["-o", p(&a)]].concat()).0, 0);
    assert_eq!(trace_s(&[&base[..], &["--prefill-chunk", "7", "-o", p(&b)]].concat()).0, 0);
    let (code, out, err) = trace_s(&["extract", p(&a), p(&b), "-o", p(&repro)]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("layers.26.self_attn.scores (matmul) at position 3"), "{out}");
    assert!(std::fs::metadata(&repro).unwrap().len() < 1 << 20);
    assert_eq!(trace_s(&["replay", p(&repro)]).0, 0);
}

/// `extract --candle DIR`: a Cargo project needing candle alone (built and run by
/// tools/check-candle-repro.sh in CI): the operands and a's recorded output as safetensors,
/// with the recorded shapes, and a program calling the op's candle expression.
#[test]
fn extract_candle_writes_a_candle_only_project() {
    let d = tmp();
    let (a, b, repro, dir) = (d.path().join("a.trace"), d.path().join("b.trace"), d.path().join("repro.trace"), d.path().join("candle"));
    let base = ["record", "--max-tokens", "4", "--dump", "layers.0.*"];
    assert_eq!(trace_s(&[&base[..], &["-o", p(&a)]].concat()).0, 0);
    assert_eq!(trace_s(&[&base[..], &["--prefill-chunk", "1", "-o", p(&b)]].concat()).0, 0);
    // A file where the project's folder should go is refused before anything is written.
    let (code, _, err) = trace_s(&["extract", p(&a), p(&b), "-o", p(&repro), "--candle", p(&a)]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("is a file") && !repro.exists(), "{err}");
    let (code, out, err) = trace_s(&["extract", p(&a), p(&b), "-o", p(&repro), "--candle", p(&dir)]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("layers.0.self_attn.q_proj (linear)") && out.contains("with candle alone"), "{out}");
    let toml = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
    assert!(toml.contains("candle-core = \"=0.11.1\"") && !toml.contains("candle-trace"), "{toml}");
    let main = std::fs::read_to_string(dir.join("src/main.rs")).unwrap();
    assert!(main.contains("candle_nn::Linear::new(x1.clone(), None).forward(&x0)?"), "{main}");
    let t = candle_core::safetensors::load(dir.join("operands.safetensors"), &candle_core::Device::Cpu).unwrap();
    let mut names: Vec<&String> = t.keys().collect();
    names.sort();
    // b dumped the op too: its operands, for the program to run b's op and compare it with a's
    // at the first position whose digests differ (position 0: the prefill chunk of 1 token).
    assert_eq!(names, ["b_x0", "b_x1", "recorded", "x0", "x1"]);
    assert_eq!(t["b_x0"].dims(), [1, 1, 64], "b's one-token chunk");
    assert!(main.contains("let x0 = get(\"b_x0\")?;") && main.contains("at token position 0, a's and b's outputs differ in"), "{main}");
    assert!(main.contains("&[(0, 64)]"), "position 0's elements in a's [1, 30, 64] output and in b's [1, 1, 64]: {main}");
    let r = candle_trace::format::read_trace(&repro).unwrap();
    let rec = r.items.iter().find_map(|i| if let candle_trace::record::Item::Op(r) = i { Some(r) } else { None }).unwrap();
    assert_eq!(t["recorded"].dims().iter().map(|&x| x as u32).collect::<Vec<_>>(), rec.shape);
    // The repro written into the project's own new folder is no reason to refuse it.
    let inner = d.path().join("inner");
    std::fs::create_dir(&inner).unwrap();
    let (code, _, err) = trace_s(&["extract", p(&a), p(&b), "-o", p(&inner.join("repro.trace")), "--candle", p(&inner)]);
    assert!(code == 0 && inner.join("Cargo.toml").is_file(), "{err}");
    // The project written before is written over; someone's own project is refused, untouched.
    let (code, _, err) = trace_s(&["extract", p(&a), p(&b), "-o", p(&repro), "--candle", p(&dir)]);
    assert_eq!(code, 0, "again into its own project: {err}");
    let mine = d.path().join("mine");
    std::fs::create_dir_all(mine.join("src")).unwrap();
    std::fs::write(mine.join("Cargo.toml"), "[package]\nname = \"mine\"\n").unwrap();
    std::fs::write(mine.join("src/main.rs"), "fn main() {}\n").unwrap();
    std::fs::remove_file(&repro).unwrap();
    let (code, _, err) = trace_s(&["extract", p(&a), p(&b), "-o", p(&repro), "--candle", p(&mine)]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("would overwrite") && err.lines().count() == 1 && !repro.exists(), "{err}");
    assert_eq!(std::fs::read_to_string(mine.join("Cargo.toml")).unwrap(), "[package]\nname = \"mine\"\n");
    assert_eq!(std::fs::read_to_string(mine.join("src/main.rs")).unwrap(), "fn main() {}\n");
}

/// f32 against bf16, the embedding the root: both runs' ops reproduce from their own operands,
/// and the verdict names what differs in them, the dtype of the table, not their shapes (it
/// said "the op's inputs and their shapes (prefill chunk, batch)"; found by a fresh-user trial).
#[test]
fn a_replay_names_the_operand_dtype_that_differs() {
    let d = tmp();
    let (a, b, repro) = (d.path().join("a.trace"), d.path().join("b.trace"), d.path().join("repro.trace"));
    let base = ["record", "--max-tokens", "2", "--dump", "embed_tokens"];
    assert_eq!(trace_s(&[&base[..], &["-o", p(&a)]].concat()).0, 0);
    assert_eq!(trace_s(&[&base[..], &["--dtype", "bf16", "-o", p(&b)]].concat()).0, 0);
    let (code, _, err) = trace_s(&["extract", p(&a), p(&b), "-o", p(&repro)]);
    assert_eq!(code, 0, "{err}");
    let (code, out, _) = trace_s(&["replay", p(&repro), "--format", "json"]);
    assert_eq!(code, 0, "{out}");
    let verdict = json(&out)["verdict"].as_str().unwrap().to_string();
    assert!(verdict.contains("which differ in dtype (operand 1: a f32, b bf16)") && !verdict.contains("shape"), "{verdict}");
}

/// A request alone against the same request in a padded batch of two, where it is row 1: the
/// repro's a-vs-b line is left out (b's row 0 is the other request, and padded rows' positions
/// are not their indices: it compared the other request, "max 2126391105 ULP", a fresh-user
/// trial), and replay says why.
#[test]
fn a_batch_counterpart_is_not_compared_row_by_index() {
    let d = tmp();
    let (a, b, r) = (d.path().join("a.trace"), d.path().join("b.trace"), d.path().join("r.trace"));
    assert_eq!(trace_s(&["record", "--prompt", "Hello there", "--max-tokens", "2", "--dump", "all", "-o", p(&a)]).0, 0);
    assert_eq!(trace_s(&["record", "--prompt", "A much longer request that pads the batch", "--prompt", "Hello there", "--max-tokens", "2", "--dump", "all", "-o", p(&b)]).0, 0);
    let (code, out, err) = trace_s(&["extract", p(&a), p(&b), "-o", p(&r)]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, text, err) = trace_s(&["replay", p(&r)]);
    assert_eq!(code, 0, "{err}");
    assert!(!text.contains("a vs b, both replayed here") && text.contains("a's and b's outputs are not compared element by element: batches of 1 and 2 rows"), "{text}");
    assert!(text.contains("b's op, replayed from b's operands: same bits as b's recording"), "{text}");
}
