//! `trace check`: run one input many times under the conditions that change numerics (threads,
//! batch, prefill chunking, dtype, batching with other requests), count the distinct answers
//! and bisect every run against a baseline.
//!
//! A check is a plan of `trace record` runs ([`plan`]): a baseline, the baseline repeated, and
//! `runs` recordings for each value of each varied knob. The plan is a folder: `manifest.json`
//! (this module's [`Plan`]) and `jobs.txt` (one shell command per line), so any scheduler can run
//! the jobs (`xargs -P`, GNU parallel, a Slurm job array); [`collect`] then builds the table from
//! whichever traces are present. `trace check` without `--plan` does both in one process, one
//! job after the other, so the two give the same table.

use crate::bisect::{CauseClass, Report};
pub use crate::text::shell_quote;
use crate::untrusted::Untrusted;
use candle_trace_format::error::{Error, Result};
use candle_trace_format::format::{read_trace_where, Trace, TraceReader};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::path::Path;

/// The knobs `--vary` takes.
pub const KNOBS: [&str; 5] = ["threads", "batch", "prefill-chunk", "dtype", "padded-batch"];

/// Other requests the prompt is batched with for `padded-batch` (one longer, one shorter, so
/// the prompt's row is padded or pads another row): the first of [`COMPANIONS`].
pub const OTHER_REQUESTS: [&str; 2] = ["Write a short poem about the sea, the wind and the boats coming home at night.", "Hi!"];

/// The companion sets `padded-batch` draws, each as (requests before the prompt, after it): of
/// different counts and lengths, longer and shorter than the prompt, so its row is padded by
/// some and pads others. Set `i` is condition [`COMPANION_LABELS`]`[i]`, its requests in
/// [`PROMPTS_FILES`]`[i]`.
pub const COMPANIONS: [(&[&str], &[&str]); 3] = [
    (&[OTHER_REQUESTS[0]], &[OTHER_REQUESTS[1]]),
    (&[], &["Explain in a few sentences how a lighthouse keeper kept the lamp burning through a long winter storm, and why it mattered to the ships."]),
    (&["Hi!", "What is the capital of France?"], &[OTHER_REQUESTS[0], "List three colours of the rainbow."]),
];
/// The conditions of [`COMPANIONS`] in the table: the batch's request count.
pub const COMPANION_LABELS: [&str; 3] = ["3 requests", "2 requests", "5 requests"];

/// What one `trace record` run of a check is asked for: the manifest holds this, the command
/// line is made from it ([`Settings::args`]), and a trace present is checked against it
/// (`job_mismatch`), with no argument list parsed back.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Settings {
    /// The model file or folder (absolute); `None`: the builtin model.
    pub model: Option<String>,
    /// Wrap the prompt in the model's chat template.
    pub chat: bool,
    /// Tokens to generate.
    pub max_tokens: usize,
    /// Weight dtype (`q`, `f32`, `f16`, `bf16`); `None`: the model's default.
    pub dtype: Option<String>,
    /// Prefill chunk in tokens; `None`: the whole prompt in one pass.
    pub prefill_chunk: Option<usize>,
    /// Copies of the request in one batch; `None`: 1.
    pub batch: Option<usize>,
    /// CPU threads; `None`: the recorder's default.
    pub threads: Option<usize>,
    /// The request among others of different lengths (companion set [`Settings::companions`],
    /// in [`PROMPTS_FILES`]) instead of alone ([`PROMPT_FILE`]).
    pub padded: bool,
    /// Which of [`COMPANIONS`] a padded run batches the request with.
    #[serde(skip_serializing_if = "is_zero")]
    pub companions: usize,
    /// The request is a sentence to embed (an encoder folder, `check --text`): jobs read it
    /// with `--texts-file` ([`TEXT_FILE`], or [`PROMPTS_FILE`] when padded).
    pub encoder: bool,
    /// The baseline is a batch of different requests ([`REQUESTS_FILE`], `check
    /// --prompts-file`).
    pub requests: bool,
    /// `--device` (`cpu`, `cuda:0`, …); `None`: the CPU.
    pub device: Option<String>,
    /// Sampling temperature; `None`: greedy.
    pub temperature: Option<f64>,
    /// Top-k cut-off (with a temperature).
    pub top_k: Option<u32>,
    /// Top-p cut-off (with a temperature).
    pub top_p: Option<f64>,
    /// `--repeat-penalty`; `None`: off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeat_penalty: Option<f32>,
    /// `--repeat-last-n` (with a repeat penalty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeat_last_n: Option<usize>,
    /// Sampling seed; `None`: the recorder's default.
    pub seed: Option<u64>,
    /// `--level` (`layers`, `logits`); `None`: every op.
    pub level: Option<String>,
    /// `--numerics` (`upstream`, `invariant`); `None`: the default (`fixed`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub numerics: Option<String>,
}

