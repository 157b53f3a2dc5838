//! Renders a bisect [`Report`] for people: plain text for the terminal, markdown to paste into a
//! GitHub issue. (JSON is the report serialised with serde; [`crate::html`] renders the page.)
//! Every field of the report is a section of all four; `crates/compare/tests/sections.rs` pins
//! that, and that every string from a trace comes out escaped.

use crate::bisect::Report;
pub use crate::text::{bound, cell, clean, g};
pub use crate::untrusted::Out;
use crate::untrusted::Untrusted;
use std::fmt::Write;

/// One line of elementwise metrics (from `--dump` values).
pub fn elementwise_line(e: &crate::bisect::Elementwise) -> String {
    let ulp = match e.max_ulp {
        Some(u) => {
            let h: Vec<String> = e.ulp_histogram.iter().map(|(b, n)| format!("{b}:{n}")).collect();
            format!(", max {u} ULP [ULP histogram {}]", h.join(" "))
        }
        None => String::new(),
    };
    format!(
        "elementwise (dumped values): {} of {} elements differ, max |a-b| {} (relative {}){ulp}; worst element {}: {} vs {}",
        e.differing,
        e.count,
        g(e.max_abs_diff),
        g(e.max_rel_diff),
        e.worst_index,
        e.a_worst,
        e.b_worst
    )
}

/// True when the per-request answers say more than the rest of the report: several requests,
/// rows compared across batch positions or batch sizes (a request alone against the same one
/// in row 0 of a batch), or embeddings.
pub fn rows_worth_listing(r: &Report) -> bool {
    let batches_differ = r.env_diff.iter().any(|d| &*d.key == "run.batch");
    r.rows.len() > 1 || (batches_differ && !r.rows.is_empty()) || r.rows.iter().any(|x| x.embedding.is_some() || x.a_row != x.b_row)
}

/// One line per request: did its output change? Its strings escaped for `out`.
pub fn row_line(x: &crate::bisect::RowAnswer, out: Out) -> String {
    let rows = if x.a_row == x.b_row { format!("row {}", x.a_row) } else { format!("a row {} = b row {}", x.a_row, x.b_row) };
    let what = match (&x.embedding, x.first_flip) {
        (Some(e), _) if e.identical => format!("embedding identical ({} dims)", e.dims),
        (Some(e), _) if e.max_abs_diff.is_nan() => "embedding differs: one side holds NaN".into(),
        (Some(e), _) => {
            let cos = if e.cosine > 0.999_999 && e.cosine < 1.0 { format!("1 - {:.2e}", 1.0 - e.cosine) } else { format!("{:.10}", e.cosine) };
            format!("embedding differs: max |a-b| {}, cosine {cos}", g(e.max_abs_diff))
        }
        (None, Some(f)) => {
            let before = x.logits_max_abs_diff.iter().take(f as usize).copied().fold(0.0, f64::max);
            let logits = if before > 0.0 { format!("final logits max |a-b| >= {} before it", g(before)) } else { "final logits identical before it".into() };
            format!("generated token {f} differs (of {} compared); {logits}", x.tokens_compared)
        }
        (None, None) if x.tokens_compared > 0 => {
            let m = x.logits_max_abs_diff.iter().copied().fold(0.0, f64::max);
            if m > 0.0 {
                format!("all {} generated tokens identical; final logits max |a-b| >= {}", x.tokens_compared, g(m))
            } else {
                format!("all {} generated tokens identical, final logits identical", x.tokens_compared)
            }
        }
        // Redacted: no ids to compare token by token, but the logits are still compared.
        (None, None) if !x.logits_max_abs_diff.is_empty() => {
            let (m, n) = (x.logits_max_abs_diff.iter().copied().fold(0.0, f64::max), x.logits_max_abs_diff.len());
            let logits = if m > 0.0 { format!("final logits max |a-b| >= {} over {n} steps", g(m)) } else { format!("final logits identical over {n} steps") };
            format!("its tokens are not compared here (a redacted trace holds no ids; see generated tokens below); {logits}")
        }
        (None, None) => "no output compared".into(),
    };
    let root = x.first_root.as_ref().map(|p| format!("; first root {}", out.u(p))).unwrap_or_default();
    format!("{rows} {}: {what}{root}", out.q(&x.input))
}

