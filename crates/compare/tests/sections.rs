//! One report model, four renderers that cannot drift: every field of the bisect [`Report`] is
//! a section that text, markdown, JSON and HTML all render (or one a renderer leaves out on
//! purpose, named in the table with the reason), and every string a trace can hold reaches each
//! output escaped, through [`Untrusted`]'s methods.

use candle_trace_compare::bisect::*;
use candle_trace_compare::html;
use candle_trace_compare::nonfinite::NonFinite;
use candle_trace_compare::report;

/// Terminal escapes (clear screen, a hyperlink, BEL), HTML and markdown table syntax.
const EVIL: &str = "\u{1b}[2J\u{1b}]8;;x\u{7}<b>|`";

fn u(s: &str) -> Untrusted {
    Untrusted::new(format!("{s}{EVIL}"))
}

fn view(seq: u64) -> EntryView {
    EntryView { seq, step: 0, execution: u("cpu"), dtype: u("f32"), shape: vec![1, 4, 8], sum: 1.5, abs_max: 0.75, nonfinite: 0, samples: [0.0; 4] }
}

fn nonfinite(path: &str) -> NonFinite {
    NonFinite { seq: 4, step: 0, layer: Some(1), path: u(path), op: u("div"), row: Some(0), position: Some(2), nan: 3, pos_inf: 0, neg_inf: 0, inputs_finite: true }
}

/// A report with every section filled (the root cause set, so no graph fork: bisect sets the
/// fork only when no op is blamed; see [`with_fork`]).
fn full() -> Report {
    let root = OpDivergence {
        seq: 7,
        step: 0,
        layer: Some(1),
        path: u("layers.1.mlp"),
        op: u("matmul"),
        b_op: None,
        position: 2,
        row: 0,
        b_row: 1,
        inputs_matched: true,
        max_abs_diff: 3.0e-6,
        max_rel_diff: 1.0e-7,
        below_resolution: false,
        class: CauseClass::ShapesDiffer,
        nonfinite: (0, 0),
        a: view(7),
        b: view(9),
        elementwise: Some(Elementwise {
            count: 32,
            differing: 2,
            max_abs_diff: 3.0e-6,
            max_rel_diff: 1e-7,
            max_ulp: Some(4),
            ulp_histogram: vec![("1-2".into(), 1), ("3-4".into(), 1)],
            worst_index: 5,
            a_worst: 1.0,
            b_worst: 1.000003,
        }),
    };
    let absorbed = Absorbed { seq: 3, b_seq: 3, path: u("layers.0.self_attn.softmax"), op: u("softmax"), position: 1, max_abs_diff: 1e-8, below_resolution: false, class: CauseClass::ShapesDiffer };
    Report {
        both_invariant: false,
        // Recorded at `--level layers`: the root's sentence says what a root is there.
        level: candle_trace_format::site::Level::Layers,
        positions: vec![PositionCompare {
            position: 29,
            a_pass: u("decode step 1 (M=1)"),
            b_pass: u("prefill step 0 (M=41)"),
            layer: u("layers.3"),
            max_abs_diff: Some(2e-7),
            a_next: Some(5),
            b_next: Some(6),
        }],
        verdict: Verdict::Diverged,
        a: SideInfo { path: u("a.trace"), truncated: true, op_records: 120, tokens: 4, text: u(" Paris") },
        b: SideInfo { path: u("b.trace"), truncated: false, op_records: 130, tokens: 4, text: u(" Lyon") },
        rows: vec![
            RowAnswer {
                a_row: 0,
                b_row: 1,
                input: u("The capital"),
                embedding: None,
                tokens_compared: 4,
                first_flip: Some(3),
                logits_max_abs_diff: vec![1e-6, 2e-6, 3e-6],
                first_root: Some(u("layers.1.mlp @ 2")),
            },
            RowAnswer {
                a_row: 1,
                b_row: 0,
                input: u("A text"),
                embedding: Some(EmbeddingDiff { identical: false, max_abs_diff: 1e-7, cosine: 0.99999999, dims: 384 }),
                tokens_compared: 0,
                first_flip: None,
                logits_max_abs_diff: vec![],
                first_root: None,
            },
        ],
        first_token_divergence: Some(TokenDivergence {
            step: 3,
            row: 0,
            pos: 9,
            b_pos: 9,
            a_token: Some(11),
            b_token: Some(12),
            a_text: u(" Paris"),
            b_text: u(" Lyon"),
            a_margin: 0.01,
            b_margin: 0.02,
            a_tie: false,
            b_tie: true,
            common_text: u("The capital of France is\n"),
            ids_redacted: false,
        }),
        tokens: TokenComparison::Ids { compared: 4 },
        sampling: Some(SamplingVerdict {
            class: "different_draw".into(),
            explanation: "the same probabilities met a different random draw".into(),
            a_draw: Some(0.5),
            b_draw: Some(0.25),
            tokens: vec![],
        }),
        first_divergence: Some(root),
        inputs_differ: Some(InputsDiffer { position: 12, row: 0, in_prompt: false, explanation: "the token ids differ at generated position 12".into() }),
        growth: vec![
            LayerGrowth { layer: u("layers.0"), identical: true, ops_differing: 0, ops_compared: 12, max_abs_diff: 0.0, max_rel_diff: 0.0, exact_max_abs_diff: None, max_ulp: None },
            LayerGrowth { layer: u("layers.1"), identical: false, ops_differing: 3, ops_compared: 12, max_abs_diff: 3e-6, max_rel_diff: 1e-7, exact_max_abs_diff: Some(3e-6), max_ulp: Some(4) },
        ],
        drift: vec![
            PositionDrift { position: 0, max_abs_diff: 0.0, inputs_matched: true },
            PositionDrift { position: 1, max_abs_diff: 1e-6, inputs_matched: true },
            PositionDrift { position: 2, max_abs_diff: 3e-6, inputs_matched: true },
        ],
        drift_grows: true,
        absorbed: vec![absorbed],
        absorbed_count: 2,
        groups: vec![RootGroup {
            kind: u("matmul"),
            class: CauseClass::ShapesDiffer,
            count: 3,
            first: u("layers.0.self_attn.softmax @ 1"),
            description: CauseClass::ShapesDiffer.describe().into(),
            remedy: u(CauseClass::ShapesDiffer.remedy()),
        }],
        nonfinite: Some(NonFiniteSides { a: Some(nonfinite("layers.1.attn")), b: None }),
        env_diff: vec![EnvDiff { key: u("run.prefill_chunk"), a: u("0"), b: u("1") }],
        environment: vec![EnvDiff { key: u("model sha256"), a: u("5e3f"), b: u("5e3f") }],
        compared: 5000,
        differing: 123,
        notes: vec![u("rows were paired by request")],
        graph_fork: None,
    }
}

