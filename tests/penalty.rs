//! The repeat penalty candle's examples apply (`--repeat-penalty`, `--repeat-last-n`): each
//! decode step's logits are penalised exactly as `candle_transformers::utils::apply_repeat_penalty`
//! penalises them, the settings and per-step records are in the trace, bisect classes a flip
//! between two penalties as a run setting, and `show` lists the penalised logits.

use crate::util::{json, p, tmp, trace_s};
use candle_core::{Device, Tensor};
use candle_trace::format::{read_trace, Trace};
use candle_trace::record::Item;

const PROMPT: &str = "the the the a a b";

/// Each forward pass's `lm_head` output (dumped), its last position's logits, in pass order.
fn last_logits(t: &Trace) -> Vec<Vec<f32>> {
    let vocab = t.header.run.model.vocab_size as usize;
    let logits = |d| candle_trace::values::to_tensor(d, &Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    crate::util::dumps_with_paths(t)
        .into_iter()
        .filter(|(path, _)| path == "lm_head")
        .map(|(_, d)| {
            let x = logits(d);
            x[x.len() - vocab..].to_vec()
        })
        .collect()
}

/// Greedy decoding with a penalty of 1.5 over the last 8 tokens: at every step the recorded top
/// logits are candle's function's output bits on the dumped raw logits (window: the prompt and
/// the tokens generated so far), the chosen token is the penalised argmax, and the run's text
/// differs from the unpenalised run's (the penalty did something).
#[test]
fn repeat_penalty_is_bit_equal_to_candles_function() {
    let d = tmp();
    let (a, n) = (d.path().join("pen.trace"), d.path().join("none.trace"));
    let common = ["record", "--prompt", PROMPT, "--max-tokens", "12", "--dump", "lm_head"];
    assert_eq!(trace_s(&[&common[..], &["--repeat-penalty", "1.5", "--repeat-last-n", "8", "-o", p(&a)]].concat()).0, 0);
    assert_eq!(trace_s(&[&common[..], &["-o", p(&n)]].concat()).0, 0);
    let (t, plain) = (read_trace(&a).unwrap(), read_trace(&n).unwrap());
    assert_eq!(t.extras.settings.0, vec![("repeat_last_n".to_string(), "8".to_string()), ("repeat_penalty".to_string(), "1.5".to_string())]);
    assert!(plain.extras.settings.0.is_empty() && plain.extras.penalty.is_empty(), "no frame without the penalty");
    let raw = last_logits(&t);
    let choices: Vec<_> = t.items.iter().filter_map(|i| if let Item::Token(e) = i { Some(e.rows[0].clone()) } else { None }).collect();
    assert_eq!((raw.len(), choices.len(), t.extras.penalty.len()), (12, 12, 12));
    let mut context = t.header.run.prompt_tokens.clone();
    let mut penalised_somewhere = false;
    for (k, (logits, c)) in raw.iter().zip(&choices).enumerate() {
        let window = &context[context.len().saturating_sub(8)..];
        let want = candle_transformers::utils::apply_repeat_penalty(&Tensor::new(logits.as_slice(), &Device::Cpu).unwrap(), 1.5, window).unwrap().to_vec1::<f32>().unwrap();
        let step = &t.extras.penalty[k];
        assert_eq!((step.index, step.row), (k as u32, 0));
        let distinct: std::collections::HashSet<_> = window.iter().collect();
        assert_eq!(step.penalised as usize, distinct.len());
        for &(id, before, after) in &step.top {
            assert_eq!((before.to_bits(), after.to_bits()), (logits[id as usize].to_bits(), want[id as usize].to_bits()), "step {k} token {id}");
            penalised_somewhere |= before != after;
        }
        let top: Vec<(u32, u32)> = c.top.iter().map(|&(id, l)| (id, l.to_bits())).collect();
        assert_eq!(top, step.top.iter().map(|&(id, _, l)| (id, l.to_bits())).collect::<Vec<_>>(), "the choice's top-5 is of the penalised logits");
        let argmax = want.iter().enumerate().fold(0, |m, (i, &x)| if x > want[m] { i } else { m });
        assert_eq!(c.token as usize, argmax, "step {k}");
        context.push(c.token);
    }
    assert!(penalised_somewhere, "a penalised token reached the top 5");
    assert_ne!(t.footer.as_ref().unwrap().texts, plain.footer.as_ref().unwrap().texts, "the penalty changed the text");
}

/// Two penalties on the same greedy run: the forward passes agree up to the flip, which bisect
/// classes as a run setting naming the keys and both values; `show` lists the penalised logits.
#[test]
fn a_flip_between_two_penalties_is_a_run_setting() {
    let d = tmp();
    let (a, b) = (d.path().join("a.trace"), d.path().join("b.trace"));
    for (pen, out) in [("1.1", &a), ("1.5", &b)] {
        assert_eq!(trace_s(&["record", "--prompt", PROMPT, "--max-tokens", "12", "--repeat-penalty", pen, "-o", p(out)]).0, 0);
    }
    let (code, out, _) = trace_s(&["bisect", p(&a), p(&b), "--format", "json"]);
    assert_eq!(code, 1, "{out}");
    let v = json(&out);
    assert_eq!(v["sampling"]["class"], "sampler_settings", "{v}");
    assert!(v["first_divergence"].is_null(), "no op is blamed: {v}");
    let (_, text, _) = trace_s(&["bisect", p(&a), p(&b)]);
    assert!(text.contains("the sampler settings differ (a greedy, repeat penalty 1.1 over the last 64 tokens, b greedy, repeat penalty 1.5 over the last 64 tokens)"), "{text}");
    assert!(text.contains("under other sampler settings (a run setting): run.repeat_penalty (a 1.1, b 1.5)"), "{text}");
    assert!(text.contains("run.repeat_penalty: 1.1 -> 1.5"), "{text}");
    let (code, shown, _) = trace_s(&["show", p(&b)]);
    assert_eq!(code, 0);
    assert!(shown.contains("greedy (argmax), repeat penalty 1.5 over the last 64 tokens"), "{shown}");
    assert!(shown.contains("after the repeat penalty, the logit before it in parentheses where it was penalised"), "{shown}");
    assert!(shown.lines().any(|l| l.contains(" pos ") && l.contains(')') && l.contains('(')), "a penalised logit is listed: {shown}");
    // The commands that reproduce both runs name their penalties.
    let (_, md, _) = trace_s(&["bisect", p(&a), p(&b), "--format", "markdown"]);
    assert!(md.contains("--repeat-penalty 1.1 --repeat-last-n 64") && md.contains("--repeat-penalty 1.5 --repeat-last-n 64"), "{md}");
    // The same penalty: identical.
    let c = d.path().join("c.trace");
    assert_eq!(trace_s(&["record", "--prompt", PROMPT, "--max-tokens", "12", "--repeat-penalty", "1.5", "-o", p(&c)]).0, 0);
    assert_eq!(trace_s(&["bisect", p(&b), p(&c)]).0, 0);
}

/// Bad values are one-line usage errors (exit 2).
#[test]
fn bad_penalties_are_refused() {
    for args in [&["--repeat-penalty", "0"][..], &["--repeat-penalty", "-1"], &["--repeat-penalty", "nan"], &["--repeat-penalty", "1e-7"], &["--repeat-last-n", "8"]] {
        let (code, _, err) = trace_s(&[&["record", "--untraced", "--max-tokens", "1"][..], args].concat());
        assert_eq!(code, 2, "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains("--repeat-"), "{err}");
    }
}

/// The settings frame is read once, before the items; a second one, or one after the items
/// began or before the header, is refused naming it; a penalty step's top list is capped.
#[test]
fn settings_and_penalty_frames_are_checked() {
    use candle_trace::format::{decode_trace, frame_bytes, items_frame_bytes, preamble, Refusal, KIND_FOOTER, KIND_HEADER, KIND_PENALTY, KIND_SETTINGS};
    use candle_trace::record::{Footer, Header, PenaltyStep, Settings};
    let settings = Settings(vec![("repeat_penalty".into(), "1.5".into())]);
    let site = Item::Site { id: 0, path: "x".into(), op: "add".into() };
    let file = |frames: &[Vec<u8>]| -> Vec<u8> { preamble().iter().copied().chain(frames.iter().flatten().copied()).collect() };
    let (header, set) = (frame_bytes(KIND_HEADER, &Header::default()).unwrap(), frame_bytes(KIND_SETTINGS, &settings).unwrap());
    let (items, footer) = (items_frame_bytes(std::slice::from_ref(&site)).unwrap(), frame_bytes(KIND_FOOTER, &Footer { items: 1, ..Footer::default() }).unwrap());
    let steps = vec![PenaltyStep { index: 0, row: 0, penalised: 3, top: vec![(7, 2.0, 1.0)] }];
    let pen = frame_bytes(KIND_PENALTY, &steps).unwrap();
    let t = decode_trace(&file(&[header.clone(), set.clone(), items.clone(), pen.clone(), footer.clone()]), std::path::Path::new("ok.trace")).unwrap();
    assert_eq!((t.extras.settings, t.extras.penalty), (settings, steps));
    let refused = |frames: &[Vec<u8>]| match decode_trace(&file(frames), std::path::Path::new("bad.trace")) {
        Err(candle_trace::error::Error::Refused { why, .. }) => why,
        other => panic!("{other:?}"),
    };
    for (frames, what) in [
        (vec![header.clone(), set.clone(), set.clone(), footer.clone()], "settings frame after the items began, or a second one"),
        (vec![header.clone(), items.clone(), set.clone(), footer.clone()], "settings frame after the items began, or a second one"),
        (vec![set.clone(), header.clone()], "frame before the header"),
        (vec![pen.clone(), header.clone()], "frame before the header"),
    ] {
        assert!(matches!(refused(&frames), Refusal::Misplaced { what: w, .. } if w == what), "{what}");
    }
    let long = vec![PenaltyStep { top: vec![(0, 0.0, 0.0); 65], ..PenaltyStep::default() }];
    assert!(matches!(refused(&[header.clone(), frame_bytes(KIND_PENALTY, &long).unwrap(), footer.clone()]), Refusal::Decode { .. }));
    let unsorted = Settings(vec![("repeat_penalty".into(), "1.5".into()), ("repeat_last_n".into(), "8".into())]);
    assert!(matches!(refused(&[header, frame_bytes(KIND_SETTINGS, &unsorted).unwrap(), footer]), Refusal::Invalid { msg, .. } if msg.contains("not sorted and unique")));
}

/// `trace redact` keeps the settings and clears the penalised top tokens (their ids spell the
/// text).
#[test]
fn redact_keeps_the_settings_and_clears_the_penalised_tokens() {
    let d = tmp();
    let (a, r) = (d.path().join("a.trace"), d.path().join("r.trace"));
    assert_eq!(trace_s(&["record", "--prompt", PROMPT, "--max-tokens", "4", "--repeat-penalty", "1.5", "-o", p(&a)]).0, 0);
    let (code, out, err) = trace_s(&["redact", p(&a), "-o", p(&r)]);
    assert_eq!(code, 0, "redact");
    assert!(format!("{out}{err}").contains("top tokens of the repeat penalty's steps (4 steps)"), "{out}{err}");
    let t = read_trace(&r).unwrap();
    assert_eq!(t.extras.settings.get("repeat_penalty"), Some("1.5"));
    assert_eq!(t.extras.penalty.len(), 4);
    assert!(t.extras.penalty.iter().all(|s| s.top.is_empty() && s.penalised > 0));
}

/// `check --golden` re-records with the golden's penalty; the sampler flags given override it
/// (and the bisect then names the key), as the other settings do.
#[test]
fn check_golden_keeps_or_overrides_the_penalty() {
    let d = tmp();
    let g = d.path().join("g.trace");
    let base = ["check", "--prompt", PROMPT, "--max-tokens", "12"];
    assert_eq!(trace_s(&[&base[..], &["--repeat-penalty", "1.3", "--write-golden", p(&g)]].concat()).0, 0);
    let out = d.path().join("out");
    let (code, text, err) = trace_s(&["check", "--golden", p(&g), "--out", p(&out)]);
    assert_eq!(code, 0, "{text}{err}");
    assert!(!text.contains("run.repeat_penalty"), "{text}");
    let (code, text, _) = trace_s(&["check", "--golden", p(&g), "--repeat-penalty", "1.5", "--out", p(&out)]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("run.repeat_penalty: 1.3 -> 1.5"), "{text}");
    let plain = d.path().join("plain.trace");
    assert_eq!(trace_s(&[&base[..], &["--write-golden", p(&plain)]].concat()).0, 0);
    let (code, _, err) = trace_s(&["check", "--golden", p(&plain), "--repeat-last-n", "5", "--out", p(&out)]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("the golden trace has none"), "{err}");
}
