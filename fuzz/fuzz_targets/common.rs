//! What both targets do with traces that the reader accepted.
use candle_trace_format::format::Trace;
use std::path::PathBuf;

/// The streaming bisect `trace bisect` runs (two passes over files, a frame at a time) on the
/// bytes of two traces, written to this process's own files: it reads and checks the files
/// itself, so it runs on bytes the in-memory reader refused too.
pub fn consume_files(a: &[u8], b: &[u8]) {
    let dir = std::env::temp_dir().join(format!("candle-trace-fuzz-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let (pa, pb): (PathBuf, PathBuf) = (dir.join("a.trace"), dir.join("b.trace"));
    if std::fs::write(&pa, a).is_err() || std::fs::write(&pb, b).is_err() {
        return;
    }
    if let Ok((r, profile, ta, tb)) = candle_trace_compare::bisect_file::bisect_files_profiled(&pa, &pb) {
        let _ = candle_trace_compare::report::text(&r);
        let _ = candle_trace_compare::report::markdown(&r);
        let views = candle_trace_compare::html::Views { points: profile.points, heat: profile.heat, a_tokens: candle_trace_compare::html::tokens(&ta, 0), b_tokens: candle_trace_compare::html::tokens(&tb, 0), commands: Vec::new() };
        let _ = candle_trace_compare::html::page(&r, &views);
    }
}

pub fn consume(a: &Trace, b: &Trace) {
    for t in [a, b] {
        let s = candle_trace_compare::show::summarize(t);
        let _ = candle_trace_compare::show::text(&s);
        let _ = candle_trace_compare::show::sites_text(&s);
        let _ = serde_json::to_string(&s);
        let _ = candle_trace_compare::repro::plan(t, None);
        if let Some(seq) = t.items.iter().find_map(|i| match i {
            candle_trace_format::record::Item::Op(r) => Some(r.seq),
            _ => None,
        }) {
            let _ = candle_trace_compare::repro::plan(t, Some(seq));
        }
        let _ = candle_trace_format::redact::redact(t, &candle_trace_format::redact::Keep::default());
        // `--causal`'s and `check --golden`'s checks before a re-run.
        let _ = candle_trace_compare::rerun::rerun_perturbs(&t.header);
        let _ = candle_trace_compare::rerun::tokens_redacted(t);
    }
    if let Ok(r) = candle_trace_compare::bisect::bisect(a, b) {
        let _ = candle_trace_compare::report::text(&r);
        let _ = candle_trace_compare::report::markdown(&r);
        let _ = serde_json::to_string(&r);
        let views = candle_trace_compare::html::Views { a_tokens: candle_trace_compare::html::tokens(a, 0), b_tokens: candle_trace_compare::html::tokens(b, 0), ..Default::default() };
        let _ = candle_trace_compare::html::page(&r, &views);
        // The step `--causal` follows, read from the crafted files (its earlier panic).
        if let Some(f) = &r.first_token_divergence {
            let row_b = r.rows.iter().find(|x| x.a_row == f.row).map_or(f.row, |x| x.b_row);
            let (ta, tb) = (candle_trace_compare::rerun::row_tokens(a, f.row), candle_trace_compare::rerun::row_tokens(b, row_b));
            let _ = candle_trace_compare::rerun::step_positions(&ta, &tb, f.step as usize);
        }
    }
}
