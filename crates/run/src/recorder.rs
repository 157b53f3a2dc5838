//! `trace record` as a library call: load the model, tokenize the prompt, run generation through
//! a tracer that streams into a trace file (or records nothing, `--untraced`), write the footer.
//!
//! When the run fails partway, the items recorded so far are flushed as a final frame and the file
//! is left without a footer: readers recover it as a truncated trace.

use crate::device::{device_name, DeviceSpec};
use crate::env;
use crate::generate::{generate, generate_rows, GenConfig, Generation};
use crate::models::llama::MAX_SEQ_LEN;
use crate::models::{builtin, gguf, hf, LoadedModel, WeightDtype};
use crate::numerics::Numerics;
use crate::tracer::{Perturb, Tracer};
use candle_core::Device;
use candle_trace_format::error::{Error, Result};
use candle_trace_format::fields::{Alteration, StopReason};
use candle_trace_format::format::TraceWriter;
use candle_trace_format::record::{Footer, Header, RunInfo};
use std::path::PathBuf;

/// Everything `trace record` takes.
#[derive(Clone, Debug, Default)]
pub struct RecordOptions {
    /// GGUF file; `None` = the builtin seeded model.
    pub model: Option<PathBuf>,
    /// The prompt, in every row (unused when `prompts` is set).
    pub prompt: String,
    /// Decoders: a batch of different requests, one prompt per row (`--prompt` given several
    /// times, or `--prompts-file`), left-padded to the longest as Hugging Face's `generate`
    /// pads. Empty: `prompt` in every row (`gen.batch` rows).
    pub prompts: Vec<String>,
    /// Apply the model's chat template to the prompt.
    pub chat: bool,
    /// `None` = the model's own (q for GGUF, f32 for builtin).
    pub dtype: Option<WeightDtype>,
    /// Generation knobs: max tokens, prefill chunk, batch, sampling.
    pub gen: GenConfig,
    /// Threads in effect (the CLI sets RAYON_NUM_THREADS before any kernel runs).
    pub threads: usize,
    /// Numerics-relevant environment variables as the user set them.
    pub env_vars: Vec<(String, String)>,
    /// `--perturb` (repeatable): one-bit faults, each applied once.
    pub perturb: Vec<Perturb>,
    /// Trace file to write; `None` runs untraced.
    pub out: Option<PathBuf>,
    /// End the run after the first op whose output holds a NaN or ±Inf (trace completed).
    pub stop_on_nonfinite: bool,
    /// Encoder runs: the sentences to embed (one batch).
    pub texts: Vec<String>,
    /// `--dump`: which op outputs (and their inputs) to store in full.
    pub dump: candle_trace_format::dump::DumpSpec,
    /// `--device`: the CPU (default), `cuda:N` or `metal:N`.
    pub device: DeviceSpec,
    /// `--numerics`: [`Numerics::Upstream`] reproduces candle-transformers' numerics where they
    /// depart from the model's definition (Gemma 3's SiLU, BERT's half-precision mask, candle's
    /// half-precision softmax); [`Numerics::Invariant`] runs every model on batch-invariant
    /// kernels (CPU only).
    pub numerics: Numerics,
    /// Show a progress bar of generated tokens on stderr (when it is a terminal), and say the
    /// expected size of a `--dump` there before the run ([`dump_estimate`]).
    pub progress: bool,
    /// `--model-name`: the model's name in the header, instead of the GGUF file name or the
    /// folder's architecture-and-sha256 name ([`crate::models::folder_name`]).
    pub model_name: Option<String>,
    /// `--level`: which ops are recorded (every op by default).
    pub level: candle_trace_format::site::Level,
    /// `--summary-worker`: summarise op outputs on a thread of their own
    /// ([`Tracer::with_summary_worker`]; ignored under `stop_on_nonfinite`). The trace is the
    /// same either way; off by default, because on the machines measured it did not make
    /// recording cheaper (docs/performance.md, "Summarising on a worker").
    pub summary_worker: bool,
}