impl Settings {
    /// The arguments after `trace record` for these settings, without the prompt and `-o`.
    pub fn args(&self) -> Vec<String> {
        let mut a: Vec<String> = Vec::new();
        if let Some(m) = &self.model {
            a.extend(["--model".into(), m.clone()]);
        }
        if self.chat {
            a.push("--chat".into());
        }
        if !self.encoder {
            a.extend(["--max-tokens".into(), self.max_tokens.to_string()]);
        }
        if let Some(d) = &self.dtype {
            a.extend(["--dtype".into(), d.clone()]);
        }
        for (flag, v) in [("--prefill-chunk", self.prefill_chunk), ("--batch", self.batch), ("--threads", self.threads)] {
            if let Some(v) = v {
                a.extend([flag.to_string(), v.to_string()]);
            }
        }
        let sampling = [
            ("--temperature", self.temperature.map(|v| v.to_string())),
            ("--top-k", self.top_k.map(|v| v.to_string())),
            ("--top-p", self.top_p.map(|v| v.to_string())),
            ("--repeat-penalty", self.repeat_penalty.map(|v| v.to_string())),
            ("--repeat-last-n", self.repeat_last_n.map(|v| v.to_string())),
        ];
        for (flag, v) in
            sampling.into_iter().chain([("--seed", self.seed.map(|v| v.to_string())), ("--device", self.device.clone()), ("--level", self.level.clone()), ("--numerics", self.numerics.clone())])
        {
            if let Some(v) = v {
                a.extend([flag.to_string(), v]);
            }
        }
        a
    }
}

/// One `trace record` run of a check.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Job {
    /// `baseline`, `repeat`, or the knob varied.
    pub knob: String,
    /// The knob's value (`-` for the baseline and its repeats).
    pub value: String,
    /// 1-based run number within the condition.
    pub run: u32,
    /// The trace's file name within the check folder.
    pub trace: String,
    /// What the run records.
    pub settings: Settings,
}

/// A check's runs, as `manifest.json` holds them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Format of this manifest ([`MANIFEST_VERSION`]).
    pub version: u32,
    /// The request checked (the prompt, or the encoder's sentence).
    pub prompt: String,
    /// `check --prompts-file`: the baseline's batch of requests (`prompt` is the first).
    #[serde(default)]
    pub requests: Vec<String>,
    /// The first job is the baseline.
    pub jobs: Vec<Job>,
}

impl Plan {
    /// The jobs to run: each trace file once, in plan order (a condition that is the baseline's
    /// own setting names the repeats' traces instead of recording its own).
    pub fn recordings(&self) -> Vec<&Job> {
        let mut seen = std::collections::HashSet::new();
        self.jobs.iter().filter(|j| seen.insert(j.trace.as_str())).collect()
    }
}

/// The manifest format this build writes and reads (2: jobs as [`Settings`]; 1 held argument
/// lists).
pub const MANIFEST_VERSION: u32 = 2;

/// What a plan is made from.
#[derive(Clone, Debug, Default)]
pub struct PlanInput {
    /// What every run shares (the baseline): a varied knob must be left unset here.
    pub base: Settings,
    /// The request checked, as given (the jobs read it from [`PROMPT_FILE`]).
    pub prompt: String,
    /// `check --prompts-file`: a batch of requests as the baseline (empty: `prompt` alone).
    pub requests: Vec<String>,
    /// Knobs to vary (names from [`KNOBS`]).
    pub vary: Vec<String>,
    /// Recordings per condition.
    pub runs: u32,
    /// Prompt length in tokens (chooses a prefill chunk that does not divide it).
    pub prompt_tokens: usize,
    /// The dtypes the model takes (`q`, `f32`, `f16`, `bf16`).
    pub dtypes: Vec<String>,
    /// CPU threads of this machine ("all").
    pub threads_all: usize,
}

