//! The commands over one trace: `trace show`, `trace redact`, and `trace import` (a reference
//! run's exchange folder into a trace).

use super::{same_file, stdout, to_json};
use crate::cli::{ImportArgs, RedactArgs, ShowArgs, ShowFormat};
use candle_trace::error::{Error, Result};
use candle_trace::format::read_trace;
use candle_trace::show;

/// `trace show`.
pub(crate) fn show_cmd(ShowArgs { file, format, sites, model }: ShowArgs) -> Result<u8> {
    // Read a frame at a time: memory does not grow with the trace's length.
    let mut s = show::summarize_file(&file)?;
    if let Some(m) = &model {
        s.received = candle_trace::recorder::received_prompt(&s.header, m)?;
        if s.received.is_none() {
            eprintln!("note: --model: this trace holds no single prompt's token ids to decode (redacted, an encoder's texts, or a batch of prompts)");
        }
    }
    if sites {
        match format {
            ShowFormat::Text => stdout(&show::sites_text(&s))?,
            ShowFormat::Json => stdout(&format!("{}\n", to_json(&s.sites)?))?,
        }
        return Ok(0);
    }
    match format {
        ShowFormat::Text => stdout(&show::text(&s))?,
        ShowFormat::Json => stdout(&format!("{}\n", to_json(&s)?))?,
    }
    Ok(0)
}

/// `trace redact`.
pub(crate) fn redact_cmd(RedactArgs { file, keep, out }: RedactArgs) -> Result<u8> {
    let t = read_trace(&file)?;
    if same_file(&file, &out) {
        return Err(Error::usage(format!("-o {}: is the input trace; write the copy elsewhere", out.display())));
    }
    let keep = candle_trace::redact::Keep { prompt: keep.iter().any(|k| k == "prompt"), values: keep.iter().any(|k| k == "values") };
    let r = candle_trace::redact::redact(&t, &keep);
    candle_trace::redact::write(&r, &out)?;
    let removed = if r.removed.is_empty() { "nothing left to remove (already redacted?)".to_string() } else { format!("removed {}", r.removed.join(", ")) };
    stdout(&format!("wrote {}: {removed}\n", out.display()))?;
    if r.values_kept > 0 {
        eprintln!(
            "note: {} keeps {} dumped float values (a repro's operands, which replay needs, or --keep values): values of the first layers tell their tokens to anyone with the model",
            out.display(),
            r.values_kept
        );
    }
    Ok(0)
}

/// `trace import`: a reference run's exchange folder into a trace.
pub(crate) fn import_cmd(ImportArgs { dir, dump, out }: ImportArgs) -> Result<u8> {
    if !dir.is_dir() {
        return Err(Error::usage(format!("{}: not a folder (give the folder the reference recorder wrote with --out)", dir.display())));
    }
    let dump = candle_trace::dump::DumpSpec::parse(&dump)?;
    let r = candle_trace::import::import(&dir, &out, &dump)?;
    let kept = if dump == candle_trace::dump::DumpSpec::All { "with their values".to_string() } else { format!("(values of {})", dump.to_arg()) };
    stdout(&format!("wrote {}: {} forward passes, {} op records {kept}, {} tokens, from {}\n", out.display(), r.forward_passes, r.op_records, r.tokens, r.implementation))?;
    for n in &r.not_covered {
        eprintln!("note: the reference does not record: {n}");
    }
    Ok(0)
}