/// Checks a `--model-name`: 1 to 128 characters, no path separator or control character.
///
/// # Errors
/// [`Error::Usage`] naming the problem.
pub fn check_model_name(name: &str) -> Result<()> {
    if name.is_empty() || name.chars().count() > 128 || name.contains(['/', '\\']) || name.chars().any(char::is_control) {
        return Err(Error::usage(format!("--model-name {name:?}: expected 1 to 128 characters, no path separator")));
    }
    Ok(())
}

/// The tracer of a run: streaming into `-o` (header first) or untraced, with the run's
/// perturbation, non-finite stop and dump settings.
fn open_tracer(opts: &RecordOptions, header: &Header) -> Result<Tracer> {
    let tracer = match &opts.out {
        Some(path) => Tracer::new(Box::new(TraceWriter::create(path, header, Some(&crate::env::build_info()))?)),
        None => Tracer::untraced(),
    };
    // Under --stop-on-nonfinite every op is summarised in place (it decides whether to go on).
    let worker = opts.summary_worker && !opts.stop_on_nonfinite;
    let mut tracer = tracer.with_level(opts.level)?;
    tracer.settings(&opts.gen.settings())?;
    Ok(tracer.with_perturbs(opts.perturb.clone()).with_stop_on_nonfinite(opts.stop_on_nonfinite).with_dump(opts.dump.clone()).with_summary_worker(worker)?.with_numerics(opts.numerics))
}

/// The expected size of the run's `--dump` ([`crate::dump_size`]), before anything is written;
/// `None` when nothing is dumped or nothing is written.
///
/// # Errors
/// Candle errors of the calibration passes.
pub fn dump_estimate(run: &mut DecoderRun, opts: &RecordOptions) -> Result<Option<crate::dump_size::DumpEstimate>> {
    if opts.out.is_none() || opts.dump == candle_trace_format::dump::DumpSpec::None {
        return Ok(None);
    }
    let rows = run.batch_rows(opts);
    let longest = run.rows.iter().map(Vec::len).max().unwrap_or(0);
    let configure = |t: Tracer| -> Result<Tracer> { Ok(t.with_level(opts.level)?.with_numerics(opts.numerics)) };
    crate::dump_size::estimate(&mut run.model.model, configure, &opts.dump, rows, longest, &opts.gen).map(Some)
}

/// What a recording produced.
#[derive(Clone, Debug)]
pub struct RecordOutcome {
    /// Tokens and text per row, and why generation stopped (no tokens for encoder runs).
    pub generation: Generation,
    /// Encoder runs: one embedding per text.
    pub embeddings: Vec<Vec<f32>>,
    /// The run's trace header.
    pub header: Header,
    /// Op records made.
    pub op_records: u64,
    /// Forward passes run.
    pub forward_passes: u32,
    /// Where the first NaN or ±Inf appeared (`layers.7.mlp_residual, forward pass 0`); `None`
    /// when every recorded output is finite (or nothing was recorded).
    pub first_nonfinite: Option<String>,
}

/// Loads the model named by `opts` (the builtin one when `model` is `None`).
///
/// # Errors
/// See [`gguf::load`] and [`builtin::load`].
pub fn load_model(opts: &RecordOptions, device: &Device) -> Result<LoadedModel> {
    let dtype = default_dtype(opts);
    match &opts.model {
        None => builtin::load(dtype, device),
        Some(p) if p.is_dir() => match dtype {
            WeightDtype::Dense(d) => hf::load(p, d, device),
            WeightDtype::Quantized => Err(Error::model(p, "--dtype q needs a GGUF file; a folder holds dense weights (use f32, f16 or bf16)")),
        },
        Some(p) => gguf::load(p, dtype, device),
    }
}

