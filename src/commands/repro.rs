//! The commands around one op: `trace replay` (re-run a dumped op here), `trace extract` (cut
//! it into a repro trace, and a candle-only Cargo project) and `trace bundle` (the zip for a
//! bug report).

use super::{not_an_input_trace, stdout, to_json};
use crate::cli::{BundleArgs, ExtractArgs, FloatArg, ReplayArgs, ShowFormat};
use candle_trace::env;
use candle_trace::error::{Error, Result};
use candle_trace::format::read_trace;
use candle_trace::models::WeightDtype;

/// `trace replay`.
pub(crate) fn replay_cmd(ReplayArgs { file, op, dtype, threads, device, format }: ReplayArgs) -> Result<u8> {
    if let Some(n) = threads {
        env::pin_threads(n)?;
    }
    let dtype = match dtype.map(FloatArg::weight) {
        Some(WeightDtype::Dense(d)) => Some(d),
        _ => None,
    };
    let t = read_trace(&file)?;
    let dev = device.open()?;
    // Operands are checked before candle runs (repro::fits); should candle still panic on
    // a crafted one, that is one line naming the file, not a backtrace.
    std::panic::set_hook(Box::new(|_| {}));
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| candle_trace::replay::replay(&t, op, dtype, &dev)));
    let _ = std::panic::take_hook();
    let r = match outcome {
        Ok(Ok(r)) => r,
        Ok(Err(Error::Candle(e))) => return Err(Error::trace(&file, format!("replay: tensor op failed: {e}"))),
        Ok(Err(e)) => return Err(e),
        Err(_) => return Err(Error::trace(&file, "replay: the op panicked inside candle on these operands")),
    };
    match format {
        ShowFormat::Text => stdout(&candle_trace::replay::text(&r))?,
        ShowFormat::Json => stdout(&format!("{}\n", to_json(&r)?))?,
    }
    Ok(if r.matches_recording { 0 } else { 1 })
}

/// `trace extract`.
pub(crate) fn extract_cmd(ExtractArgs { a, b, out, candle }: ExtractArgs) -> Result<u8> {
    not_an_input_trace("-o", &out, (&a, &b), "the repro")?;
    if let Some(dir) = &candle {
        candle_trace::candle_repro::check_dir(dir, Some(&out))?;
    }
    let r = candle_trace::replay::extract(&a, &b, &out)?;
    if r.path != r.live_root_cause {
        eprintln!("note: the root cause {} was not dumped; extracted the earlier {} (it died out within its layer)", r.live_root_cause, r.path);
    }
    stdout(&format!("wrote {}: {} ({}) at position {}, {} bytes\n", out.display(), r.path, r.op, r.position, r.bytes))?;
    if let Some(n) = r.b_operands_too_large {
        eprintln!("note: b's operands of the op ({} MiB) are over what one frame of the repro holds: left out, so `trace replay` runs a's op only", n >> 20);
    }
    if r.holds_prompt {
        eprintln!("note: the repro holds the prompt (its text and token ids, in the runs' headers): `trace redact` it, or use `trace bundle`, before attaching it in public");
    }
    if let Some(dir) = candle {
        // The repro is written either way: an error here says so.
        candle_trace::candle_repro::write(&read_trace(&out)?, &dir).map_err(|e| Error::usage(format!("{e} (the repro trace {} was written; `trace replay` runs it)", out.display())))?;
        stdout(&format!("wrote {}: a Cargo project that re-runs the op with candle alone (cargo run --release in it)\n", dir.display()))?;
    }
    Ok(0)
}

/// `trace bundle`.
pub(crate) fn bundle_cmd(BundleArgs { a, b, keep, no_traces, limit, out }: BundleArgs) -> Result<u8> {
    not_an_input_trace("-o", &out, (&a, &b), "the bundle")?;
    let opts = candle_trace::bundle::BundleOptions { keep_prompt: keep.iter().any(|k| k == "prompt"), traces: !no_traces, limit };
    let r = candle_trace::bundle::bundle(&a, &b, &out, &opts)?;
    let files: Vec<String> = r.files.iter().map(|(n, b)| format!("{n} ({b} bytes)")).collect();
    stdout(&format!("wrote {} ({} bytes): {}; bisect {}\n", out.display(), r.bytes, files.join(", "), r.verdict))?;
    for w in &r.warnings {
        eprintln!("note: {}", candle_trace::text::clean(w));
    }
    Ok(if r.bytes > opts.limit { 1 } else { 0 })
}