/// [`full`] where the op graphs part before any op is blamed.
fn with_fork() -> Report {
    let mut r = full();
    r.first_divergence = None;
    r.graph_fork = Some(GraphFork {
        path: u("layers.0.self_attn.o_proj"),
        row: 0,
        position: 3,
        a_inputs: vec![u("layers.0.self_attn.sdpa")],
        b_inputs: vec![u("layers.0.self_attn.matmul"), u("layers.0.self_attn.softmax")],
    });
    r
}

/// Per field of [`Report`] (its JSON key): the section's marker in the text, the markdown and
/// the HTML, from the report that holds it (`fork`: [`with_fork`], else [`full`]). `None` would
/// be a section left out of that renderer on purpose, with the reason in the last column.
#[allow(clippy::type_complexity)]
const SECTIONS: &[(&str, bool, [Option<&str>; 3], &str)] = &[
    ("verdict", false, [Some("verdict: diverged"), Some("### candle-trace bisect: diverged"), Some(": diverged</h1>")], ""),
    (
        "level",
        false,
        [
            Some("at --level layers the output recorded before it matched"),
            Some("at `--level layers` the output recorded before it matched"),
            Some("at --level layers the output recorded before it matched"),
        ],
        "",
    ),
    ("a", false, [Some("a: a.trace"), Some("| a | a.trace"), Some("<td>a</td><td><code>a.trace")], ""),
    ("b", false, [Some("b: b.trace"), Some("| b | b.trace"), Some("<td>b</td><td><code>b.trace")], ""),
    ("rows", false, [Some("a row 1 = b row 0 \"A text"), Some("- a row 1 = b row 0 \"A text"), Some("<li>a row 1 = b row 0 <code>A text")], ""),
    ("first_token_divergence", false, [Some("first generated token that differs: token 3"), Some("**First differing token:** generated token 3"), Some("Token 3 flips")], ""),
    ("tokens", false, [Some("; 4 generated tokens, by id"), Some("; 4 generated tokens, by id"), Some("; 4 generated tokens, by id")], ""),
    ("sampling", false, [Some("sampling: the same probabilities"), Some("**Sampling:** the same probabilities"), Some("Sampling: the same probabilities")], ""),
    ("first_divergence", false, [Some("the first difference that reached its layer's output: layers.1.mlp"), Some("**Root cause:** `layers.1.mlp"), Some("Root cause: <code>layers.1.mlp")], ""),
    ("inputs_differ", false, [Some("inputs differ: the token ids"), Some("**Inputs differ:** the token ids"), Some("Inputs differ: the token ids")], ""),
    ("growth", false, [Some("how the difference grew at position 2"), Some("| layer | ops differing |"), Some("How the difference grew at position 2")], ""),
    ("positions", false, [Some("decoded step by step and the other prefilled (row 0):\n"), Some("**Positions one run decoded step by step"), Some("<h2>Positions one run decoded step by step")], ""),
    ("drift", false, [Some("by position (row 0; * = the output recorded before it matched there)"), Some("| position | max abs diff"), Some("by position (row 0)")], ""),
    ("drift_grows", false, [Some(", following position"), Some(", following position"), Some("It follows position")], ""),
    ("absorbed", false, [Some("layers.0.self_attn.softmax"), Some("`layers.0.self_attn.softmax"), Some("<code>layers.0.self_attn.softmax")], ""),
    (
        "absorbed_count",
        false,
        [Some("before it, 2 differences entered and died out"), Some("Before the root cause, 2 differences died out"), Some("Before it, 2 differences entered and died out")],
        "",
    ),
    ("groups", false, [Some("3 x matmul"), Some("| 3 | `matmul"), Some("<td>3</td><td><code>matmul")], ""),
    (
        "nonfinite",
        false,
        [Some("first non-finite value differs:\n  a: layers.1.attn"), Some("**First non-finite value:**\n\n- a: layers.1.attn"), Some("First non-finite value</h2>\n<ul><li>a: layers.1.attn")],
        "",
    ),
    ("env_diff", false, [Some("run.prefill_chunk"), Some("| run.prefill_chunk"), Some("<td><code>run.prefill_chunk")], ""),
    ("environment", false, [None, Some("| model sha256"), Some("<td>model sha256")], "the terminal report lists what differs (env_diff); `trace show` prints a run's whole environment"),
    ("compared", false, [Some("compared 5000 (op, row, position) outputs"), Some("Compared 5000 (op, row, position) outputs"), Some("Compared 5000 (op, row, position) outputs")], ""),
    ("differing", false, [Some(", 123 differ"), Some(", 123 differ"), Some(", 123 differ")], ""),
    ("notes", false, [Some("note: rows were paired by request"), Some("> rows were paired by request"), Some("Note: rows were paired by request")], ""),
    (
        "graph_fork",
        true,
        [Some("the op graphs differ here: layers.0.self_attn.o_proj"), Some("**The op graphs differ:** `layers.0.self_attn.o_proj"), Some("The op graphs differ: <code>layers.0.self_attn.o_proj")],
        "",
    ),
];

