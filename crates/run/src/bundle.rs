//! `trace bundle A B -o report.zip`: one file to attach to a bug report. GitHub accepts `.zip`
//! attachments up to 25 MB, not `.trace` or `.html`. The bundle holds:
//!
//! - `report.md`: the markdown bisect report (the issue body), with the commands that record
//!   both runs again and what the bundle holds or lacks;
//! - the two traces, redacted unless the prompt is kept ([`candle_trace_format::redact`]), and
//!   without their dumped values (the repro holds the root cause's; a walkthrough pair recorded
//!   with `--dump 'layers.0.*'` is 31 MB with them): they still bisect op by op, and bisect
//!   finds a flipped token in them through the input-id digests;
//! - `repro.trace`: the root-cause op cut from the redacted traces by [`crate::replay::extract`]
//!   when the runs dumped it, for `trace replay`.
//!
//! Entries are stored, not deflated: the traces' frames are zstd already.

use candle_trace_compare::report::{markdown_with, record_command};
use candle_trace_format::error::{Error, Result};
use candle_trace_format::format::read_trace;
use candle_trace_format::record::Item;
use candle_trace_format::redact::{redact, write, Keep};
use serde::Serialize;
use std::io::Write;
use std::path::Path;

/// The most GitHub accepts as an issue attachment, in bytes (25 MB).
pub const ATTACHMENT_LIMIT: u64 = 25_000_000;

/// What goes into a bundle.
#[derive(Clone, Debug)]
pub struct BundleOptions {
    /// Keep the prompt and generated text in the traces (they are redacted otherwise).
    pub keep_prompt: bool,
    /// Include the two traces (without them: the report and the repro only).
    pub traces: bool,
    /// The size the bundle must stay under, in bytes ([`ATTACHMENT_LIMIT`]).
    pub limit: u64,
}

impl Default for BundleOptions {
    fn default() -> Self {
        BundleOptions { keep_prompt: false, traces: true, limit: ATTACHMENT_LIMIT }
    }
}

/// What a bundle holds.
#[derive(Clone, Debug, Serialize)]
pub struct Bundle {
    /// The bisect verdict (`identical`, `diverged`, `incomplete`).
    pub verdict: String,
    /// (entry name, bytes) in the zip, in order.
    pub files: Vec<(String, u64)>,
    /// Size of the zip file, in bytes.
    pub bytes: u64,
    /// What the reader of the bundle should know: a prompt included, no repro, a repro of an op
    /// whose difference died out, b's operands missing, the bundle over the limit.
    pub warnings: Vec<String>,
}

