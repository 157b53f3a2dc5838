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
    bytes[8] = 2;
    let v2 = d.path().join("v2.trace");
    std::fs::write(&v2, bytes).unwrap();
    refused(&["show", p(&v2)], &["v2.trace", "version 2", "reads version 1"]);
    refused(&["bisect", p(&t), p(&v2)], &["v2.trace", "version 2"]);
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
    let Some(m) = smollm2_path() else { return };
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
    refused(&["record", "--dtype", "f8", "-o", p(&o)], &["--dtype f8"]);
    refused(&["record", "--dtype", "q", "-o", p(&o)], &["builtin"]);
    refused(&["record", "--chat", "-o", p(&o)], &["chat template"]);
}
