//! Sampling made visible: each decode step's choice through candle-transformers'
//! `LogitsProcessor`, with what decided it recorded ([`SamplingStep`]): the candidate set after
//! top-k and top-p, the cut-offs and any token outside the set that ties one or lies within 1 ULP,
//! the probability mass, the uniform value drawn, and the chosen token's rank.
//!
//! The choice itself is `LogitsProcessor::sample`'s. Alongside, a shadow `StdRng` seeded alike
//! replays the processor's candidate logic (the same `select_nth_unstable_by`, sort and clamp on
//! the same f32 probabilities) and its `WeightedIndex` draw, so the recorded draw is the one the
//! processor made; [`Sampler::sample`] checks that both chose the same token and records no
//! draw if they ever did not. Tie rules, as upstream: argmax keeps the lowest index among equal
//! maxima; top-k keeps whichever tied entries `select_nth_unstable_by` leaves below the k-th
//! place (an unstable partition: which of two tokens tied at the boundary survives depends on
//! their positions, not on a rule); top-p sorts stably by probability, so ties keep the lower id
//! first.

use candle_core::{DType, Tensor};
use candle_trace_format::error::{Error, Result};
use candle_trace_format::record::SamplingStep;
use candle_transformers::generation::{LogitsProcessor, Sampling};
use rand::distr::weighted::WeightedIndex;
use rand::distr::{Distribution, Uniform};
use rand::SeedableRng;

/// A row's sampler: the upstream processor and its shadow.
pub struct Sampler {
    proc: LogitsProcessor,
    shadow: rand::rngs::StdRng,
    sampling: Sampling,
}

/// Distance in units in the last place between two finite f32 of one sign.
fn ulps(a: f32, b: f32) -> u64 {
    ulp_key(a).abs_diff(ulp_key(b))
}

/// `x`'s place on the line of f32 values [`ulps`] measures along (adjacent floats one apart).
#[inline]
fn ulp_key(x: f32) -> i64 {
    let b = x.to_bits() as i64;
    if b < 0x8000_0000 {
        b
    } else {
        0x8000_0000 - b
    }
}

impl Sampler {
    /// A sampler seeded as `LogitsProcessor::from_sampling(seed, sampling)`.
    pub fn new(seed: u64, sampling: Sampling) -> Self {
        Sampler { proc: LogitsProcessor::from_sampling(seed, sampling.clone()), shadow: rand::rngs::StdRng::seed_from_u64(seed), sampling }
    }

    /// Chooses the next token from `logits` (`[vocab]`, any float dtype) and describes the
    /// choice.
    ///
    /// # Errors
    /// Candle errors; the processor's own errors (all weights zero).
    pub fn sample(&mut self, logits: &Tensor, index: u32, row: u32) -> Result<(u32, SamplingStep)> {
        let token = self.proc.sample(logits)?;
        self.describe(logits, token, index, row)
    }

    /// Chooses the next token only (untraced runs: nothing is described, and the shadow is
    /// not kept in step, so do not mix with [`Sampler::sample`] on one sampler).
    ///
    /// # Errors
    /// As [`Sampler::sample`].
    pub fn choose(&mut self, logits: &Tensor) -> Result<u32> {
        Ok(self.proc.sample(logits)?)
    }

    fn describe(&mut self, logits: &Tensor, token: u32, index: u32, row: u32) -> Result<(u32, SamplingStep)> {
        let lf = logits.to_dtype(DType::F32)?;
        let raw = lf.to_vec1::<f32>()?;
        let vocab = raw.len() as u32;
        let temperature = match &self.sampling {
            Sampling::ArgMax => 1.0,
            Sampling::All { temperature }
            | Sampling::TopK { temperature, .. }
            | Sampling::TopP { temperature, .. }
            | Sampling::TopKThenTopP { temperature, .. }
            | Sampling::GumbelSoftmax { temperature } => *temperature,
        };
        // The processor's probabilities, computed the same way.
        let prs = candle_nn::ops::softmax_last_dim(&(&lf / temperature)?)?.to_vec1::<f32>()?;
        let mut step = SamplingStep {
            index,
            row,
            vocab,
            after_top_k: vocab,
            after_top_p: vocab,
            chosen: token,
            probs_digest: candle_trace_format::hash::xxh3_64(&crate::digest::le_bytes(&prs)),
            ..SamplingStep::default()
        };
        let p_tok = |t: u32| prs.get(t as usize).copied().unwrap_or(0.0);
        step.rank = prs.iter().enumerate().filter(|&(i, &p)| p > p_tok(token) || (p == p_tok(token) && (i as u32) < token)).count() as u32;
        // (candidate indices, weights the draw is made over), replaying the processor.
        let Some((cands, weights)) = candidates(self.sampling.clone(), &mut step, &prs) else {
            argmax_boundary(&mut step, &raw, &prs, token);
            return Ok((token, step));
        };
        describe_set(&mut step, &prs, &raw, &cands, &weights);
        // The draw, on a copy of the shadow; then the shadow consumes it as the processor did.
        let wi = WeightedIndex::new(&weights).map_err(|e| Error::usage(format!("sampling: {e}")))?;
        step.mass = wi.total_weight();
        // The uniform value in [0, 1) behind the draw: rand's UniformFloat takes the top 23 bits
        // of one u32 as a float in [1, 2) and subtracts 1, then scales by the mass.
        let mut copy = self.shadow.clone();
        let bits = rand::RngCore::next_u32(&mut copy);
        let uniform = f32::from_bits((bits >> 9) | 0x3f80_0000) - 1.0;
        let scaled = Uniform::new(0.0f32, step.mass).map_err(|e| Error::usage(format!("sampling: {e}")))?.sample(&mut self.shadow.clone());
        let pick = cands[wi.sample(&mut self.shadow)] as u32;
        step.draw = (pick == token && scaled == uniform * step.mass).then_some(uniform);
        Ok((token, step))
    }
}