/// `--dtype` or the model's own default: `q` for GGUF files, f32 for folders and the builtin model.
fn default_dtype(opts: &RecordOptions) -> WeightDtype {
    opts.dtype.unwrap_or(match &opts.model {
        Some(p) if !p.is_dir() => WeightDtype::Quantized,
        _ => WeightDtype::Dense(candle_core::DType::F32),
    })
}

/// Runs `trace record`.
///
/// # Errors
/// Model loading errors, [`Error::Usage`] for a prompt the tokenizer or template refuses or a
/// `--perturb` path that never ran, I/O errors on the trace file, candle errors.
pub fn record(opts: &RecordOptions) -> Result<RecordOutcome> {
    if let Some(n) = &opts.model_name {
        check_model_name(n)?;
    }
    let device = opts.device.open()?;
    opts.gen.validate()?;
    if let Some(out) = &opts.out {
        if out.is_dir() {
            return Err(Error::usage(format!("-o {}: is a directory", out.display())));
        }
        // Writing the trace over the model it reads would destroy the model.
        let same = |x: &std::path::Path| matches!((out.canonicalize(), x.canonicalize()), (Ok(a), Ok(b)) if a == b);
        if opts.model.as_deref().is_some_and(same) {
            return Err(Error::usage(format!("-o {}: is the model file; write the trace elsewhere", out.display())));
        }
    }
    if let Some(dir) = opts.model.as_ref().filter(|p| p.is_dir()) {
        if hf::architecture(dir)? == "bert" {
            return record_encoder(opts, dir, &device);
        }
    }
    let mut run = prepare_decoder(opts, &device)?;
    if opts.progress {
        if let Some(e) = dump_estimate(&mut run, opts)? {
            eprintln!("note: {}", e.note(&opts.dump));
        }
    }
    let bar = opts.progress.then(|| {
        let b = indicatif::ProgressBar::new(opts.gen.max_tokens as u64);
        if let Ok(st) = indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} tokens") {
            b.set_style(st);
        }
        b
    });
    let tick = bar.clone().map(|b| Box::new(move || b.inc(1)) as Box<dyn Fn() + Send>);
    let mut tracer = open_tracer(opts, &run.header)?.with_progress(tick);
    let unapplied = |tracer: &Tracer, g: &Generation| -> Option<Error> {
        let p = tracer.perturbations_left().into_iter().next().filter(|_| !matches!(g.stop, StopReason::NonFinite { .. }))?;
        Some(Error::usage(if tracer.ran(&p.path) {
            format!("--perturb {}: that op never produced that position (lm_head and logits hold only the last position of each forward pass)", p.to_arg())
        } else {
            format!("--perturb {}: no op at that path ran in this run (which ops run can depend on batch, dtype and device: Qwen 3's flash_attn runs at batch 1 in f32 only)", p.to_arg())
        }))
    };
    let generation = match run_decoder(&mut run, opts, &mut tracer).and_then(|g| unapplied(&tracer, &g).map_or(Ok(g), Err)) {
        Ok(g) => g,
        Err(e) => {
            // Keep what was recorded: flush it as a last frame, leave the footer out.
            let _ = tracer.end_forward();
            return Err(e);
        }
    };
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    tracer.finish(&footer(&tracer, &generation))?;
    Ok(RecordOutcome { generation, embeddings: Vec::new(), header: run.header, op_records: tracer.op_records(), forward_passes: tracer.forward_passes(), first_nonfinite: nonfinite_at(&tracer) })
}

/// Where `tracer` saw the first non-finite output, in words.
fn nonfinite_at(tracer: &Tracer) -> Option<String> {
    tracer.first_nonfinite().map(|(path, step)| format!("{path}, forward pass {step}"))
}

/// The footer of a decoder run that produced `g` through `tracer`.
pub fn footer(tracer: &Tracer, g: &Generation) -> Footer {
    Footer {
        items: 0, // set by the writer
        op_records: tracer.op_records(),
        forward_passes: tracer.forward_passes(),
        tokens_generated: g.tokens.first().map_or(0, |t| t.len() as u32),
        texts: g.texts.clone(),
        stop: g.stop.to_string(),
    }
}

