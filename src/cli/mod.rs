//! The `trace` command line's definitions: every subcommand's flags, as clap parses them, and
//! the parsers of flag values. What each subcommand does is in `crate::commands`.

mod check;
mod files;
mod record;

pub(crate) use check::CheckArgs;
pub(crate) use files::{BisectArgs, BundleArgs, ExtractArgs, ImportArgs, RedactArgs, ReplayArgs, ReportArgs, ShowArgs};
pub(crate) use record::{RecordArgs, SamplingArgs};

use candle_trace::env;
use candle_trace::models::WeightDtype;
use clap::{Parser, Subcommand, ValueEnum};

/// Record every tensor op of a candle forward pass; find where two runs parted ways.
#[derive(Parser)]
#[command(name = "trace", version)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) cmd: Cmd,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum ReportFormat {
    Text,
    Json,
    Markdown,
}

/// `replay --dtype` values: the float dtypes.
#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum FloatArg {
    F32,
    F16,
    Bf16,
}

impl FloatArg {
    pub(crate) fn weight(self) -> WeightDtype {
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
pub(crate) enum DtypeArg {
    Q,
    F32,
    F16,
    Bf16,
}

impl DtypeArg {
    pub(crate) fn weight(self) -> WeightDtype {
        weight_of(self)
    }
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum ShowFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once per process
pub(crate) enum Cmd {
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
    Check(CheckArgs),
    /// The bisect of two traces as one self-contained HTML page: a per-layer chart of the
    /// largest difference (log scale), both runs' tokens with the flip marked, the root causes
    /// and their classes, the settings that differ. Loads nothing from the network. Exit 0
    /// identical, 1 diverged or incomplete (the page is written either way), 2 error.
    Report(ReportArgs),
    /// Does this op give the recorded bits on this machine? Re-executes one recorded op from its
    /// dumped operands (record with --dump) and compares bit for bit. Exit 0 same bits, 1
    /// different, 2 error.
    Replay(ReplayArgs),
    /// What can I attach to a bug report? Cuts the root-cause op of `bisect A B` into a small
    /// self-contained repro trace (needs A recorded with --dump covering it) that `trace replay`
    /// runs with nothing else present. Exit 0 written, 2 error.
    Extract(ExtractArgs),
    /// One file to attach to a bug report: a zip of the markdown bisect report (the issue body,
    /// with the commands that record both runs), both traces redacted, and the root-cause op as
    /// a repro for `trace replay` when the runs dumped it. Exit 0 written, 1 written but over the
    /// 25 MB GitHub accepts, 2 error.
    Bundle(BundleArgs),
    /// What is in this trace? The run's settings and environment, the generated text with each
    /// decode step's margin, the first NaN/Inf and the op that made it, embeddings' cosines, and
    /// a per-layer summary. Exit 0, 2 error.
    Show(ShowArgs),
    /// Copy a trace without the prompt text, its token ids, the encoder texts, the generated
    /// text and dumped values, for a public bug report; prints what it removed. The copy
    /// still bisects against the original by digest. Exit 0 written, 2 error.
    Redact(RedactArgs),
    /// Turn a reference run (PyTorch/transformers, recorded by the Python package in python/:
    /// `candle-trace-ref record ... --out DIR`) into a trace, every op's values dumped, for
    /// `trace bisect REF.trace CANDLE.trace --tolerance auto`. Exit 0 written, 2 error.
    Import(ImportArgs),
}

/// `--threads N`: 1 to [`env::MAX_THREADS`].
fn threads_arg(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=env::MAX_THREADS).contains(&n) => Ok(n),
        _ => Err(format!("expected 1 to {}", env::MAX_THREADS)),
    }
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
