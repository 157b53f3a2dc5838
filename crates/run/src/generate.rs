//! The generation loop: prefill (whole prompt or in chunks), then decode steps with candle's
//! `LogitsProcessor`, recording each step's choice (top-5, margin, exact ties) in the trace.
//!
//! Knobs that change numerics: `prefill_chunk` (tokens per prefill forward pass), `batch` (the
//! prompt replicated in that many rows; row 0 is what bisect compares with a batch-1 run) and the
//! dtype and threads chosen by the caller.

use crate::models::Decoder;
use crate::sampling::Sampler;
use crate::tokenizer::TextTokenizer;
use crate::tracer::Tracer;
use candle_core::Tensor;
use candle_trace_format::error::{Error, Result};
use candle_trace_format::fields::StopReason;
use candle_trace_format::record::{Choice, PenaltyStep, Phase, TokenEvent};
use candle_transformers::generation::Sampling;

/// Generation settings.
#[derive(Clone, Debug, PartialEq)]
pub struct GenConfig {
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// Prompt tokens per prefill forward pass; 0 = the whole prompt at once.
    pub prefill_chunk: usize,
    /// Rows in the batch, each holding the prompt.
    pub batch: usize,
    /// None or below 1e-7: greedy (argmax, ties to the lowest id).
    pub temperature: Option<f64>,
    /// Sample among the k highest logits only (candle's `Sampling::TopK`); needs a temperature.
    pub top_k: Option<u32>,
    /// Nucleus sampling: the most probable tokens up to probability mass p, in (0, 1] (after
    /// top-k when both are set); needs a temperature.
    pub top_p: Option<f64>,
    /// Seed of each row's `LogitsProcessor`; every row starts from the same seed.
    pub seed: u64,
    /// Repeat penalty applied to each decode step's logits before sampling, as candle's
    /// `candle_transformers::utils::apply_repeat_penalty` does (a logit of a token in the
    /// window divided by it when positive, multiplied when negative); 1.0 = off.
    pub repeat_penalty: f32,
    /// The penalty's window: the last N tokens of the row's prompt and generated text (as
    /// candle's llama example, llama.cpp and transformers count them; candle's quantized example
    /// leaves the prompt out).
    pub repeat_last_n: usize,
}

impl Default for GenConfig {
    fn default() -> Self {
        GenConfig { max_tokens: 32, prefill_chunk: 0, batch: 1, temperature: None, top_k: None, top_p: None, seed: 299792458, repeat_penalty: 1.0, repeat_last_n: 64 }
    }
}

/// What a generation produced, per batch row.
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    /// Each row's generated token ids, prompt excluded; ends with row 0's end-of-sequence id
    /// when that stopped it.
    pub tokens: Vec<Vec<u32>>,
    /// Each row's generated text, detokenized token by token.
    pub texts: Vec<String>,
    /// Why generation stopped.
    pub stop: StopReason,
}

/// The smallest `--repeat-penalty` accepted: a positive logit divided by it stays finite
/// (logits would have to pass 3.4e32).
pub const MIN_REPEAT_PENALTY: f32 = 1e-6;

/// The largest `--batch` accepted.
pub const MAX_BATCH: usize = 256;

