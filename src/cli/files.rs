//! The flags of the subcommands that read traces: `bisect`, `report`, `replay`, `extract`,
//! `bundle`, `show`, `redact` and `import`.

use super::{threads_arg, tolerance_arg, FloatArg, ReportFormat, ShowFormat};
use candle_trace::device::DeviceSpec;
use std::path::PathBuf;

/// `trace bisect`'s options.
#[derive(clap::Args)]
pub(crate) struct BisectArgs {
    /// First trace (run a, usually the reference).
    pub(crate) a: PathBuf,
    /// Second trace (run b), of the same model.
    pub(crate) b: PathBuf,
    /// Report format: text for the terminal, markdown for a bug report, json for tools.
    #[arg(long, value_enum, default_value = "text")]
    pub(crate) format: ReportFormat,
    /// Which difference changed the answer: re-run a with b's values patched in at the
    /// entry points (ops whose output differs while their inputs matched) and shrink them to
    /// a set that alone makes a produce b's token (needs the model; both runs must re-run
    /// bit for bit here).
    #[arg(long)]
    pub(crate) causal: bool,
    /// --causal: the model file or folder the runs used (not needed for the builtin model).
    #[arg(long, requires = "causal")]
    pub(crate) model: Option<PathBuf>,
    /// --causal: at most this many re-runs.
    #[arg(long, requires = "causal", default_value_t = candle_trace::causal::DEFAULT_MAX_RUNS, allow_negative_numbers = true)]
    pub(crate) max_runs: usize,
    /// --causal: write run a re-run with the set patched as a trace (show it, bisect it).
    #[arg(long, requires = "causal", value_name = "FILE")]
    pub(crate) causal_out: Option<PathBuf>,
    /// No progress indicator (it is shown only when stderr is a terminal).
    #[arg(long)]
    pub(crate) quiet: bool,
    /// Runs not meant to agree bit for bit (another dtype, another implementation): compare by
    /// value, a the reference, under the tolerance model (docs/tolerance.md): the root is the
    /// first op whose error its inputs' error and its rounding do not explain. `auto` allows 64
    /// epsilons of each op's dtype; a number is a relative tolerance. Needs both traces recorded
    /// with --dump covering the ops (`--dump all`). Exit 0 no root, 1 a root, 2 error.
    #[arg(long, value_name = "auto|REL", conflicts_with = "causal", value_parser = tolerance_arg, allow_hyphen_values = true)]
    pub(crate) tolerance: Option<candle_trace::tolerance::Tolerance>,
}

/// `trace report`'s options.
#[derive(clap::Args)]
pub(crate) struct ReportArgs {
    /// First trace (run a).
    pub(crate) a: PathBuf,
    /// Second trace (run b).
    pub(crate) b: PathBuf,
    /// HTML file to write.
    #[arg(short = 'o', long = "out", value_name = "FILE", help_heading = "Required")]
    pub(crate) out: PathBuf,
}

/// `trace replay`'s options.
#[derive(clap::Args)]
pub(crate) struct ReplayArgs {
    /// Trace holding the dumped op: a repro trace from `trace extract`, or any `--dump` trace.
    pub(crate) file: PathBuf,
    /// Op record to replay (default: the only dumped op, as in a repro trace).
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) op: Option<u64>,
    /// Convert the float operands to this dtype first.
    #[arg(long, value_enum)]
    pub(crate) dtype: Option<FloatArg>,
    /// CPU threads (sets RAYON_NUM_THREADS for this run).
    #[arg(long, value_parser = threads_arg, allow_negative_numbers = true)]
    pub(crate) threads: Option<usize>,
    /// Device: cpu, cuda, cuda:N, metal or metal:N (needs a build with --features cuda / metal).
    #[arg(long, default_value = "cpu")]
    pub(crate) device: DeviceSpec,
    #[arg(long, value_enum, default_value = "text")]
    pub(crate) format: ShowFormat,
}

/// `trace extract`'s options.
#[derive(clap::Args)]
pub(crate) struct ExtractArgs {
    /// First trace (its op and operands go into the repro).
    pub(crate) a: PathBuf,
    /// Second trace (its header and record go in as the counterpart).
    pub(crate) b: PathBuf,
    /// Repro trace to write.
    #[arg(short = 'o', long = "out", value_name = "FILE", help_heading = "Required")]
    pub(crate) out: PathBuf,
    /// Also write the repro as a Cargo project that needs candle alone: the operands as
    /// safetensors and a program that re-runs the op and compares with the recorded bits.
    #[arg(long, value_name = "DIR")]
    pub(crate) candle: Option<PathBuf>,
}

/// `trace bundle`'s options.
#[derive(clap::Args)]
pub(crate) struct BundleArgs {
    /// First trace (run a).
    pub(crate) a: PathBuf,
    /// Second trace (run b).
    pub(crate) b: PathBuf,
    /// Keep something redaction removes: `prompt` (the prompt text and its token ids; the
    /// generated text and token ids are removed all the same).
    #[arg(long, value_parser = ["prompt"])]
    pub(crate) keep: Vec<String>,
    /// Leave the two traces out: the report and the repro only.
    #[arg(long)]
    pub(crate) no_traces: bool,
    /// The size the zip must stay under, in bytes (GitHub's attachment limit; for tests).
    #[arg(long, hide = true, default_value_t = candle_trace::bundle::ATTACHMENT_LIMIT, allow_negative_numbers = true)]
    pub(crate) limit: u64,
    /// Zip file to write.
    #[arg(short = 'o', long = "out", value_name = "FILE", help_heading = "Required")]
    pub(crate) out: PathBuf,
}

/// `trace show`'s options.
#[derive(clap::Args)]
pub(crate) struct ShowArgs {
    /// Trace to show (a truncated one shows its complete frames).
    pub(crate) file: PathBuf,
    #[arg(long, value_enum, default_value = "text")]
    pub(crate) format: ShowFormat,
    /// List the op sites (module path and op) instead, e.g. for --perturb.
    #[arg(long)]
    pub(crate) sites: bool,
    /// The model file or folder the trace was recorded with: its tokenizer decodes the
    /// prompt's ids into the text the model received (chat template included).
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
}

/// `trace redact`'s options.
#[derive(clap::Args)]
pub(crate) struct RedactArgs {
    /// Trace to copy.
    #[arg(value_name = "TRACE")]
    pub(crate) file: PathBuf,
    /// Keep something redaction removes: `prompt` (the prompt text, its ids, encoder texts),
    /// `values` (dumped float values: an embedding row tells its token; a repro's operands
    /// are always kept, as replay needs them).
    #[arg(long, value_parser = ["prompt", "values"])]
    pub(crate) keep: Vec<String>,
    /// Redacted trace to write.
    #[arg(short = 'o', long = "out", value_name = "FILE", help_heading = "Required")]
    pub(crate) out: PathBuf,
}

/// `trace import`'s options.
#[derive(clap::Args)]
pub(crate) struct ImportArgs {
    /// Exchange folder the reference recorder wrote (exchange.json, values.safetensors).
    #[arg(value_name = "DIR")]
    pub(crate) dir: PathBuf,
    /// Which ops keep their values in full: all (the default; what `bisect --tolerance`
    /// compares), or comma-separated module-path patterns (`layers.0.mlp.*`) for a trace
    /// small enough to attach to a report; suffixed `@decode` or `@from:N` as `record --dump`.
    #[arg(long, default_value = "all")]
    pub(crate) dump: String,
    /// Trace to write.
    #[arg(short = 'o', long = "out", value_name = "FILE", help_heading = "Required")]
    pub(crate) out: PathBuf,
}
