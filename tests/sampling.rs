//! Sampling made visible: each decode step records its candidate set, cut-offs, boundary ties,
//! draw and rank; bisect classifies a sampled divergence (different draw, candidate set differed
//! at the boundary, distribution differed); `show` lists the fragile steps.

use crate::util::{json, p, tmp, trace_s};
use candle_core::{Device, Tensor};
use candle_trace::bisect::classify_sampling;
use candle_trace::sampling::Sampler;
use candle_transformers::generation::Sampling;

#[test]
fn same_seed_identical_other_seed_is_a_different_draw() {
    let d = tmp();
    let (a, b, c) = (d.path().join("s1.trace"), d.path().join("s1b.trace"), d.path().join("s2.trace"));
    let args = |seed: &str, out: &std::path::Path| -> Vec<String> {
        ["record", "--temperature", "0.9", "--top-k", "5", "--max-tokens", "8", "--seed", seed, "-o", p(out)].iter().map(|s| s.to_string()).collect()
    };
    for (seed, out) in [("1", &a), ("1", &b), ("2", &c)] {
        let v = args(seed, out);
        assert_eq!(trace_s(&v.iter().map(String::as_str).collect::<Vec<_>>()).0, 0);
    }
    let t = candle_trace::format::read_trace(&a).unwrap();
    assert_eq!(t.sampling.len(), 8, "one record per decode step");
    assert!(t.sampling.iter().all(|s| s.mode == "top_k" && s.after_top_k == 5 && s.draw.is_some() && s.rank < 5));
    assert_eq!(trace_s(&["bisect", p(&a), p(&b)]).0, 0);
    let (code, out, _) = trace_s(&["bisect", p(&a), p(&c), "--format", "json"]);
    assert_eq!(code, 1);
    let v = json(&out);
    assert_eq!(v["sampling"]["class"], "different_draw", "{v}");
    let (x, y) = (v["sampling"]["a_draw"].as_f64().unwrap(), v["sampling"]["b_draw"].as_f64().unwrap());
    assert_ne!(x, y);
    let (_, text, _) = trace_s(&["bisect", p(&a), p(&c)]);
    assert!(text.contains("sampling: the same probabilities met a different random draw (a "), "{text}");
    assert!(text.contains("run.seed: 1 -> 2"), "{text}");
}

/// Logits whose top-k boundary holds an exact tie (tokens 3 and 4 at the 2nd place of k = 2),
/// and the same logits with token 4 one ULP higher: the same seed draws the same value, the
/// candidate set differs at the boundary, and the tied tokens are named.
#[test]
fn top_k_boundary_tie_is_classified_and_named() {
    let mut v = vec![0.0f32; 16];
    v[7] = 3.0;
    v[3] = 2.0;
    v[4] = 2.0;
    let mut w = v.clone();
    w[4] = f32::from_bits(w[4].to_bits() + 1);
    let mode = Sampling::TopK { k: 2, temperature: 1.0 };
    let step = |logits: &[f32]| {
        let t = Tensor::new(logits, &Device::Cpu).unwrap();
        Sampler::new(42, mode.clone()).sample(&t, 0, 0).unwrap().1
    };
    let (a, b) = (step(&v), step(&w));
    assert!(a.boundary.iter().any(|&(t, _, tie)| tie && (t == 3 || t == 4)), "the exact tie is recorded: {a:?}");
    assert_ne!(a.set_digest, b.set_digest, "the candidate sets differ");
    let verdict = classify_sampling(&a, &b);
    assert_eq!(verdict.class, "boundary", "{verdict:?}");
    assert!(verdict.tokens.contains(&3) || verdict.tokens.contains(&4), "{verdict:?}");
    assert_eq!(verdict.a_draw.map(f32::to_bits), verdict.b_draw.map(f32::to_bits), "same seed, same draw");
    // A near-tie that swaps places (no exact tie, no 1-ULP neighbour): the least likely kept
    // token changed while the cut-off stayed within 1%, so it is still the boundary.
    let (mut n1, mut n2) = (v.clone(), v.clone());
    n1[4] = 2.0 - 1e-3;
    n2[3] = 2.0 - 1e-3;
    let swap = classify_sampling(&step(&n1), &step(&n2));
    assert_eq!(swap.class, "boundary", "{swap:?}");
    assert!(swap.tokens.contains(&3) && swap.tokens.contains(&4), "{swap:?}");
    // Same probabilities, other seed: a different draw.
    let t = Tensor::new(v.as_slice(), &Device::Cpu).unwrap();
    let c = Sampler::new(7, mode.clone()).sample(&t, 0, 0).unwrap().1;
    assert_eq!(classify_sampling(&a, &c).class, "different_draw");
    // Logits that differ away from any boundary: the distribution differed.
    let mut u = v.clone();
    u[7] = 3.5;
    assert_eq!(classify_sampling(&a, &step(&u)).class, "distribution_differed");
    // The same logits sampled with another top-k, temperature, or greedily: the settings, not a
    // draw (it said "different random draw (a 0.82, b 0.82)") nor the logits (a fresh-user trial).
    let with = |m: Sampling| Sampler::new(42, m).sample(&t, 0, 0).unwrap().1;
    let k3 = classify_sampling(&a, &with(Sampling::TopK { k: 3, temperature: 1.0 }));
    assert_eq!((k3.class.as_str(), k3.a_draw.map(f32::to_bits) == k3.b_draw.map(f32::to_bits)), ("sampler_settings", true), "{k3:?}");
    assert!(k3.explanation.starts_with("the sampler settings differ (a temperature 1, top-k 2, b temperature 1, top-k 3)"), "{k3:?}");
    let hot = classify_sampling(&a, &with(Sampling::TopK { k: 2, temperature: 1.5 }));
    assert_eq!(hot.class, "sampler_settings", "{hot:?}");
    let greedy = classify_sampling(&with(Sampling::ArgMax), &a);
    assert!(greedy.class == "sampler_settings" && greedy.explanation.contains("(a greedy, b temperature 1, top-k 2)"), "{greedy:?}");

    // show lists the fragile step, even in one run.
    let d = tmp();
    let f = d.path().join("one.trace");
    assert_eq!(trace_s(&["record", "--max-tokens", "1", "-o", p(&f)]).0, 0);
    let mut tr = candle_trace::format::read_trace(&f).unwrap();
    tr.sampling = vec![a];
    let text = candle_trace::show::text(&candle_trace::show::summarize(&tr));
    assert!(text.contains("fragile steps: a token outside the candidate set ties a cut-off") && text.contains("exact tie"), "{text}");
}