/// A decoder run made ready: the model loaded once, the requests tokenized, the header written
/// out. [`run_decoder`] runs it, as many times as needed, each time through a new tracer (the
/// re-runs of `trace bisect --causal`).
pub struct DecoderRun {
    /// The loaded model and tokenizer, with its info as the header holds it.
    pub model: LoadedModel,
    /// Token ids of each request (one per batch row, or one replicated `gen.batch` times).
    pub rows: Vec<Vec<u32>>,
    /// The run's trace header.
    pub header: Header,
}

impl DecoderRun {
    /// The rows of each forward pass: one per request, or `--batch` copies of the one.
    fn batch_rows(&self, opts: &RecordOptions) -> usize {
        if self.rows.len() > 1 {
            self.rows.len()
        } else {
            opts.gen.batch
        }
    }
}

/// `--perturb` specs as the header keeps them: comma-separated, `None` when there are none.
fn perturb_arg(p: &[Perturb]) -> Option<String> {
    Alteration::field(&p.iter().map(|x| Alteration::Perturb(x.clone())).collect::<Vec<_>>())
}

/// Sets a decoder up for `numerics` and names them in the header's model config (bisect lists
/// them as a setting that differs). `--numerics invariant` is refused on any device but the CPU
/// (its kernels are CPU kernels).
///
/// # Errors
/// [`Error::Usage`] naming what is not covered.
fn apply_numerics(numerics: Numerics, model: &mut crate::models::Decoder, info: &mut candle_trace_format::record::ModelInfo, device: &Device) -> Result<()> {
    match numerics {
        Numerics::Fixed => return Ok(()),
        Numerics::Upstream => match model {
            crate::models::Decoder::Gemma3(g) => g.set_upstream_numerics(),
            crate::models::Decoder::Llama(l) => l.set_upstream_numerics(),
        },
        Numerics::Invariant => invariant_on_cpu(numerics, device)?,
    }
    name_numerics(numerics, info);
    Ok(())
}

/// Refuses `--numerics invariant` on any device but the CPU: its kernels are CPU kernels.
///
/// # Errors
/// [`Error::Usage`] naming the device.
fn invariant_on_cpu(numerics: Numerics, device: &Device) -> Result<()> {
    if numerics == Numerics::Invariant && !device.is_cpu() {
        return Err(Error::usage(format!("--numerics invariant runs on the CPU only, not {}: its kernels are CPU kernels", device_name(device))));
    }
    Ok(())
}

/// Names `numerics` in the header's model config, unless it is the default (bisect lists it as
/// a setting that differs).
fn name_numerics(numerics: Numerics, info: &mut candle_trace_format::record::ModelInfo) {
    if numerics != Numerics::Fixed {
        info.config.push(("numerics".into(), format!("\"{}\"", numerics.name())));
        info.config.sort();
    }
}

