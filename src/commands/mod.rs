//! What each subcommand does: one function a subcommand, over the library's calls, and the
//! helpers they share (stdout, JSON, output paths that must not be inputs, the progress bar).

pub(crate) mod bisect;
pub(crate) mod check;
pub(crate) mod files;
pub(crate) mod record;
pub(crate) mod repro;

use candle_trace::error::{Error, Result};
use candle_trace::tracer::Perturb;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The prompt `record` and `check` run when none is given.
pub(crate) const DEFAULT_PROMPT: &str = "Tell me about Richard Feynman.";

/// Writes to stdout; a closed pipe (`trace show x | head`) is not an error.
pub(crate) fn stdout(s: &str) -> Result<()> {
    let mut o = std::io::stdout().lock();
    match o.write_all(s.as_bytes()).and_then(|_| o.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(Error::usage(format!("cannot write to stdout: {e}"))),
        _ => Ok(()),
    }
}

/// Parses `--perturb` specs; one given twice is refused (two flips of one bit cancel).
pub(crate) fn parse_perturbs(specs: &[String]) -> Result<Vec<Perturb>> {
    let parsed = specs.iter().map(|p| p.parse::<Perturb>()).collect::<Result<Vec<_>>>()?;
    for (i, p) in parsed.iter().enumerate() {
        // An element not given is element 0.
        let same = |q: &Perturb| (&q.path, q.pos, q.element.unwrap_or(0)) == (&p.path, p.pos, p.element.unwrap_or(0));
        if parsed[..i].iter().any(same) {
            return Err(Error::usage(format!("--perturb {}: given twice (the second flip would undo the first)", p.to_arg())));
        }
    }
    Ok(parsed)
}

/// True when `a` and `b` name the same existing file (one inode: symlinks and hard links too).
pub(crate) fn same_file(a: &std::path::Path, b: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    matches!((std::fs::metadata(a), std::fs::metadata(b)), (Ok(x), Ok(y)) if x.dev() == y.dev() && x.ino() == y.ino())
}

/// Refuses `flag out` naming either input trace `a` or `b`: writing `what` there would destroy it.
pub(crate) fn not_an_input_trace(flag: &str, out: &Path, (a, b): (&Path, &Path), what: &str) -> Result<()> {
    if same_file(a, out) || same_file(b, out) {
        return Err(Error::usage(format!("{flag} {}: is an input trace; write {what} elsewhere", out.display())));
    }
    Ok(())
}

/// Refuses `-o` naming a file the run reads (each `(flag, file)`): the trace written over it
/// would destroy it.
pub(crate) fn not_over_inputs(out: Option<&Path>, inputs: &[(&str, &Option<PathBuf>)]) -> Result<()> {
    for (flag, f) in inputs {
        if let (Some(f), Some(o)) = (f, out) {
            if same_file(f, o) {
                return Err(Error::usage(format!("-o {}: is the {flag}; write the trace elsewhere", o.display())));
            }
        }
    }
    Ok(())
}

/// `v` as pretty JSON.
pub(crate) fn to_json<T: serde::Serialize>(v: &T) -> Result<String> {
    serde_json::to_string_pretty(v).map_err(|e| Error::usage(format!("cannot render JSON: {e}")))
}

/// A progress bar on stderr over `len` units, hidden with `--quiet` or when stderr is not a
/// terminal (indicatif's own check).
pub(crate) fn progress(len: u64, quiet: bool, unit: &str) -> indicatif::ProgressBar {
    if quiet {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    let style = indicatif::ProgressStyle::with_template(&format!("{{bar:30}} {{pos}}/{{len}} {unit} {{msg}}")).unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    bar.set_style(style);
    bar
}
