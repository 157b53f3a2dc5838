//! `trace`: the command-line tool. A thin clap layer: every subcommand is one library call, and
//! exit codes are decided here, in one place: 0 success (bisect: identical), 1 bisect diverged,
//! 2 any error (printed as one line naming the file and the problem).

mod check_cmd;

use candle_trace::bisect;
use candle_trace::device::DeviceSpec;
use candle_trace::error::{Error, Result};
use candle_trace::format::read_trace;
use candle_trace::generate::GenConfig;
use candle_trace::models::WeightDtype;
use candle_trace::recorder::{record, RecordOptions};
use candle_trace::tracer::Perturb;
use candle_trace::{env, report, show};
use clap::{CommandFactory, Parser, Subcommand, ValueEnum};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Record every tensor op of a candle forward pass; find where two runs parted ways.
#[derive(Parser)]
#[command(name = "trace", version)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, ValueEnum)]
enum ReportFormat {
    Text,
    Json,
    Markdown,
}

/// `replay --dtype` values: the float dtypes.
#[derive(Clone, Copy, ValueEnum)]
enum FloatArg {
    F32,
    F16,
    Bf16,
}

impl FloatArg {
    fn weight(self) -> WeightDtype {
        weight_of(self)
    }
}

/// The weight dtype a `--dtype` value names, through the library's one parser
/// ([`WeightDtype::parse`]): clap lists the values, the library owns their meaning.
fn weight_of(v: impl ValueEnum) -> WeightDtype {
    let name = v.to_possible_value().expect("no skipped values");
    WeightDtype::parse(name.get_name()).expect("every --dtype value is one WeightDtype::parse takes")
}

/// `--numerics` values.
#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum NumericsArg {
    Fixed,
    Upstream,
    Invariant,
}

impl NumericsArg {
    /// The library's value of the same name.
    pub(crate) fn numerics(self) -> candle_trace::numerics::Numerics {
        use candle_trace::numerics::Numerics;
        match self {
            NumericsArg::Fixed => Numerics::Fixed,
            NumericsArg::Upstream => Numerics::Upstream,
            NumericsArg::Invariant => Numerics::Invariant,
        }
    }
}

/// `--dtype` values.
#[derive(Clone, Copy, ValueEnum)]
enum DtypeArg {
    Q,
    F32,
    F16,
    Bf16,
}