/// The text report's lines on where the op graphs part.
fn fork_text(o: &mut String, g: &crate::bisect::GraphFork) {
    let _ = writeln!(o, "\nthe op graphs differ here: {} (token position {} of the row, row {}) was computed from different ops", g.path.text(), g.position, g.row);
    let _ = writeln!(o, "  a read {}; b read {}", Out::Text.list(&g.a_inputs), Out::Text.list(&g.b_inputs));
    let _ = writeln!(o, "  every input both runs share matched there");
    let _ = writeln!(o, "  cause: a different code path (a kernel chosen by batch size, prompt length, dtype or device); the ops only one run has are where the numbers parted");
}

/// The markdown report's paragraph on where the op graphs part (set only when no op is blamed).
fn fork_markdown(o: &mut String, g: Option<&crate::bisect::GraphFork>) {
    let Some(g) = g else { return };
    let q = |v: &[Untrusted]| v.iter().map(|p| format!("`{}`", p.cell())).collect::<Vec<_>>().join(", ");
    let _ = writeln!(
        o,
        "**The op graphs differ:** `{}` at token position {} was computed from {} in a and from {} in b; every input both runs share matched. Cause: a different code path (a kernel chosen by batch size, prompt length, dtype or device).\n",
        g.path.cell(),
        g.position,
        q(&g.a_inputs),
        q(&g.b_inputs)
    );
}

/// Plain-text report.
pub fn text(r: &Report) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "verdict: {}", r.verdict);
    let _ = writeln!(o, "a: {} ({} op records, {} tokens{})", r.a.path.text(), r.a.op_records, r.a.tokens, if r.a.truncated { ", truncated" } else { "" });
    let _ = writeln!(o, "b: {} ({} op records, {} tokens{})", r.b.path.text(), r.b.op_records, r.b.tokens, if r.b.truncated { ", truncated" } else { "" });
    if rows_worth_listing(r) {
        let _ = writeln!(o, "\nper request:");
        for x in &r.rows {
            let _ = writeln!(o, "  {}", row_line(x, Out::Text));
        }
        o.push('\n');
    }
    let _ = writeln!(o, "{}", compared_line(r));
    o.push_str(&crate::positions::render(&r.positions, Out::Text));
    text_tokens(&mut o, r);
    text_root(&mut o, r);
    text_spread(&mut o, r);
    if let Some(nf) = &r.nonfinite {
        let _ = writeln!(o, "\nfirst non-finite value differs:");
        let _ = writeln!(o, "  a: {}", crate::nonfinite::describe(nf.a.as_ref()).text());
        let _ = writeln!(o, "  b: {}", crate::nonfinite::describe(nf.b.as_ref()).text());
    }
    if r.env_diff.is_empty() {
        let _ = writeln!(o, "\nsettings and environment: identical");
    } else {
        let _ = writeln!(o, "\nsettings and environment that differ:");
        for e in &r.env_diff {
            let _ = writeln!(o, "  {}: {} -> {}", e.key.text(), e.a.text(), e.b.text());
        }
    }
    for n in &r.notes {
        let _ = writeln!(o, "note: {}", n.text());
    }
    o
}

/// For tokens compared through the input ids that fed them back (a redacted trace): `; token
/// N, the last, is not: it was never fed back` when a run made more tokens than were compared
/// (a flip there cannot be seen). Empty otherwise.
pub fn last_not_compared(r: &Report) -> String {
    let made = r.a.tokens.min(r.b.tokens) as u32;
    match r.tokens {
        // A continuation pairs tokens by position (`positions`): no "last token" to name.
        crate::bisect::TokenComparison::InputDigests { compared } if made > compared && r.positions.is_empty() => {
            format!("; token {compared}, the last, is not: a redacted trace never feeds its last token back, so a flip there cannot be seen")
        }
        _ => String::new(),
    }
}

/// What the by-position table's mark says at `level`: the root's inputs matched at that
/// position, or (coarser levels) the output recorded before it did.
pub fn star_means(level: candle_trace_format::site::Level) -> &'static str {
    match level {
        candle_trace_format::site::Level::Ops => "its inputs matched",
        _ => "the output recorded before it matched",
    }
}