/// Loads the decoder `opts` names, tokenizes its prompt(s) and builds the run's header.
///
/// # Errors
/// Model loading errors; [`Error::Usage`] for encoder-only flags, a prompt the tokenizer or
/// template refuses, too many positions, or a `--perturb` the model cannot take.
pub fn prepare_decoder(opts: &RecordOptions, device: &Device) -> Result<DecoderRun> {
    if !opts.texts.is_empty() {
        return Err(Error::usage("--text is for encoder folders (BERT); decoders take --prompt"));
    }
    let LoadedModel { mut model, tokenizer, mut info } = load_model(opts, device)?;
    apply_numerics(opts.numerics, &mut model, &mut info, device)?;
    if let Some(n) = &opts.model_name {
        info.name = n.clone();
    }
    let requests: Vec<String> = if opts.prompts.is_empty() { vec![opts.prompt.clone()] } else { opts.prompts.clone() };
    if requests.len() > 1 && opts.gen.batch != 1 {
        return Err(Error::usage("--batch replicates one prompt; with several prompts the batch is one row per prompt"));
    }
    let mut rows: Vec<Vec<u32>> = Vec::with_capacity(requests.len());
    for (i, p) in requests.iter().enumerate() {
        let text = if opts.chat {
            tokenizer.apply_chat_template(p).map_err(|e| {
                let who = opts.model.as_ref().map_or_else(|| "the builtin model".to_string(), |m| m.display().to_string());
                let sep = if e.starts_with("has no") { " " } else { ": " };
                Error::usage(format!("--chat: {who}{sep}{e}"))
            })?
        } else {
            p.clone()
        };
        let mut ids = tokenizer.encode(&text).map_err(Error::usage)?;
        if ids.is_empty() {
            return Err(Error::usage(if requests.len() > 1 { format!("prompt {} is empty (no tokens)", i + 1) } else { "the prompt is empty (no tokens)".into() }));
        }
        // The file asks for a BOS first (GGUF `add_bos_token`: Gemma, Llama 2), unless the chat
        // template already wrote one.
        if let Some(bos) = tokenizer.bos_id().filter(|&b| tokenizer.add_bos() && ids.first() != Some(&b)) {
            ids.insert(0, bos);
        }
        rows.push(ids);
    }
    let prompt_tokens: Vec<u32> = rows.concat();
    let longest = rows.iter().map(Vec::len).max().unwrap_or(0);
    // Positions fed to the model: the (padded) prompt, then every generated token but the last.
    let positions = longest + opts.gen.max_tokens.max(1) - 1;
    if positions > MAX_SEQ_LEN {
        return Err(Error::usage(format!("--max-tokens {}: the {}-token prompt plus the generated tokens exceed the {MAX_SEQ_LEN} positions supported", opts.gen.max_tokens, longest)));
    }
    for p in &opts.perturb {
        check_perturb(p, model.sites().map(|s| s.path.as_str()), positions)?;
    }
    check_dump(&opts.dump, opts.level, model.sites())?;
    let dtype = default_dtype(opts);
    let header = Header {
        run: RunInfo {
            model: info,
            dtype: dtype.as_str().into(),
            prompt: requests[0].clone(),
            chat: opts.chat,
            prompt_tokens,
            max_tokens: opts.gen.max_tokens as u32,
            temperature: opts.gen.temperature,
            top_k: opts.gen.top_k,
            top_p: opts.gen.top_p,
            seed: opts.gen.seed,
            prefill_chunk: opts.gen.prefill_chunk as u32,
            batch: if requests.len() > 1 { requests.len() as u32 } else { opts.gen.batch as u32 },
            threads: opts.threads as u32,
            perturb: perturb_arg(&opts.perturb),
            texts: if requests.len() > 1 { requests.clone() } else { Vec::new() },
            pooling: String::new(),
            dump: opts.dump.to_arg(),
        },
        env: env::capture(opts.env_vars.clone(), opts.threads, &device_name(device)),
    };
    let model_out = LoadedModel { model, tokenizer, info: header.run.model.clone() };
    Ok(DecoderRun { model: model_out, rows, header })
}

/// Runs generation for a prepared decoder through `tracer` (which carries the run's perturbations,
/// patches and captures). A run stopped by `--stop-on-nonfinite` is a generation with stop
/// `nonfinite (op record N)`. The caller finishes the tracer (writes the footer) and decides
/// what a perturbation that never applied means ([`Tracer::perturbations_left`]: `record`
/// refuses it; a shorter re-run never reaches it).
///
/// # Errors
/// Candle and sink errors.
pub fn run_decoder(run: &mut DecoderRun, opts: &RecordOptions, tracer: &mut Tracer) -> Result<Generation> {
    let n_rows = run.batch_rows(opts);
    let LoadedModel { model, tokenizer, .. } = &mut run.model;
    let result = if run.rows.len() > 1 { generate_rows(model, tokenizer, &run.rows, &opts.gen, tracer) } else { generate(model, tokenizer, &run.rows[0], &opts.gen, tracer) };
    let generation = match result {
        Ok(g) => g,
        Err(Error::StoppedOnNonFinite { seq }) => Generation { tokens: vec![Vec::new(); n_rows], texts: vec![String::new(); n_rows], stop: StopReason::NonFinite { seq } },
        Err(e) => return Err(e),
    };
    Ok(generation)
}