impl GenConfig {
    /// Checks the settings before anything runs.
    ///
    /// # Errors
    /// [`Error::Usage`] naming the flag: batch outside 1..=[`MAX_BATCH`], a temperature that is
    /// negative or not finite, top-k of 0, top-p outside (0, 1], or top-k/top-p without a
    /// temperature > 0, a repeat penalty that is not a finite value >= [`MIN_REPEAT_PENALTY`].
    pub fn validate(&self) -> Result<()> {
        // Below 1e-6 a positive logit divided by the penalty could pass f32's range.
        if !(self.repeat_penalty.is_finite() && self.repeat_penalty >= MIN_REPEAT_PENALTY) {
            return Err(Error::usage(format!("--repeat-penalty {:?}: expected a finite value >= 1e-6 (1 = off)", self.repeat_penalty)));
        }
        if !(1..=MAX_BATCH).contains(&self.batch) {
            return Err(Error::usage(format!("--batch {}: expected 1 to {MAX_BATCH}", self.batch)));
        }
        if let Some(t) = self.temperature {
            if !t.is_finite() || t < 0.0 {
                return Err(Error::usage(format!("--temperature {t}: expected a finite value >= 0")));
            }
        }
        if self.top_k == Some(0) {
            return Err(Error::usage("--top-k 0: expected at least 1"));
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(Error::usage(format!("--top-p {p}: expected 0 < P <= 1")));
            }
        }
        let sampling = self.temperature.is_some_and(|t| t >= 1e-7);
        if !sampling && (self.top_k.is_some() || self.top_p.is_some()) {
            return Err(Error::usage("--top-k and --top-p apply only when sampling: add --temperature T > 0"));
        }
        Ok(())
    }

    /// Whether a repeat penalty applies.
    pub fn penalised(&self) -> bool {
        self.repeat_penalty != 1.0
    }

    /// The settings a trace keeps in its settings frame (format 2.7): the repeat penalty and
    /// its window when one applies, else none. The recorder writes them ([`Tracer::settings`]).
    pub fn settings(&self) -> candle_trace_format::record::Settings {
        let mut pairs = Vec::new();
        if self.penalised() {
            pairs.push(("repeat_last_n".to_string(), self.repeat_last_n.to_string()));
            pairs.push(("repeat_penalty".to_string(), serde_json::to_string(&self.repeat_penalty).unwrap_or_default()));
        }
        candle_trace_format::record::Settings(pairs)
    }

    /// Takes the settings a trace's settings frame holds (the inverse of [`GenConfig::settings`];
    /// a trace without the frame leaves the penalty off).
    ///
    /// # Errors
    /// [`Error::Usage`] for a key this build does not know or a value it cannot read.
    pub fn apply_settings(&mut self, settings: &candle_trace_format::record::Settings) -> Result<()> {
        for (key, value) in &settings.0 {
            let bad = || Error::usage(format!("the trace's setting {key} = {value} is not one this build can read"));
            match key.as_str() {
                "repeat_penalty" => self.repeat_penalty = serde_json::from_str(value).map_err(|_| bad())?,
                "repeat_last_n" => self.repeat_last_n = serde_json::from_str(value).map_err(|_| bad())?,
                _ => return Err(bad()),
            }
        }
        Ok(())
    }
}

/// One row's logits after the repeat penalty (`logits` itself when none applies), and for a
/// traced run what the penalty did: the distinct tokens of the window and the top 5 after it.
/// `context`: the row's prompt then its generated tokens.
fn penalise(logits: Tensor, cfg: &GenConfig, context: &[u32], index: u32, row: u32, traced: bool) -> Result<(Tensor, Option<PenaltyStep>)> {
    if !cfg.penalised() {
        return Ok((logits, None));
    }
    let window = &context[context.len().saturating_sub(cfg.repeat_last_n)..];
    let after = candle_transformers::utils::apply_repeat_penalty(&logits, cfg.repeat_penalty, window)?;
    if !traced {
        return Ok((after, None));
    }
    let (before, vals) = (logits.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?, after.to_vec1::<f32>()?);
    let distinct: std::collections::HashSet<u32> = window.iter().copied().filter(|&t| (t as usize) < before.len()).collect();
    let top = top5(&vals).0.into_iter().map(|(t, l)| (t, before[t as usize], l)).collect();
    Ok((after, Some(PenaltyStep { index, row, penalised: distinct.len() as u32, top })))
}

fn sampling(cfg: &GenConfig) -> Sampling {
    match cfg.temperature.filter(|t| *t >= 1e-7) {
        None => Sampling::ArgMax,
        Some(temperature) => match (cfg.top_k, cfg.top_p) {
            (None, None) => Sampling::All { temperature },
            (Some(k), None) => Sampling::TopK { k: k as usize, temperature },
            (None, Some(p)) => Sampling::TopP { p, temperature },
            (Some(k), Some(p)) => Sampling::TopKThenTopP { k: k as usize, p, temperature },
        },
    }
}