/// What a root cause is at the compared level: at `ops`, the op whose inputs matched and whose
/// output differs; at a coarser level (`layers`, `logits`), the first recorded output that
/// differs after one that matched, the difference having entered somewhere between the two
/// (an `--level layers` root is a layer, not the op the layer ends with), unless `--perturb`
/// flipped a bit of that recorded output itself (`class`). `flag` renders a command-line flag
/// (`--level ops`) for the output at hand.
pub fn matched_clause(level: candle_trace_format::site::Level, class: crate::bisect::CauseClass, flag: impl Fn(&str) -> String) -> String {
    match level {
        candle_trace_format::site::Level::Ops => "its inputs matched bit for bit, its output differs".into(),
        l if class == crate::bisect::CauseClass::Perturbed => format!("at {} the output recorded before it matched bit for bit and this one differs: --perturb flipped a bit of this recorded output itself", flag(&format!("--level {}", l.as_str()))),
        l => format!(
            "at {} the output recorded before it matched bit for bit and this one differs: the difference entered between the two, in an op this level does not record (re-record both runs at {} to find the op)",
            flag(&format!("--level {}", l.as_str())),
            flag("--level ops")
        ),
    }
}

/// The root's cause class as a reader takes it ([`crate::bisect::CauseClass::describe`]); below
/// `--level ops` the root is a layer's output, so the class is said of an op inside the layer
/// ("the kernel depends on M" of a residual add misleads otherwise), but for a fault
/// `--perturb` injected into the recorded output itself.
pub fn cause(class: crate::bisect::CauseClass, level: candle_trace_format::site::Level) -> String {
    use candle_trace_format::site::Level;
    match level {
        _ if class == crate::bisect::CauseClass::Perturbed => class.describe().to_string(),
        Level::Ops => class.describe().to_string(),
        Level::Layers => format!("{}, in an op inside the layer (--level layers records each layer's output only)", class.describe()),
        Level::Logits => format!("{}, in an op before the logits (--level logits records the token ids and logits only)", class.describe()),
    }
}

/// Why no generated token was compared though both runs made some: the runs were fed different
/// sequences (their tokens answer different inputs), or a redacted trace made one token only
/// (compared through the input ids that fed it back, which never happens for a run's last).
pub fn tokens_not_compared(r: &Report) -> &'static str {
    match (&r.inputs_differ, r.tokens) {
        (Some(_), _) => "the runs were fed different token sequences, so their tokens answer different inputs",
        (None, crate::bisect::TokenComparison::InputDigests { .. }) => "the one token both runs generated at the same position is a run's last, and a redacted trace never feeds that back",
        (None, crate::bisect::TokenComparison::Ids { .. }) => "the runs' tokens answer different inputs",
    }
}

/// How much was compared: op outputs, and generated tokens (and how, for a redacted trace).
pub fn compared_line(r: &Report) -> String {
    let by = match r.tokens {
        crate::bisect::TokenComparison::Ids { .. } => "by id",
        crate::bisect::TokenComparison::InputDigests { .. } => "through the digests of the input ids that fed them back (a trace is redacted)",
    };
    let n = r.tokens.compared();
    let tokens = if r.a.tokens.max(r.b.tokens) > 0 { format!("; {}, {by}", crate::text::plural(n as u64, "generated token")) } else { String::new() };
    format!("compared {} (op, row, position) outputs, {} differ{tokens}", r.compared, r.differing)
}

/// `s` with its first letter upper-case.
pub fn capitalized(s: &str) -> String {
    let mut c = s.chars();
    c.next().map_or_else(String::new, |f| f.to_uppercase().chain(c).collect())
}

/// The two runs' choices at a flip found without token ids (a redacted trace).
pub fn redacted_flip(t: &crate::bisect::TokenDivergence, show: impl Fn(&Untrusted) -> String) -> String {
    let chose = |side: &str, id: Option<u32>, text: &Untrusted| id.map(|id| format!("; {side} chose {id} {}", show(text))).unwrap_or_default();
    let whose = match (t.a_token, t.b_token) {
        (Some(_), None) => " in b",
        (None, Some(_)) => " in a",
        _ => "",
    };
    format!(
        "token ids redacted{whose}: the first generated token the runs chose differently{}{}; margins a {}{}, b {}{}",
        chose("a", t.a_token, &t.a_text),
        chose("b", t.b_token, &t.b_text),
        g(t.a_margin as f64),
        if t.a_tie { " (exact tie)" } else { "" },
        g(t.b_margin as f64),
        if t.b_tie { " (exact tie)" } else { "" }
    )
}

/// A token id, or `?` when it was redacted.
pub fn id(t: Option<u32>) -> String {
    t.map_or_else(|| "?".into(), |t| t.to_string())
}