/// Refuses a `--dump` pattern that matches no op site of the model (a typo would store
/// nothing), or only sites `level` does not record (nothing of them is stored either).
fn check_dump<'a>(spec: &candle_trace_format::dump::DumpSpec, level: candle_trace_format::site::Level, sites: impl Iterator<Item = &'a candle_trace_format::site::Site>) -> Result<()> {
    let spec = match spec.unbounded() {
        candle_trace_format::dump::DumpSpec::Outputs(inner) => inner,
        s => s,
    };
    let candle_trace_format::dump::DumpSpec::Globs(globs) = spec else { return Ok(()) };
    let sites: Vec<&candle_trace_format::site::Site> = sites.collect();
    for g in globs {
        let one = candle_trace_format::dump::DumpSpec::Globs(vec![g.clone()]);
        let mut matched = sites.iter().filter(|s| one.matches(&s.path)).peekable();
        if matched.peek().is_none() {
            return Err(Error::usage(format!("--dump {g}: matches no op of the model (`trace show --sites FILE` lists them)")));
        }
        if !matched.any(|s| level.keeps(&s.path, s.op)) {
            let l = level.as_str();
            return Err(Error::usage(format!("--dump {g}: matches only ops --level {l} does not record, so nothing would be dumped: dump an op it records (`trace show --sites` of a --level {l} trace lists them), or record at --level ops")));
        }
    }
    Ok(())
}

/// Refuses a `--perturb` that cannot apply: an unknown module path, an integer input, or a
/// position at or past `positions`.
fn check_perturb<'a>(p: &Perturb, mut sites: impl Iterator<Item = &'a str>, positions: usize) -> Result<()> {
    if !sites.any(|s| s == p.path) {
        return Err(Error::usage(format!("--perturb {}: the model has no op at that module path (`trace show --sites FILE` lists them)", p.path)));
    }
    if ["input_ids", "token_type_ids", "attention_mask"].contains(&p.path.as_str()) {
        return Err(Error::usage(format!("--perturb {}: token ids are integers; perturb a float op", p.path)));
    }
    if let Some(pos) = p.pos {
        if pos as usize >= positions {
            return Err(Error::usage(format!("--perturb {}@{pos}: position {pos} is never computed (positions 0 to {})", p.path, positions.saturating_sub(1))));
        }
    }
    Ok(())
}

