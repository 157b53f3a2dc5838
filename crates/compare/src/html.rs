//! `trace report A B -o report.html`: the bisect of two traces as one self-contained HTML page
//! (inline CSS and SVG, no script, nothing loaded from the network): a per-layer chart of the
//! largest difference along the run (log scale), both runs' generated tokens with the flip
//! marked, the root causes with their classes, and the settings and environment that differ.

use crate::bisect::{LayerPoint, Report};
use std::fmt::Write;

/// Escapes text for HTML content and attribute values.
pub fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in crate::report::clean(s).chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

/// Chart geometry (SVG user units).
const W: f64 = 760.0;
const H: f64 = 260.0;
const LEFT: f64 = 60.0;
const BOTTOM: f64 = 40.0;
const TOP: f64 = 16.0;

/// The per-layer chart: one `<circle class="pt">` per layer, its height log10 of the layer's
/// largest difference; layers with no difference sit on the axis (class `pt zero`), those with
/// a NaN/±Inf on one side only at the top (class `pt nonfinite`).
pub fn chart(points: &[LayerPoint]) -> String {
    let finite: Vec<f64> = points.iter().map(|p| p.max_abs_diff).filter(|d| d.is_finite() && *d > 0.0).collect();
    let (lo, hi) = match (finite.iter().copied().reduce(f64::min), finite.iter().copied().reduce(f64::max)) {
        (Some(a), Some(b)) => (a.log10().floor(), b.log10().ceil().max(a.log10().floor() + 1.0)),
        _ => (-8.0, 0.0),
    };
    let plot_h = H - TOP - BOTTOM;
    let y_of = |d: f64| -> f64 {
        if d.is_nan() {
            TOP
        } else if d <= 0.0 {
            H - BOTTOM
        } else {
            H - BOTTOM - (d.log10() - lo) / (hi - lo) * plot_h
        }
    };
    let n = points.len().max(1) as f64;
    let x_of = |i: usize| LEFT + (i as f64 + 0.5) * (W - LEFT - 10.0) / n;
    let mut o = String::new();
    let _ = write!(o, r#"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" aria-label="largest difference per layer, log scale">"#);
    let _ = write!(o, r#"<line x1="{LEFT}" y1="{}" x2="{W}" y2="{}" class="axis"/><line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{}" class="axis"/>"#, H - BOTTOM, H - BOTTOM, H - BOTTOM);
    let mut e = lo as i32;
    while e as f64 <= hi {
        let y = y_of(10f64.powi(e));
        let _ = write!(o, r#"<line x1="{LEFT}" y1="{y:.1}" x2="{W}" y2="{y:.1}" class="grid"/><text x="{}" y="{:.1}" class="tick">1e{e}</text>"#, LEFT - 6.0, y + 4.0);
        e += 1;
    }
    let mut path = String::new();
    for (i, p) in points.iter().enumerate() {
        let (x, y) = (x_of(i), y_of(p.max_abs_diff));
        let _ = write!(path, "{}{x:.1},{y:.1}", if i == 0 { "M" } else { " L" });
    }
    let _ = write!(o, r#"<path d="{path}" class="line"/>"#);
    for (i, p) in points.iter().enumerate() {
        let (x, y) = (x_of(i), y_of(p.max_abs_diff));
        let class = if p.max_abs_diff.is_nan() {
            "pt nonfinite"
        } else if p.differing == 0 {
            "pt zero"
        } else {
            "pt"
        };
        let what = if p.max_abs_diff.is_nan() {
            "NaN/Inf on one side".to_string()
        } else if p.differing == 0 {
            "identical".to_string()
        } else {
            format!("max |a-b| ≥ {}", crate::report::g(p.max_abs_diff))
        };
        let _ = write!(
            o,
            r#"<circle cx="{x:.1}" cy="{y:.1}" r="4" class="{class}" data-layer="{}"><title>{}: {what} ({}/{} differ)</title></circle>"#,
            esc(&p.layer),
            esc(&p.layer),
            p.differing,
            p.compared
        );
        if points.len() <= 40 || i % (points.len() / 20).max(1) == 0 {
            let _ = write!(o, r#"<text x="{x:.1}" y="{:.1}" class="lab" transform="rotate(45 {x:.1} {:.1})">{}</text>"#, H - BOTTOM + 12.0, H - BOTTOM + 12.0, esc(&p.layer));
        }
    }
    o.push_str("</svg>");
    o
}

/// One run's generated tokens as a strip: `(text, token id)` per step; the flip step marked.
fn strip(tokens: &[(String, u32)], flip: Option<u32>) -> String {
    let mut o = String::from(r#"<div class="strip">"#);
    for (i, (text, id)) in tokens.iter().enumerate() {
        let class = match flip {
            Some(f) if i as u32 == f => "tok flip",
            Some(f) if i as u32 > f => "tok after",
            _ => "tok",
        };
        let _ = write!(o, r#"<span class="{class}" title="token {i}: id {id}">{}</span>"#, esc(&text.replace('\n', "⏎")));
    }
    o.push_str("</div>");
    o
}

const STYLE: &str = "body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:64em;color:#222}h1{font-size:1.4em}h2{font-size:1.1em;margin-top:1.6em}\
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2em .5em;text-align:left;vertical-align:top}code{background:#f4f4f4;padding:0 .2em}\
.axis{stroke:#444}.grid{stroke:#eee}.line{fill:none;stroke:#4a7ab5;stroke-width:1.5}.pt{fill:#4a7ab5}.pt.zero{fill:#fff;stroke:#4a7ab5}.pt.nonfinite{fill:#c33}\
.tick,.lab{font-size:10px;fill:#555}.tick{text-anchor:end}.strip{font-family:monospace;white-space:pre-wrap;line-height:1.9}\
.tok{border-bottom:1px solid #ddd;margin-right:1px}.tok.flip{background:#fdd;border-bottom:2px solid #c33;font-weight:bold}.tok.after{color:#999}";

/// The whole page. `a_tokens` and `b_tokens` are each run's generated tokens (row 0).
pub fn page(r: &Report, points: &[LayerPoint], a_tokens: &[(String, u32)], b_tokens: &[(String, u32)]) -> String {
    let mut o = String::new();
    let _ = write!(o, "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>candle-trace: {} vs {}</title><style>{STYLE}</style></head><body>\n", esc(&r.a.path), esc(&r.b.path));
    let _ = writeln!(o, "<h1>candle-trace: <code>{}</code> vs <code>{}</code>: {}</h1>", esc(&r.a.path), esc(&r.b.path), r.verdict);
    let _ = writeln!(o, "<h2>Largest difference per layer, along the whole run (log scale)</h2>\n{}", chart(points));
    let flip = r.first_token_divergence.as_ref().map(|t| t.step);
    let _ = writeln!(o, "<h2>Generated tokens</h2>");
    if let Some(t) = &r.first_token_divergence {
        let _ = writeln!(
            o,
            "<p>Token {} flips: a {} <code>{}</code> (margin {}), b {} <code>{}</code> (margin {}).</p>",
            t.step,
            t.a_token,
            esc(&t.a_text),
            crate::report::g(t.a_margin as f64),
            t.b_token,
            esc(&t.b_text),
            crate::report::g(t.b_margin as f64)
        );
    } else {
        let _ = writeln!(o, "<p>No generated token differs.</p>");
    }
    let _ = writeln!(o, "<p>a</p>{}\n<p>b</p>{}", strip(a_tokens, flip), strip(b_tokens, flip));
    let _ = writeln!(o, "<h2>Where the numbers parted</h2>");
    match &r.first_divergence {
        Some(d) => {
            let _ = writeln!(
                o,
                "<p>Root cause: <code>{}</code> ({}) at token position {}: its inputs matched bit for bit, its output differs (max |a-b| ≥ {}). Cause: {}. Remedy: {}.</p>",
                esc(&d.path),
                esc(&d.op),
                d.position,
                crate::report::g(d.max_abs_diff),
                esc(d.class.describe()),
                esc(d.class.remedy())
            );
        }
        None => {
            let _ = writeln!(o, "<p>{}</p>", if r.verdict == crate::bisect::Verdict::Identical { "Every compared op output is bit-identical." } else { "No op is blamed (see the notes)." });
        }
    }
    if !r.groups.is_empty() {
        let _ = writeln!(o, "<table><tr><th>roots</th><th>op</th><th>cause</th><th>remedy</th></tr>");
        for g in &r.groups {
            let _ = writeln!(o, "<tr><td>{}</td><td><code>{}</code></td><td>{}</td><td>{}</td></tr>", g.count, esc(&g.kind), esc(&g.description), esc(&g.remedy));
        }
        let _ = writeln!(o, "</table>");
    }
    let _ = writeln!(o, "<h2>Settings and environment that differ</h2>");
    if r.env_diff.is_empty() {
        let _ = writeln!(o, "<p>None.</p>");
    } else {
        let _ = writeln!(o, "<table><tr><th>setting</th><th>a</th><th>b</th></tr>");
        for e in &r.env_diff {
            let _ = writeln!(o, "<tr><td><code>{}</code></td><td>{}</td><td>{}</td></tr>", esc(&e.key), esc(&e.a), esc(&e.b));
        }
        let _ = writeln!(o, "</table>");
    }
    for n in &r.notes {
        let _ = writeln!(o, "<p class=\"note\">{}</p>", esc(n));
    }
    o.push_str("</body></html>\n");
    o
}

/// Row 0's generated tokens of a trace: (text, id) per step.
pub fn tokens(t: &candle_trace_format::format::Trace) -> Vec<(String, u32)> {
    t.items
        .iter()
        .filter_map(|i| match i {
            candle_trace_format::record::Item::Token(e) => e.rows.first().map(|c| (c.text.clone(), c.token)),
            _ => None,
        })
        .collect()
}