/// The plan of a check (see the module docs).
///
/// # Errors
/// [`Error::Usage`] for an unknown knob, `runs` of 0 or above 100, or a `base` that already sets
/// a varied knob.
pub fn plan(input: &PlanInput) -> Result<Plan> {
    if !(1..=100).contains(&input.runs) {
        return Err(Error::usage(format!("--runs {}: expected 1 to 100", input.runs)));
    }
    let b = &input.base;
    for k in &input.vary {
        let why = match k.as_str() {
            "batch" | "padded-batch" if b.requests => Some("the baseline is already a batch of different requests (--prompts-file)"),
            "prefill-chunk" if b.encoder => Some("an encoder embeds its sentences in one pass (no prefill chunks)"),
            _ => None,
        };
        if let Some(why) = why {
            return Err(Error::usage(format!("--vary {k}: {why}")));
        }
        let set = match k.as_str() {
            "threads" => b.threads.is_some(),
            "batch" | "padded-batch" => b.batch.is_some(),
            "prefill-chunk" => b.prefill_chunk.is_some(),
            "dtype" => b.dtype.is_some(),
            _ => return Err(Error::usage(format!("--vary {k}: expected some of {}", KNOBS.join(",")))),
        };
        if set {
            let flag = if k == "padded-batch" { "batch" } else { k.as_str() };
            return Err(Error::usage(format!("--vary {k}: the baseline also sets --{flag}; leave it out to vary it")));
        }
    }
    // A knob named twice is one condition, run once.
    let mut vary: Vec<&String> = Vec::new();
    for k in &input.vary {
        if !vary.contains(&k) {
            vary.push(k);
        }
    }
    let mut jobs = Vec::new();
    let mut push = |knob: &str, value: &str, run: u32, settings: Settings| {
        let name = if knob == "baseline" { "baseline.trace".to_string() } else { format!("{knob}-{}-{run}.trace", value.replace(['/', ' '], "_")) };
        jobs.push(Job { knob: knob.into(), value: value.into(), run, trace: name, settings });
    };
    push("baseline", "-", 1, b.clone());
    for run in 1..=input.runs {
        push("repeat", "-", run, b.clone());
    }
    for knob in vary {
        for (value, settings) in conditions(input, knob) {
            for run in 1..=input.runs {
                push(knob, &value, run, settings.clone());
            }
        }
    }
    // A condition that is the baseline's own setting (the whole prompt in one prefill pass) is
    // the same command as the repeats: its rows count the repeats' traces, recorded once.
    let repeats: Vec<String> = jobs.iter().filter(|j| j.knob == "repeat").map(|j| j.trace.clone()).collect();
    for j in jobs.iter_mut().filter(|j| j.knob != "baseline" && j.knob != "repeat" && j.settings == *b) {
        if let Some(t) = repeats.get(j.run as usize - 1) {
            j.trace = t.clone();
        }
    }
    Ok(Plan { version: MANIFEST_VERSION, prompt: input.prompt.clone(), requests: input.requests.clone(), jobs })
}

/// The values a varied knob takes, each with the settings of its runs.
fn conditions(input: &PlanInput, knob: &str) -> Vec<(String, Settings)> {
    let with = |f: &dyn Fn(&mut Settings)| {
        let mut s = input.base.clone();
        f(&mut s);
        s
    };
    match knob {
        "threads" => {
            // Sorted before dedup: on one core "all" is 1, which must not make a second
            // "threads 1" condition (its runs were counted twice in one row).
            let mut v: Vec<usize> = vec![1, 2, input.threads_all.max(1)];
            v.sort_unstable();
            v.dedup();
            v.into_iter().map(|n| (if n == input.threads_all && n > 2 { format!("{n} (all)") } else { n.to_string() }, with(&|s| s.threads = Some(n)))).collect()
        }
        "batch" => [1usize, 2, 4, 8].iter().map(|&n| (n.to_string(), with(&|s| s.batch = Some(n)))).collect(),
        "prefill-chunk" => {
            let l = input.prompt_tokens.max(1);
            let mut v = vec![("whole".to_string(), input.base.clone())];
            // A chunk that does not divide the prompt: the last prefill pass is shorter.
            let odd = (2..=l / 2).rev().find(|c| *c != 7 && !l.is_multiple_of(*c));
            for c in [Some(1), Some(7), odd].into_iter().flatten() {
                v.push((c.to_string(), with(&|s| s.prefill_chunk = Some(c))));
            }
            v
        }
        "dtype" => input.dtypes.iter().map(|d| (d.clone(), with(&|s| s.dtype = Some(d.clone())))).collect(),
        // The prompt among each companion set (PROMPTS_FILES).
        _ => COMPANION_LABELS.iter().enumerate().map(|(i, l)| (l.to_string(), with(&|s| (s.padded, s.companions) = (true, i)))).collect(),
    }
}

