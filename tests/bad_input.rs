//! Bad input gives one line on stderr naming the file and the problem, and exit code 2 — never a
//! panic or a backtrace.

use crate::util::{p, smollm2_path, tmp, trace_s};
use candle_core::quantized::gguf_file;

/// Asserts exit 2 and a single `trace: error:` line containing every needle.
fn refused(args: &[&str], needles: &[&str]) {
    let (code, out, err) = trace_s(args);
    assert_eq!(code, 2, "args {args:?}\nstdout {out}\nstderr {err}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "expected one line, got:\n{err}");
    assert!(lines[0].starts_with("trace: error: "), "{err}");
    for n in needles {
        assert!(lines[0].contains(n), "missing {n:?} in {err}");
    }
    assert!(!err.contains("panicked"));
}

fn small_trace(dir: &std::path::Path) -> std::path::PathBuf {
    let t = dir.join("ok.trace");
    assert_eq!(trace_s(&["record", "--max-tokens", "2", "-o", p(&t)]).0, 0);
    t
}

#[test]
fn missing_model_file() {
    refused(&["record", "--model", "/nonexistent/model.gguf", "-o", "/tmp/x.trace"], &["/nonexistent/model.gguf", "No such file"]);
}

#[test]
fn model_file_that_is_not_gguf() {
    let d = tmp();
    let f = d.path().join("notes.gguf");
    std::fs::write(&f, "hello, not a model").unwrap();
    refused(&["record", "--model", p(&f), "-o", p(&d.path().join("x.trace"))], &["notes.gguf", "not a GGUF file"]);
}

#[test]
fn gguf_of_unsupported_architecture() {
    let d = tmp();
    let f = d.path().join("bert.gguf");
    let mut w = std::fs::File::create(&f).unwrap();
    let arch = gguf_file::Value::String("bert".into());
    gguf_file::write(&mut w, &[("general.architecture", &arch)], &[]).unwrap();
    drop(w);
    refused(&["record", "--model", p(&f), "-o", p(&d.path().join("x.trace"))], &["bert.gguf", "unsupported architecture 'bert'", "supported: llama"]);
}

#[test]
fn trace_of_another_format_version() {
    let d = tmp();
    let t = small_trace(d.path());
    let mut bytes = std::fs::read(&t).unwrap();
    bytes[8] = 3;
    let v3 = d.path().join("v3.trace");
    std::fs::write(&v3, bytes).unwrap();
    refused(&["show", p(&v3)], &["v3.trace", "version 3.x is newer", "reads (version 2.x)"]);
    refused(&["bisect", p(&t), p(&v3)], &["v3.trace", "version 3"]);
}

#[test]
fn trace_truncated_before_header() {
    let d = tmp();
    let t = small_trace(d.path());
    let bytes = std::fs::read(&t).unwrap();
    let cut = d.path().join("cut.trace");
    std::fs::write(&cut, &bytes[..20]).unwrap();
    refused(&["show", p(&cut)], &["cut.trace", "truncated before the header"]);
}

#[test]
fn garbage_trace() {
    let d = tmp();
    let g = d.path().join("garbage.trace");
    std::fs::write(&g, (0..4096u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect::<Vec<_>>()).unwrap();
    refused(&["show", p(&g)], &["garbage.trace", "not a candle-trace file"]);
    let empty = d.path().join("empty.trace");
    std::fs::write(&empty, b"").unwrap();
    refused(&["bisect", p(&empty), p(&g)], &["empty.trace", "not a candle-trace file"]);
}

#[test]
fn corrupt_frame() {
    let d = tmp();
    let t = small_trace(d.path());
    let mut bytes = std::fs::read(&t).unwrap();
    let n = bytes.len();
    bytes[n - 10] ^= 0xff; // inside the footer frame's payload
    let c = d.path().join("corrupt.trace");
    std::fs::write(&c, bytes).unwrap();
    refused(&["show", p(&c)], &["corrupt.trace", "frame at byte"]);
}

#[test]
fn missing_trace_file() {
    refused(&["show", "/nonexistent/a.trace"], &["/nonexistent/a.trace"]);
}

#[test]
fn bisect_traces_of_different_models() {
    let m = smollm2_path();
    let d = tmp();
    let a = small_trace(d.path());
    let b = d.path().join("smol.trace");
    assert_eq!(trace_s(&["record", "--model", p(&m), "--max-tokens", "1", "-o", p(&b)]).0, 0);
    refused(&["bisect", p(&a), p(&b)], &["different models", "builtin", "SmolLM2-135M-Instruct.Q4_1.gguf"]);
}

#[test]
fn perturb_of_unknown_module_path() {
    let d = tmp();
    refused(&["record", "--max-tokens", "2", "--perturb", "layers.99.mlp.up_proj", "-o", p(&d.path().join("x.trace"))], &["layers.99.mlp.up_proj"]);
}

#[test]
fn bad_dtype_and_chat_without_template() {
    let d = tmp();
    let o = d.path().join("x.trace");
    refused(&["record", "--dtype", "f8", "-o", p(&o)], &["'f8'", "--dtype", "possible values: q, f32, f16, bf16"]);
    refused(&["record", "--dtype", "q", "-o", p(&o)], &["builtin"]);
    refused(&["record", "--chat", "-o", p(&o)], &["chat template"]);
}

/// A prompt file is read no further than a trace can store (16 MiB): `/dev/zero` is refused,
/// not read until memory runs out; bytes that are not UTF-8 are named as such.
#[test]
fn prompt_files_are_capped_and_text() {
    let d = tmp();
    let o = d.path().join("x.trace");
    if std::path::Path::new("/dev/zero").exists() {
        refused(&["record", "--prompt-file", "/dev/zero", "-o", p(&o)], &["--prompt-file /dev/zero", "over 16 MiB"]);
        refused(&["record", "--prompts-file", "/dev/zero", "-o", p(&o)], &["--prompts-file /dev/zero", "over 16 MiB"]);
        refused(&["record", "--texts-file", "/dev/zero", "-o", p(&o)], &["--texts-file /dev/zero", "over 16 MiB"]);
    }
    let bin = d.path().join("bin.txt");
    std::fs::write(&bin, [0x66u8, 0xff, 0xfe, 0x0a]).unwrap();
    refused(&["record", "--prompt-file", p(&bin), "-o", p(&o)], &["bin.txt", "not UTF-8"]);
    assert!(!o.exists());
}

#[test]
fn usage_errors_are_one_line() {
    refused(&["record"], &["--out"]);
    refused(&["record", "--untraced", "-o", "x.trace"], &["cannot be used with"]);
    // Options that would have no effect together.
    refused(&["record", "--summary-worker", "--stop-on-nonfinite", "-o", "x.trace"], &["'--summary-worker' cannot be used with '--stop-on-nonfinite'"]);
    refused(&["record", "--summary-worker", "--untraced"], &["'--summary-worker' cannot be used with '--untraced'"]);
    refused(&["record", "--untraced", "--dump", "all"], &["cannot be used with"]);
    refused(&["bisect", "a.trace"], &["<B>"]);
    refused(&["show", "x.trace", "--format", "xml"], &["xml"]);
    refused(&["frobnicate"], &["frobnicate"]);
}

#[test]
fn sampling_settings_are_checked_before_running() {
    let d = tmp();
    let o = d.path().join("x.trace");
    refused(&["record", "--temperature", "NaN", "-o", p(&o)], &["--temperature"]);
    refused(&["record", "--temperature=-1", "-o", p(&o)], &["--temperature"]);
    refused(&["record", "--temperature", "0.8", "--top-p", "2", "-o", p(&o)], &["--top-p 2"]);
    refused(&["record", "--temperature", "0.8", "--top-k", "0", "-o", p(&o)], &["--top-k 0"]);
    refused(&["record", "--top-k", "5", "-o", p(&o)], &["--temperature"]);
    refused(&["record", "--batch", "4294967295", "-o", p(&o)], &["--batch"]);
    refused(&["record", "--max-tokens", "5000", "-o", p(&o)], &["--max-tokens 5000", "4096"]);
    refused(&["record", "--perturb", "layers.0.mlp.act@9999", "-o", p(&o)], &["never computed"]);
    refused(&["record", "--perturb", "x@5@6", "-o", p(&o)], &["PATH@POSITION"]);
    assert!(!o.exists(), "a refused run must not create its trace file");
}

/// Regression (fresh-eyes review): an existing trace survives a refused run.
#[test]
fn refused_record_keeps_existing_trace() {
    let d = tmp();
    let t = small_trace(d.path());
    let before = std::fs::read(&t).unwrap();
    refused(&["record", "--perturb", "foo", "-o", p(&t)], &["foo"]);
    assert_eq!(std::fs::read(&t).unwrap(), before);
    // A file where check's plan folder goes: said so (it was "File exists (os error 17)").
    refused(&["check", "--plan", p(&t), "--runs", "1"], &["is a file, not a folder"]);
    assert_eq!(std::fs::read(&t).unwrap(), before);
}

/// `trace` alone is a usage error (exit 2) that prints the help, on stderr (it exited 0; found
/// by a fresh-user trial); `--help` and `--version` exit 0.
#[test]
fn no_subcommand_is_a_usage_error_with_the_help() {
    let (code, out, err) = trace_s(&[]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(out.is_empty() && err.contains("Usage: trace <COMMAND>") && err.contains("bisect"), "{err}");
    assert_eq!(trace_s(&["--help"]).0, 0);
    assert_eq!(trace_s(&["--version"]).0, 0);
}

/// Regression (fresh-eyes review): a header-only trace is not "identical" to anything.
#[test]
fn bisect_with_nothing_in_common_is_an_error() {
    let d = tmp();
    let t = small_trace(d.path());
    let bytes = std::fs::read(&t).unwrap();
    let clen = u32::from_le_bytes(bytes[13..17].try_into().unwrap()) as usize;
    let header_only = d.path().join("header-only.trace");
    std::fs::write(&header_only, &bytes[..12 + 17 + clen]).unwrap();
    refused(&["bisect", p(&header_only), p(&t)], &["nothing to compare", "header-only.trace (0 op records, truncated)"]);
    // Replaying an op of it says it holds none, being truncated (it said "op records 0 to 0").
    refused(&["replay", p(&header_only), "--op", "5"], &["header-only.trace", "the trace has no op record (it is truncated)"]);
    // Without --op it says the file is cut, not that nothing was dumped (record with --dump).
    refused(&["replay", p(&header_only)], &["header-only.trace", "is truncated (the run did not finish, or the file was cut) and its complete frames hold no dumped op"]);
}

/// Regression (fresh-eyes review): dropping a whole, intact frame is detected.
#[test]
fn missing_frame_is_detected() {
    let d = tmp();
    let t = small_trace(d.path());
    let bytes = std::fs::read(&t).unwrap();
    // Walk the frames: preamble, header, items..., footer. Drop the first items frame.
    let mut at = 12;
    let mut frames = Vec::new();
    while at < bytes.len() {
        let clen = u32::from_le_bytes(bytes[at + 1..at + 5].try_into().unwrap()) as usize;
        frames.push((bytes[at], at, at + 17 + clen));
        at += 17 + clen;
    }
    assert!(frames.len() >= 4, "header, at least two items frames, footer");
    // The first items frame (kind 2; the build fingerprint, kind 129, may come before it).
    let &(_, s, e) = frames.iter().find(|f| f.0 == 2).expect("an items frame");
    let mut cut = bytes[..s].to_vec();
    cut.extend_from_slice(&bytes[e..]);
    let f = d.path().join("dropped.trace");
    std::fs::write(&f, cut).unwrap();
    refused(&["show", p(&f)], &["dropped.trace", "missing or repeated"]);
}

#[test]
fn closed_stdout_is_not_an_error() {
    let d = tmp();
    let t = small_trace(d.path());
    // A pipe whose read end is closed before the child starts: every write to it fails with
    // EPIPE, deterministically (no race with a reader that closes late).
    let mut fds = [0i32; 2];
    // SAFETY: pipe(2) with a valid 2-element array; both fds are owned below.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    use std::os::fd::FromRawFd;
    // SAFETY: fds[0] and fds[1] were just returned by pipe(2) and are owned by nobody else.
    let (read_end, write_end) = unsafe { (std::os::fd::OwnedFd::from_raw_fd(fds[0]), std::os::fd::OwnedFd::from_raw_fd(fds[1])) };
    drop(read_end);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_trace")).args(["show", p(&t)]).stdout(std::process::Stdio::from(write_end)).stderr(std::process::Stdio::piped()).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
#[cfg(not(feature = "cuda"))]
fn gpu_device_without_the_feature() {
    let d = tmp();
    let o = d.path().join("x.trace");
    refused(&["record", "--device", "cuda:0", "-o", p(&o)], &["--device cuda:0", "--features cuda"]);
    refused(&["record", "--device", "tpu", "-o", p(&o)], &["tpu", "--device", "expected cpu, cuda, cuda:N, metal or metal:N"]);
    refused(&["replay", "x.trace", "--op", "0", "--device", "cuda:x"], &["cuda:x", "expected cpu, cuda"]);
}

/// `--help` marks what is required, lists enum values, describes every positional argument,
/// and usage errors point to the subcommand's own help.
#[test]
fn help_marks_required_and_lists_values() {
    let (code, out, _) = trace_s(&["record", "--help"]);
    assert_eq!(code, 0);
    let required = out.find("Required:").expect(&out);
    assert!(out[required..].contains("-o, --out <FILE>"), "{out}");
    assert!(out.contains("[possible values: q, f32, f16, bf16]"), "{out}");
    for sub in ["bisect", "show", "replay", "extract", "redact"] {
        let (_, out, _) = trace_s(&[sub, "--help"]);
        let args = out.split("Arguments:").nth(1).unwrap_or_else(|| panic!("{sub}: no Arguments section\n{out}"));
        for line in args.lines().take_while(|l| !l.trim().is_empty()).filter(|l| l.trim_start().starts_with('<')) {
            assert!(line.split_whitespace().count() > 1, "{sub}: positional without a description: {line}");
        }
    }
    let (code, _, err) = trace_s(&["bisect", "only-one.trace"]);
    assert_eq!(code, 2);
    assert!(err.contains("(see trace bisect --help)"), "{err}");
    // Every subcommand's help says its exit codes.
    for sub in ["record", "bisect", "check", "report", "replay", "extract", "bundle", "show", "redact"] {
        let (_, out, _) = trace_s(&[sub, "--help"]);
        let flat = out.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(flat.contains("Exit 0") && flat.contains("2 error"), "{sub}: no exit codes in its help\n{out}");
    }
}

/// A GGUF file whose `output.weight` is listed but cut short is refused, naming the tensor: its
/// output projection is not silently replaced by the embeddings (the tied-embeddings reading of
/// a file without one).
#[test]
fn gguf_whose_output_projection_does_not_read() {
    let d = tmp();
    let seeded = d.path().join("phi3.gguf");
    crate::gguf_archs::write_seeded_gguf(&seeded, "phi3", 4, candle_core::quantized::GgmlDType::F32);
    // The same tensors and metadata, `output.weight` written last, then the file cut inside it.
    let (ct, mut f) = candle_trace::models::gguf::open(&seeded).unwrap();
    let mut names: Vec<&String> = ct.tensor_infos.keys().filter(|n| *n != "output.weight").collect();
    names.sort();
    names.push(ct.tensor_infos.keys().find(|n| *n == "output.weight").expect("phi3 has an output.weight"));
    let tensors: Vec<(&str, candle_core::quantized::QTensor)> = names.iter().map(|n| (n.as_str(), ct.tensor(&mut f, n, &candle_core::Device::Cpu).unwrap())).collect();
    let md: Vec<(&str, &gguf_file::Value)> = ct.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let cut = d.path().join("cut.gguf");
    let mut w = std::fs::File::create(&cut).unwrap();
    gguf_file::write(&mut w, &md, &tensors.iter().map(|(n, t)| (*n, t)).collect::<Vec<_>>()).unwrap();
    let len = w.metadata().unwrap().len();
    w.set_len(len - 1000).unwrap();
    drop(w);
    refused(&["record", "--model", p(&cut), "-o", p(&d.path().join("x.trace"))], &["cut.gguf", "tensor output.weight"]);
}

/// `report`, `extract` and `bundle` refuse `-o` naming either input trace (a link to it too), and
/// the input is left as it was.
#[test]
fn writing_over_an_input_trace_is_refused() {
    let d = tmp();
    let a = small_trace(d.path());
    let b = d.path().join("b.trace");
    std::fs::copy(&a, &b).unwrap();
    let link = d.path().join("link.trace");
    std::os::unix::fs::symlink(&a, &link).unwrap();
    let before = std::fs::read(&a).unwrap();
    for (cmd, what) in [("report", "the report"), ("extract", "the repro"), ("bundle", "the bundle")] {
        refused(&[cmd, p(&a), p(&b), "-o", p(&b)], &["-o ", "b.trace: is an input trace", &format!("write {what} elsewhere")]);
        refused(&[cmd, p(&a), p(&b), "-o", p(&link)], &["link.trace: is an input trace"]);
    }
    assert_eq!(std::fs::read(&a).unwrap(), before);
    assert_eq!(std::fs::read(&b).unwrap(), before);
}