/// Writes the bundle of traces `pa` and `pb` to `out` (see the module docs).
///
/// # Errors
/// Read errors of either trace (one line naming the file); [`Error::Mismatch`] when the traces
/// compare nothing; I/O errors writing `out` or the scratch folder.
pub fn bundle(pa: &Path, pb: &Path, out: &Path, opts: &BundleOptions) -> Result<Bundle> {
    let scratch = tempfile::Builder::new().prefix("trace-bundle-").tempdir().map_err(|e| Error::io(&std::env::temp_dir(), e))?;
    let name = |p: &Path, other: &str| p.file_name().map_or_else(|| other.to_string(), |n| n.to_string_lossy().into_owned());
    let (mut na, mut nb) = (name(pa, "a.trace"), name(pb, "b.trace"));
    // Two entries of one name, or a trace named as the bundle's own entries: a- and b- prefixes.
    if na == nb || [&na, &nb].iter().any(|n| ["repro.trace", "report.md"].contains(&n.as_str())) {
        (na, nb) = (format!("a-{na}"), format!("b-{nb}"));
    }
    // Redacted copies with their values (the repro is cut from them), then without.
    let full = scratch.path().join("full");
    std::fs::create_dir(&full).map_err(|e| Error::io(&full, e))?;
    let (ca, cb) = (scratch.path().join(&na), scratch.path().join(&nb));
    let (fa, fb) = (full.join(&na), full.join(&nb));
    // Values kept in the copies the repro is cut from; the traces in the zip lose them below.
    let keep = Keep { prompt: opts.keep_prompt, values: true };
    for (src, with, without) in [(pa, &fa, &ca), (pb, &fb, &cb)] {
        let mut r = redact(&read_trace(src)?, &keep);
        write(&r, with)?;
        r.items.retain(|i| !matches!(i, Item::Dump(_) | Item::Operand(_)));
        write(&r, without)?;
    }
    let mut warnings = Vec::new();
    if opts.keep_prompt {
        // Without the traces, the report's commands to reproduce still hold the prompt.
        let what = if opts.traces { "the traces hold the prompt and its token ids" } else { "the report's commands to reproduce (and the repro, when there is one) hold the prompt" };
        warnings.push(format!("{what} (--keep prompt): anyone who opens the bundle can read them"));
    }
    // The report from the copies with their values: elementwise metrics where they were dumped.
    let (mut report, a, b) = candle_trace_compare::bisect_file::bisect_files(&fa, &fb)?;
    if !opts.keep_prompt {
        flip_from_originals(&mut report, pa, pb)?;
    }
    let repro = scratch.path().join("repro.trace");
    let has_repro = repro_warnings(&fa, &fb, &repro, &mut warnings);
    if has_repro && !opts.keep_prompt {
        warnings.push("repro.trace holds the root op's operand values, which replaying it needs: values of the first layers tell their tokens to anyone with the model".into());
    }
    let commands = [record_command(&a.header, &a.extras.settings, &na), record_command(&b.header, &b.extras.settings, &nb)];
    let mut entries: Vec<(String, std::path::PathBuf)> = Vec::new();
    if opts.traces {
        entries.extend([(na.clone(), ca.clone()), (nb.clone(), cb.clone())]);
    }
    if has_repro {
        entries.push(("repro.trace".into(), repro));
    }
    let body = |warnings: &[String]| format!("{}{}", markdown_with(&report, &commands), held(&entries, &na, &nb, warnings));
    let bytes = write_zip(out, &body(&warnings), &entries)?;
    if bytes > opts.limit {
        // Without the traces, what is left to shrink is the repro: its operands are the dumped
        // op's inputs (an embedding table for embed_tokens).
        let how = if opts.traces {
            "bundle without the traces (--no-traces: the report and the repro), or record fewer --max-tokens or a narrower --dump"
        } else {
            "the repro's operands are most of it: re-record both runs with --dump naming the root op alone (an op that reads a weight table, such as embed_tokens, carries the table)"
        };
        warnings.push(format!("{} is {:.1} MB, over the {:.0} MB GitHub accepts: {how}", out.display(), bytes as f64 / 1e6, opts.limit as f64 / 1e6));
        write_zip(out, &body(&warnings), &entries)?;
    }
    let mut files = vec![("report.md".to_string(), body(&warnings).len() as u64)];
    for (n, p) in &entries {
        files.push((n.clone(), std::fs::metadata(p).map_err(|e| Error::io(p, e))?.len()));
    }
    let bytes = std::fs::metadata(out).map_err(|e| Error::io(out, e))?.len();
    Ok(Bundle { verdict: report.verdict.to_string(), files, bytes, warnings })
}

/// The first flipped token as the unredacted traces `pa`, `pb` show it, put in `report` (of
/// their redacted copies) without the token ids and texts
/// ([`candle_trace_compare::bisect::take_flip`]): a flip at a run's last token is invisible
/// in a redacted trace, and the issue body would say the tokens agree.
///
/// # Errors
/// As [`candle_trace_compare::bisect_file::bisect_files`] of the originals.
fn flip_from_originals(report: &mut candle_trace_compare::bisect::Report, pa: &Path, pb: &Path) -> Result<()> {
    let (orig, _, _) = candle_trace_compare::bisect_file::bisect_files(pa, pb)?;
    if candle_trace_compare::bisect::take_flip(report, &orig) {
        let step = report.first_token_divergence.as_ref().map_or(0, |t| t.step);
        report.notes.push(format!("generated token {step} differs: found by id in the unredacted traces, whose token ids this bundle leaves out").into());
    }
    Ok(())
}