/// `trace record` for an encoder folder: embed `opts.texts` as one batch.
fn record_encoder(opts: &RecordOptions, dir: &std::path::Path, device: &Device) -> Result<RecordOutcome> {
    if opts.texts.is_empty() {
        return Err(Error::usage(format!("{} is an encoder: give the sentences with --text (repeat for a batch)", dir.display())));
    }
    if opts.chat {
        return Err(Error::usage("--chat applies to decoders only"));
    }
    let g = &opts.gen;
    if g.batch != 1 || g.prefill_chunk != 0 || g.temperature.is_some() || g.top_k.is_some() || g.top_p.is_some() {
        return Err(Error::usage("--prefill-chunk and the sampling flags apply to decoders; an encoder's batch is its --text sentences (--batch N repeats them)"));
    }
    let dtype = match default_dtype(opts) {
        WeightDtype::Dense(d) => d,
        WeightDtype::Quantized => return Err(Error::model(dir, "--dtype q needs a GGUF file; a folder holds dense weights (use f32, f16 or bf16)")),
    };
    invariant_on_cpu(opts.numerics, device)?;
    let mut enc = crate::encoder::load_folder(dir, dtype, device)?;
    if opts.numerics == Numerics::Upstream {
        enc.model.set_upstream_mask()?;
    }
    name_numerics(opts.numerics, &mut enc.info);
    if let Some(n) = &opts.model_name {
        enc.info.name = n.clone();
    }
    let batch = crate::encoder::tokenize(&enc, &opts.texts)?;
    // Header token ids: every text's ids, one text after the other (no padding).
    let prompt_tokens: Vec<u32> = batch.tokens.concat();
    for p in &opts.perturb {
        check_perturb(p, enc.model.sites().map(|s| s.path.as_str()), batch.input_ids.dim(1)?)?;
    }
    check_dump(&opts.dump, opts.level, enc.model.sites())?;
    let header = Header {
        run: RunInfo {
            model: enc.info.clone(),
            dtype: dtype.as_str().into(),
            batch: opts.texts.len() as u32,
            threads: opts.threads as u32,
            seed: opts.gen.seed,
            perturb: perturb_arg(&opts.perturb),
            texts: opts.texts.clone(),
            prompt_tokens,
            pooling: enc.pooling.as_str().into(),
            dump: opts.dump.to_arg(),
            ..RunInfo::default()
        },
        env: env::capture(opts.env_vars.clone(), opts.threads, &device_name(device)),
    };
    let mut tracer = open_tracer(opts, &header)?;
    let (embeddings, stop) = match crate::encoder::embed(&mut enc, &opts.texts, &mut tracer) {
        Ok(e) => (e, StopReason::Done),
        Err(Error::StoppedOnNonFinite { seq }) => (Vec::new(), StopReason::NonFinite { seq }),
        Err(e) => {
            let _ = tracer.end_forward();
            return Err(e);
        }
    };
    if !embeddings.is_empty() {
        tracer.embeddings(embeddings.clone())?;
    }
    let footer = Footer {
        items: 0, // set by the writer
        op_records: tracer.op_records(),
        forward_passes: tracer.forward_passes(),
        tokens_generated: 0,
        texts: Vec::new(),
        stop: stop.to_string(),
    };
    tracer.finish(&footer)?;
    let generation = Generation { tokens: Vec::new(), texts: Vec::new(), stop };
    Ok(RecordOutcome { generation, embeddings, header, op_records: tracer.op_records(), forward_passes: tracer.forward_passes(), first_nonfinite: nonfinite_at(&tracer) })
}

/// The settings that re-record the run `h` describes (`trace bisect --causal` re-runs both
/// runs): model, prompt(s), chat template, dtype, generation knobs, threads and `--perturb`s.
/// The repeat penalty comes from the trace's settings frame (`settings`). Not restored: the dump
/// pattern and the output file (the caller chooses), and the environment.
///
/// # Errors
/// [`Error::Usage`] for an encoder run, a redacted trace (no prompt to re-run), a run that was
/// itself patched, or a `--perturb`, dtype or setting this build does not parse.
pub fn options_from_header(h: &Header, settings: &candle_trace_format::record::Settings, model: Option<PathBuf>) -> Result<RecordOptions> {
    let r = &h.run;
    let perturb = candle_trace_compare::rerun::rerun_perturbs(h)?;
    let batch_of_prompts = r.texts.len() > 1;
    let mut gen = GenConfig {
        max_tokens: r.max_tokens as usize,
        prefill_chunk: r.prefill_chunk as usize,
        batch: if batch_of_prompts { 1 } else { r.batch.max(1) as usize },
        temperature: r.temperature,
        top_k: r.top_k,
        top_p: r.top_p,
        seed: r.seed,
        ..GenConfig::default()
    };
    gen.apply_settings(settings)?;
    Ok(RecordOptions {
        model,
        prompt: r.prompt.clone(),
        prompts: if batch_of_prompts { r.texts.clone() } else { Vec::new() },
        chat: r.chat,
        dtype: Some(WeightDtype::parse(&r.dtype)?),
        gen,
        threads: r.threads as usize,
        perturb,
        numerics: Numerics::of_config(&r.model.config).ok_or_else(|| Error::usage("the trace's numerics are not ones this build knows (fixed, upstream, invariant)"))?,
        ..RecordOptions::default()
    })
}

