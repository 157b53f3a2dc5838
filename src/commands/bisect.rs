//! `trace bisect` (by digest, by value with `--tolerance`, or `--causal`) and `trace report`
//! (the bisect as an HTML page).

use super::{not_an_input_trace, stdout, to_json};
use crate::cli::{BisectArgs, ReportArgs, ReportFormat};
use candle_trace::bisect;
use candle_trace::error::{Error, Result};
use candle_trace::format::read_trace;
use candle_trace::report;
use std::path::Path;

/// `trace bisect`.
pub(crate) fn bisect_cmd(BisectArgs { a, b, format, causal, model, max_runs, causal_out, quiet, tolerance }: BisectArgs) -> Result<u8> {
    if let Some(tol) = tolerance {
        return bisect_tolerance(&a, &b, tol, format);
    }
    // Large traces take seconds to read and align: say so on a terminal.
    let spin = if quiet { indicatif::ProgressBar::hidden() } else { indicatif::ProgressBar::new_spinner() };
    spin.enable_steady_tick(std::time::Duration::from_millis(120));
    if !causal {
        // Both files are read a frame at a time: memory does not grow with their length.
        spin.set_message(format!("comparing {} with {}", a.display(), b.display()));
        let r = candle_trace::bisect_file::bisect_files(&a, &b);
        spin.finish_and_clear();
        let (r, ta, tb) = r?;
        return print_bisect(&r, &ta, &tb, format);
    }
    spin.set_message(format!("reading {}", a.display()));
    let ta = read_trace(&a)?;
    spin.set_message(format!("reading {}", b.display()));
    let tb = read_trace(&b)?;
    spin.set_message("re-running both runs with patches (see --max-runs)".to_string());
    if let Some(o) = &causal_out {
        not_an_input_trace("--causal-out", o, (&a, &b), "the patched run")?;
    }
    let opts = candle_trace::causal::CausalOptions { model, max_runs, out: causal_out, ..Default::default() };
    let r = candle_trace::causal::causal(&ta, &tb, &opts);
    spin.finish_and_clear();
    let r = r?;
    let text = match format {
        ReportFormat::Json => format!("{}\n", to_json(&r)?),
        ReportFormat::Text => candle_trace::causal::text(&r),
        ReportFormat::Markdown => format!("```text\n{}```\n", candle_trace::causal::text(&r)),
    };
    stdout(&text)?;
    Ok(if r.verdict == candle_trace::causal::CausalVerdict::Identical { 0 } else { 1 })
}

/// `trace bisect --tolerance`: both traces read whole, compared by value.
fn bisect_tolerance(a: &Path, b: &Path, tol: candle_trace::tolerance::Tolerance, format: ReportFormat) -> Result<u8> {
    let (ta, tb) = (read_trace(a)?, read_trace(b)?);
    let r = candle_trace::across::compare(&ta, &tb, tol)?;
    if r.compared == 0 && r.fed_differ_at == Some(0) {
        // Passes that split the prompt otherwise (--prefill-chunk, --batch) pair nothing.
        return Err(Error::usage(format!(
            "--tolerance: {} and {} were fed different token ids from their first forward pass (another --prefill-chunk, --batch or prompt), and it compares passes fed the same ids: bisect them without --tolerance",
            a.display(),
            b.display()
        )));
    }
    if r.compared == 0 {
        return Err(Error::usage(format!("--tolerance: {} and {} hold no op whose values both dumped (record both with --dump all, or with the same --dump patterns)", a.display(), b.display())));
    }
    stdout(&match format {
        ReportFormat::Json => format!("{}\n", to_json(&r)?),
        ReportFormat::Text => candle_trace::across::text(&r),
        ReportFormat::Markdown => format!("```text\n{}```\n", candle_trace::across::text(&r)),
    })?;
    Ok(if r.root.is_some() { 1 } else { 0 })
}

/// Prints a bisect report of `a` and `b` in `format` (markdown with the commands that reproduce
/// both runs) and returns the exit code: 0 identical, 1 otherwise.
pub(crate) fn print_bisect(r: &bisect::Report, a: &candle_trace::format::Trace, b: &candle_trace::format::Trace, format: ReportFormat) -> Result<u8> {
    let text = match format {
        ReportFormat::Text => report::text(r),
        ReportFormat::Markdown => report::markdown_with(r, &[report::record_command(&a.header, &a.extras.settings, &r.a.path), report::record_command(&b.header, &b.extras.settings, &r.b.path)]),
        ReportFormat::Json => to_json(r)?,
    };
    stdout(&text)?;
    if !text.ends_with('\n') {
        stdout("\n")?;
    }
    Ok(if r.verdict == bisect::Verdict::Identical { 0 } else { 1 })
}

/// `trace report`.
pub(crate) fn report_cmd(ReportArgs { a, b, out }: ReportArgs) -> Result<u8> {
    not_an_input_trace("-o", &out, (&a, &b), "the report")?;
    // Streamed, as `trace bisect` is: the traces as far as the report reads them.
    let (r, profile, ta, tb) = candle_trace::bisect_file::bisect_files_profiled(&a, &b)?;
    // Both runs' tokens in the heatmap's row and the row of b holding the same request.
    let row_a = profile.heat.row;
    let row_b = r.rows.iter().find(|x| x.a_row == row_a).map_or(row_a, |x| x.b_row);
    let name = |p: &std::path::Path| p.file_name().map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into_owned());
    let views = candle_trace::html::Views {
        a_tokens: candle_trace::html::tokens(&ta, row_a),
        b_tokens: candle_trace::html::tokens(&tb, row_b),
        commands: vec![report::record_command(&ta.header, &ta.extras.settings, &name(&a)), report::record_command(&tb.header, &tb.extras.settings, &name(&b))],
        points: profile.points,
        heat: profile.heat,
    };
    std::fs::write(&out, candle_trace::html::page(&r, &views)).map_err(|e| Error::io(&out, e))?;
    stdout(&format!("wrote {}: {} ({} layers charted)\n", out.display(), r.verdict, views.points.len()))?;
    Ok(if r.verdict == bisect::Verdict::Identical { 0 } else { 1 })
}
