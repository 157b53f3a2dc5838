//! The `--causal` report as text.

use super::*;

/// The report as text for the terminal: the set, the reverse check, the runs and their times.
pub fn text(r: &CausalReport) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(o, "causal: {} vs {}", candle_trace_compare::report::clean(&r.a), candle_trace_compare::report::clean(&r.b));
    let step = r.step.unwrap_or(0);
    match (&r.flip, r.verdict) {
        (_, CausalVerdict::Identical) => {
            let _ = writeln!(o, "  the runs are identical: nothing to explain");
            return o;
        }
        (Some(f), _) => {
            let _ = writeln!(
                o,
                "  which difference changed token {} (row {}): a {} {:?}, b {} {:?}",
                f.step,
                f.row,
                candle_trace_compare::report::id(f.a_token),
                candle_trace_compare::report::clean(&f.a_text),
                candle_trace_compare::report::id(f.b_token),
                candle_trace_compare::report::clean(&f.b_text)
            );
        }
        (None, _) => {
            let _ = writeln!(o, "  no generated token differs: which difference moves the final logits (tokens 0 to {step}) most");
        }
    }
    let found = r.candidates.iter().filter(|c| c.round > 0).count();
    let _ = writeln!(
        o,
        "  entry points (output differs, inputs matched) up to {}: {}{}",
        if r.flip.is_some() { "that token's logits" } else { "the last step's logits" },
        r.candidates.len() - found,
        if found > 0 { format!(", and {found} more found after patching") } else { String::new() }
    );
    verdict_text(&mut o, r);
    let _ = writeln!(o, "\nre-runs: {} in {:.1} s", r.runs.len(), r.seconds);
    for x in &r.runs {
        let patched = if x.patched.is_empty() { String::new() } else { format!(", {} patched", x.patched.len()) };
        let _ = writeln!(o, "  {:>3} {:<12} {:>5.1} s  {}{patched}", x.n, x.kind, x.seconds, candle_trace_compare::report::clean(&x.outcome));
    }
    for n in &r.notes {
        let _ = writeln!(o, "note: {n}");
    }
    o
}

/// Candidate `i` in one line: op, position, layer, row, class, and the round that found it.
fn describe(r: &CausalReport, i: usize) -> String {
    let c = &r.candidates[i];
    let layer = c.layer.map_or(String::new(), |l| format!(", layer {l}"));
    let row = if c.row == 0 { String::new() } else { format!(", row {}", c.row) };
    let found = if c.round == 0 { String::new() } else { format!(" [found after patching, round {}]", c.round) };
    format!("{} ({}) at position {}{layer}{row}: {}{found}", c.path.text(), c.op.text(), c.position, c.class.describe())
}

/// The verdict: the set that flips the token and the reverse check, the ranking, or why none.
fn verdict_text(o: &mut String, r: &CausalReport) {
    use std::fmt::Write;
    let step = r.step.unwrap_or(0);
    match r.verdict {
        CausalVerdict::Found => {
            let one = r.set.len() == 1;
            let _ = writeln!(
                o,
                "\n{} that, patched into a with b's values, make{} a produce b's token {step}{}:",
                if one { "the entry point".to_string() } else { format!("the {} entry points", r.set.len()) },
                if one { "s" } else { "" },
                if r.minimal { " (leaving any one out loses the flip)" } else { " (not shown minimal)" }
            );
            for &i in &r.set {
                let _ = writeln!(o, "  {}", describe(r, i));
            }
            let mut classes: Vec<CauseClass> = r.set.iter().map(|&i| r.candidates[i].class).collect();
            classes.sort_unstable();
            classes.dedup();
            for c in classes {
                let _ = writeln!(o, "  remedy: {}", c.remedy());
            }
            if let Some((j, ok)) = r.bisect_root_alone {
                if !r.set.contains(&j) || r.set.len() > 1 {
                    let c = &r.candidates[j];
                    let _ = writeln!(o, "bisect's root cause {}@{} alone: {}", c.path.text(), c.position, if ok { "also makes a produce b's token" } else { "does not change the token" });
                }
            }
            if let Some(x) = r.runs.iter().rev().find(|x| x.kind == "reverse") {
                let _ = writeln!(
                    o,
                    "reverse check, a's values there patched into b: {}",
                    if x.flipped == Some(true) { "b produces a's token".to_string() } else { candle_trace_compare::report::clean(&x.outcome) }
                );
            }
            if r.candidates.len() > 1 && r.flip.as_ref().is_some_and(|f| f.a_margin.min(f.b_margin) < 0.01) {
                let _ = writeln!(o, "note: the flipped token won by a margin under 0.01, so a near tie: any of several differences may suffice alone; this set is one that does");
            }
        }
        CausalVerdict::NotFound => {
            let _ = writeln!(o, "\nno set found: patching the entry points did not reproduce b's token {step}");
        }
        _ => {
            if let Some(d) = r.logits_max_abs_diff {
                let _ = writeln!(o, "  final logits unpatched: max |a-b| {d:.3e} (largest over the steps)");
            }
            if r.candidates.is_empty() {
                let _ = writeln!(o, "\nno entry point up to token {step}: the runs' numbers agree there");
            } else {
                let _ = writeln!(o, "\nentry points patched alone, closest to b first: how far each moves a's final logits, and how far a then remains from b:");
            }
            for x in r.ranking.iter().take(10) {
                let _ = writeln!(o, "  moved {:.3e}, then {:.3e} from b: {}", x.moved, x.remaining, describe(r, x.candidate));
            }
            if r.ranking.len() > 10 {
                let _ = writeln!(o, "  … {} more", r.ranking.len() - 10);
            }
        }
    }
}