/// The 5 highest logits, highest first, ties to the lowest id; plus top-1 minus top-2 and
/// whether they tie exactly.
pub fn top5(logits: &[f32]) -> (Vec<(u32, f32)>, f32, bool) {
    // `f32::total_cmp`'s order as integers: the fifth place's key is compared with each logit
    // (one integer compare a logit, not two keys computed).
    let key = |x: f32| {
        let b = x.to_bits() as i32;
        b ^ (((b >> 31) as u32) >> 1) as i32
    };
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(6);
    let mut fifth = i32::MIN;
    for (i, &v) in logits.iter().enumerate() {
        let k = key(v);
        if top.len() == 5 && k <= fifth {
            continue;
        }
        let at = top.iter().position(|&(_, t)| k > key(t)).unwrap_or(top.len());
        top.insert(at, (i as u32, v));
        top.truncate(5);
        fifth = key(top[top.len() - 1].1);
    }
    let (margin, tie) = match (top.first(), top.get(1)) {
        (Some(a), Some(b)) => (a.1 - b.1, a.1 == b.1),
        _ => (0.0, false),
    };
    (top, margin, tie)
}

/// Runs prefill and decode for `prompt` on `model`, recording through `tr`.
///
/// Stops after `max_tokens` tokens or when row 0 produces the tokenizer's end-of-sequence id.
///
/// # Errors
/// [`Error::Usage`] for an empty prompt or settings [`GenConfig::validate`] refuses; candle and
/// sink errors.
pub fn generate(model: &mut Decoder, tok: &TextTokenizer, prompt: &[u32], cfg: &GenConfig, tr: &mut Tracer) -> Result<Generation> {
    cfg.validate()?;
    let rows = vec![prompt.to_vec(); cfg.batch];
    generate_rows(model, tok, &rows, &GenConfig { batch: 1, ..cfg.clone() }, tr)
}

/// Runs prefill and decode for a batch of different requests, one prompt per row, as a server
/// batches them: rows shorter than the longest are left-padded (Hugging Face `generate`'s
/// padding: pad tokens first, masked out of attention, each row's positions counted from its own
/// first token), so every row computes what it would alone up to the kernels' dependence on the
/// batch shape. The tracer numbers each row's positions from its own first token
/// ([`Tracer::set_rows`]), so row `r` aligns with a run of its prompt alone.
///
/// # Errors
/// [`Error::Usage`] for an empty prompt or more rows than [`MAX_BATCH`]; as [`generate`].
pub fn generate_rows(model: &mut Decoder, tok: &TextTokenizer, prompts: &[Vec<u32>], cfg: &GenConfig, tr: &mut Tracer) -> Result<Generation> {
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        return Err(Error::usage("the prompt has no tokens"));
    }
    cfg.validate()?;
    if prompts.len() > MAX_BATCH {
        return Err(Error::usage(format!("{} prompts: at most {MAX_BATCH} rows", prompts.len())));
    }
    let device = model.device().clone();
    model.clear_kv_cache();
    let rows = prompts.len();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let pads: Vec<usize> = prompts.iter().map(|p| longest - p.len()).collect();
    let pad_id = tok.eos_id().unwrap_or(0);
    let padded: Vec<Vec<u32>> = prompts.iter().zip(&pads).map(|(p, &n)| std::iter::repeat_n(pad_id, n).chain(p.iter().copied()).collect()).collect();
    if pads.iter().any(|&n| n > 0) {
        model.set_padding(pads.clone());
        tr.set_rows(pads.iter().map(|&n| (n as u32, u32::MAX)).collect());
    } else {
        model.set_padding(Vec::new());
        tr.set_rows(Vec::new());
    }
    let mut procs: Vec<Sampler> = (0..rows).map(|_| Sampler::new(cfg.seed, sampling(cfg))).collect();
    let chunk = if cfg.prefill_chunk == 0 { longest } else { cfg.prefill_chunk };
    let (mut logits, mut pos) = (prefill(model, tr, &padded, chunk)?, longest);
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); rows];
    let mut texts: Vec<String> = vec![String::new(); rows];
    let mut streams: Vec<_> = (0..rows).map(|_| tok.stream()).collect();
    let mut stop = StopReason::MaxTokens;
    // A row that generated its end-of-sequence token is done: like a run of its prompt alone,
    // it generates nothing more (its later steps feed the pad id, and their logits are unread).
    let mut done = vec![false; rows];
    for index in 0..cfg.max_tokens {
        let mut choices = Vec::with_capacity(rows);
        let mut steps = Vec::with_capacity(rows);
        let mut penalties = Vec::new();
        for (r, proc) in procs.iter_mut().enumerate() {
            if done[r] {
                continue;
            }
            let context: Vec<u32> = if cfg.penalised() { prompts[r].iter().chain(&tokens[r]).copied().collect() } else { Vec::new() };
            let (row, penalty) = penalise(logits.get(r)?, cfg, &context, index as u32, r as u32, tr.is_traced())?;
            penalties.extend(penalty);
            let next = if tr.is_traced() {
                let (next, step) = proc.sample(&row, index as u32, r as u32)?;
                steps.push(step);
                next
            } else {
                proc.choose(&row)?
            };
            tokens[r].push(next);
            done[r] = Some(next) == tok.eos_id();
            let text = streams[r].step(next).map_err(Error::usage)?;
            texts[r].push_str(&text);
            if tr.is_traced() {
                let (top, margin, tie) = top5(&row.to_vec1::<f32>()?);
                choices.push(Choice { row: r as u32, token: next, text, top, margin, tie });
            }
        }
        if tr.is_traced() {
            tr.penalty(&penalties)?;
            tr.sampling(&steps)?;
            let step = tr.forward_passes().saturating_sub(1);
            tr.token(TokenEvent { step, index: index as u32, pos: pos as u32, rows: choices })?;
        }
        tr.tick();
        if done.iter().all(|d| *d) {
            stop = StopReason::Eos;
            break;
        }
        if index + 1 == cfg.max_tokens {
            break;
        }
        let ids: Vec<u32> = tokens.iter().map(|t| t.get(index).copied().unwrap_or(pad_id)).collect();
        let ids = Tensor::from_vec(ids, (rows, 1), &device)?;
        logits = model.forward(tr, &ids, pos, Phase::Decode)?;
        pos += 1;
    }
    Ok(Generation { tokens, texts, stop })
}

