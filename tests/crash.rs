//! Crash safety: a recording killed with SIGKILL at many chosen moments (after N frames, or with
//! half a frame written) reads up to its last complete frame and says it is truncated; a full
//! disk or a read-only directory gives one line and exit 2 and no file that claims completion.
//! And the bad-CLI table: every subcommand refuses bad input with one line, exit 2, and writes
//! nothing.

use crate::util::{p, tmp, trace_s};
use candle_trace::crash::KILL_AT_VAR;
use candle_trace::format::{read_trace, PREAMBLE_LEN};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;

const RECORD: [&str; 4] = ["record", "--max-tokens", "12", "--prompt"];

fn frames(path: &Path) -> usize {
    let b = std::fs::read(path).unwrap();
    let (mut at, mut n) = (PREAMBLE_LEN, 0);
    while at + 17 <= b.len() {
        at += 17 + u32::from_le_bytes(b[at + 1..at + 5].try_into().unwrap()) as usize;
        n += 1;
    }
    n
}

#[test]
fn sigkill_at_every_frame_leaves_a_truncated_prefix() {
    let d = tmp();
    let full = d.path().join("full.trace");
    assert_eq!(trace_s(&[RECORD[0], RECORD[1], RECORD[2], RECORD[3], "Hello, candle!", "-o", p(&full)]).0, 0);
    let whole = read_trace(&full).unwrap();
    let n = frames(&full);
    // Kill after frame k (k = 0 is the header) for every frame but the footer, and halfway
    // through every frame including the footer.
    let mut points: Vec<String> = (0..n - 1).map(|k| k.to_string()).collect();
    points.extend((0..n).map(|k| format!("{k}.5")));
    assert!(points.len() >= 20, "only {} kill points", points.len());
    for at in &points {
        let out = d.path().join(format!("killed-{at}.trace"));
        let status = std::process::Command::new(env!("CARGO_BIN_EXE_trace"))
            .args([RECORD[0], RECORD[1], RECORD[2], RECORD[3], "Hello, candle!", "-o", p(&out)])
            .env(KILL_AT_VAR, at)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        assert_eq!(status.signal(), Some(9), "kill point {at}: {status:?}");
        match read_trace(&out) {
            Ok(t) => {
                assert!(t.truncated && t.footer.is_none(), "kill point {at}: claims to be complete");
                assert_eq!(t.items[..], whole.items[..t.items.len()], "kill point {at}: not a prefix of the full run");
                let (code, show, err) = trace_s(&["show", p(&out)]);
                assert_eq!(code, 0, "{err}");
                assert!(show.contains("TRUNCATED"), "{show}");
            }
            // Half a header frame: nothing to recover, and the reader says so.
            Err(e) => {
                assert_eq!(at, "0.5", "kill point {at}: {e}");
                assert!(e.to_string().contains("truncated before the header"), "{e}");
            }
        }
    }
}

/// Mounts a tmpfs of `size` bytes (read-only when `ro`) on `dir`; false (after saying why)
/// when this process may not mount, which fails the test on CI.
fn mount_tmpfs(dir: &Path, size: usize, ro: bool) -> bool {
    let opts = format!("size={size}{}", if ro { ",ro" } else { "" });
    let ok = std::process::Command::new("mount").args(["-t", "tmpfs", "-o", &opts, "tmpfs", p(dir)]).status().map(|s| s.success()).unwrap_or(false);
    if !ok {
        assert_ne!(std::env::var("CI").as_deref(), Ok("true"), "cannot mount a tmpfs on CI (needs root)");
        eprintln!("skipping: cannot mount a tmpfs here (needs root)");
    }
    ok
}

fn umount(dir: &Path) {
    let _ = std::process::Command::new("umount").arg(dir).status();
}

#[test]
fn full_disk_and_read_only_directory() {
    let d = tmp();
    let full = d.path().join("full");
    std::fs::create_dir(&full).unwrap();
    if !mount_tmpfs(&full, 24 * 1024, false) {
        return;
    }
    let out = full.join("t.trace");
    let (code, _, err) = trace_s(&[RECORD[0], RECORD[1], RECORD[2], RECORD[3], "Hello, candle!", "--dump", "all", "-o", p(&out)]);
    let complete = read_trace(&out).map(|t| !t.truncated);
    umount(&full);
    assert_eq!(code, 2, "{err}");
    // The note of the dump's expected size comes first, then the one-line error.
    assert!(err.lines().next().is_some_and(|l| l.starts_with("note: --dump all: about ")), "{err}");
    let err = err.lines().skip(1).collect::<Vec<_>>().join("\n");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("t.trace") && err.contains("No space left on device"), "{err}");
    assert!(!matches!(complete, Ok(true)), "a file on the full disk claims completion");

    let ro = d.path().join("ro");
    std::fs::create_dir(&ro).unwrap();
    if !mount_tmpfs(&ro, 24 * 1024, true) {
        return;
    }
    let out = ro.join("t.trace");
    let (code, _, err) = trace_s(&["record", "--max-tokens", "2", "-o", p(&out)]);
    let exists = out.exists();
    umount(&ro);
    assert_eq!(code, 2, "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("t.trace") && err.contains("Read-only file system"), "{err}");
    assert!(!exists);
}

