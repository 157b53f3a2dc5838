//! `trace check`: the command line over [`candle_trace::check`]. Plans the runs, runs them
//! one after the other as child `trace record` processes (or only writes the plan), collects
//! the table; `--golden` re-records a golden trace's settings here and bisects.

use super::bisect::print_bisect;
use super::{progress, stdout, to_json, DEFAULT_PROMPT};
use crate::cli::{CheckArgs, DtypeArg, ReportFormat, SamplingArgs};
use candle_trace::check::{CheckReport, Settings};
use candle_trace::env;
use candle_trace::error::{Error, Result};
use candle_trace::generate::GenConfig;
use candle_trace::models::WeightDtype;
use candle_trace::recorder::{record, RecordOptions};
use std::path::{Path, PathBuf};

/// `trace check`.
pub(crate) fn check_cmd(args: CheckArgs, env_vars: Vec<(String, String)>) -> Result<u8> {
    if args.prefill_chunk == Some(0) {
        return Err(Error::usage("--prefill-chunk must be at least 1"));
    }
    if let Some(dir) = &args.collect {
        return print_table(&candle_trace::check::collect(dir)?, args.format);
    }
    if let Some(g) = &args.golden {
        let over = GoldenOverrides {
            prompt: args.prompt.clone(),
            chat: args.chat,
            max_tokens: args.max_tokens,
            dtype: args.dtype.map(DtypeArg::weight),
            prefill_chunk: args.prefill_chunk,
            batch: args.batch,
            threads: args.threads,
            level: args.level,
            sampling: args.sampling,
            seed: args.seed,
        };
        return check_golden(g, args.model.clone(), &over, (args.format, &args.out), env_vars, args.quiet);
    }
    let requests = match &args.prompts_file {
        Some(f) => candle_trace::recorder::read_prompts_file(f, "--prompts-file")?.0,
        None => Vec::new(),
    };
    let prompt = match (&args.text, requests.first()) {
        (Some(t), _) => t.clone(),
        (None, Some(r)) => r.clone(),
        (None, None) => args.prompt.clone().unwrap_or_else(|| DEFAULT_PROMPT.to_string()),
    };
    let base = baseline(&args, !requests.is_empty())?;
    let exe = std::env::current_exe().map_err(|e| Error::usage(format!("cannot find the trace binary: {e}")))?;
    if let Some(g) = &args.write_golden {
        let mut words = vec!["record".to_string()];
        words.extend(base.args());
        words.extend([if base.encoder { "--text" } else { "--prompt" }.to_string(), prompt, "-o".to_string(), g.to_string_lossy().into_owned()]);
        run_job(&exe, &words)?;
        stdout(&format!("wrote {}: the golden trace; check against it with trace check --golden {}\n", g.display(), g.display()))?;
        return Ok(0);
    }
    // Settings every job would refuse are refused here, before a plan is written.
    refuse_early(&args)?;
    let p = candle_trace::check::plan(&plan_input(&args, base, (prompt, requests), env_vars)?)?;
    let exe_s = exe.to_string_lossy().into_owned();
    if let Some(dir) = &args.plan {
        candle_trace::check::write_plan(&p, dir, &exe_s)?;
        stdout(&format!(
            "wrote {}: {} jobs in {}; run them (e.g. xargs -d '\\n' -n 1 -P 4 sh -c < {}), then trace check --collect {}\n",
            dir.join("manifest.json").display(),
            p.recordings().len(),
            dir.join("jobs.txt").display(),
            candle_trace::check::shell_quote(&dir.join("jobs.txt").to_string_lossy()),
            candle_trace::check::shell_quote(&dir.to_string_lossy())
        ))?;
        return Ok(0);
    }
    candle_trace::check::write_plan(&p, &args.out, &exe_s)?;
    let abs = std::fs::canonicalize(&args.out).map_err(|e| Error::io(&args.out, e))?;
    let jobs = p.recordings();
    let bar = progress(jobs.len() as u64, args.quiet, "runs");
    for (i, j) in jobs.into_iter().enumerate() {
        bar.set_message(j.trace.clone());
        if let Err(e) = run_job(&exe, &candle_trace::check::job_command(j, &abs)) {
            if i == 0 {
                // The baseline itself was refused: take the plan back, so the folder can be reused.
                use candle_trace::check::{PROMPTS_FILES, PROMPT_FILE, REQUESTS_FILE, TEXT_FILE};
                for f in ["manifest.json", "jobs.txt", PROMPT_FILE, TEXT_FILE, REQUESTS_FILE].into_iter().chain(PROMPTS_FILES) {
                    let _ = std::fs::remove_file(abs.join(f));
                }
            }
            return Err(e);
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    print_table(&candle_trace::check::collect(&args.out)?, args.format)
}

/// Refuses, before anything is written, what every job of the check would refuse: the batch
/// size and sampler flags (as `record` checks them), `--max-tokens` 0 or with `--text`, a device this build or machine cannot open,
/// and `--text` without an encoder folder.
fn refuse_early(a: &CheckArgs) -> Result<()> {
    match (a.max_tokens, &a.text) {
        (Some(_), Some(_)) => return Err(Error::usage("--max-tokens with --text: --text embeds sentences with an encoder folder, in one forward pass that generates no token")),
        (Some(0), None) => return Err(Error::usage("--max-tokens 0: a check compares generated tokens; give at least 1")),
        _ => {}
    }
    a.sampling.apply(GenConfig { batch: a.batch.unwrap_or(1), ..GenConfig::default() })?.validate()?;
    if let Some(d) = a.device {
        d.open()?;
    }
    let folder = a.model.as_ref().filter(|m| m.is_dir());
    if a.text.is_some() && folder.is_none_or(|m| !m.join("config.json").is_file()) {
        return Err(Error::usage("--text checks a sentence encoder: give --model with its folder (a BERT folder with config.json)"));
    }
    Ok(())
}

/// The baseline's settings from the command line; the model path made absolute (the jobs may
/// run from elsewhere).
fn baseline(a: &CheckArgs, requests: bool) -> Result<Settings> {
    let model = match &a.model {
        Some(m) => Some(std::fs::canonicalize(m).map_err(|e| Error::io(m, e))?.to_string_lossy().into_owned()),
        None => None,
    };
    Ok(Settings {
        model,
        chat: a.chat,
        max_tokens: a.max_tokens.unwrap_or(GenConfig::default().max_tokens),
        dtype: a.dtype.map(|d| d.weight().as_str().to_string()),
        prefill_chunk: a.prefill_chunk,
        batch: a.batch,
        threads: a.threads,
        padded: false,
        companions: 0,
        encoder: a.text.is_some(),
        requests,
        device: a.device.map(|d| d.to_string()),
        temperature: a.sampling.temperature,
        top_k: a.sampling.top_k,
        top_p: a.sampling.top_p,
        repeat_penalty: a.sampling.repeat_penalty,
        repeat_last_n: a.sampling.repeat_last_n,
        seed: a.seed,
        level: a.level.filter(|l| *l != candle_trace::site::Level::Ops).map(|l| l.as_str().to_string()),
        numerics: a.numerics.map(|n| n.numerics()).filter(|n| *n != candle_trace::numerics::Numerics::Fixed).map(|n| n.name().to_string()),
    })
}

/// What the plan needs to know of the model (the prompt's length in tokens, the dtypes it
/// takes), read by preparing the model once here.
fn plan_input(a: &CheckArgs, base: Settings, (prompt, requests): (String, Vec<String>), env_vars: Vec<(String, String)>) -> Result<candle_trace::check::PlanInput> {
    let dtypes: Vec<String> = match &a.model {
        Some(m) if !m.is_dir() => ["q", "f32", "f16", "bf16"].map(String::from).to_vec(),
        _ => ["f32", "f16", "bf16"].map(String::from).to_vec(),
    };
    let threads_all = std::thread::available_parallelism().map_or(1, |n| n.get());
    // The default knobs, less those that do not apply (an encoder has no prefill; a batch of
    // requests is already a batch); given explicitly, they are refused by the plan.
    let mut vary = a.vary.clone();
    if vary == ["threads", "batch", "prefill-chunk"] {
        vary.retain(|k| !((base.encoder && k == "prefill-chunk") || (base.requests && k == "batch")));
    }
    if base.encoder {
        // No prefill to chunk: the prompt's length in tokens is not needed.
        return Ok(candle_trace::check::PlanInput { base, prompt, requests, vary, runs: a.runs, prompt_tokens: 0, dtypes, threads_all });
    }
    let probe = RecordOptions {
        model: a.model.clone(),
        prompt: prompt.clone(),
        chat: a.chat,
        dtype: a.dtype.map(DtypeArg::weight),
        env_vars,
        gen: GenConfig { max_tokens: base.max_tokens, ..GenConfig::default() },
        // A model the numerics do not cover is refused here, before any run.
        numerics: a.numerics.map_or(candle_trace::numerics::Numerics::Fixed, |n| n.numerics()),
        ..RecordOptions::default()
    };
    let prompt_tokens = candle_trace::recorder::prepare_decoder(&probe, &candle_core::Device::Cpu)?.rows.first().map_or(0, Vec::len);
    Ok(candle_trace::check::PlanInput { base, prompt, requests, vary, runs: a.runs, prompt_tokens, dtypes, threads_all })
}

/// Prints the check table; exit 0 when every run present matched and none is missing, else 1.
fn print_table(r: &CheckReport, format: ReportFormat) -> Result<u8> {
    stdout(&match format {
        ReportFormat::Text => candle_trace::check::text(r),
        ReportFormat::Markdown => candle_trace::check::markdown(r),
        ReportFormat::Json => format!("{}\n", to_json(r)?),
    })?;
    Ok(if r.identical && r.missing.is_empty() { 0 } else { 1 })
}

/// Runs `trace ARGS` as a child process; a failure is one line naming the job.
fn run_job(exe: &Path, args: &[String]) -> Result<()> {
    let mut cmd = std::process::Command::new(exe);
    if env::set_by_pin() {
        // Set by this process, not by the user: the child's header should not say otherwise.
        cmd.env_remove("RAYON_NUM_THREADS");
    }
    let o = cmd.args(args).output().map_err(|e| Error::usage(format!("cannot run {}: {e}", exe.display())))?;
    if !o.status.success() {
        let err = String::from_utf8_lossy(&o.stderr);
        let line = err.lines().last().unwrap_or("").trim_start_matches("trace: error: ");
        let out = args.iter().skip_while(|a| *a != "-o").nth(1).map_or("", String::as_str);
        return Err(Error::usage(format!("the run writing {out} failed: {line}")));
    }
    Ok(())
}

/// `trace check --golden` settings given on the command line: they override the golden's.
struct GoldenOverrides {
    prompt: Option<String>,
    chat: bool,
    max_tokens: Option<usize>,
    dtype: Option<WeightDtype>,
    prefill_chunk: Option<usize>,
    batch: Option<usize>,
    threads: Option<usize>,
    level: Option<candle_trace::site::Level>,
    sampling: SamplingArgs,
    seed: Option<u64>,
}

impl GoldenOverrides {
    /// The sampler flags given, over the golden's sampler (`--repeat-last-n` alone changes the
    /// window of the golden's penalty).
    ///
    /// # Errors
    /// [`Error::Usage`] for settings [`GenConfig::validate`] refuses, or `--repeat-last-n` when
    /// neither the golden nor the command line has a repeat penalty.
    fn sampler(&self, gen: &mut GenConfig) -> Result<()> {
        let s = self.sampling;
        gen.temperature = s.temperature.or(gen.temperature);
        gen.top_k = s.top_k.or(gen.top_k);
        gen.top_p = s.top_p.or(gen.top_p);
        gen.seed = self.seed.unwrap_or(gen.seed);
        gen.repeat_penalty = s.repeat_penalty.unwrap_or(gen.repeat_penalty);
        if let Some(n) = s.repeat_last_n {
            if !gen.penalised() {
                return Err(Error::usage("--repeat-last-n applies only with a repeat penalty, and the golden trace has none: add --repeat-penalty F"));
            }
            gen.repeat_last_n = n;
        }
        gen.validate()
    }
}

/// `trace check --golden FILE`: re-record the golden trace's settings here and bisect; the run
/// recorded here is kept in `out` when it does not match (for bisect, bundle or extract).
fn check_golden(golden: &Path, model: Option<PathBuf>, over: &GoldenOverrides, (format, out): (ReportFormat, &Path), env_vars: Vec<(String, String)>, quiet: bool) -> Result<u8> {
    // The whole file is read (keeping no item) for the settings frame behind the header.
    let t = candle_trace::format::read_trace_where(golden, |_| false)?;
    let g = &t.header;
    let mut opts = candle_trace::recorder::options_from_header(g, &t.extras.settings, model).map_err(|e| Error::trace(golden, e.to_string()))?;
    if let Some(p) = &over.prompt {
        (opts.prompt, opts.prompts) = (p.clone(), Vec::new());
    }
    opts.chat |= over.chat;
    if let Some(n) = over.max_tokens {
        opts.gen.max_tokens = n;
    }
    if let Some(d) = over.dtype {
        opts.dtype = Some(d);
    }
    if let Some(c) = over.prefill_chunk {
        opts.gen.prefill_chunk = c;
    }
    if let Some(b) = over.batch {
        opts.gen.batch = b;
    }
    if let Some(t) = over.threads {
        opts.threads = t;
    }
    over.sampler(&mut opts.gen)?;
    // Recorded at the golden's level, so that the bisect compares like with like.
    opts.level = match over.level {
        Some(l) => l,
        None => candle_trace::bisect_file::level_of(golden)?,
    };
    opts.progress = !quiet;
    if opts.model.is_none() && g.run.model.name != "builtin" {
        return Err(Error::usage(format!("--golden {}: give --model with the file it was recorded with ({})", golden.display(), g.run.model.name)));
    }
    // Another model file is said to be so before anything is loaded or recorded (a folder's
    // digest needs it loaded: the recording's header is compared below).
    let other_model = |m: &Path, sha: &str| {
        Error::usage(format!(
            "--model {}: not the model --golden {} was recorded with ({}, sha256 {}); this one's sha256 is {sha}",
            m.display(),
            golden.display(),
            g.run.model.name,
            g.run.model.sha256
        ))
    };
    if let Some(m) = opts.model.as_ref().filter(|m| m.is_file()) {
        let (sha, _) = candle_trace::models::gguf::sha256_file(m)?;
        if sha != g.run.model.sha256 {
            return Err(other_model(m, &sha));
        }
    }
    if let Some(m) = opts.model.as_ref().filter(|m| m.is_dir() && g.run.model.name.ends_with(".gguf")) {
        return Err(Error::usage(format!("--model {}: a folder, but --golden {} was recorded with the GGUF file {}", m.display(), golden.display(), g.run.model.name)));
    }
    if opts.threads > 0 {
        env::pin_threads(opts.threads)?;
    }
    let dir = tempfile_dir()?;
    let fresh = dir.path().join("this-machine.trace");
    opts.out = Some(fresh.clone());
    opts.env_vars = env_vars;
    record(&opts)?;
    let here = candle_trace::format::TraceReader::open(&fresh)?.header().run.model.sha256.clone();
    if let Some(m) = opts.model.as_ref().filter(|_| here != g.run.model.sha256) {
        return Err(other_model(m, &here));
    }
    // Streamed, as `trace bisect` does; the scratch folder goes when `dir` is dropped.
    let (r, g, t) = candle_trace::bisect_file::bisect_files(golden, &fresh)?;
    if g.truncated {
        // A cut golden is bad input, not a run that diverged from it.
        return Err(Error::trace(golden, "is truncated (the run that wrote it did not finish, or the file was cut): write the golden again with --write-golden"));
    }
    if r.verdict != candle_trace::bisect::Verdict::Identical {
        keep_fresh(&fresh, out, golden)?;
    }
    print_bisect(&r, &g, &t, format)
}

/// Copies the run recorded here (`fresh`, in a scratch folder removed at the end) to
/// `out/this-machine.trace`, and says so: a run that did not match its golden is what a user
/// bisects, bundles or extracts next (a fresh-user trial found it deleted).
fn keep_fresh(fresh: &Path, out: &Path, golden: &Path) -> Result<()> {
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let kept = out.join("this-machine.trace");
    std::fs::copy(fresh, &kept).map_err(|e| Error::io(&kept, e))?;
    eprintln!("note: kept the run recorded here as {}: `trace bisect {} {}` (or `trace bundle`) works on it", kept.display(), golden.display(), kept.display());
    Ok(())
}

/// A fresh private folder (random name, owner-only) under the system's temporary directory,
/// removed when dropped.
fn tempfile_dir() -> Result<tempfile::TempDir> {
    tempfile::Builder::new().prefix("trace-check-").tempdir().map_err(|e| Error::usage(format!("cannot create a folder in {}: {e}", std::env::temp_dir().display())))
}
