//! `trace record`: the flags into the recorder's options, the run, and what it printed.

use super::{not_over_inputs, parse_perturbs, stdout, DEFAULT_PROMPT};
use crate::cli::{DtypeArg, RecordArgs};
use candle_trace::env;
use candle_trace::error::{Error, Result};
use candle_trace::generate::{GenConfig, MAX_BATCH};
use candle_trace::recorder::{record, RecordOptions, RecordOutcome};
use std::path::Path;

/// What a run is fed, from the prompt and text flags.
struct Inputs {
    /// The prompt (the first of a batch of requests).
    prompt: String,
    /// A batch of different requests, one per row; empty for one request.
    prompts: Vec<String>,
    /// An encoder's sentences (`--batch N` repeats them N times).
    texts: Vec<String>,
    /// Batch rows, each holding the prompt (1 for an encoder: its copies are in `texts`).
    batch: usize,
}

/// `trace record`.
pub(crate) fn record_cmd(args: RecordArgs, env_vars: Vec<(String, String)>) -> Result<u8> {
    not_over_inputs(args.out.as_deref(), &[("--prompt-file", &args.prompt_file), ("--prompts-file", &args.prompts_file), ("--texts-file", &args.texts_file)])?;
    args.threads.map(env::pin_threads).transpose()?;
    let Inputs { prompt, prompts, texts, batch } = inputs(&args)?;
    if args.prefill_chunk == Some(0) {
        return Err(Error::usage("--prefill-chunk must be at least 1"));
    }
    let RecordArgs {
        model, chat, max_tokens, dtype, prefill_chunk, sampling, seed, perturb, dump, device, stop_on_nonfinite, untraced, model_name, numerics, quiet, level, summary_worker, out, ..
    } = args;
    let opts = RecordOptions {
        model,
        prompt,
        prompts,
        chat,
        dtype: dtype.map(DtypeArg::weight),
        gen: sampling.apply(GenConfig { max_tokens: max_tokens.unwrap_or(GenConfig::default().max_tokens), prefill_chunk: prefill_chunk.unwrap_or(0), batch, seed, ..GenConfig::default() })?,
        threads: candle_core::utils::get_num_threads(),
        env_vars,
        perturb: parse_perturbs(&perturb)?,
        out: if untraced { None } else { out },
        stop_on_nonfinite,
        texts,
        dump: candle_trace::dump::DumpSpec::parse(&dump)?,
        device,
        model_name,
        numerics: numerics.numerics(),
        progress: !quiet,
        level,
        summary_worker,
    };
    let outcome = record(&opts)?;
    print_outcome(&opts, &outcome)?;
    Ok(0)
}

/// The prompt, the batch of requests or the encoder's sentences the flags give, read from their
/// files (empty lines skipped, and counted on stderr).
///
/// # Errors
/// [`Error::Usage`] for `--max-tokens` with sentences, a `--batch` of sentences out of range,
/// and a file that cannot be read.
fn inputs(args: &RecordArgs) -> Result<Inputs> {
    let lines = |f: &Path, flag: &str| -> Result<Vec<String>> {
        let (v, skipped) = candle_trace::recorder::read_prompts_file(f, flag)?;
        if skipped > 0 {
            eprintln!("note: {}: {skipped} empty line(s) skipped", f.display());
        }
        Ok(v)
    };
    let mut texts = match &args.texts_file {
        Some(f) => lines(f, "--texts-file")?,
        None => args.texts.clone(),
    };
    if !texts.is_empty() && args.max_tokens.is_some() {
        return Err(Error::usage("--max-tokens with --text: --text embeds sentences with an encoder folder, in one forward pass that generates no token"));
    }
    // Encoders: --batch N repeats the sentences (N copies of each request in one batch).
    let batch = if texts.is_empty() {
        args.batch
    } else if (1..=MAX_BATCH).contains(&args.batch) {
        texts = std::iter::repeat_n(texts, args.batch).flatten().collect();
        1
    } else {
        return Err(Error::usage(format!("--batch {}: expected 1 to {MAX_BATCH}", args.batch)));
    };
    let mut prompts: Vec<String> = match (&args.prompts_file, args.prompt.len()) {
        (Some(f), _) => lines(f, "--prompts-file")?,
        (None, n) if n > 1 => args.prompt.clone(),
        _ => Vec::new(),
    };
    let prompt = match (args.prompt.first(), &args.prompt_file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => candle_trace::recorder::read_text_file(f, "--prompt-file")?,
        (None, None) => prompts.first().cloned().unwrap_or_else(|| DEFAULT_PROMPT.to_string()),
    };
    if prompts.len() == 1 {
        prompts.clear();
    }
    Ok(Inputs { prompt, prompts, texts, batch })
}

/// Prints a run's text (each row's, for a batch of requests) or its embeddings on stdout, and
/// on stderr a NaN or Inf it met and what it wrote.
fn print_outcome(opts: &RecordOptions, outcome: &RecordOutcome) -> Result<()> {
    if outcome.embeddings.is_empty() && outcome.generation.texts.len() > 1 && !opts.prompts.is_empty() {
        // A batch of different requests: each row's text.
        for (r, t) in outcome.generation.texts.iter().enumerate() {
            stdout(&format!("[{r}] {t}\n"))?;
        }
    } else if outcome.embeddings.is_empty() {
        stdout(&format!("{}\n", outcome.generation.texts.first().map(String::as_str).unwrap_or("")))?;
    } else {
        for (text, e) in opts.texts.iter().zip(&outcome.embeddings) {
            stdout(&format!("{} dims, |e| = {:.6}: {text:?}\n", e.len(), e.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>().sqrt()))?;
        }
    }
    if matches!(outcome.generation.stop, candle_trace::fields::StopReason::NonFinite { .. }) {
        eprintln!("stopped: {}", outcome.generation.stop);
    } else if let Some(at) = &outcome.first_nonfinite {
        // The run finished, but its numbers did not stay finite (f16 overflow, for one): say so.
        eprintln!("warning: a NaN or Inf first appeared at {at}; later outputs (and the text) may be meaningless (trace show names it; --stop-on-nonfinite ends a run there)");
    }
    if let Some(path) = &opts.out {
        // A pipe or a device (`-o /dev/null`) has no size to give.
        let size = std::fs::metadata(path).ok().filter(|m| m.is_file()).map_or_else(String::new, |m| format!(", {} bytes", m.len()));
        eprintln!("wrote {}: {} forward passes, {} op records, {} tokens{}", path.display(), outcome.forward_passes, outcome.op_records, outcome.generation.tokens.first().map_or(0, Vec::len), size);
    }
    Ok(())
}
