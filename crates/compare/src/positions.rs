//! The positions section of a report ([`crate::bisect::Report::positions`]): when one run's
//! prompt continues the other's output, each position one run decoded step by step (KV cache)
//! and the other prefilled, rendered for the terminal, markdown and HTML alike.

use crate::bisect::PositionCompare;
use crate::text::bound;
use crate::untrusted::Out;
use std::fmt::Write;

/// The section's title.
pub const TITLE: &str = "Positions one run decoded step by step and the other prefilled (row 0)";

fn diff(d: Option<f64>) -> String {
    match d {
        None => "not compared".into(),
        Some(0.0) => "identical".into(),
        Some(x) => bound(x, false),
    }
}

fn next(a: Option<u32>, b: Option<u32>) -> String {
    match (a, b) {
        (Some(x), Some(y)) if x == y => format!("{x} (both)"),
        (Some(x), Some(y)) => format!("a {x}, b {y}: DIFFER"),
        (Some(x), None) => format!("a {x}"),
        (None, Some(y)) => format!("b {y}"),
        (None, None) => String::new(),
    }
}

/// The section for `out`; empty when `ps` is.
pub fn render(ps: &[PositionCompare], out: Out) -> String {
    let mut o = String::new();
    if ps.is_empty() {
        return o;
    }
    let head = ["position", "a computed it in", "b computed it in", "deepest layer both recorded", "max |a-b| there", "next token predicted"];
    match out {
        Out::Text => {
            let _ = writeln!(o, "\n{}:", TITLE.to_lowercase());
            let _ = writeln!(o, "  {:>8}  {:<24} {:<24} {:<12} {:<16} next token", head[0], "a", "b", "layer", "max |a-b|");
            for p in ps {
                let _ = writeln!(o, "  {:>8}  {:<24} {:<24} {:<12} {:<16} {}", p.position, p.a_pass.text(), p.b_pass.text(), p.layer.text(), diff(p.max_abs_diff), next(p.a_next, p.b_next));
            }
        }
        Out::Markdown => {
            let _ = writeln!(o, "**{TITLE}:**\n\n| {} |\n|---|---|---|---|---|---|", head.join(" | ").replace("|a-b|", "\\|a-b\\|"));
            for p in ps {
                let _ = writeln!(o, "| {} | {} | {} | {} | {} | {} |", p.position, p.a_pass.cell(), p.b_pass.cell(), p.layer.cell(), diff(p.max_abs_diff), next(p.a_next, p.b_next));
            }
            o.push('\n');
        }
        Out::Html => {
            let _ = writeln!(o, "<h2>{TITLE}</h2>\n<table><tr>{}</tr>", head.iter().map(|h| format!("<th>{h}</th>")).collect::<String>());
            for p in ps {
                let _ = writeln!(
                    o,
                    "<tr><td>{}</td><td>{}</td><td>{}</td><td><code>{}</code></td><td>{}</td><td>{}</td></tr>",
                    p.position,
                    p.a_pass.html(),
                    p.b_pass.html(),
                    p.layer.html(),
                    crate::text::esc(&diff(p.max_abs_diff)),
                    next(p.a_next, p.b_next)
                );
            }
            let _ = writeln!(o, "</table>");
        }
    }
    o
}