impl DtypeArg {
    fn weight(self) -> WeightDtype {
        weight_of(self)
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum ShowFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once per process
enum Cmd {
    /// Run generation (or an encoder) with an instrumented forward pass and write a trace:
    /// what every op produced, for `bisect` against another run. Exit 0 written, 2 error.
    Record(RecordArgs),
    /// Where did two runs part ways? First differing token, root-cause op (output differs,
    /// inputs matched), how the difference grew, settings that differ. Exit 0 identical,
    /// 1 diverged or incomplete (identical as far as both go, but a run stopped early or made
    /// fewer tokens), 2 error.
    Bisect(BisectArgs),
    /// Does this input give the same answer every way it is run? Records a baseline, repeats
    /// it, and records it under each value of each varied knob, then bisects every run against
    /// the baseline: one table row per condition. Exit 0 every run bit-identical, 1 otherwise,
    /// 2 error.
    Check(check_cmd::CheckArgs),
    /// The bisect of two traces as one self-contained HTML page: a per-layer chart of the
    /// largest difference (log scale), both runs' tokens with the flip marked, the root causes
    /// and their classes, the settings that differ. Loads nothing from the network. Exit 0
    /// identical, 1 diverged or incomplete (the page is written either way), 2 error.
    Report {
        /// First trace (run a).
        a: PathBuf,
        /// Second trace (run b).
        b: PathBuf,
        /// HTML file to write.
        #[arg(short = 'o', long = "out", value_name = "FILE", help_heading = "Required")]
        out: PathBuf,
    },
    /// Does this op give the recorded bits on this machine? Re-executes one recorded op from its
    /// dumped operands (record with --dump) and compares bit for bit. Exit 0 same bits, 1
    /// different, 2 error.
    Replay {
        /// Trace holding the dumped op: a repro trace from `trace extract`, or any `--dump` trace.
        file: PathBuf,
        /// Op record to replay (default: the only dumped op, as in a repro trace).
        #[arg(long, allow_negative_numbers = true)]
        op: Option<u64>,
        /// Convert the float operands to this dtype first.
        #[arg(long, value_enum)]
        dtype: Option<FloatArg>,
        /// CPU threads (sets RAYON_NUM_THREADS for this run).
        #[arg(long, value_parser = threads_arg, allow_negative_numbers = true)]
        threads: Option<usize>,
        /// Device: cpu, cuda, cuda:N, metal or metal:N (needs a build with --features cuda / metal).
        #[arg(long, default_value = "cpu")]
        device: DeviceSpec,
        #[arg(long, value_enum, default_value = "text")]
        format: ShowFormat,
    },
    /// What can I attach to a bug report? Cuts the root-cause op of `bisect A B` into a small
    /// self-contained repro trace (needs A recorded with --dump covering it) that `trace replay`
    /// runs with nothing else present. Exit 0 written, 2 error.
    Extract {
        /// First trace (its op and operands go into the repro).
        a: PathBuf,
        /// Second trace (its header and record go in as the counterpart).
        b: PathBuf,
        /// Repro trace to write.
        #[arg(short = 'o', long = "out", value_name = "FILE", help_heading = "Required")]
        out: PathBuf,
        /// Also write the repro as a Cargo project that needs candle alone: the operands as
        /// safetensors and a program that re-runs the op and compares with the recorded bits.
        #[arg(long, value_name = "DIR")]
        candle: Option<PathBuf>,
    },
    /// One file to attach to a bug report: a zip of the markdown bisect report (the issue body,
    /// with the commands that record both runs), both traces redacted, and the root-cause op as
    /// a repro for `trace replay` when the runs dumped it. Exit 0 written, 1 written but over the
    /// 25 MB GitHub accepts, 2 error.
    Bundle {
        /// First trace (run a).
        a: PathBuf,
        /// Second trace (run b).
        b: PathBuf,
        /// Keep something redaction removes: `prompt` (the prompt text and its token ids; the
        /// generated text and token ids are removed all the same).
        #[arg(long, value_parser = ["prompt"])]
        keep: Vec<String>,
        /// Leave the two traces out: the report and the repro only.
        #[arg(long)]
        no_traces: bool,
        /// The size the zip must stay under, in bytes (GitHub's attachment limit; for tests).
        #[arg(long, hide = true, default_value_t = candle_trace::bundle::ATTACHMENT_LIMIT, allow_negative_numbers = true)]
        limit: u64,
        /// Zip file to write.
        #[arg(short = 'o', long = "out", value_name = "FILE", help_heading = "Required")]
        out: PathBuf,
    },
    /// What is in this trace? The run's settings and environment, the generated text with each
    /// decode step's margin, the first NaN/Inf and the op that made it, embeddings' cosines, and
    /// a per-layer summary. Exit 0, 2 error.
    Show {
        /// Trace to show (a truncated one shows its complete frames).
        file: PathBuf,
        #[arg(long, value_enum, default_value = "text")]
        format: ShowFormat,
        /// List the op sites (module path and op) instead, e.g. for --perturb.
        #[arg(long)]
        sites: bool,
        /// The model file or folder the trace was recorded with: its tokenizer decodes the
        /// prompt's ids into the text the model received (chat template included).
        #[arg(long)]
        model: Option<PathBuf>,
    },
    /// Copy a trace without the prompt text, its token ids, the encoder texts, the generated
    /// text and dumped values, for a public bug report; prints what it removed. The copy
    /// still bisects against the original by digest. Exit 0 written, 2 error.
    Redact {
        /// Trace to copy.
        #[arg(value_name = "TRACE")]
        file: PathBuf,
        /// Keep something redaction removes: `prompt` (the prompt text, its ids, encoder texts),
        /// `values` (dumped float values: an embedding row tells its token; a repro's operands
        /// are always kept, as replay needs them).
        #[arg(long, value_parser = ["prompt", "values"])]
        keep: Vec<String>,
        /// Redacted trace to write.
        #[arg(short = 'o', long = "out", value_name = "FILE", help_heading = "Required")]
        out: PathBuf,
    },
    /// Turn a reference run (PyTorch/transformers, recorded by the Python package in python/:
    /// `candle-trace-ref record ... --out DIR`) into a trace, every op's values dumped, for
    /// `trace bisect REF.trace CANDLE.trace --tolerance auto`. Exit 0 written, 2 error.
    Import {
        /// Exchange folder the reference recorder wrote (exchange.json, values.safetensors).
        #[arg(value_name = "DIR")]
        dir: PathBuf,
        /// Which ops keep their values in full: all (the default; what `bisect --tolerance`
        /// compares), or comma-separated module-path patterns (`layers.0.mlp.*`) for a trace
        /// small enough to attach to a report; suffixed `@decode` or `@from:N` as `record --dump`.
        #[arg(long, default_value = "all")]
        dump: String,
        /// Trace to write.
        #[arg(short = 'o', long = "out", value_name = "FILE", help_heading = "Required")]
        out: PathBuf,
    },
}

fn main() -> ExitCode {
    // Captured before --threads changes RAYON_NUM_THREADS: the header keeps the user's own values.
    let env_vars = env::numeric_env_vars();
    // candle's default thread count, computed once rather than at every matmul; the same
    // threads, so the same results (`--threads` may change it below).
    env::pin_candle_threads();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            // No subcommand: the help, on stderr, and the exit code of a usage error (2).
            if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                eprint!("{}", e.render());
                return ExitCode::from(2);
            }
            // One line, like every other error: clap's message up to its usage block.
            let msg = e.to_string();
            let words: Vec<&str> =
                msg.lines().map(str::trim).take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information")).filter(|l| !l.is_empty() && !l.starts_with("tip:")).collect();
            let line = words.join(" ");
            // Name the subcommand's own help when one was given.
            let sub = std::env::args().nth(1).filter(|a| Cli::command().find_subcommand(a).is_some());
            let help = match sub {
                Some(s) => format!("trace {s} --help"),
                None => "trace --help".into(),
            };
            eprintln!("trace: error: {} (see {help})", line.trim_start_matches("error: "));
            return ExitCode::from(2);
        }
    };
    match run(cli, env_vars) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            // One line, with any control character from a crafted file escaped.
            eprintln!("trace: error: {}", candle_trace::report::clean(&e.to_string()));
            ExitCode::from(2)
        }
    }
}

