//! `trace report A B -o report.html`: the bisect of two traces as one self-contained HTML page
//! (inline CSS and SVG, no script, nothing loaded from the network): a heatmap of the
//! difference by layer and position with where it entered and the flip marked
//! ([`heat::heatmap`]), a per-layer chart of the largest difference along the run
//! ([`chart::chart`]), both runs' generated tokens with the flip marked, and every other
//! section of the report.

pub mod chart;
pub mod heat;

use crate::bisect::{Heat, LayerPoint, Report};
use crate::nonfinite::describe;
use crate::report::{bound, g, Out};
use std::fmt::Write;

pub use crate::text::esc;

/// One run's generated tokens as a strip: `(text, token id)` per step; the flip step marked.
fn strip(tokens: &[(String, Option<u32>)], flip: Option<u32>) -> String {
    if !tokens.is_empty() && tokens.iter().all(|t| t.1.is_none()) {
        return format!(r#"<div class="strip">({} tokens; ids and texts redacted by trace redact)</div>"#, tokens.len());
    }
    let mut o = String::from(r#"<div class="strip">"#);
    for (i, (text, id)) in tokens.iter().enumerate() {
        let id = id.map_or_else(|| "redacted".to_string(), |id| id.to_string());
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
table{border-collapse:collapse;max-width:100%}td,th{border:1px solid #ccc;padding:.2em .5em;text-align:left;vertical-align:top;overflow-wrap:break-word}table.wide{table-layout:fixed;width:100%}code{background:#f4f4f4;padding:0 .2em}\
pre{white-space:pre-wrap;overflow-wrap:anywhere;background:#f4f4f4;padding:.5em}svg{max-width:100%;height:auto}.title{font-size:11px;fill:#333;text-anchor:middle}\
.mark{fill:none}.mark.root{stroke:#000;stroke-width:2}.mark.entry{stroke:#1565c0;stroke-width:2;stroke-dasharray:3 2}.mark.flip{stroke:#c33;stroke-width:2}.flipnote{font-size:10px;fill:#c33;text-anchor:end}.pt.root{fill:none;stroke:#000;stroke-width:2}\
.axis{stroke:#444}.grid{stroke:#eee}.line{fill:none;stroke:#4a7ab5;stroke-width:1.5}.pt{fill:#4a7ab5}.pt.zero{fill:#fff;stroke:#4a7ab5}.pt.nonfinite{fill:#c33}\
.tick,.lab{font-size:10px;fill:#555}.tick{text-anchor:end}.strip{font-family:monospace;white-space:pre-wrap;line-height:1.9}\
.tok{border-bottom:1px solid #ddd;margin-right:1px}.tok.flip{background:#fdd;border-bottom:2px solid #c33;font-weight:bold}.tok.after{color:#999}";

/// What the page draws beside the report.
#[derive(Clone, Debug, Default)]
pub struct Views {
    /// The largest difference per layer along the whole run ([`crate::bisect::profile`]).
    pub points: Vec<LayerPoint>,
    /// One row by layer and position ([`crate::bisect::heat`]).
    pub heat: Heat,
    /// Run a's generated tokens, `(text, id)` per step, in the heatmap's row ([`tokens`]).
    pub a_tokens: Vec<(String, Option<u32>)>,
    /// Run b's, in the row holding the same request.
    pub b_tokens: Vec<(String, Option<u32>)>,
    /// The commands that record both runs again ([`crate::report::record_command`]).
    pub commands: Vec<String>,
}

/// The whole page. Every section of the [`Report`] is rendered (see the report tests),
/// strings from the traces escaped through [`crate::untrusted::Untrusted::html`].
pub fn page(r: &Report, v: &Views) -> String {
    let mut o = String::new();
    let _ = write!(o, "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>candle-trace: {} vs {}</title><style>{STYLE}</style></head><body>\n", r.a.path.html(), r.b.path.html());
    let _ = writeln!(o, "<h1>candle-trace: <code>{}</code> vs <code>{}</code>: {}</h1>", r.a.path.html(), r.b.path.html(), r.verdict);
    let _ = writeln!(o, "<p>{}.</p>", esc(&crate::report::capitalized(&crate::report::compared_line(r))));
    traces(&mut o, r);
    let _ = writeln!(o, "<h2>Where the difference entered and how it spread (run a's row {})</h2>", v.heat.row);
    let _ = writeln!(
        o,
        "<p>Rows are layers, columns token positions; the colour is the largest difference of the layer's ops there (log scale, set by the positions before the flip). Black box: the root cause; dashed blue box: the earliest difference, which died out; red line: the first flipped token (after it the runs read different tokens: faded).</p>\n{}",
        heat::heatmap(&v.heat, r)
    );
    let root_layer = r.first_divergence.as_ref().map(|d| crate::bisect::layer_group(&d.path));
    let _ = writeln!(o, "<h2>Largest difference per layer, along the whole run (log scale)</h2>\n{}", chart::chart(&v.points, root_layer.as_deref()));
    if crate::report::rows_worth_listing(r) {
        let _ = writeln!(o, "<h2>Per request</h2>\n<ul>");
        for x in &r.rows {
            let _ = writeln!(o, "<li>{}</li>", crate::report::row_line(x, Out::Html));
        }
        let _ = writeln!(o, "</ul>");
    }
    generated(&mut o, r, &v.a_tokens, &v.b_tokens);
    o.push_str(&crate::positions::render(&r.positions, Out::Html));
    let _ = writeln!(o, "<h2>Where the numbers parted</h2>");
    root(&mut o, r);
    spread(&mut o, r);
    if let Some(nf) = &r.nonfinite {
        let _ = writeln!(o, "<h2>First non-finite value</h2>\n<ul><li>a: {}</li><li>b: {}</li></ul>", describe(nf.a.as_ref()).html(), describe(nf.b.as_ref()).html());
    }
    let _ = writeln!(o, "<h2>Settings and environment that differ</h2>");
    if r.env_diff.is_empty() {
        let _ = writeln!(o, "<p>None.</p>");
    } else {
        let _ = writeln!(o, "<table class=\"wide\"><tr><th>setting</th><th>a</th><th>b</th></tr>");
        for e in &r.env_diff {
            let _ = writeln!(o, "<tr><td><code>{}</code></td><td>{}</td><td>{}</td></tr>", e.key.html(), e.a.html(), e.b.html());
        }
        let _ = writeln!(o, "</table>");
    }
    let _ = writeln!(o, "<h2>Model and environment</h2>\n<table class=\"wide\"><tr><th></th><th>a</th><th>b</th></tr>");
    for e in &r.environment {
        let _ = writeln!(o, "<tr><td>{}</td><td>{}</td><td>{}</td></tr>", e.key.html(), e.a.html(), e.b.html());
    }
    let _ = writeln!(o, "</table>");
    for n in &r.notes {
        let _ = writeln!(o, "<p class=\"note\">Note: {}</p>", n.html());
    }
    if !v.commands.is_empty() {
        // Each command escaped alone: the escaping shows control characters, and the line
        // breaks between the commands are real ones (a shell reads them as two commands).
        let _ = writeln!(o, "<h2>To reproduce</h2>\n<pre>{}</pre>", v.commands.iter().map(|c| esc(c)).collect::<Vec<_>>().join("\n"));
    }
    o.push_str("</body></html>\n");
    o
}

/// The two traces: file, op records, decode steps, whether truncated.
fn traces(o: &mut String, r: &Report) {
    let _ = writeln!(o, "<table><tr><th></th><th>trace</th><th>op records</th><th>tokens</th></tr>");
    for (name, s) in [("a", &r.a), ("b", &r.b)] {
        let _ = writeln!(o, "<tr><td>{name}</td><td><code>{}</code>{}</td><td>{}</td><td>{}</td></tr>", s.path.html(), if s.truncated { " (truncated)" } else { "" }, s.op_records, s.tokens);
    }
    let _ = writeln!(o, "</table>");
}

/// The generated tokens: the flip, both runs' strips, the sampler's verdict, inputs that differ.
fn generated(o: &mut String, r: &Report, a_tokens: &[(String, Option<u32>)], b_tokens: &[(String, Option<u32>)]) {
    let flip = r.first_token_divergence.as_ref().map(|t| t.step);
    let _ = writeln!(o, "<h2>Generated tokens</h2>");
    if let Some(t) = r.first_token_divergence.as_ref().filter(|t| t.ids_redacted) {
        let _ = writeln!(o, "<p>Token {} flips ({}).</p>", t.step, crate::report::redacted_flip(t, |u| format!("<code>{}</code>", u.html())));
    } else if let Some(t) = &r.first_token_divergence {
        let _ = writeln!(
            o,
            "<p>Token {} flips: a {} <code>{}</code> (margin {}), b {} <code>{}</code> (margin {}).</p>",
            t.step,
            crate::report::id(t.a_token),
            t.a_text.html(),
            g(t.a_margin as f64),
            crate::report::id(t.b_token),
            t.b_text.html(),
            g(t.b_margin as f64)
        );
    } else {
        let _ = writeln!(o, "<p>No generated token differs ({} compared{}).</p>", r.tokens.compared(), esc(&crate::report::last_not_compared(r)));
    }
    let _ = writeln!(o, "<p>a</p>{}\n<p>b</p>{}", strip(a_tokens, flip), strip(b_tokens, flip));
    if let Some(v) = &r.sampling {
        let _ = writeln!(o, "<p>Sampling: {}</p>", esc(&v.explanation));
    }
    if let Some(i) = &r.inputs_differ {
        let _ = writeln!(o, "<p>Inputs differ: {}</p>", esc(&i.explanation));
    }
}

/// The root cause (or the fork in the op graphs) and the differences absorbed before it.
fn root(o: &mut String, r: &Report) {
    if let Some(d) = &r.first_divergence {
        let _ = writeln!(
            o,
            "<p>Root cause: <code>{}</code> ({}) at token position {}: {} (max |a-b| {}). Cause: {}. Remedy: {}.</p>",
            d.path.html(),
            d.op_label().html(),
            d.position,
            esc(&crate::report::matched_clause(r.level, d.class, str::to_string)),
            esc(&bound(d.max_abs_diff, d.below_resolution)),
            esc(&crate::report::cause(d.class, r.level)),
            crate::bisect::remedy(d.class, &r.env_diff, r.both_invariant).html()
        );
        if let Some(x) = r.absorbed.first() {
            let _ = writeln!(
                o,
                "<p>It is the first difference that reached its layer's output (the residual stream); the earliest, <code>{}</code> at position {}, died out within its layer.</p>",
                x.path.html(),
                x.position
            );
        }
        let _ = writeln!(o, "<ul>");
        for (name, e) in [("a", &d.a), ("b", &d.b)] {
            let _ = writeln!(o, "<li>{name} ran it in {}: {} {:?}, sum {} abs-max {}</li>", e.execution.html(), e.dtype.html(), e.shape, g(e.sum), g(e.abs_max));
        }
        let _ = writeln!(o, "</ul>");
        if let Some(e) = &d.elementwise {
            let _ = writeln!(o, "<p>{}</p>", esc(&crate::report::elementwise_line(e)));
        }
    } else if let Some(f) = &r.graph_fork {
        let _ = writeln!(
            o,
            "<p>The op graphs differ: <code>{}</code> at token position {} (row {}) was computed from {} in a and from {} in b; every input both runs share matched. Cause: a different code path (a kernel chosen by batch size, prompt length, dtype or device).</p>",
            f.path.html(),
            f.position,
            f.row,
            Out::Html.list(&f.a_inputs),
            Out::Html.list(&f.b_inputs)
        );
    } else {
        let _ = writeln!(o, "<p>{}</p>", if r.verdict == crate::bisect::Verdict::Identical { "Every compared op output is bit-identical." } else { "No op is blamed (see the notes)." });
    }
    if r.absorbed_count > 0 {
        let _ = writeln!(o, "<p>Before it, {} differences entered and died out within their layer (its output matched):</p>\n<ul>", r.absorbed_count);
        for x in &r.absorbed {
            let _ = writeln!(o, "<li><code>{}</code> ({}) at position {}, max |a-b| {}</li>", x.path.html(), x.op.html(), x.position, esc(&bound(x.max_abs_diff, x.below_resolution)));
        }
        let more = r.absorbed_count - r.absorbed.len().min(r.absorbed_count);
        if more > 0 {
            let _ = writeln!(o, "<li>… {more} more</li>");
        }
        let _ = writeln!(o, "</ul>");
    }
}

/// The causes by group, the growth table and the root's drift along positions.
fn spread(o: &mut String, r: &Report) {
    if !r.groups.is_empty() {
        let _ = writeln!(o, "<table><tr><th>roots</th><th>op</th><th>cause</th><th>remedy</th></tr>");
        for g in &r.groups {
            let _ = writeln!(o, "<tr><td>{}</td><td><code>{}</code> (first {})</td><td>{}</td><td>{}</td></tr>", g.count, g.kind.html(), g.first.html(), esc(&g.description), g.remedy.html());
        }
        let _ = writeln!(o, "</table>");
    }
    if let (false, Some(d)) = (r.growth.is_empty(), &r.first_divergence) {
        let _ =
            writeln!(o, "<h2>How the difference grew at position {}</h2>\n<table><tr><th>layer</th><th>ops differing</th><th>max |a-b|</th><th>relative</th><th>dumped values</th></tr>", d.position);
        for l in &r.growth {
            let m = if l.identical { "identical".to_string() } else { esc(&bound(l.max_abs_diff, false)) };
            let exact = match (l.exact_max_abs_diff, l.max_ulp) {
                (Some(x), Some(u)) => format!("max |a-b| {}, {u} ULP", g(x)),
                (Some(x), None) => format!("max |a-b| {}", g(x)),
                _ => String::new(),
            };
            let _ = writeln!(o, "<tr><td><code>{}</code></td><td>{}/{}</td><td>{m}</td><td>{}</td><td>{exact}</td></tr>", l.layer.html(), l.ops_differing, l.ops_compared, g(l.max_rel_diff));
        }
        let _ = writeln!(o, "</table>");
    }
    if let (false, Some(d)) = (r.drift.is_empty(), &r.first_divergence) {
        let follows = if r.drift_grows { " It follows position." } else { "" };
        let _ = writeln!(
            o,
            "<h2><code>{}</code> by position (row {})</h2>\n<p>* = {} there.{follows}</p>\n<table><tr><th>position</th><th>max |a-b|</th></tr>",
            d.path.html(),
            d.row,
            crate::report::star_means(r.level)
        );
        for x in &r.drift {
            let m = if x.max_abs_diff == 0.0 { "identical".to_string() } else { esc(&bound(x.max_abs_diff, false)) };
            let _ = writeln!(o, "<tr><td>{}{}</td><td>{m}</td></tr>", x.position, if x.inputs_matched { "*" } else { "" });
        }
        let _ = writeln!(o, "</table>");
    }
}

/// Batch row `row`'s generated tokens of a trace: (text, id) per step; the id is `None` where the
/// trace was redacted (its choices hold no top-5).
pub fn tokens(t: &candle_trace_format::format::Trace, row: u32) -> Vec<(String, Option<u32>)> {
    t.items
        .iter()
        .filter_map(|i| match i {
            candle_trace_format::record::Item::Token(e) => e.rows.iter().find(|c| c.row == row).map(|c| (c.text.clone(), (!c.top.is_empty()).then_some(c.token))),
            _ => None,
        })
        .collect()
}