/// The candidates the processor draws from under `sampling`, and their weights, noting the mode
/// and cut-offs in `step`; `None` for argmax (no draw).
fn candidates(sampling: Sampling, step: &mut SamplingStep, prs: &[f32]) -> Option<(Vec<usize>, Vec<f32>)> {
    match sampling {
        Sampling::ArgMax | Sampling::GumbelSoftmax { .. } => None,
        Sampling::All { temperature } => {
            step.mode = "all".into();
            step.temperature = Some(temperature);
            Some(((0..prs.len()).collect(), prs.to_vec()))
        }
        Sampling::TopK { k, temperature } => {
            step.mode = "top_k".into();
            step.temperature = Some(temperature);
            step.top_k = Some(k as u32);
            let c = top_k(prs, k);
            step.after_top_k = c.len() as u32;
            step.after_top_p = c.len() as u32;
            let w = c.iter().map(|&i| prs[i]).collect();
            Some((c, w))
        }
        Sampling::TopP { p, temperature } => {
            step.mode = "top_p".into();
            step.temperature = Some(temperature);
            step.top_p = Some(p);
            let w = if p <= 0.0 || p >= 1.0 { prs.to_vec() } else { top_p(prs, p as f32) };
            step.after_top_p = w.iter().filter(|&&x| x > 0.0).count() as u32;
            Some(((0..prs.len()).collect(), w))
        }
        Sampling::TopKThenTopP { k, p, temperature } => {
            step.mode = "top_k_then_top_p".into();
            step.temperature = Some(temperature);
            step.top_k = Some(k as u32);
            step.top_p = Some(p);
            if k >= prs.len() {
                let w = if p <= 0.0 || p >= 1.0 { prs.to_vec() } else { top_p(prs, p as f32) };
                step.after_top_p = w.iter().filter(|&&x| x > 0.0).count() as u32;
                Some(((0..prs.len()).collect(), w))
            } else {
                let c = top_k(prs, k);
                step.after_top_k = c.len() as u32;
                let wk: Vec<f32> = c.iter().map(|&i| prs[i]).collect();
                let sum: f32 = wk.iter().sum();
                let w = if p <= 0.0 || p as f32 >= sum { wk } else { top_p(&wk, p as f32) };
                step.after_top_p = w.iter().filter(|&&x| x > 0.0).count() as u32;
                Some((c, w))
            }
        }
    }
}

/// An argmax step: the other tokens whose logit ties the maximum or is within 1 ULP of it.
fn argmax_boundary(step: &mut SamplingStep, raw: &[f32], prs: &[f32], token: u32) {
    let p_tok = |t: u32| prs.get(t as usize).copied().unwrap_or(0.0);
    let max = raw.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    step.mode = "argmax".into();
    step.after_top_k = 1;
    step.after_top_p = 1;
    step.mass = 1.0;
    let at_max = ulp_key(max); // [`ulps`] to the maximum, its half computed once
    step.boundary = raw
        .iter()
        .enumerate()
        .filter(|&(i, &l)| i as u32 != token && (l == max || ulp_key(l).abs_diff(at_max) <= 1))
        .take(candle_trace_format::limits::MAX_TOP)
        .map(|(i, &l)| (i as u32, p_tok(i as u32), l == max))
        .collect();
}