/// The first generated token that differs (or that none did), and inputs that differ.
fn text_tokens(o: &mut String, r: &Report) {
    match &r.first_token_divergence {
        Some(t) if t.ids_redacted => {
            let _ = writeln!(
                o,
                "
first generated token that differs: token {} (position {}, row {})",
                t.step, t.pos, t.row
            );
            let _ = writeln!(o, "  {}", redacted_flip(t, Untrusted::quoted));
        }
        Some(t) => {
            let pos = if t.pos == t.b_pos { format!("position {}", t.pos) } else { format!("positions {} and {}", t.pos, t.b_pos) };
            let _ = writeln!(o, "\nfirst generated token that differs: token {} ({pos}, row {})", t.step, t.row);
            let _ = writeln!(o, "  a: {} {}  margin {}{}", id(t.a_token), t.a_text.quoted(), g(t.a_margin as f64), if t.a_tie { " (exact tie)" } else { "" });
            let _ = writeln!(o, "  b: {} {}  margin {}{}", id(t.b_token), t.b_text.quoted(), g(t.b_margin as f64), if t.b_tie { " (exact tie)" } else { "" });
            let _ = writeln!(o, "  after the common text {}", t.common_text.quoted());
            if let Some(v) = &r.sampling {
                let _ = writeln!(o, "  sampling: {}", v.explanation);
            }
        }
        None if r.tokens.compared() > 0 => {
            let _ = writeln!(o, "\ngenerated tokens: identical ({} compared{})", r.tokens.compared(), last_not_compared(r));
        }
        None if r.a.tokens.min(r.b.tokens) > 0 => {
            let _ = writeln!(o, "\ngenerated tokens: not compared ({})", tokens_not_compared(r));
        }
        None => {}
    }
    if let Some(i) = &r.inputs_differ {
        let _ = writeln!(o, "\ninputs differ: {}", i.explanation);
    }
}

/// The root cause, or the fork in the op graph, and the differences absorbed before it.
fn text_root(o: &mut String, r: &Report) {
    if let Some(d) = &r.first_divergence {
        match r.absorbed.first() {
            // Earlier differences died out: this is the first that reached the residual stream.
            Some(x) => {
                let _ = writeln!(o, "\nthe first difference that reached its layer's output: {} ({})", d.path.text(), d.op_label().text());
                let _ = writeln!(o, "  (the earliest entered before it, at {} ({}) position {}, and died out within its layer)", x.path.text(), x.op.text(), x.position);
            }
            None => {
                let _ = writeln!(o, "\nthe numbers first parted here: {} ({})", d.path.text(), d.op_label().text());
            }
        }
        let layer = d.layer.map_or(String::new(), |l| format!("layer {l}, "));
        let row = if d.row == d.b_row { format!("row {}", d.row) } else { format!("row {} (b row {})", d.row, d.b_row) };
        let _ = writeln!(o, "  {layer}token position {} of the row, {row}; {}", d.position, matched_clause(r.level, d.class, str::to_string));
        if d.max_abs_diff.is_nan() {
            let _ = writeln!(o, "  max |a-b| {} (non-finite values: a {}, b {})", bound(f64::NAN, false), d.nonfinite.0, d.nonfinite.1);
        } else if d.below_resolution {
            let _ = writeln!(o, "  max |a-b| {}: samples, abs-max and sum match", bound(0.0, true));
        } else {
            let _ = writeln!(o, "  max |a-b| >= {} (relative {}), from samples and reductions", g(d.max_abs_diff), g(d.max_rel_diff));
        }
        let _ = writeln!(o, "  cause: {}", cause(d.class, r.level));
        for (name, e) in [("a", &d.a), ("b", &d.b)] {
            let _ = writeln!(o, "  {name} ran it in {}: {} {:?}, sum {} abs-max {}", e.execution.text(), e.dtype.text(), e.shape, g(e.sum), g(e.abs_max));
        }
        if let Some(e) = &d.elementwise {
            let _ = writeln!(o, "  {}", elementwise_line(e));
        }
    } else if let Some(g) = &r.graph_fork {
        fork_text(o, g);
    } else if r.verdict == crate::bisect::Verdict::Diverged && r.inputs_differ.is_none() {
        let _ = writeln!(o, "\nno op with matching inputs and a different output was found");
    }
    if r.absorbed_count > 0 {
        let _ = writeln!(o, "  before it, {} differences entered and died out within their layer (its output matched):", r.absorbed_count);
        for x in &r.absorbed {
            let _ = writeln!(o, "    {} ({}) at position {}, max |a-b| {}", x.path.text(), x.op.text(), x.position, bound(x.max_abs_diff, x.below_resolution));
        }
        if r.absorbed_count > r.absorbed.len() {
            let _ = writeln!(o, "    … {} more", r.absorbed_count - r.absorbed.len());
        }
    }
}