/// The check folder's file holding the prompt, exactly (`--prompt-file`).
pub const PROMPT_FILE: &str = "prompt.txt";
/// The check folder's file holding the first padded batch's requests, one JSON string a line
/// (`--prompts-file`): a longer request, the prompt, a shorter one.
pub const PROMPTS_FILE: &str = "prompts.txt";
/// The check folder's files holding each padded batch's requests ([`COMPANIONS`]).
pub const PROMPTS_FILES: [&str; 3] = [PROMPTS_FILE, "prompts-2.txt", "prompts-3.txt"];

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// The requests of padded batch `set` around `prompt`, in order (an out-of-range set, from a
/// hand-edited manifest: the first).
pub fn companion_batch(set: usize, prompt: &str) -> Vec<&str> {
    let (before, after) = COMPANIONS.get(set).copied().unwrap_or(COMPANIONS[0]);
    before.iter().copied().chain([prompt]).chain(after.iter().copied()).collect()
}
/// The check folder's file holding an encoder's sentence, as one JSON string (`--texts-file`).
pub const TEXT_FILE: &str = "text.txt";
/// The check folder's file holding `check --prompts-file`'s requests, one JSON string a line.
pub const REQUESTS_FILE: &str = "requests.txt";

/// The arguments after `trace` that run `job` of the check in `dir` (an absolute folder):
/// `record`, the job's [`Settings::args`], the prompt file in `dir` (the prompt travels in a
/// file of the check folder: no prompt text on a command line), and `-o DIR/TRACE`.
pub fn job_command(job: &Job, dir: &Path) -> Vec<String> {
    let mut out = vec!["record".to_string()];
    out.extend(job.settings.args());
    let s = &job.settings;
    let (flag, file) = match (s.encoder, s.requests, s.padded) {
        (true, true, _) => ("--texts-file", REQUESTS_FILE),
        (false, true, _) => ("--prompts-file", REQUESTS_FILE),
        (true, false, true) => ("--texts-file", PROMPTS_FILES.get(s.companions).copied().unwrap_or(PROMPTS_FILE)),
        (true, false, false) => ("--texts-file", TEXT_FILE),
        (false, false, true) => ("--prompts-file", PROMPTS_FILES.get(s.companions).copied().unwrap_or(PROMPTS_FILE)),
        (false, false, false) => ("--prompt-file", PROMPT_FILE),
    };
    out.extend([flag.to_string(), dir.join(file).to_string_lossy().into_owned()]);
    out.extend(["-o".to_string(), dir.join(&job.trace).to_string_lossy().into_owned()]);
    out
}

/// Why a trace present for `job` is not that job's run (another run's file copied there), if so.
fn job_mismatch(job: &Job, plan: &Plan, h: &candle_trace_format::record::Header) -> Option<String> {
    let (r, s) = (&h.run, &job.settings);
    let show = |v: Option<usize>| v.map_or(String::new(), |v| v.to_string());
    let checks = [
        ("--threads", s.threads.is_some(), show(s.threads), r.threads.to_string()),
        ("--batch", !s.padded && !s.requests, s.batch.unwrap_or(1).to_string(), r.batch.to_string()),
        ("--prefill-chunk", true, s.prefill_chunk.unwrap_or(0).to_string(), r.prefill_chunk.to_string()),
        ("--dtype", s.dtype.is_some(), s.dtype.clone().unwrap_or_default(), r.dtype.clone()),
    ];
    if !s.requests && s.padded != r.texts.iter().any(|t| *t != plan.prompt) {
        return Some(format!("holds another run ({} in its batch)", crate::text::plural(r.texts.len().max(1) as u64, "request")));
    }
    if s.requests {
        return (r.texts != plan.requests).then(|| "holds other requests".to_string());
    }
    let want = companion_batch(s.companions, &plan.prompt).len();
    if s.padded && r.texts.len() != want {
        return Some(format!("holds another run ({} in its batch, the job has {want})", crate::text::plural(r.texts.len() as u64, "request")));
    }
    for (flag, applies, w, got) in checks {
        if applies && w != got {
            return Some(format!("holds another run ({flag} {got}, the job has {w})"));
        }
    }
    let holds = r.prompt == plan.prompt || r.texts.contains(&plan.prompt);
    (!holds).then(|| "holds another prompt".to_string())
}