/// Writes to stdout; a closed pipe (`trace show x | head`) is not an error.
fn stdout(s: &str) -> Result<()> {
    let mut o = std::io::stdout().lock();
    match o.write_all(s.as_bytes()).and_then(|_| o.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(Error::usage(format!("cannot write to stdout: {e}"))),
        _ => Ok(()),
    }
}

/// Parses `--perturb` specs; one given twice is refused (two flips of one bit cancel).
fn parse_perturbs(specs: &[String]) -> Result<Vec<Perturb>> {
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
fn same_file(a: &std::path::Path, b: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    matches!((std::fs::metadata(a), std::fs::metadata(b)), (Ok(x), Ok(y)) if x.dev() == y.dev() && x.ino() == y.ino())
}

/// Refuses `-o` naming a file the run reads (each `(flag, file)`): the trace written over it
/// would destroy it.
fn not_over_inputs(out: Option<&Path>, inputs: &[(&str, &Option<PathBuf>)]) -> Result<()> {
    for (flag, f) in inputs {
        if let (Some(f), Some(o)) = (f, out) {
            if same_file(f, o) {
                return Err(Error::usage(format!("-o {}: is the {flag}; write the trace elsewhere", o.display())));
            }
        }
    }
    Ok(())
}

/// `--threads N`: 1 to [`env::MAX_THREADS`].
fn threads_arg(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=env::MAX_THREADS).contains(&n) => Ok(n),
        _ => Err(format!("expected 1 to {}", env::MAX_THREADS)),
    }
}

fn to_json<T: serde::Serialize>(v: &T) -> Result<String> {
    serde_json::to_string_pretty(v).map_err(|e| Error::usage(format!("cannot render JSON: {e}")))
}