/// The causes by group, how the difference grew through the layers and along positions.
fn text_spread(o: &mut String, r: &Report) {
    if !r.groups.is_empty() {
        let n = r.groups.iter().map(|g| g.count).sum::<usize>();
        let _ = writeln!(o, "\ncauses ({}, by op and class):", crate::text::plural(n as u64, "reported root"));
        for gr in &r.groups {
            let _ = writeln!(o, "  {} x {}: {} (first {})", gr.count, gr.kind.text(), gr.description, gr.first.text());
            let _ = writeln!(o, "    remedy: {}", gr.remedy.text());
        }
    }
    if !r.growth.is_empty() {
        let pos = r.first_divergence.as_ref().map_or(0, |d| d.position);
        let _ = writeln!(o, "\nhow the difference grew at position {pos}:");
        let w = r.growth.iter().map(|l| l.layer.text().chars().count()).max().unwrap_or(12).max(12);
        for l in &r.growth {
            if l.identical {
                let _ = writeln!(o, "  {:<w$} identical ({} ops)", l.layer.text(), l.ops_compared);
            } else {
                let exact = match (l.exact_max_abs_diff, l.max_ulp) {
                    (Some(x), Some(u)) => format!("; dumped: max |a-b| {}, {u} ULP", g(x)),
                    (Some(x), None) => format!("; dumped: max |a-b| {}", g(x)),
                    _ => String::new(),
                };
                let rel = if l.max_abs_diff > 0.0 { format!(" (relative {})", g(l.max_rel_diff)) } else { String::new() };
                let _ = writeln!(o, "  {:<w$} {}/{} ops differ, max |a-b| {}{rel}{exact}", l.layer.text(), l.ops_differing, l.ops_compared, bound(l.max_abs_diff, false));
            }
        }
    }
    if let (false, Some(d)) = (r.drift.is_empty(), &r.first_divergence) {
        let follows = if r.drift_grows { ", following position" } else { "" };
        let _ = writeln!(o, "\n{} by position (row {}; * = {} there){follows}:", d.path.text(), d.row, star_means(r.level));
        for x in &r.drift {
            let m = if x.max_abs_diff == 0.0 { "identical".to_string() } else { format!("max |a-b| {}", bound(x.max_abs_diff, false)) };
            let _ = writeln!(o, "  position {:>6}{} {m}", x.position, if x.inputs_matched { "*" } else { " " });
        }
    }
}

/// Markdown report, to paste into a bug report.
pub fn markdown(r: &Report) -> String {
    markdown_with(r, &[])
}

/// How the difference grew layer by layer at the root's position, as a markdown table (nothing
/// without a growth table).
fn growth_markdown(o: &mut String, r: &Report) {
    if r.growth.is_empty() {
        return;
    }
    let _ = writeln!(o, "| layer | ops differing | max abs diff ≥ | relative |\n|---|---|---|---|");
    for l in &r.growth {
        let m = if l.identical {
            "identical".to_string()
        } else if l.max_abs_diff.is_nan() {
            "NaN/Inf on one side".to_string()
        } else if l.max_abs_diff == 0.0 {
            "below resolution".to_string()
        } else {
            g(l.max_abs_diff)
        };
        let _ = writeln!(o, "| {} | {}/{} | {} | {} |", l.layer.cell(), l.ops_differing, l.ops_compared, m, g(l.max_rel_diff));
    }
    o.push('\n');
}

/// The root op's difference by position, as a markdown table (nothing without one).
fn drift_markdown(o: &mut String, r: &Report) {
    if r.drift.is_empty() {
        return;
    }
    let follows = if r.drift_grows { ", following position" } else { "" };
    let matched = if r.level == candle_trace_format::site::Level::Ops { "inputs matched" } else { "output before it matched" };
    let _ = writeln!(o, "| position | max abs diff ≥ (root op{follows}) | {matched} |\n|---|---|---|");
    for x in &r.drift {
        let d = if x.max_abs_diff == 0.0 { "identical".to_string() } else { g(x.max_abs_diff) };
        let _ = writeln!(o, "| {} | {d} | {} |", x.position, if x.inputs_matched { "yes" } else { "" });
    }
    o.push('\n');
}