/// Writes `plan` into `dir`: `manifest.json`, and `jobs.txt` with one command per job
/// (`EXE record ARGS -o DIR/TRACE`).
///
/// # Errors
/// I/O errors naming the file; [`Error::Usage`] when `dir` already holds a check.
pub fn write_plan(plan: &Plan, dir: &Path, exe: &str) -> Result<()> {
    if dir.join("manifest.json").exists() {
        return Err(Error::usage(format!("{}: already holds a check (collect it with --collect, or choose another folder)", dir.display())));
    }
    if dir.exists() && !dir.is_dir() {
        return Err(Error::usage(format!("{}: is a file, not a folder (the check's plan and its traces go into a folder)", dir.display())));
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    // Absolute, so the jobs run from anywhere (a scheduler's own working directory).
    let dir = &std::fs::canonicalize(dir).map_err(|e| Error::io(dir, e))?;
    let pf = dir.join(PROMPT_FILE);
    std::fs::write(&pf, &plan.prompt).map_err(|e| Error::io(&pf, e))?;
    for (set, name) in PROMPTS_FILES.iter().enumerate() {
        let lines: Vec<String> = companion_batch(set, &plan.prompt).iter().map(|p| serde_json::to_string(p).unwrap_or_default()).collect();
        let pf = dir.join(name);
        std::fs::write(&pf, lines.join("\n") + "\n").map_err(|e| Error::io(&pf, e))?;
    }
    let json_lines = |v: &[String]| v.iter().map(|p| serde_json::to_string(p).unwrap_or_default() + "\n").collect::<String>();
    for (name, v) in [(TEXT_FILE, std::slice::from_ref(&plan.prompt)), (REQUESTS_FILE, &plan.requests[..])] {
        let f = dir.join(name);
        std::fs::write(&f, json_lines(v)).map_err(|e| Error::io(&f, e))?;
    }
    let m = dir.join("manifest.json");
    let json = serde_json::to_string_pretty(plan).map_err(|e| Error::usage(format!("cannot render the manifest: {e}")))?;
    std::fs::write(&m, json + "\n").map_err(|e| Error::io(&m, e))?;
    let mut lines = String::new();
    for j in plan.recordings() {
        let mut words = vec![exe.to_string()];
        words.extend(job_command(j, dir));
        // One command a line: nothing may hold a line break (prompts are in files).
        if let Some(w) = words.iter().find(|w| w.chars().any(char::is_control)) {
            return Err(Error::usage(format!("{w:?}: a path with a control character cannot go in jobs.txt")));
        }
        let quoted: Vec<String> = words.iter().map(|w| shell_quote(w)).collect();
        lines.push_str(&quoted.join(" "));
        lines.push('\n');
    }
    let jf = dir.join("jobs.txt");
    std::fs::write(&jf, lines).map_err(|e| Error::io(&jf, e))
}

/// Reads a check folder's manifest.
///
/// # Errors
/// [`Error::Usage`] when it is missing; a manifest that does not parse names the file.
pub fn read_plan(dir: &Path) -> Result<Plan> {
    let m = dir.join("manifest.json");
    let text = std::fs::read_to_string(&m).map_err(|_| Error::usage(format!("{}: no manifest.json (write one with trace check --plan DIR)", dir.display())))?;
    #[derive(Deserialize)]
    struct Version {
        version: u32,
    }
    let v: Version = serde_json::from_str(&text).map_err(|e| Error::trace(&m, format!("not a check manifest: {e}")))?;
    if v.version != MANIFEST_VERSION {
        return Err(Error::trace(&m, format!("a version-{} check manifest; this build reads version {MANIFEST_VERSION} (plan the check again with this build)", v.version)));
    }
    let plan: Plan = serde_json::from_str(&text).map_err(|e| Error::trace(&m, format!("not a check manifest: {e}")))?;
    if plan.jobs.len() > 10_000 {
        return Err(Error::trace(&m, format!("{} jobs: at most 10000", plan.jobs.len())));
    }
    if plan.jobs.first().is_none_or(|j| j.knob != "baseline") {
        return Err(Error::trace(&m, "not a check manifest starting with its baseline"));
    }
    let bad = |x: &str| x.is_empty() || x.contains(['/', '\\']) || x.starts_with('.') || x.chars().any(char::is_control);
    if plan.jobs.iter().any(|j| bad(&j.trace) || j.knob.chars().chain(j.value.chars()).any(char::is_control)) {
        return Err(Error::trace(&m, "a job's trace name is empty, holds a path or a control character"));
    }
    Ok(plan)
}

/// One condition's answer.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// `repeat`, or the knob varied (as [`Job::knob`]).
    pub knob: String,
    /// The knob's value (`-` for the repeats).
    pub value: String,
    /// Runs whose trace is present.
    pub runs: u32,
    /// Distinct generated token sequences of the request among those runs.
    pub unique_outputs: u32,
    /// `identical` (every run bit for bit the baseline's), `token_flip` (a generated token
    /// differs), `embedding_differs` (an encoder's pooled embedding differs), `numerics`
    /// (numbers differ, the tokens or embedding do not), or `missing` (no trace present).
    pub verdict: String,
    /// The runs are an encoder's: their outputs are pooled embeddings, and
    /// [`Row::logits_max_abs_diff`] is the embedding's max |a - b|.
    pub encoder: bool,
    /// Earliest differing generated token over the runs.
    pub first_flip: Option<u32>,
    /// The first run's root cause that differs: `path @ position`, and its class.
    pub root: Option<Untrusted>,
    /// The class of that root cause (`None` when no op is blamed).
    pub class: Option<CauseClass>,
    /// Lower bound of max |a - b| of the request's final logits, over runs and steps.
    pub logits_max_abs_diff: Option<f64>,
    /// `trace bisect` command showing the first run that differs.
    pub bisect: Option<String>,
    /// That run's trace file name in the check folder.
    pub trace: Option<String>,
}