/// The report in the four forms, as `trace bisect --format text|markdown|json` and `trace
/// report -o x.html` render it.
fn render(r: &Report) -> [String; 4] {
    let toks = vec![(format!(" Paris{EVIL}"), Some(11))];
    let views = html::Views {
        points: vec![LayerPoint { layer: u("layers.1"), max_abs_diff: 1e-6, differing: 1, compared: 2 }],
        heat: Heat { row: 0, layers: vec![u("layers.0"), u("layers.1")], cells: vec![vec![(0, 0.0), (1, 1e-8), (9, 5.0)], vec![(0, 0.0), (2, 3e-6), (9, f64::NAN)]] },
        a_tokens: toks.clone(),
        b_tokens: toks,
        commands: vec![format!("trace record --prompt 'x{EVIL}' -o a.trace")],
    };
    [report::text(r), report::markdown_with(r, &["trace record --prompt x -o a.trace".into()]), serde_json::to_string_pretty(r).unwrap(), html::page(r, &views)]
}

#[test]
fn every_field_of_the_report_is_a_section_of_every_renderer() {
    let json = serde_json::to_value(full()).unwrap();
    let keys: Vec<&String> = json.as_object().unwrap().keys().collect();
    for k in &keys {
        assert!(SECTIONS.iter().any(|s| s.0 == k.as_str()), "Report.{k} is in no renderer's table: add it to SECTIONS (and to text, markdown and HTML)");
    }
    let (full, fork) = (render(&full()), render(&with_fork()));
    for (key, in_fork, markers, why) in SECTIONS {
        assert!(keys.iter().any(|k| k == key), "SECTIONS names {key}, which Report no longer has");
        let outs = if *in_fork { &fork } else { &full };
        let json = serde_json::from_str::<serde_json::Value>(&outs[2]).unwrap();
        assert!(!json[key].is_null(), "JSON: {key} missing");
        for (i, (name, m)) in ["text", "markdown", "html"].iter().zip(markers).enumerate() {
            let out = &outs[if i == 2 { 3 } else { i }];
            match m {
                Some(m) => assert!(out.contains(m), "{name}: section {key} (marker {m:?}) missing from\n{out}"),
                None => assert!(!why.is_empty(), "{name} leaves out {key}: say why in SECTIONS"),
            }
        }
    }
}

#[test]
fn a_string_from_a_trace_reaches_no_output_unescaped() {
    for r in [full(), with_fork()] {
        let [text, md, json, page] = render(&r);
        assert!(text.contains("layers.1.mlp\\u{1b}[2J") || text.contains("o_proj\\u{1b}[2J"), "escaped, not dropped:\n{text}");
        // Markdown outside fenced code blocks: GitHub renders no HTML inside one.
        let md_prose: String = md.split("```").step_by(2).collect::<Vec<_>>().join("\n");
        for (what, out) in [("text", &text), ("markdown", &md), ("json", &json), ("html", &page)] {
            assert!(!out.contains('\u{1b}') && !out.contains('\u{7}'), "{what}: a raw control character in\n{out}");
        }
        assert!(!md_prose.contains("<b>") && !md_prose.contains("<b>|`"), "markdown: raw HTML or an unescaped cell in\n{md_prose}");
        assert!(!page.contains("<b>"), "html: raw HTML from the trace in\n{page}");
    }
}
