//! `trace record`'s flags, and the sampler's flags it shares with `trace check`.

use super::{level_arg, threads_arg, DtypeArg, NumericsArg};
use candle_trace::device::DeviceSpec;
use candle_trace::error::{Error, Result};
use candle_trace::generate::GenConfig;
use std::path::PathBuf;

/// `trace record`'s options.
#[derive(clap::Args)]
pub(crate) struct RecordArgs {
    /// GGUF file (llama, qwen2, qwen3, phi3, gemma3) or Hugging Face folder (llama, qwen2, mistral, bert).
    /// Without it: the builtin seeded model.
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    /// Prompt text [default: "Tell me about Richard Feynman."]. Give it several times for a
    /// batch of different requests: one row per prompt, left-padded to the longest (as a
    /// server batches them); bisect compares each row with a run of its prompt alone.
    #[arg(long, conflicts_with_all = ["prompt_file", "prompts_file"])]
    pub(crate) prompt: Vec<String>,
    /// Read the prompt from a file (exactly as stored, trailing newline included).
    #[arg(long, conflicts_with = "prompts_file")]
    pub(crate) prompt_file: Option<PathBuf>,
    /// A batch of different requests from a file: one prompt per line (empty lines skipped, and
    /// counted on stderr; a line written as a JSON string, "...", is decoded, so a prompt may
    /// hold newlines).
    #[arg(long)]
    pub(crate) prompts_file: Option<PathBuf>,
    /// Apply the model's chat template (rendered by a Jinja engine) to the prompt.
    #[arg(long)]
    pub(crate) chat: bool,
    /// Tokens to generate at most. [default: 32]
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) max_tokens: Option<usize>,
    /// Weights: q (as quantized in the file), or dequantized to f32, f16 or bf16.
    /// [default: q for a GGUF file, f32 for a folder and the builtin model]
    #[arg(long, value_enum)]
    pub(crate) dtype: Option<DtypeArg>,
    /// Prompt tokens per prefill forward pass (default: the whole prompt at once).
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) prefill_chunk: Option<usize>,
    /// Batch rows, each holding the prompt.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    pub(crate) batch: usize,
    /// CPU threads (sets RAYON_NUM_THREADS for this run).
    #[arg(long, value_parser = threads_arg, allow_negative_numbers = true)]
    pub(crate) threads: Option<usize>,
    #[command(flatten)]
    pub(crate) sampling: SamplingArgs,
    /// Sampling seed.
    #[arg(long, default_value_t = 299792458, allow_negative_numbers = true)]
    pub(crate) seed: u64,
    /// Flip the lowest mantissa bit of one op's output: PATH[@POSITION[#ELEMENT]], e.g.
    /// layers.3.self_attn.softmax@5 (element 0 of row 0 at position 5), or lm_head@29#135
    /// (token 135's logit). Repeat for several faults.
    #[arg(long)]
    pub(crate) perturb: Vec<String>,
    /// Encoder folders (BERT): a sentence to embed; repeat for a batch. The trace ends with the
    /// pooled embeddings; `show` prints their cosine similarities.
    #[arg(long = "text", conflicts_with_all = ["prompt", "prompt_file", "prompts_file", "chat"])]
    pub(crate) texts: Vec<String>,
    /// Encoder folders: the sentences to embed from a file, one per line as --prompts-file
    /// reads them. With --batch N the sentences are repeated N times (N copies of each request).
    #[arg(long, conflicts_with_all = ["prompt", "prompt_file", "prompts_file", "chat", "texts"])]
    pub(crate) texts_file: Option<PathBuf>,
    /// Store full values: none, all, or comma-separated module-path patterns (`layers.3.*`).
    /// A selected op's inputs are stored too; prefixed `outputs:` (`outputs:all`), only its
    /// output (for `bisect --tolerance` against a reference; `replay` needs the inputs).
    /// Suffixed `@decode` (`outputs:all@decode`), only in decode steps; `@from:N`, only in
    /// passes that hold a position >= N: a long prompt's prefill holds most of a dump.
    /// Enables elementwise metrics in bisect. Not with --untraced, which records nothing.
    #[arg(long, default_value = "none", conflicts_with = "untraced")]
    pub(crate) dump: String,
    /// Device: cpu, cuda, cuda:N, metal or metal:N (needs a build with --features cuda / metal).
    #[arg(long, default_value = "cpu")]
    pub(crate) device: DeviceSpec,
    /// End the run after the first op whose output holds a NaN or ±Inf; the trace is complete.
    #[arg(long)]
    pub(crate) stop_on_nonfinite: bool,
    /// Run the same generation without recording (overhead baseline); prints only the text.
    #[arg(long, conflicts_with = "out")]
    pub(crate) untraced: bool,
    /// Where candle-transformers departs from the model's definition, `upstream` reproduces it
    /// exactly and `fixed` (the default) follows the definition. BERT: upstream's f16/bf16 mask
    /// (NaN in half precision) vs the dtype's own finite minimum. Gemma 3: upstream's SiLU in
    /// the MLP vs GELU (tanh), Gemma 3's activation. Decoders in f16/bf16: candle's softmax,
    /// which sums in the half dtype, vs one computed in f32 and rounded once (transformers').
    /// `invariant` follows the definition on batch-invariant kernels: a request's bits do not
    /// depend on the batch, its companions and their padding, the prefill chunk, decode step vs
    /// prefill, or the thread count (every model shipped, on the CPU).
    #[arg(long, value_enum, default_value = "fixed")]
    pub(crate) numerics: NumericsArg,
    /// The model's name in the trace header. Default: the GGUF file name; for a folder, its
    /// architecture and weights' sha256 (`llama-3f1a2b3c4d5e`), never the folder's own name.
    #[arg(long)]
    pub(crate) model_name: Option<String>,
    /// No progress bar (it is shown only when stderr is a terminal), and no note of a dump's
    /// expected size before the run.
    #[arg(long)]
    pub(crate) quiet: bool,
    /// What to record: ops (every op), layers (each layer's output, i.e. the residual stream,
    /// and the logits: a few KB a token, for always-on use), logits (the logits and the
    /// sampling records only). Bisect names the first layer and position that differ; against
    /// an ops trace it compares what both hold.
    #[arg(long, default_value = "ops", value_parser = level_arg)]
    pub(crate) level: candle_trace::site::Level,
    /// Summarise each op's output on a thread of its own while the forward pass runs on (the
    /// trace is the same; docs/performance.md says what it saved where measured). Not with
    /// --stop-on-nonfinite, which decides at each op whether to go on, nor --untraced.
    #[arg(long, conflicts_with_all = ["stop_on_nonfinite", "untraced"])]
    pub(crate) summary_worker: bool,
    /// Trace file to write (required, unless --untraced).
    #[arg(short = 'o', long = "out", value_name = "FILE", required_unless_present = "untraced", help_heading = "Required")]
    pub(crate) out: Option<PathBuf>,
}

