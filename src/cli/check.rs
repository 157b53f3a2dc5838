//! `trace check`'s flags.

use super::{level_arg, threads_arg, DtypeArg, NumericsArg, ReportFormat, SamplingArgs};
use std::path::PathBuf;

/// `trace check`'s options.
#[derive(clap::Args)]
pub(crate) struct CheckArgs {
    /// GGUF file or Hugging Face folder (without it: the builtin seeded model).
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    /// The request checked [default: "Tell me about Richard Feynman."].
    #[arg(long)]
    pub(crate) prompt: Option<String>,
    /// A batch of different requests as the baseline, one per line (as `record
    /// --prompts-file` reads it): every request's output is compared.
    #[arg(long, conflicts_with_all = ["prompt", "text", "golden", "write_golden"])]
    pub(crate) prompts_file: Option<PathBuf>,
    /// Encoder folders (BERT): the sentence checked (`--vary batch` embeds N copies of it).
    #[arg(long, conflicts_with_all = ["prompt", "chat"])]
    pub(crate) text: Option<String>,
    /// Device of every run: cpu, cuda, cuda:N, metal or metal:N.
    #[arg(long)]
    pub(crate) device: Option<candle_trace::device::DeviceSpec>,
    #[command(flatten)]
    pub(crate) sampling: SamplingArgs,
    /// Sampling seed of every run.
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) seed: Option<u64>,
    /// Apply the model's chat template.
    #[arg(long)]
    pub(crate) chat: bool,
    /// Tokens to generate at most [default: 32].
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) max_tokens: Option<usize>,
    /// The baseline's dtype (default: the model's own).
    #[arg(long, value_enum)]
    pub(crate) dtype: Option<DtypeArg>,
    /// The baseline's prefill chunk (default: the whole prompt).
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) prefill_chunk: Option<usize>,
    /// The baseline's batch rows.
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) batch: Option<usize>,
    /// The baseline's CPU threads.
    #[arg(long, value_parser = threads_arg, allow_negative_numbers = true)]
    pub(crate) threads: Option<usize>,
    /// What every run records: ops (every op, the default), layers (each layer's output and the
    /// logits: the first layer and position that differ, at a few KB a token) or logits. With
    /// --golden: the golden trace's level unless given
    #[arg(long, value_parser = level_arg)]
    pub(crate) level: Option<candle_trace::site::Level>,
    /// Every run's numerics (see `trace record --numerics`): `invariant` checks that the
    /// batch-invariant kernels keep the request's output the same under every knob.
    #[arg(long, value_enum)]
    pub(crate) numerics: Option<NumericsArg>,
    /// Recordings per condition (the whole-prompt condition, the baseline's own setting, counts the repeats).
    #[arg(long, default_value_t = 3, allow_negative_numbers = true)]
    pub(crate) runs: u32,
    /// Knobs to vary, comma-separated: threads, batch, prefill-chunk, dtype, padded-batch.
    #[arg(long, value_delimiter = ',', default_value = "threads,batch,prefill-chunk")]
    pub(crate) vary: Vec<String>,
    /// Folder that keeps every trace (and the plan); with --golden, the run recorded here when
    /// it does not match the golden (DIR/this-machine.trace).
    #[arg(long, value_name = "DIR", default_value = "trace-check")]
    pub(crate) out: PathBuf,
    #[arg(long, value_enum, default_value = "text")]
    pub(crate) format: ReportFormat,
    /// Only write the plan into DIR: manifest.json and jobs.txt (one `trace record` command
    /// a line, for xargs -P, GNU parallel or a Slurm job array); run nothing.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["collect", "golden", "write_golden"])]
    pub(crate) plan: Option<PathBuf>,
    /// Build the table from the traces present in DIR (a plan's folder); names missing ones.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["golden", "write_golden"])]
    pub(crate) collect: Option<PathBuf>,
    /// Record the baseline into FILE: the reference for --golden.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["golden", "runs", "vary"])]
    pub(crate) write_golden: Option<PathBuf>,
    /// Re-record FILE's settings here (those given on this command line override them) and
    /// bisect against it: exit 0 identical, 1 diverged.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["runs", "vary"])]
    pub(crate) golden: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    pub(crate) quiet: bool,
}