/// Greedy runs record their steps too: a tie or 1-ULP near-tie with the top logit is fragile.
#[test]
fn greedy_steps_are_recorded() {
    let d = tmp();
    let f = d.path().join("g.trace");
    assert_eq!(trace_s(&["record", "--max-tokens", "4", "-o", p(&f)]).0, 0);
    let t = candle_trace::format::read_trace(&f).unwrap();
    assert_eq!(t.sampling.len(), 4);
    assert!(t.sampling.iter().all(|s| s.mode == "argmax" && s.rank == 0 && s.draw.is_none()));
    let (_, show, _) = trace_s(&["show", p(&f)]);
    assert!(show.contains("fragile steps: none") || show.contains("fragile steps: a token"), "{show}");
}

/// The seeded builtin model in bf16, sampling with top-k 77 at temperature 1: the first token's
/// top-k cut-off holds an exact tie (token 135 outside, tied with the last kept token). Run b is
/// the same but for a 1-ULP move of token 135's bf16 logit (`--perturb lm_head@29#135`): the
/// same draw meets a candidate set that differs at the boundary, and bisect says so and names
/// the tied token.
#[test]
fn builtin_top_k_boundary_tie() {
    let d = tmp();
    let (a, b) = (d.path().join("a.trace"), d.path().join("b.trace"));
    let base = ["record", "--dtype", "bf16", "--temperature", "1.0", "--top-k", "77", "--seed", "29", "--max-tokens", "1"];
    assert_eq!(trace_s(&[&base[..], &["-o", p(&a)]].concat()).0, 0);
    assert_eq!(trace_s(&[&base[..], &["--perturb", "lm_head@29#135", "-o", p(&b)]].concat()).0, 0);
    let ta = candle_trace::format::read_trace(&a).unwrap();
    let s = &ta.sampling[0];
    assert!(s.boundary.iter().any(|&(t, _, tie)| t == 135 && tie), "the setup: an exact tie at the cut-off: {s:?}");
    let (code, out, _) = trace_s(&["bisect", p(&a), p(&b), "--format", "json"]);
    assert_eq!(code, 1, "{out}");
    let v = json(&out);
    assert_eq!(v["sampling"]["class"], "boundary", "{v}");
    assert!(v["sampling"]["tokens"].as_array().unwrap().iter().any(|t| t == 135), "{v}");
    assert_eq!(v["sampling"]["a_draw"], v["sampling"]["b_draw"], "same seed, same draw");
    let (_, text, _) = trace_s(&["bisect", p(&a), p(&b)]);
    assert!(text.contains("sampling: the same draw met a different candidate set: at the top-k cut-off, token(s)"), "{text}");
    // The spec round-trips.
    let spec: candle_trace::tracer::Perturb = "lm_head@29#135".parse().unwrap();
    assert_eq!((spec.pos, spec.element, spec.to_arg().as_str()), (Some(29), Some(135), "lm_head@29#135"));
}

/// `show` prints each sampled step (candidates after top-k and top-p, mass, draw, chosen token
/// and rank; JSON holds every record), and with `--model` the text the model received, chat
/// template included; a model that is not the trace's is refused.
#[test]
fn show_prints_the_sampler_and_the_received_prompt() {
    let m = crate::util::smollm2_path();
    let d = tmp();
    let t = d.path().join("s.trace");
    let (code, _, err) = trace_s(&["record", "--model", p(&m), "--chat", "--prompt", "Hi!", "--max-tokens", "3", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "-o", p(&t)]);
    assert_eq!(code, 0, "{err}");
    let (_, text, _) = trace_s(&["show", p(&t)]);
    assert!(text.contains("`trace show FILE --model MODEL` prints the text"), "{text}");
    let (_, js, _) = trace_s(&["show", p(&t), "--format", "json"]);
    let steps = json(&js)["sampling"].as_array().unwrap().clone();
    assert_eq!(steps.len(), 3, "{js}");
    let lines: Vec<&str> = text.lines().skip_while(|l| !l.starts_with("sampling (row 0)")).skip(1).take(3).collect();
    for (x, line) in steps.iter().zip(&lines) {
        let want = format!("{} / {}", x["after_top_k"], x["after_top_p"]);
        assert!(line.contains(&want) && line.contains(&format!("chose {} (rank {})", x["chosen"], x["rank"])), "{line} vs {x}");
        assert_eq!(x["after_top_k"], 20);
    }
    let (code, text, err) = trace_s(&["show", p(&t), "--model", p(&m)]);
    assert_eq!(code, 0, "{err}");
    assert!(text.contains("received     \"<|im_start|>system\\n") && text.contains("<|im_start|>user\\nHi!<|im_end|>"), "{text}");
    let (code, _, err) = trace_s(&["show", p(&t), "--model", p(&t)]);
    assert!(code == 2 && err.contains("not the model this trace was recorded with"), "{err}");
}