/// The processor's top-k candidates: indices left of the k-th place after
/// `select_nth_unstable_by` on descending probability (upstream's exact call).
fn top_k(prs: &[f32], k: usize) -> Vec<usize> {
    if k >= prs.len() {
        return (0..prs.len()).collect();
    }
    let mut idx: Vec<usize> = (0..prs.len()).collect();
    let (left, _, _) = idx.select_nth_unstable_by(k, |&i, &j| prs[j].total_cmp(&prs[i]));
    left.to_vec()
}

/// The processor's top-p weights: probabilities sorted descending (stable), the cumulative sum
/// kept until it reaches `p`, the rest set to 0 (upstream's exact loop).
fn top_p(prs: &[f32], p: f32) -> Vec<f32> {
    let mut w = prs.to_vec();
    let mut idx: Vec<usize> = (0..w.len()).collect();
    idx.sort_by(|&i, &j| w[j].total_cmp(&w[i]));
    let mut cumsum = 0.;
    for &i in &idx {
        if cumsum >= p {
            w[i] = 0.0;
        } else {
            cumsum += w[i];
        }
    }
    w
}

/// Fills in the candidate set's cut-offs, digest and boundary tokens of `step`, from the
/// probabilities `prs`, the raw logits, and the (candidate, weight) pairs the draw is made over.
fn describe_set(step: &mut SamplingStep, prs: &[f32], raw: &[f32], cands: &[usize], weights: &[f32]) {
    // The cut-offs: the smallest probability kept after top-k, and after top-p.
    let kept = |w: &[f32]| -> Option<(f32, u32)> { cands.iter().zip(w).filter(|(_, &x)| x > 0.0).map(|(&i, _)| (prs[i], i as u32)).min_by(|a, b| a.0.total_cmp(&b.0)) };
    if step.top_k.is_some() && (step.after_top_k as usize) < prs.len() {
        let k_set: Vec<f32> = cands.iter().map(|&i| prs[i]).collect();
        step.k_cutoff = kept(&k_set).map(|(p, t)| (p, raw[t as usize]));
    }
    if step.top_p.is_some() {
        step.p_cutoff = kept(weights).map(|(p, t)| (p, raw[t as usize]));
    }
    if step.top_k.is_some() || step.top_p.is_some() {
        step.cutoff_token = kept(weights).map(|(_, t)| t);
    }
    let mut set: Vec<u32> = cands.iter().zip(weights).filter(|(_, &x)| x > 0.0).map(|(&i, _)| i as u32).collect();
    set.sort_unstable();
    step.set_digest = candle_trace_format::hash::xxh3_64(&crate::digest::le_bytes(&set));
    // Tokens outside the final set that tie a cut-off or lie within 1 ULP of it.
    let inside: std::collections::HashSet<usize> = cands.iter().zip(weights).filter(|(_, &x)| x > 0.0).map(|(&i, _)| i).collect();
    for (cut, _) in [step.k_cutoff, step.p_cutoff].into_iter().flatten() {
        for (i, &p) in prs.iter().enumerate() {
            if step.boundary.len() < candle_trace_format::limits::MAX_TOP && !inside.contains(&i) && p > 0.0 && ulps(p, cut) <= 1 && !step.boundary.iter().any(|b| b.0 == i as u32) {
                step.boundary.push((i as u32, p, p == cut));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Parity with `LogitsProcessor` over many seeded steps in every mode, with logits that hold
    /// exact ties: the shadow replays every draw (a draw is recorded only when both chose the
    /// same token, so a recorded draw at every step proves it).
    #[test]
    fn shadow_replays_every_draw_of_logits_processor() {
        let modes = [
            Sampling::ArgMax,
            Sampling::All { temperature: 0.8 },
            Sampling::TopK { k: 5, temperature: 1.0 },
            Sampling::TopP { p: 0.9, temperature: 0.7 },
            Sampling::TopKThenTopP { k: 8, p: 0.5, temperature: 1.3 },
        ];
        for mode in modes {
            for seed in [1u64, 2, 299792458] {
                let mut s = Sampler::new(seed, mode.clone());
                let mut reference = LogitsProcessor::from_sampling(seed, mode.clone());
                for step in 0..200u32 {
                    // Deterministic logits with ties: values on a coarse grid.
                    let v: Vec<f32> = (0..64u32).map(|i| (((i * 7 + step * 13) % 17) as f32) * 0.25 - 2.0).collect();
                    let t = Tensor::new(v.as_slice(), &Device::Cpu).unwrap();
                    let (tok, rec) = s.sample(&t, step, 0).unwrap();
                    assert_eq!(tok, reference.sample(&t).unwrap(), "{mode:?} seed {seed} step {step}");
                    if !matches!(mode, Sampling::ArgMax) {
                        let d = rec.draw.unwrap_or_else(|| panic!("{mode:?} seed {seed} step {step}: draw not replayed"));
                        assert!((0.0..1.0).contains(&d));
                    }
                }
            }
        }
    }
}