/// The text the model of trace header `h` received: its prompt token ids decoded with special
/// tokens kept, by the tokenizer of `model` (the file or folder the trace was recorded with);
/// `None` when the trace holds no single prompt's ids (redacted, an encoder's texts, a batch of
/// prompts).
///
/// # Errors
/// [`Error::Usage`] when `model` cannot be loaded as the trace's model or is not it (its sha256
/// differs), or the ids do not decode.
pub fn received_prompt(h: &Header, model: &std::path::Path) -> Result<Option<String>> {
    if h.run.prompt_tokens.is_empty() || !h.run.texts.is_empty() {
        return Ok(None);
    }
    let opts = options_from_header(h, &Default::default(), Some(model.to_path_buf()))?;
    let not_it = |why: String| Error::usage(format!("--model {}: not the model this trace was recorded with ({}): {why}", model.display(), h.run.model.name));
    let loaded = load_model(&opts, &Device::Cpu).map_err(|e| not_it(e.to_string()))?;
    if loaded.info.sha256 != h.run.model.sha256 {
        return Err(not_it(format!("sha256 {}, the trace's {}", loaded.info.sha256, h.run.model.sha256)));
    }
    loaded.tokenizer.decode_with_special(&h.run.prompt_tokens).map(Some).map_err(Error::usage)
}

/// The text of file `f`, given to option `flag` (`--prompt-file`, …): at most
/// [`candle_trace_format::limits::MAX_STRING_LEN`] bytes (16 MiB, the most a trace stores of one
/// text), read no further, so `/dev/zero` or a wrong file is refused, not read into memory.
///
/// # Errors
/// [`Error::Io`] when the file cannot be read; [`Error::Usage`] naming the file for a larger
/// one or one that is not UTF-8.
pub fn read_text_file(f: &std::path::Path, flag: &str) -> Result<String> {
    use std::io::Read;
    const MAX: usize = candle_trace_format::limits::MAX_STRING_LEN;
    let mut bytes = Vec::new();
    std::fs::File::open(f).and_then(|file| file.take(MAX as u64 + 1).read_to_end(&mut bytes)).map_err(|e| Error::io(f, e))?;
    if bytes.len() > MAX {
        return Err(Error::usage(format!("{flag} {}: over {} MiB, more than a trace stores of one text", f.display(), MAX >> 20)));
    }
    String::from_utf8(bytes).map_err(|_| Error::usage(format!("{flag} {}: not UTF-8 text", f.display())))
}

/// The prompts of `--prompts-file` (or texts of `--texts-file`: `flag` names the option in
/// errors): one per line, empty lines skipped; a line written as a JSON string (`"..."`) is
/// decoded, so a prompt can hold newlines (and `""` is an empty prompt). Returns the prompts and
/// the number of empty lines skipped.
///
/// # Errors
/// As [`read_text_file`]; [`Error::Usage`] naming the file and line for a quoted line that is not
/// a JSON string, or a file without a prompt.
pub fn read_prompts_file(f: &std::path::Path, flag: &str) -> Result<(Vec<String>, usize)> {
    let text = read_text_file(f, flag)?;
    let mut lines: Vec<String> = Vec::new();
    let skipped = text.lines().filter(|l| l.trim().is_empty()).count();
    for (n, l) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        if l.starts_with('"') {
            let p = serde_json::from_str::<String>(l).map_err(|e| Error::usage(format!("{flag} {}: line {} starts with a quote but is not a JSON string: {e}", f.display(), n + 1)))?;
            lines.push(p);
        } else {
            lines.push(l.to_string());
        }
    }
    if lines.is_empty() {
        return Err(Error::usage(format!("{flag} {}: holds no prompt", f.display())));
    }
    Ok((lines, skipped))
}