#[test]
fn bad_cli_input_table() {
    let d = tmp();
    let good = d.path().join("good.trace");
    assert_eq!(trace_s(&["record", "--max-tokens", "2", "-o", p(&good)]).0, 0);
    let empty = d.path().join("empty.trace");
    std::fs::write(&empty, b"").unwrap();
    let dir = d.path().join("a-dir");
    std::fs::create_dir(&dir).unwrap();
    let missing = d.path().join("missing.trace");
    let outdir = d.path().join("out");
    std::fs::create_dir(&outdir).unwrap();
    let o = outdir.join("o.trace");
    let bad_json_file = d.path().join("prompts.txt");
    std::fs::write(&bad_json_file, "fine\n\"unterminated\n").unwrap();
    let bad_json = p(&bad_json_file).to_string();
    let (g, e, dd, m, oo) = (p(&good), p(&empty), p(&dir), p(&missing), p(&o));
    let table: Vec<(&str, Vec<&str>, &str)> = vec![
        ("record: missing model", vec!["record", "--model", m, "-o", oo], "missing.trace"),
        ("record: directory as prompt file", vec!["record", "--prompt-file", dd, "-o", oo], "a-dir"),
        ("record: empty model file", vec!["record", "--model", e, "-o", oo], "empty.trace"),
        ("record: wrong number type", vec!["record", "--max-tokens", "ten", "-o", oo], "--max-tokens"),
        ("record: negative count", vec!["record", "--max-tokens", "-1", "-o", oo], "invalid value '-1' for '--max-tokens"),
        ("record: negative seed", vec!["record", "--seed", "-5", "-o", oo], "invalid value '-5' for '--seed"),
        ("check: negative runs", vec!["check", "--runs", "-3"], "invalid value '-3' for '--runs"),
        ("record: conflicting flags", vec!["record", "--prompt", "x", "--prompt-file", g, "-o", oo], "cannot be used with"),
        ("record: malformed --dump", vec!["record", "--dump", "layers 3", "-o", oo], "--dump"),
        ("record: empty --dump pattern", vec!["record", "--dump", "a,,b", "-o", oo], "--dump"),
        ("record: -o a directory", vec!["record", "-o", dd], "a-dir"),
        ("record: bad --model-name", vec!["record", "--model-name", "a/b", "-o", oo], "--model-name"),
        ("record: empty --prompts-file", vec!["record", "--prompts-file", e, "-o", oo], "holds no prompt"),
        ("record: --prompts-file a directory", vec!["record", "--prompts-file", dd, "-o", oo], "a-dir"),
        ("record: --prompts-file with a broken JSON line", vec!["record", "--prompts-file", &bad_json, "-o", oo], "not a JSON string"),
        ("show: missing file", vec!["show", m], "missing.trace"),
        ("show: directory", vec!["show", dd], "a-dir"),
        ("show: empty file", vec!["show", e], "empty file"),
        ("show: bad format", vec!["show", g, "--format", "xml"], "--format"),
        ("bisect: missing file", vec!["bisect", g, m], "missing.trace"),
        ("bisect: directory", vec!["bisect", dd, g], "a-dir"),
        ("bisect: empty file", vec!["bisect", g, e], "empty file"),
        ("bisect: one argument", vec!["bisect", g], "required"),
        ("replay: missing file", vec!["replay", m], "missing.trace"),
        ("replay: directory", vec!["replay", dd], "a-dir"),
        ("replay: empty file", vec!["replay", e], "empty file"),
        ("replay: wrong number type", vec!["replay", g, "--op", "first"], "--op"),
        ("replay: --op out of range", vec!["replay", g, "--op", "999999"], "--op 999999"),
        ("replay: --threads 0", vec!["replay", g, "--threads", "0"], "--threads"),
        ("replay: --dtype q", vec!["replay", g, "--dtype", "q"], "--dtype"),
        ("extract: missing file", vec!["extract", m, g, "-o", oo], "missing.trace"),
        ("extract: directory", vec!["extract", g, dd, "-o", oo], "a-dir"),
        ("extract: empty file", vec!["extract", e, g, "-o", oo], "empty file"),
        ("extract: identical runs", vec!["extract", g, g, "-o", oo], "nothing to extract"),
        ("redact: missing file", vec!["redact", m, "-o", oo], "missing.trace"),
        ("redact: directory", vec!["redact", dd, "-o", oo], "a-dir"),
        ("redact: empty file", vec!["redact", e, "-o", oo], "empty file"),
        ("redact: unknown --keep", vec!["redact", g, "--keep", "everything", "-o", oo], "--keep"),
        ("redact: -o is the input", vec!["redact", g, "-o", g], "is the input"),
        ("no subcommand argument", vec!["frobnicate"], "frobnicate"),
    ];
    for (case, args, needle) in &table {
        let (code, out, err) = trace_s(args);
        assert_eq!(code, 2, "{case}: exit {code}\nstdout {out}\nstderr {err}");
        assert_eq!(err.lines().count(), 1, "{case}: not one line:\n{err}");
        assert!(err.starts_with("trace: error: ") && err.contains(needle), "{case}: {needle:?} not in {err}");
        assert!(!err.contains("panicked"), "{case}: {err}");
        assert!(out.is_empty(), "{case}: printed {out}");
        assert_eq!(std::fs::read_dir(&outdir).unwrap().count(), 0, "{case}: wrote a file");
    }
}