/// [`markdown`], with the commands that reproduce the two runs (see [`record_command`]) shown
/// after the growth table.
pub fn markdown_with(r: &Report, commands: &[String]) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "### candle-trace bisect: {}\n", r.verdict);
    // What differs in the settings and environment comes first: often it is the answer.
    if !r.env_diff.is_empty() {
        let _ = writeln!(o, "| setting | a | b |\n|---|---|---|");
        for e in &r.env_diff {
            let _ = writeln!(o, "| {} | {} | {} |", e.key.cell(), e.a.cell(), e.b.cell());
        }
        o.push('\n');
    }
    // Which request of one run is which of the other, before anything is said of them.
    if rows_worth_listing(r) {
        let _ = writeln!(o, "**Per request:**\n");
        for x in &r.rows {
            let _ = writeln!(o, "- {}", row_line(x, Out::Markdown));
        }
        o.push('\n');
    }
    if r.verdict == crate::bisect::Verdict::Identical {
        let _ = writeln!(
            o,
            "All {} compared op outputs (op, batch row, token position) and all {} compared generated tokens are bit-identical{}.\n",
            r.compared,
            r.tokens.compared(),
            last_not_compared(r)
        );
    } else if r.first_token_divergence.is_none() && r.tokens.compared() > 0 {
        let _ = writeln!(o, "**Generated tokens:** identical ({} compared{}).\n", r.tokens.compared(), last_not_compared(r));
    }
    markdown_flip(&mut o, r);
    o.push_str(&crate::positions::render(&r.positions, Out::Markdown));
    markdown_root(&mut o, r);
    fork_markdown(&mut o, r.graph_fork.as_ref());
    growth_markdown(&mut o, r);
    drift_markdown(&mut o, r);
    if !commands.is_empty() {
        let _ = writeln!(o, "To reproduce:\n\n```sh");
        for c in commands {
            let _ = writeln!(o, "{c}");
        }
        let _ = writeln!(o, "```\n");
    }
    let rest = markdown_details(r);
    let _ = writeln!(o, "<details><summary>the traces, every root, notes</summary>\n\n{rest}</details>");
    o
}

/// What the markdown folds into `<details>`: the traces, every request, the absorbed
/// differences, every root, the non-finite values and the notes.
fn markdown_details(r: &Report) -> String {
    let mut rest = String::new();
    let _ = writeln!(rest, "| | trace | op records | tokens |\n|---|---|---|---|");
    let _ = writeln!(rest, "| a | {}{} | {} | {} |", r.a.path.cell(), if r.a.truncated { " (truncated)" } else { "" }, r.a.op_records, r.a.tokens);
    let _ = writeln!(rest, "| b | {}{} | {} | {} |\n", r.b.path.cell(), if r.b.truncated { " (truncated)" } else { "" }, r.b.op_records, r.b.tokens);
    let _ = writeln!(rest, "{}.\n", capitalized(&compared_line(r)));
    let _ = writeln!(rest, "| environment | a | b |\n|---|---|---|");
    for e in &r.environment {
        let _ = writeln!(rest, "| {} | {} | {} |", e.key.cell(), e.a.cell(), e.b.cell());
    }
    rest.push('\n');
    if r.absorbed_count > 0 {
        let list: Vec<String> = r.absorbed.iter().map(|x| format!("`{}` @ {}", x.path.cell(), x.position)).collect();
        let _ = writeln!(
            rest,
            "Before the root cause, {} differences died out within their layer: {}{}.\n",
            r.absorbed_count,
            list.join(", "),
            if r.absorbed_count > r.absorbed.len() { ", …" } else { "" }
        );
    }
    if !r.groups.is_empty() {
        let _ = writeln!(rest, "| roots | op | cause | remedy |\n|---|---|---|---|");
        for gr in &r.groups {
            let _ = writeln!(rest, "| {} | `{}` | {} | {} |", gr.count, gr.kind.cell(), gr.description, gr.remedy.cell());
        }
        rest.push('\n');
    }
    if let Some(nf) = &r.nonfinite {
        let _ = writeln!(rest, "**First non-finite value:**\n\n- a: {}\n- b: {}\n", crate::nonfinite::describe(nf.a.as_ref()).prose(), crate::nonfinite::describe(nf.b.as_ref()).prose());
    }
    for n in &r.notes {
        let _ = writeln!(rest, "> {}\n", n.prose());
    }
    rest
}