/// The prefill of the left-padded prompts `padded` (all of one length), `chunk` positions a
/// forward pass; the last pass's logits.
fn prefill(model: &mut Decoder, tr: &mut Tracer, padded: &[Vec<u32>], chunk: usize) -> Result<Tensor> {
    let (rows, longest) = (padded.len(), padded.first().map_or(0, Vec::len));
    let device = model.device().clone();
    let mut logits = None;
    let mut pos = 0;
    while pos < longest {
        let n = chunk.min(longest - pos);
        let ids: Vec<u32> = padded.iter().flat_map(|r| r[pos..pos + n].iter().copied()).collect();
        let ids = Tensor::from_vec(ids, (rows, n), &device)?;
        logits = Some(model.forward(tr, &ids, pos, Phase::Prefill)?);
        pos += n;
    }
    logits.ok_or_else(|| Error::usage("the prompt has no tokens"))
}

#[cfg(test)]
mod tests {
    use super::top5;

    /// The first five of a stable descending sort by `f32::total_cmp`, bit for bit, over
    /// logits holding NaNs of both signs, ±0, ±Inf and ties, at lengths around five.
    #[test]
    fn top5_is_the_head_of_a_stable_descending_sort() {
        let specials = [f32::NAN, -f32::NAN, 0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, 1.0, -1.0, f32::MIN_POSITIVE, 3.0];
        let v: Vec<f32> = (0..500u32).map(|i| if i % 7 == 0 { specials[(i / 7) as usize % specials.len()] } else { ((i.wrapping_mul(2_654_435_761) % 1000) as f32 - 500.0) / 7.0 }).collect();
        let bits = |l: &[(u32, f32)]| l.iter().map(|&(i, x)| (i, x.to_bits())).collect::<Vec<_>>();
        for n in [0, 1, 3, 5, 6, 40, 71, 500] {
            let mut want: Vec<(u32, f32)> = v[..n].iter().enumerate().map(|(i, &x)| (i as u32, x)).collect();
            want.sort_by(|a, b| b.1.total_cmp(&a.1));
            want.truncate(5);
            assert_eq!(bits(&top5(&v[..n]).0), bits(&want), "{n} logits");
        }
    }

    #[test]
    fn top5_orders_and_breaks_ties_low() {
        let (top, margin, tie) = top5(&[1.0, 3.0, 3.0, -1.0, 2.0, 0.5, 2.5]);
        assert_eq!(top, vec![(1, 3.0), (2, 3.0), (6, 2.5), (4, 2.0), (0, 1.0)]);
        assert_eq!((margin, tie), (0.0, true));
        let (top, margin, tie) = top5(&[0.0, 2.0]);
        assert_eq!(top, vec![(1, 2.0), (0, 0.0)]);
        assert_eq!((margin, tie), (2.0, false));
    }
}
