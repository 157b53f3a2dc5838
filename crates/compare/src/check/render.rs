//! The check table as text and as a GitHub-flavoured markdown issue body.

use super::{shell_quote, CheckReport, Row};

fn verdict_words(r: &Row) -> String {
    match r.verdict.as_str() {
        "identical" => "identical".into(),
        "token_flip" => format!("token {} flips", r.first_flip.map_or("?".into(), |s| s.to_string())),
        "embedding_differs" => "embedding differs".into(),
        "numerics" if r.encoder => "numbers differ, embedding same".into(),
        "numerics" => "numbers differ, tokens same".into(),
        other => other.into(),
    }
}

/// Whether the check ran an encoder (its rows' outputs are embeddings).
fn encoder(r: &CheckReport) -> bool {
    r.rows.iter().any(|x| x.encoder)
}

pub(super) fn diff_words(r: &Row) -> String {
    match r.logits_max_abs_diff {
        Some(d) if d.is_nan() => "NaN or ±Inf".into(),
        // An encoder's embeddings are recorded whole: the figure is exact, not a lower bound.
        Some(d) if d > 0.0 && r.encoder => crate::text::g(d),
        Some(d) if d > 0.0 => format!("≥ {}", crate::text::g(d)),
        Some(_) if r.verdict == "identical" => "0".into(),
        // An encoder's embedding the same bits: nothing below resolution about it.
        Some(_) if r.encoder && r.verdict == "numerics" => "0".into(),
        Some(_) => "below resolution".into(),
        None => "-".into(),
    }
}

/// The table as text.
pub fn text(r: &CheckReport) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    if r.requests.is_empty() {
        let _ = writeln!(o, "check: {:?}", crate::text::clean(&r.prompt));
    } else {
        let _ = writeln!(o, "check: {} requests in one batch, the first {:?} (outputs count every request's)", r.requests.len(), crate::text::clean(&r.prompt));
    }
    let _ = writeln!(o, "baseline output: {}\n", r.baseline_text.quoted());
    let rows: Vec<[String; 7]> = r
        .rows
        .iter()
        .map(|x| {
            [
                format!("{} {}", x.knob, if x.value == "-" { String::new() } else { x.value.clone() }).trim().to_string(),
                x.runs.to_string(),
                x.unique_outputs.to_string(),
                verdict_words(x),
                x.root.as_ref().map_or_else(|| "-".into(), |r| r.text()),
                x.class.and_then(|c| serde_json::to_value(c).ok()).and_then(|v| v.as_str().map(String::from)).unwrap_or_else(|| "-".into()),
                diff_words(x),
            ]
        })
        .collect();
    let head = ["condition", "runs", "outputs", "vs baseline", "first root", "class", if encoder(r) { "embedding max |Δ|" } else { "logits max |Δ|" }];
    let mut w = head.map(|h| h.chars().count());
    for row in &rows {
        for (i, c) in row.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |cells: &[String]| -> String {
        let s: Vec<String> = cells.iter().enumerate().map(|(i, c)| format!("{c}{}", " ".repeat(w[i] - c.chars().count()))).collect();
        s.join("  ").trim_end().to_string()
    };
    let _ = writeln!(o, "{}", line(&head.map(String::from)));
    for row in &rows {
        let _ = writeln!(o, "{}", line(row));
    }
    let failing: Vec<&Row> = r.rows.iter().filter(|x| x.bisect.is_some()).collect();
    if !failing.is_empty() {
        let _ = writeln!(o, "\nto see why:");
        for x in failing {
            let _ = writeln!(o, "  {}", x.bisect.as_deref().unwrap_or(""));
        }
    }
    for m in &r.missing {
        let _ = writeln!(o, "missing: {m}");
    }
    let _ = writeln!(o, "\n{}", distinct_line(r));
    let _ = writeln!(
        o,
        "\n{}",
        match (r.identical, r.missing.is_empty()) {
            (true, true) => "every run matched the baseline bit for bit",
            (true, false) => "every run present matched the baseline bit for bit; some runs are missing",
            _ => "some runs differ from the baseline",
        }
    );
    o
}

/// The table as a GitHub-flavoured markdown issue body.
pub fn markdown(r: &CheckReport) -> String {
    use std::fmt::Write;
    let cell = crate::text::cell;
    let mut o = String::new();
    let _ = writeln!(o, "### candle-trace check: {}\n", if r.identical { "every run identical" } else { "runs differ" });
    let batch = if r.requests.is_empty() { String::new() } else { format!(" (the first of {} requests in one batch; outputs count every request's)", r.requests.len()) };
    let _ = writeln!(o, "Prompt: {}{batch}\n\nBaseline output: {}\n", cell(&r.prompt), r.baseline_text.cell());
    let _ = writeln!(o, "| condition | runs | outputs | vs baseline | first root | class | {} max \\|Δ\\| |\n|---|---|---|---|---|---|---|", if encoder(r) { "embedding" } else { "logits" });
    for x in &r.rows {
        let _ = writeln!(
            o,
            "| {} {} | {} | {} | {} | {} | {} | {} |",
            cell(&x.knob),
            if x.value == "-" { String::new() } else { cell(&x.value) },
            x.runs,
            x.unique_outputs,
            verdict_words(x),
            x.root.as_ref().map_or("-".into(), |s| format!("`{}`", s.cell())),
            x.class.map_or("-".into(), |c| c.describe().to_string()),
            diff_words(x)
        );
    }
    let _ = writeln!(
        o,
        "\n*outputs*: distinct {} among the condition's runs (1: every run gave the same); *vs baseline*: the first run that differs from the baseline, bit for bit.",
        if encoder(r) { "pooled embeddings" } else { "generated token sequences" }
    );
    let _ = writeln!(o, "\n{}", distinct_line(r).replacen("distinct", "Distinct", 1));
    if !r.environment.is_empty() {
        let _ = writeln!(o, "\n| baseline's model and environment | |\n|---|---|");
        for (k, v) in &r.environment {
            let _ = writeln!(o, "| {} | {} |", cell(k), v.cell());
        }
    }
    let failing: Vec<&Row> = r.rows.iter().filter(|x| x.bisect.is_some()).collect();
    if !failing.is_empty() {
        let _ = writeln!(o, "\n<details><summary>commands that show each difference</summary>\n\n```sh");
        for x in failing {
            if let Some(t) = &x.trace {
                let _ = writeln!(o, "trace bisect {} {}", shell_quote(&format!("{}/baseline.trace", r.folder)), shell_quote(&format!("{}/{t}", r.folder)));
            }
        }
        let _ = writeln!(o, "```\n\n</details>");
    }
    if !r.missing.is_empty() {
        let _ = writeln!(o, "\nMissing: {}", r.missing.iter().map(|m| cell(m)).collect::<Vec<_>>().join(", "));
    }
    o
}

/// "distinct outputs of the request over all N runs: K".
fn distinct_line(r: &CheckReport) -> String {
    let whose = if r.requests.is_empty() { "the request" } else { "the requests" };
    format!("distinct outputs of {whose} over all {} runs: {}", r.runs, r.distinct_outputs)
}