/// Extracts the repro from the copies `ca`, `cb` into `repro`; notes what it lacks. Returns
/// whether a repro was written.
fn repro_warnings(ca: &Path, cb: &Path, repro: &Path, warnings: &mut Vec<String>) -> bool {
    // A repro that cannot be replayed (its op reads token ids the redaction zeroed) is no repro.
    let replayable = |x| read_trace(repro).and_then(|t| candle_trace_compare::repro::plan(&t, None).map(|_| ())).map(|()| x);
    match crate::replay::extract(ca, cb, repro).and_then(replayable) {
        Ok(x) => {
            if x.path != x.live_root_cause {
                warnings.push(format!(
                    "the repro holds {} (position {}), whose difference died out within its layer: the root cause {} was not dumped; re-record both runs with --dump covering it",
                    x.path, x.position, x.live_root_cause
                ));
            }
            if let Some(n) = x.b_operands_too_large {
                warnings.push(format!("b's operands of {} ({} MiB) are over what one frame of the repro holds: the repro replays a's op only", x.path, n >> 20));
            } else if !x.b_operands {
                warnings.push(format!("run b did not dump {}: the repro replays a's op only; re-record b with the same --dump as a", x.path));
            }
            true
        }
        Err(e) => {
            // The scratch folder's path is nobody's business: the files by name.
            let mut why = e.to_string();
            for p in [ca, cb, repro] {
                if let Some(n) = p.file_name() {
                    why = why.replace(&p.display().to_string(), &n.to_string_lossy());
                }
            }
            warnings.push(format!("no repro: {}", candle_trace_compare::text::clean(&why)));
            false
        }
    }
}

/// The markdown section saying what the bundle holds and what its reader should know.
fn held(entries: &[(String, std::path::PathBuf)], na: &str, nb: &str, warnings: &[String]) -> String {
    let cell = candle_trace_compare::text::cell;
    let mut o = String::from("\n### In this bundle\n\n- `report.md`: this report\n");
    for (n, _) in entries {
        let what = if n == na {
            "run a's trace, without its dumped values (`trace show`, `trace bisect`)"
        } else if n == nb {
            "run b's trace, likewise"
        } else {
            "the root-cause op with its operands: `trace replay repro.trace` re-runs it"
        };
        o.push_str(&format!("- `{}`: {what}\n", cell(n)));
    }
    for w in warnings {
        o.push_str(&format!("\n> **Note:** {}\n", candle_trace_compare::untrusted::Untrusted::new(w.as_str()).prose()));
    }
    o
}

/// Writes the zip: `report.md` and each entry, stored. Returns its size in bytes.
fn write_zip(out: &Path, report: &str, entries: &[(String, std::path::PathBuf)]) -> Result<u64> {
    let file = std::fs::File::create(out).map_err(|e| Error::io(out, e))?;
    let mut z = zip::ZipWriter::new(file);
    let stored = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored).large_file(false);
    let zerr = |e: zip::result::ZipError| Error::io(out, std::io::Error::other(e.to_string()));
    z.start_file("report.md", stored).map_err(zerr)?;
    z.write_all(report.as_bytes()).map_err(|e| Error::io(out, e))?;
    for (name, path) in entries {
        z.start_file(name.as_str(), stored).map_err(zerr)?;
        let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        std::io::copy(&mut f, &mut z).map_err(|e| Error::io(out, e))?;
    }
    z.finish().map_err(zerr)?;
    Ok(std::fs::metadata(out).map_err(|e| Error::io(out, e))?.len())
}