fn run(cli: Cli, env_vars: Vec<(String, String)>) -> Result<u8> {
    match cli.cmd {
        Cmd::Record(args) => record_cmd(args, env_vars),
        Cmd::Bisect(args) => bisect_cmd(args),
        Cmd::Check(args) => check_cmd::check_cmd(args, env_vars),
        Cmd::Report { a, b, out } => {
            if same_file(&a, &out) || same_file(&b, &out) {
                return Err(Error::usage(format!("-o {}: is an input trace; write the report elsewhere", out.display())));
            }
            // Streamed, as `trace bisect` is: the traces as far as the report reads them.
            let (r, profile, ta, tb) = candle_trace::bisect_file::bisect_files_profiled(&a, &b)?;
            // Both runs' tokens in the heatmap's row and the row of b holding the same request.
            let row_a = profile.heat.row;
            let row_b = r.rows.iter().find(|x| x.a_row == row_a).map_or(row_a, |x| x.b_row);
            let name = |p: &std::path::Path| p.file_name().map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into_owned());
            let views = candle_trace::html::Views {
                a_tokens: candle_trace::html::tokens(&ta, row_a),
                b_tokens: candle_trace::html::tokens(&tb, row_b),
                commands: vec![report::record_command(&ta.header, &ta.extras.settings, &name(&a)), report::record_command(&tb.header, &tb.extras.settings, &name(&b))],
                points: profile.points,
                heat: profile.heat,
            };
            std::fs::write(&out, candle_trace::html::page(&r, &views)).map_err(|e| Error::io(&out, e))?;
            stdout(&format!("wrote {}: {} ({} layers charted)\n", out.display(), r.verdict, views.points.len()))?;
            Ok(if r.verdict == bisect::Verdict::Identical { 0 } else { 1 })
        }
        Cmd::Replay { file, op, dtype, threads, device, format } => {
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
        Cmd::Extract { a, b, out, candle } => {
            if same_file(&a, &out) || same_file(&b, &out) {
                return Err(Error::usage(format!("-o {}: is an input trace; write the repro elsewhere", out.display())));
            }
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
        Cmd::Bundle { a, b, keep, no_traces, limit, out } => {
            if same_file(&a, &out) || same_file(&b, &out) {
                return Err(Error::usage(format!("-o {}: is an input trace; write the bundle elsewhere", out.display())));
            }
            let opts = candle_trace::bundle::BundleOptions { keep_prompt: keep.iter().any(|k| k == "prompt"), traces: !no_traces, limit };
            let r = candle_trace::bundle::bundle(&a, &b, &out, &opts)?;
            let files: Vec<String> = r.files.iter().map(|(n, b)| format!("{n} ({b} bytes)")).collect();
            stdout(&format!("wrote {} ({} bytes): {}; bisect {}\n", out.display(), r.bytes, files.join(", "), r.verdict))?;
            for w in &r.warnings {
                eprintln!("note: {}", candle_trace::text::clean(w));
            }
            Ok(if r.bytes > opts.limit { 1 } else { 0 })
        }
        Cmd::Import { dir, dump, out } => import_cmd(&dir, &dump, &out),
        Cmd::Redact { file, keep, out } => redact_cmd(&file, &keep, &out),
        Cmd::Show { file, format, sites, model } => {
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
    }
}

/// A progress bar on stderr over `len` units, hidden with `--quiet` or when stderr is not a
/// terminal (indicatif's own check).
fn progress(len: u64, quiet: bool, unit: &str) -> indicatif::ProgressBar {
    if quiet {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    let style = indicatif::ProgressStyle::with_template(&format!("{{bar:30}} {{pos}}/{{len}} {unit} {{msg}}")).unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    bar.set_style(style);
    bar
}

/// `trace record`'s options.
#[derive(clap::Args)]
struct RecordArgs {
    /// GGUF file (llama, qwen2, qwen3, phi3, gemma3) or Hugging Face folder (llama, qwen2, mistral, bert).
    /// Without it: the builtin seeded model.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompt text [default: "Tell me about Richard Feynman."]. Give it several times for a
    /// batch of different requests: one row per prompt, left-padded to the longest (as a
    /// server batches them); bisect compares each row with a run of its prompt alone.
    #[arg(long, conflicts_with_all = ["prompt_file", "prompts_file"])]
    prompt: Vec<String>,
    /// Read the prompt from a file (exactly as stored, trailing newline included).
    #[arg(long, conflicts_with = "prompts_file")]
    prompt_file: Option<PathBuf>,
    /// A batch of different requests from a file: one prompt per line (empty lines skipped, and
    /// counted on stderr; a line written as a JSON string, "...", is decoded, so a prompt may
    /// hold newlines).
    #[arg(long)]
    prompts_file: Option<PathBuf>,
    /// Apply the model's chat template (rendered by a Jinja engine) to the prompt.
    #[arg(long)]
    chat: bool,
    /// Tokens to generate at most. [default: 32]
    #[arg(long, allow_negative_numbers = true)]
    max_tokens: Option<usize>,
    /// Weights: q (as quantized in the file), or dequantized to f32, f16 or bf16.
    /// [default: q for a GGUF file, f32 for a folder and the builtin model]
    #[arg(long, value_enum)]
    dtype: Option<DtypeArg>,
    /// Prompt tokens per prefill forward pass (default: the whole prompt at once).
    #[arg(long, allow_negative_numbers = true)]
    prefill_chunk: Option<usize>,
    /// Batch rows, each holding the prompt.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    batch: usize,
    /// CPU threads (sets RAYON_NUM_THREADS for this run).
    #[arg(long, value_parser = threads_arg, allow_negative_numbers = true)]
    threads: Option<usize>,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Sampling seed.
    #[arg(long, default_value_t = 299792458, allow_negative_numbers = true)]
    seed: u64,
    /// Flip the lowest mantissa bit of one op's output: PATH[@POSITION[#ELEMENT]], e.g.
    /// layers.3.self_attn.softmax@5 (element 0 of row 0 at position 5), or lm_head@29#135
    /// (token 135's logit). Repeat for several faults.
    #[arg(long)]
    perturb: Vec<String>,
    /// Encoder folders (BERT): a sentence to embed; repeat for a batch. The trace ends with the
    /// pooled embeddings; `show` prints their cosine similarities.
    #[arg(long = "text", conflicts_with_all = ["prompt", "prompt_file", "prompts_file", "chat"])]
    texts: Vec<String>,
    /// Encoder folders: the sentences to embed from a file, one per line as --prompts-file
    /// reads them. With --batch N the sentences are repeated N times (N copies of each request).
    #[arg(long, conflicts_with_all = ["prompt", "prompt_file", "prompts_file", "chat", "texts"])]
    texts_file: Option<PathBuf>,
    /// Store full values: none, all, or comma-separated module-path patterns (`layers.3.*`).
    /// A selected op's inputs are stored too; prefixed `outputs:` (`outputs:all`), only its
    /// output (for `bisect --tolerance` against a reference; `replay` needs the inputs).
    /// Suffixed `@decode` (`outputs:all@decode`), only in decode steps; `@from:N`, only in
    /// passes that hold a position >= N: a long prompt's prefill holds most of a dump.
    /// Enables elementwise metrics in bisect. Not with --untraced, which records nothing.
    #[arg(long, default_value = "none", conflicts_with = "untraced")]
    dump: String,
    /// Device: cpu, cuda, cuda:N, metal or metal:N (needs a build with --features cuda / metal).
    #[arg(long, default_value = "cpu")]
    device: DeviceSpec,
    /// End the run after the first op whose output holds a NaN or ±Inf; the trace is complete.
    #[arg(long)]
    stop_on_nonfinite: bool,
    /// Run the same generation without recording (overhead baseline); prints only the text.
    #[arg(long, conflicts_with = "out")]
    untraced: bool,
    /// Where candle-transformers departs from the model's definition, `upstream` reproduces it
    /// exactly and `fixed` (the default) follows the definition. BERT: upstream's f16/bf16 mask
    /// (NaN in half precision) vs the dtype's own finite minimum. Gemma 3: upstream's SiLU in
    /// the MLP vs GELU (tanh), Gemma 3's activation. Decoders in f16/bf16: candle's softmax,
    /// which sums in the half dtype, vs one computed in f32 and rounded once (transformers').
    /// `invariant` follows the definition on batch-invariant kernels: a request's bits do not
    /// depend on the batch, its companions and their padding, the prefill chunk, decode step vs
    /// prefill, or the thread count (every model shipped, on the CPU).
    #[arg(long, value_enum, default_value = "fixed")]
    numerics: NumericsArg,
    /// The model's name in the trace header. Default: the GGUF file name; for a folder, its
    /// architecture and weights' sha256 (`llama-3f1a2b3c4d5e`), never the folder's own name.
    #[arg(long)]
    model_name: Option<String>,
    /// No progress bar (it is shown only when stderr is a terminal), and no note of a dump's
    /// expected size before the run.
    #[arg(long)]
    quiet: bool,
    /// What to record: ops (every op), layers (each layer's output, i.e. the residual stream,
    /// and the logits: a few KB a token, for always-on use), logits (the logits and the
    /// sampling records only). Bisect names the first layer and position that differ; against
    /// an ops trace it compares what both hold.
    #[arg(long, default_value = "ops", value_parser = level_arg)]
    level: candle_trace::site::Level,
    /// Summarise each op's output on a thread of its own while the forward pass runs on (the
    /// trace is the same; docs/performance.md says what it saved where measured). Not with
    /// --stop-on-nonfinite, which decides at each op whether to go on, nor --untraced.
    #[arg(long, conflicts_with_all = ["stop_on_nonfinite", "untraced"])]
    summary_worker: bool,
    /// Trace file to write (required, unless --untraced).
    #[arg(short = 'o', long = "out", value_name = "FILE", required_unless_present = "untraced", help_heading = "Required")]
    out: Option<PathBuf>,
}

/// The sampler's flags, shared by `record` and `check` (every run of a check takes them).
#[derive(clap::Args, Clone, Copy, Debug)]
struct SamplingArgs {
    /// Sampling temperature (omitted or 0: greedy).
    #[arg(long, allow_hyphen_values = true)]
    temperature: Option<f64>,
    /// Sample among the K most likely tokens (needs --temperature).
    #[arg(long, allow_negative_numbers = true)]
    top_k: Option<u32>,
    /// Sample from the smallest set of tokens whose probability reaches P, 0 < P <= 1 (needs --temperature).
    #[arg(long, allow_hyphen_values = true)]
    top_p: Option<f64>,
    /// Repeat penalty F > 0, as candle's examples apply it before sampling (candle_transformers::utils::apply_repeat_penalty): a logit of a token in the window divided by F when positive, multiplied when negative. Off (1) by default; greedy runs take it too.
    #[arg(long, allow_hyphen_values = true)]
    repeat_penalty: Option<f32>,
    /// The repeat penalty's window: the last N tokens of the prompt and the generated text (default 64; needs --repeat-penalty).
    #[arg(long)]
    repeat_last_n: Option<usize>,
}

impl SamplingArgs {
    /// The generation settings these flags give, over `base`.
    ///
    /// # Errors
    /// [`Error::Usage`] for `--repeat-last-n` without `--repeat-penalty`.
    fn apply(self, base: GenConfig) -> Result<GenConfig> {
        if self.repeat_last_n.is_some() && self.repeat_penalty.is_none() {
            return Err(Error::usage("--repeat-last-n applies only with --repeat-penalty F"));
        }
        Ok(GenConfig {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            repeat_penalty: self.repeat_penalty.unwrap_or(base.repeat_penalty),
            repeat_last_n: self.repeat_last_n.unwrap_or(base.repeat_last_n),
            ..base
        })
    }
}

/// `trace record`.
fn record_cmd(
    RecordArgs {
        model,
        prompt,
        prompt_file,
        prompts_file,
        chat,
        max_tokens,
        dtype,
        prefill_chunk,
        batch,
        threads,
        sampling,
        seed,
        perturb,
        mut texts,
        texts_file,
        dump,
        device,
        stop_on_nonfinite,
        untraced,
        model_name,
        numerics,
        quiet,
        level,
        summary_worker,
        out,
    }: RecordArgs,
    env_vars: Vec<(String, String)>,
) -> Result<u8> {
    not_over_inputs(out.as_deref(), &[("--prompt-file", &prompt_file), ("--prompts-file", &prompts_file), ("--texts-file", &texts_file)])?;
    threads.map(env::pin_threads).transpose()?;
    let lines = |f: &Path, flag: &str| -> Result<Vec<String>> {
        let (v, skipped) = candle_trace::recorder::read_prompts_file(f, flag)?;
        if skipped > 0 {
            eprintln!("note: {}: {skipped} empty line(s) skipped", f.display());
        }
        Ok(v)
    };
    if let Some(f) = &texts_file {
        texts = lines(f, "--texts-file")?;
    }
    if !texts.is_empty() && max_tokens.is_some() {
        return Err(Error::usage("--max-tokens with --text: --text embeds sentences with an encoder folder, in one forward pass that generates no token"));
    }
    // Encoders: --batch N repeats the sentences (N copies of each request in one batch).
    let batch = if texts.is_empty() {
        batch
    } else if (1..=candle_trace::generate::MAX_BATCH).contains(&batch) {
        texts = std::iter::repeat_n(texts, batch).flatten().collect();
        1
    } else {
        return Err(Error::usage(format!("--batch {batch}: expected 1 to {}", candle_trace::generate::MAX_BATCH)));
    };
    let mut prompts: Vec<String> = match (&prompts_file, prompt.len()) {
        (Some(f), _) => lines(f, "--prompts-file")?,
        (None, n) if n > 1 => prompt.clone(),
        _ => Vec::new(),
    };
    let prompt = match (prompt.first(), prompt_file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => candle_trace::recorder::read_text_file(&f, "--prompt-file")?,
        (None, None) => prompts.first().cloned().unwrap_or_else(|| "Tell me about Richard Feynman.".to_string()),
    };
    if prompts.len() == 1 {
        prompts.clear();
    }
    if prefill_chunk == Some(0) {
        return Err(Error::usage("--prefill-chunk must be at least 1"));
    }
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
    Ok(0)
}

/// `trace bisect`'s options.
#[derive(clap::Args)]
struct BisectArgs {
    /// First trace (run a, usually the reference).
    a: PathBuf,
    /// Second trace (run b), of the same model.
    b: PathBuf,
    /// Report format: text for the terminal, markdown for a bug report, json for tools.
    #[arg(long, value_enum, default_value = "text")]
    format: ReportFormat,
    /// Which difference changed the answer: re-run a with b's values patched in at the
    /// entry points (ops whose output differs while their inputs matched) and shrink them to
    /// a set that alone makes a produce b's token (needs the model; both runs must re-run
    /// bit for bit here).
    #[arg(long)]
    causal: bool,
    /// --causal: the model file or folder the runs used (not needed for the builtin model).
    #[arg(long, requires = "causal")]
    model: Option<PathBuf>,
    /// --causal: at most this many re-runs.
    #[arg(long, requires = "causal", default_value_t = candle_trace::causal::DEFAULT_MAX_RUNS, allow_negative_numbers = true)]
    max_runs: usize,
    /// --causal: write run a re-run with the set patched as a trace (show it, bisect it).
    #[arg(long, requires = "causal", value_name = "FILE")]
    causal_out: Option<PathBuf>,
    /// No progress indicator (it is shown only when stderr is a terminal).
    #[arg(long)]
    quiet: bool,
    /// Runs not meant to agree bit for bit (another dtype, another implementation): compare by
    /// value, a the reference, under the tolerance model (docs/tolerance.md): the root is the
    /// first op whose error its inputs' error and its rounding do not explain. `auto` allows 64
    /// epsilons of each op's dtype; a number is a relative tolerance. Needs both traces recorded
    /// with --dump covering the ops (`--dump all`). Exit 0 no root, 1 a root, 2 error.
    #[arg(long, value_name = "auto|REL", conflicts_with = "causal", value_parser = tolerance_arg, allow_hyphen_values = true)]
    tolerance: Option<candle_trace::tolerance::Tolerance>,
}

/// `--level`: ops, layers or logits.
fn level_arg(s: &str) -> std::result::Result<candle_trace::site::Level, String> {
    candle_trace::site::Level::parse(s).ok_or_else(|| "expected ops, layers or logits".into())
}

/// `--tolerance`: `auto`, or a relative tolerance above 0.
fn tolerance_arg(s: &str) -> std::result::Result<candle_trace::tolerance::Tolerance, String> {
    match s {
        "auto" => Ok(candle_trace::tolerance::Tolerance::Auto),
        _ => match s.parse::<f64>() {
            Ok(r) if r > 0.0 && r.is_finite() => Ok(candle_trace::tolerance::Tolerance::Relative(r)),
            _ => Err("expected auto or a relative tolerance above 0 (e.g. 1e-4)".into()),
        },
    }
}

/// `trace redact`.
fn redact_cmd(file: &Path, keep: &[String], out: &Path) -> Result<u8> {
    let t = read_trace(file)?;
    if same_file(file, out) {
        return Err(Error::usage(format!("-o {}: is the input trace; write the copy elsewhere", out.display())));
    }
    let keep = candle_trace::redact::Keep { prompt: keep.iter().any(|k| k == "prompt"), values: keep.iter().any(|k| k == "values") };
    let r = candle_trace::redact::redact(&t, &keep);
    candle_trace::redact::write(&r, out)?;
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
fn import_cmd(dir: &Path, dump: &str, out: &Path) -> Result<u8> {
    if !dir.is_dir() {
        return Err(Error::usage(format!("{}: not a folder (give the folder the reference recorder wrote with --out)", dir.display())));
    }
    let dump = candle_trace::dump::DumpSpec::parse(dump)?;
    let r = candle_trace::import::import(dir, out, &dump)?;
    let kept = if dump == candle_trace::dump::DumpSpec::All { "with their values".to_string() } else { format!("(values of {})", dump.to_arg()) };
    stdout(&format!("wrote {}: {} forward passes, {} op records {kept}, {} tokens, from {}\n", out.display(), r.forward_passes, r.op_records, r.tokens, r.implementation))?;
    for n in &r.not_covered {
        eprintln!("note: the reference does not record: {n}");
    }
    Ok(0)
}

/// `trace bisect --tolerance`: both traces read whole, compared by value.
fn bisect_tolerance(a: &Path, b: &Path, tol: candle_trace::tolerance::Tolerance, format: ReportFormat) -> Result<u8> {
    let (ta, tb) = (read_trace(a)?, read_trace(b)?);
    let r = candle_trace::across::compare(&ta, &tb, tol)?;
    if r.compared == 0 && r.fed_differ_at == Some(0) {
        // Passes that split the prompt otherwise (--prefill-chunk, --batch) pair nothing.
        return Err(Error::usage(format!(
            "--tolerance: {} and {} were fed different token ids from their first forward pass (another --prefill-chunk, --batch or prompt), and it compares passes fed the same ids: bisect them without --tolerance",
            a.display(),
            b.display()
        )));
    }
    if r.compared == 0 {
        return Err(Error::usage(format!("--tolerance: {} and {} hold no op whose values both dumped (record both with --dump all, or with the same --dump patterns)", a.display(), b.display())));
    }
    stdout(&match format {
        ReportFormat::Json => format!("{}\n", to_json(&r)?),
        ReportFormat::Text => candle_trace::across::text(&r),
        ReportFormat::Markdown => format!("```text\n{}```\n", candle_trace::across::text(&r)),
    })?;
    Ok(if r.root.is_some() { 1 } else { 0 })
}

/// `trace bisect`.
fn bisect_cmd(BisectArgs { a, b, format, causal, model, max_runs, causal_out, quiet, tolerance }: BisectArgs) -> Result<u8> {
    if let Some(tol) = tolerance {
        return bisect_tolerance(&a, &b, tol, format);
    }
    // Large traces take seconds to read and align: say so on a terminal.
    let spin = if quiet { indicatif::ProgressBar::hidden() } else { indicatif::ProgressBar::new_spinner() };
    spin.enable_steady_tick(std::time::Duration::from_millis(120));
    if !causal {
        // Both files are read a frame at a time: memory does not grow with their length.
        spin.set_message(format!("comparing {} with {}", a.display(), b.display()));
        let r = candle_trace::bisect_file::bisect_files(&a, &b);
        spin.finish_and_clear();
        let (r, ta, tb) = r?;
        return print_bisect(&r, &ta, &tb, format);
    }
    spin.set_message(format!("reading {}", a.display()));
    let ta = read_trace(&a)?;
    spin.set_message(format!("reading {}", b.display()));
    let tb = read_trace(&b)?;
    spin.set_message("re-running both runs with patches (see --max-runs)".to_string());
    if let Some(o) = &causal_out {
        if same_file(&a, o) || same_file(&b, o) {
            return Err(Error::usage(format!("--causal-out {}: is an input trace; write the patched run elsewhere", o.display())));
        }
    }
    let opts = candle_trace::causal::CausalOptions { model, max_runs, out: causal_out, ..Default::default() };
    let r = candle_trace::causal::causal(&ta, &tb, &opts);
    spin.finish_and_clear();
    let r = r?;
    let text = match format {
        ReportFormat::Json => format!("{}\n", to_json(&r)?),
        ReportFormat::Text => candle_trace::causal::text(&r),
        ReportFormat::Markdown => format!("```text\n{}```\n", candle_trace::causal::text(&r)),
    };
    stdout(&text)?;
    Ok(if r.verdict == candle_trace::causal::CausalVerdict::Identical { 0 } else { 1 })
}

/// Prints a bisect report of `a` and `b` in `format` (markdown with the commands that reproduce
/// both runs) and returns the exit code: 0 identical, 1 otherwise.
fn print_bisect(r: &bisect::Report, a: &candle_trace::format::Trace, b: &candle_trace::format::Trace, format: ReportFormat) -> Result<u8> {
    let text = match format {
        ReportFormat::Text => report::text(r),
        ReportFormat::Markdown => report::markdown_with(r, &[report::record_command(&a.header, &a.extras.settings, &r.a.path), report::record_command(&b.header, &b.extras.settings, &r.b.path)]),
        ReportFormat::Json => to_json(r)?,
    };
    stdout(&text)?;
    if !text.ends_with('\n') {
        stdout("\n")?;
    }
    Ok(if r.verdict == bisect::Verdict::Identical { 0 } else { 1 })
}