/// The token strip at the first flip, the sampler's verdict, and inputs that differ.
fn markdown_flip(o: &mut String, r: &Report) {
    if let Some(t) = r.first_token_divergence.as_ref().filter(|t| t.ids_redacted) {
        let _ = writeln!(o, "**First differing token:** generated token {} (position {}): {}.\n", t.step, t.pos, redacted_flip(t, |u| format!("\"{}\"", u.cell())));
    } else if let Some(t) = &r.first_token_divergence {
        // The token strip: the common text, then the two choices at the flip.
        let tail: Untrusted = t.common_text.chars().rev().take(160).collect::<Vec<_>>().into_iter().rev().collect::<String>().into();
        let lead = if tail.chars().count() < t.common_text.chars().count() { "…" } else { "" };
        let _ = writeln!(
            o,
            "**First differing token:** generated token {} (position {}): a = {} \"{}\" (margin {}), b = {} \"{}\" (margin {}).\n",
            t.step,
            t.pos,
            id(t.a_token),
            t.a_text.cell(),
            g(t.a_margin as f64),
            id(t.b_token),
            t.b_text.cell(),
            g(t.b_margin as f64)
        );
        let _ = writeln!(o, "```text\n{lead}{} ⟦a: {:?} | b: {:?}⟧\n```\n", tail.fenced(), t.a_text, t.b_text);
    }
    if let Some(v) = &r.sampling {
        let _ = writeln!(o, "**Sampling:** {}\n", v.explanation);
    }
    if let Some(i) = &r.inputs_differ {
        let _ = writeln!(o, "**Inputs differ:** {}\n", i.explanation);
    }
}

/// The root cause: where the numbers first parted.
fn markdown_root(o: &mut String, r: &Report) {
    if let Some(d) = &r.first_divergence {
        let _ = writeln!(
            o,
            "**Root cause:** `{}` ({}) at token position {} — {} (max abs diff {}, relative {}). Cause: {}. Remedy: {}.\n\n- a: {}, {} {:?}\n- b: {}, {} {:?}\n",
            d.path.cell(),
            d.op_label().cell(),
            d.position,
            matched_clause(r.level, d.class, |f| format!("`{f}`")),
            bound(d.max_abs_diff, d.below_resolution).replace(">=", "≥"),
            g(d.max_rel_diff),
            cause(d.class, r.level),
            crate::bisect::remedy(d.class, &r.env_diff, r.both_invariant).prose(),
            d.a.execution.cell(),
            d.a.dtype.cell(),
            d.a.shape,
            d.b.execution.cell(),
            d.b.dtype.cell(),
            d.b.shape
        );
        if let Some(x) = r.absorbed.first() {
            let _ = writeln!(
                o,
                "It is the first difference that reached its layer's output (the residual stream); the earliest, `{}` at position {}, died out within its layer.\n",
                x.path.cell(),
                x.position
            );
        }
        if let Some(e) = &d.elementwise {
            let _ = writeln!(o, "{}.\n", elementwise_line(e));
        }
    }
}