/// The table of a check.
#[derive(Clone, Debug, Serialize)]
pub struct CheckReport {
    /// The request checked.
    pub prompt: String,
    /// `check --prompts-file`: the batch of requests checked (empty: `prompt` alone).
    pub requests: Vec<String>,
    /// The baseline's generated text (the request's row; for an encoder, its embedding's size).
    pub baseline_text: Untrusted,
    /// One row per condition (knob, value), in plan order; the baseline has none.
    pub rows: Vec<Row>,
    /// Traces of the plan not present (or not readable), with why.
    pub missing: Vec<String>,
    /// Every run present matched the baseline bit for bit.
    pub identical: bool,
    /// The check folder's last path component (what markdown names it by).
    pub folder: String,
    /// The baseline's model file and environment ([`crate::bisect::environment_fields`]).
    pub environment: Vec<(String, Untrusted)>,
    /// Runs present, the baseline included, each trace once (a condition sharing the
    /// baseline's setting counts the repeats' traces).
    pub runs: u32,
    /// Distinct outputs of the request (every request's, for a batch of requests) over those
    /// runs: 1 when every run gave the same, as the serving engines' determinism tests count
    /// distinct completions.
    pub distinct_outputs: u32,
}

/// Builds the table from the traces present in `dir` (see the module docs).
///
/// # Errors
/// As [`read_plan`]; [`Error::Usage`] when the baseline trace is missing; read errors of the
/// baseline.
pub fn collect(dir: &Path) -> Result<CheckReport> {
    let plan = read_plan(dir)?;
    let base_job = &plan.jobs[0];
    let base_path = dir.join(&base_job.trace);
    if !base_path.is_file() {
        return Err(Error::usage(format!("{}: the baseline trace is missing (run its job first)", base_path.display())));
    }
    // An unreadable baseline is refused before any job. Each job is then bisected against it a
    // frame at a time (two passes over both files), as `trace bisect` does: neither trace is
    // held whole.
    let environment = crate::bisect::environment_fields(TraceReader::open(&base_path)?.header()).into_iter().map(|(k, v)| (k.to_string(), Untrusted::new(v))).collect();
    let mut rows: Vec<Row> = Vec::new();
    let mut missing = Vec::new();
    let mut baseline_text = Untrusted::default();
    let mut unique: std::collections::HashMap<(String, String), BTreeSet<Vec<u32>>> = std::collections::HashMap::new();
    // Every run's output, by trace (a trace two conditions share counts once).
    let mut all: std::collections::HashMap<String, Vec<u32>> = std::collections::HashMap::new();
    // A trace two conditions share (the repeats, and the baseline's own setting of a knob) is
    // bisected once.
    let mut done: std::collections::HashMap<&str, Option<(Report, Trace)>> = std::collections::HashMap::new();
    for j in plan.jobs.iter().skip(1) {
        let at = row_for(&mut rows, &j.knob, &j.value);
        let path = dir.join(&j.trace);
        let found = match done.get(j.trace.as_str()) {
            Some(found) => found.clone(),
            None => {
                let found = bisect_job(&base_path, &path, j, &plan, &mut missing)?;
                done.insert(&j.trace, found.clone());
                found
            }
        };
        let Some((r, t)) = found else { continue };
        let row = &mut rows[at];
        row.runs += 1;
        note_run(row, &r, &base_path, &path);
        if baseline_text.is_empty() {
            baseline_text = r.a.text.clone();
        }
        // The request's output in this run (every request's, for a batch of requests).
        let b_rows: Vec<u32> = if plan.requests.is_empty() { vec![r.rows.iter().find(|x| x.a_row == 0).map_or(0, |x| x.b_row)] } else { r.rows.iter().map(|x| x.b_row).collect() };
        let output: Vec<u32> = b_rows.iter().flat_map(|&row| row_output(&t, row).into_iter().chain([u32::MAX])).collect();
        all.insert(j.trace.clone(), output.clone());
        unique.entry((j.knob.clone(), j.value.clone())).or_default().insert(output);
    }
    all.insert(base_job.trace.clone(), baseline_output(&base_path, &plan)?);
    // Distinct outputs per condition.
    // Rows whose every run is missing differ from nothing: the table says they are missing.
    let identical = rows.iter().all(|r| r.verdict == "identical" || r.verdict == "missing");
    for r in &mut rows {
        r.unique_outputs = unique.get(&(r.knob.clone(), r.value.clone())).map_or(0, |u| u.len() as u32);
    }
    if baseline_text.is_empty() {
        let base = read_trace_where(&base_path, |_| false)?;
        baseline_text = base.footer.as_ref().and_then(|f| f.texts.first()).map(|t| t.as_str().into()).unwrap_or_default();
    }
    let folder = dir.file_name().map_or_else(|| "check".to_string(), |n| n.to_string_lossy().into_owned());
    if baseline_text.is_empty() && plan.jobs[0].settings.encoder {
        baseline_text = "(an embedding: compared by its bits)".into();
    }
    let (runs, distinct_outputs) = (all.len() as u32, all.values().collect::<BTreeSet<_>>().len() as u32);
    Ok(CheckReport { prompt: plan.prompt, requests: plan.requests, baseline_text, rows, missing, identical, folder, environment, runs, distinct_outputs })
}