/// The sampler's flags, shared by `record` and `check` (every run of a check takes them).
#[derive(clap::Args, Clone, Copy, Debug)]
pub(crate) struct SamplingArgs {
    /// Sampling temperature (omitted or 0: greedy).
    #[arg(long, allow_hyphen_values = true)]
    pub(crate) temperature: Option<f64>,
    /// Sample among the K most likely tokens (needs --temperature).
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) top_k: Option<u32>,
    /// Sample from the smallest set of tokens whose probability reaches P, 0 < P <= 1 (needs --temperature).
    #[arg(long, allow_hyphen_values = true)]
    pub(crate) top_p: Option<f64>,
    /// Repeat penalty F > 0, as candle's examples apply it before sampling (candle_transformers::utils::apply_repeat_penalty): a logit of a token in the window divided by F when positive, multiplied when negative. Off (1) by default; greedy runs take it too.
    #[arg(long, allow_hyphen_values = true)]
    pub(crate) repeat_penalty: Option<f32>,
    /// The repeat penalty's window: the last N tokens of the prompt and the generated text (default 64; needs --repeat-penalty).
    #[arg(long)]
    pub(crate) repeat_last_n: Option<usize>,
}

impl SamplingArgs {
    /// The generation settings these flags give, over `base`.
    ///
    /// # Errors
    /// [`Error::Usage`] for `--repeat-last-n` without `--repeat-penalty`.
    pub(crate) fn apply(self, base: GenConfig) -> Result<GenConfig> {
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