/// The `trace record` command that re-runs the run `h` describes, with the settings frame's
/// `settings` (the repeat penalty), writing `out` (the prompt shell-quoted; `<redacted>` when
/// the trace holds none; the model by its recorded name).
pub fn record_command(h: &candle_trace_format::record::Header, settings: &candle_trace_format::record::Settings, out: &str) -> String {
    let q = crate::text::shell_quote;
    let r = &h.run;
    let mut w: Vec<String> = vec!["trace".into(), "record".into()];
    if r.model.name != "builtin" {
        w.extend(["--model".into(), q(&r.model.name)]);
    }
    if !r.pooling.is_empty() {
        for t in &r.texts {
            w.extend(["--text".into(), q(t)]);
        }
    } else if r.texts.len() > 1 {
        for t in &r.texts {
            w.extend(["--prompt".into(), q(t)]);
        }
    } else if candle_trace_format::redact::holds_prompt(h) {
        w.extend(["--prompt".into(), q(&r.prompt)]);
    } else {
        w.extend(["--prompt".into(), "'<redacted>'".into()]);
    }
    if r.chat {
        w.push("--chat".into());
    }
    if r.pooling.is_empty() {
        w.extend(["--max-tokens".into(), r.max_tokens.to_string()]);
    }
    w.extend(["--dtype".into(), q(&r.dtype)]);
    if r.prefill_chunk > 0 {
        w.extend(["--prefill-chunk".into(), r.prefill_chunk.to_string()]);
    }
    if r.batch > 1 && r.texts.len() <= 1 {
        w.extend(["--batch".into(), r.batch.to_string()]);
    }
    w.extend(["--threads".into(), r.threads.to_string()]);
    if let Some(t) = r.temperature {
        w.extend(["--temperature".into(), t.to_string(), "--seed".into(), r.seed.to_string()]);
        if let Some(k) = r.top_k {
            w.extend(["--top-k".into(), k.to_string()]);
        }
        if let Some(p) = r.top_p {
            w.extend(["--top-p".into(), p.to_string()]);
        }
    }
    for (key, flag) in [("repeat_penalty", "--repeat-penalty"), ("repeat_last_n", "--repeat-last-n")] {
        if let Some(v) = settings.get(key) {
            w.extend([flag.into(), q(v)]);
        }
    }
    match r.alterations() {
        Ok(list) => {
            for a in list {
                if let candle_trace_format::fields::Alteration::Perturb(p) = a {
                    w.extend(["--perturb".into(), q(&p.to_arg())]);
                }
            }
        }
        // As recorded: `trace record` then says what is wrong with it.
        Err(_) => w.extend(["--perturb".into(), q(r.perturb.as_deref().unwrap_or_default())]),
    }
    // What the run dumped (a repro needs the same values), how, and where.
    if !r.dump.is_empty() && r.dump != "none" {
        w.extend(["--dump".into(), q(&r.dump)]);
    }
    if let Some((_, v)) = r.model.config.iter().find(|(k, v)| k == "numerics" && v != "\"fixed\"") {
        w.extend(["--numerics".into(), q(serde_json::from_str::<String>(v).as_deref().unwrap_or(v))]);
    }
    if !h.env.device.is_empty() && h.env.device != "cpu" {
        w.extend(["--device".into(), q(&h.env.device)]);
    }
    w.extend(["-o".into(), q(out)]);
    clean(&w.join(" "))
}

#[cfg(test)]
mod tests {
    use candle_trace_format::record::Header;

    /// The reproduce command carries every recording flag the header keeps: the dump (a repro
    /// needs the same values), the perturbations, the numerics and the device.
    #[test]
    fn the_reproduce_command_carries_every_recording_flag() {
        let mut h = Header::default();
        h.run.model.name = "m.gguf".into();
        (h.run.prompt, h.run.max_tokens, h.run.dtype, h.run.threads, h.run.prefill_chunk) = ("Hi there".into(), 8, "q".into(), 2, 7);
        h.run.dump = "layers.0.*".into();
        h.run.perturb = Some("layers.1.mlp@3,patch:layers.2.mlp@4".into());
        h.run.model.config = vec![("numerics".into(), "\"upstream\"".into())];
        h.env.device = "cuda:0".into();
        let none = candle_trace_format::record::Settings::default();
        assert_eq!(
            super::record_command(&h, &none, "a b.trace"),
            "trace record --model m.gguf --prompt 'Hi there' --max-tokens 8 --dtype q --prefill-chunk 7 --threads 2 --perturb layers.1.mlp@3 --dump 'layers.0.*' --numerics upstream --device cuda:0 -o 'a b.trace'"
        );
        (h.run.dump, h.env.device, h.run.perturb) = ("none".into(), "cpu".into(), None);
        h.run.model.config = vec![("numerics".into(), "\"invariant\"".into())];
        let penalty = candle_trace_format::record::Settings(vec![("repeat_last_n".into(), "8".into()), ("repeat_penalty".into(), "1.3".into())]);
        let c = super::record_command(&h, &penalty, "x");
        assert!(c.contains("--threads 2 --repeat-penalty 1.3 --repeat-last-n 8 --numerics invariant -o x"), "{c}");
        h.run.model.config = vec![("numerics".into(), "\"fixed\"".into())];
        let c = super::record_command(&h, &none, "x");
        assert!(!c.contains("--dump") && !c.contains("--device") && !c.contains("--numerics") && !c.contains("--repeat"), "{c}");
    }
}