/// The baseline's output as [`collect`] keys every run's: the request's row (each request's
/// row, for a batch of requests), reading only the tokens and embeddings of the trace.
fn baseline_output(path: &Path, plan: &Plan) -> Result<Vec<u32>> {
    use candle_trace_format::record::Item;
    let t = read_trace_where(path, |i| matches!(i, Item::Token(_) | Item::Embeddings(_)))?;
    let rows = plan.requests.len().max(1) as u32;
    Ok((0..rows).flat_map(|row| row_output(&t, row).into_iter().chain([u32::MAX])).collect())
}

/// The index of the row of condition (`knob`, `value`), added (as "missing" until a run is
/// folded in) when new.
fn row_for(rows: &mut Vec<Row>, knob: &str, value: &str) -> usize {
    if let Some(i) = rows.iter().position(|r| r.knob == knob && r.value == value) {
        return i;
    }
    rows.push(Row {
        knob: knob.to_string(),
        value: value.to_string(),
        runs: 0,
        unique_outputs: 0,
        verdict: "missing".into(),
        encoder: false,
        first_flip: None,
        root: None,
        class: None,
        logits_max_abs_diff: None,
        bisect: None,
        trace: None,
    });
    rows.len() - 1
}

/// The bisect of job `j`'s trace at `path` against the baseline at `base_path`, and that trace as
/// far as the bisect read it (header, tokens), when it is there, finished and recorded as
/// planned; otherwise `None`, with why added to `missing`.
///
/// # Errors
/// The bisect's errors other than reading the job's own file (different models, for example).
fn bisect_job(base_path: &Path, path: &Path, j: &Job, plan: &Plan, missing: &mut Vec<String>) -> Result<Option<(Report, Trace)>> {
    if !path.exists() {
        missing.push(j.trace.clone());
        return Ok(None);
    }
    let header = match TraceReader::open(path) {
        Ok(r) => r.header().clone(),
        Err(e) => {
            missing.push(format!("{} ({e})", j.trace));
            return Ok(None);
        }
    };
    if let Some(why) = job_mismatch(j, plan, &header) {
        missing.push(format!("{} ({why})", j.trace));
        return Ok(None);
    }
    // The level is in the frame after the header: a trace of another level is another run.
    let want = j.settings.level.as_deref().and_then(candle_trace_format::site::Level::parse).unwrap_or_default();
    match crate::bisect_file::level_of(path) {
        Ok(got) if got != want => {
            missing.push(format!("{} (holds another run (--level {}, the job has {}))", j.trace, got.as_str(), want.as_str()));
            return Ok(None);
        }
        Err(e) => {
            missing.push(format!("{} ({e})", j.trace));
            return Ok(None);
        }
        Ok(_) => {}
    }
    match crate::bisect_file::bisect_files(base_path, path) {
        Ok((_, _, t)) if t.truncated => missing.push(format!("{} (truncated: the run did not finish)", j.trace)),
        Ok((r, _, t)) => return Ok(Some((r, t))),
        Err(e) if e.path() == Some(path) => missing.push(format!("{} ({e})", j.trace)),
        Err(e) => return Err(e),
    }
    Ok(None)
}

/// What row `row` of trace `t` answered: the tokens it generated, or its embedding's bits (an
/// encoder run).
fn row_output(t: &Trace, row: u32) -> Vec<u32> {
    use candle_trace_format::record::Item;
    let tokens: Vec<u32> = t.items.iter().filter_map(|i| if let Item::Token(e) = i { e.rows.iter().find(|c| c.row == row).map(|c| c.token) } else { None }).collect();
    if !tokens.is_empty() {
        return tokens;
    }
    let embedding = t.items.iter().find_map(|i| if let Item::Embeddings(v) = i { v.get(row as usize) } else { None });
    embedding.map_or_else(Vec::new, |e| e.iter().map(|x| x.to_bits()).collect())
}

/// Folds one run's bisect report into its condition's row.
fn note_run(row: &mut Row, r: &Report, base: &Path, path: &Path) {
    let embedding = r.rows.iter().find(|x| x.a_row == 0).and_then(|x| x.embedding.as_ref());
    row.encoder |= embedding.is_some();
    let verdict = if r.verdict == "identical" {
        "identical"
    } else if r.first_token_divergence.is_some() || r.rows.iter().any(|x| x.first_flip.is_some()) {
        "token_flip"
    } else if r.rows.iter().any(|x| x.embedding.as_ref().is_some_and(|e| !e.identical)) {
        "embedding_differs"
    } else {
        "numerics"
    };
    let rank = |v: &str| match v {
        "token_flip" | "embedding_differs" => 3,
        "numerics" => 2,
        "identical" => 1,
        _ => 0,
    };
    if rank(verdict) > rank(&row.verdict) {
        row.verdict = verdict.into();
    }
    let flip = r.first_token_divergence.as_ref().map(|f| f.step).or_else(|| r.rows.iter().filter_map(|x| x.first_flip).min());
    row.first_flip = match (row.first_flip, flip) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, y) => x.or(y),
    };
    if verdict != "identical" && row.root.is_none() {
        row.root = r
            .first_divergence
            .as_ref()
            .map(|d| format!("{} @ {}", &*d.path, d.position).into())
            .or_else(|| r.inputs_differ.as_ref().map(|i| i.explanation.as_str().into()))
            .or_else(|| r.graph_fork.as_ref().map(|g| format!("op graphs differ at {} @ {} ({} vs {})", &*g.path, g.position, join(&g.a_inputs), join(&g.b_inputs)).into()));
        row.class = r.first_divergence.as_ref().map(|d| d.class);
        // Paths as the folder was named on the command line (its last part in markdown).
        row.bisect = Some(format!("trace bisect {} {}", shell_quote(&base.to_string_lossy()), shell_quote(&path.to_string_lossy())));
        row.trace = path.file_name().map(|n| n.to_string_lossy().into_owned());
    }
    // NaN (a NaN or ±Inf in one run's output) wins over any number.
    let nan_max = |x: f64, y: f64| if x.is_nan() || y.is_nan() { f64::NAN } else { x.max(y) };
    let d = match embedding {
        // Every request's embedding, as the verdict reads every request.
        Some(_) => r.rows.iter().filter_map(|x| x.embedding.as_ref()).map(|e| e.max_abs_diff).fold(0.0, nan_max),
        // Every request's logits too (it read the first request's only: a fresh-user trial).
        None => r.rows.iter().flat_map(|x| x.logits_max_abs_diff.iter().copied()).fold(0.0, nan_max),
    };
    row.logits_max_abs_diff = Some(row.logits_max_abs_diff.map_or(d, |m| nan_max(m, d)));
}

/// Module paths from a trace, comma separated (still untrusted: the caller wraps the result).
fn join(v: &[Untrusted]) -> String {
    v.iter().map(|p| p.unescaped()).collect::<Vec<_>>().join(", ")
}

mod render;
pub use render::{markdown, text};

#[cfg(test)]
mod tests;
