//! The search: re-run one side with the other's values patched in at candidate entry points,
//! shrink the set that flips the token (delta debugging, `ddmin`), rank single patches, and
//! write the patched run.

use super::*;

pub(super) fn max_abs_diff(x: &Tensor, y: &Tensor) -> Result<f64> {
    let x = x.to_dtype(candle_core::DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let y = y.to_dtype(candle_core::DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    if x.len() != y.len() {
        return Ok(f64::NAN);
    }
    Ok(x.iter().zip(&y).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max))
}

/// A 1-D tensor of dumped values (exact: f64 holds every f32, f16 and bf16 value).
pub(super) fn values_tensor(dtype: &str, v: Vec<f64>) -> Result<Tensor> {
    let d = match dtype.parse::<candle_core::DType>() {
        Ok(d @ (candle_core::DType::F32 | candle_core::DType::F16 | candle_core::DType::BF16)) => d,
        _ => return Err(Error::usage(format!("--causal: cannot patch with {dtype} values"))),
    };
    let n = v.len();
    Ok(Tensor::from_vec(v, n, &candle_core::Device::Cpu)?.to_dtype(d)?)
}

/// The largest [`max_abs_diff`] over the steps of two runs' final logits (NaN when a step is
/// missing).
pub(super) fn max_step_diff(x: &[Tensor], y: &[Tensor]) -> Result<f64> {
    if x.len() != y.len() {
        return Ok(f64::NAN);
    }
    x.iter().zip(y).try_fold(0f64, |m, (p, q)| Ok(m.max(max_abs_diff(p, q)?)))
}

/// The search state: both runs, the candidates, their captured values, the run log.
pub(super) struct Search {
    pub(super) a: RunSide,
    pub(super) b: RunSide,
    pub(super) candidates: Vec<Candidate>,
    pub(super) b_values: HashMap<SliceKey, Captured>,
    pub(super) a_values: HashMap<SliceKey, Captured>,
    pub(super) runs: Vec<ReRun>,
    pub(super) max_runs: usize,
    /// `--max-runs` as given (`max_runs` less the run `--causal-out` writes), for the notes.
    pub(super) max_runs_given: usize,
    pub(super) started: Instant,
    /// Tokens to generate in a re-run (through the step compared).
    pub(super) tokens: usize,
    /// The step compared, the tokens of a and b through it (row followed).
    pub(super) step: usize,
    pub(super) a_tokens: Vec<u32>,
    pub(super) b_tokens: Vec<u32>,
    pub(super) a_logits: SliceKey,
    pub(super) b_logits: SliceKey,
    /// The final-logits slices of every step through `step`, and their unpatched values (the
    /// last: at `step` itself).
    pub(super) a_steps: Vec<SliceKey>,
    pub(super) b_steps: Vec<SliceKey>,
    pub(super) a_all: Vec<Tensor>,
    pub(super) b_all: Vec<Tensor>,
    pub(super) cache: HashMap<Vec<usize>, bool>,
    /// Run b was re-run here and matched its trace.
    pub(super) b_checked: bool,
}

impl Search {
    pub(super) fn budget_left(&self) -> bool {
        self.runs.len() < self.max_runs
    }

    pub(super) fn key_a(&self, i: usize) -> SliceKey {
        let c = &self.candidates[i];
        SliceKey { path: c.path.to_string(), row: self.a.row, pos: c.position }
    }

    pub(super) fn key_b(&self, i: usize) -> SliceKey {
        let c = &self.candidates[i];
        SliceKey { path: c.path.to_string(), row: self.b.row, pos: c.position }
    }

    /// Logs a re-run begun at `t0`; the caller fills in what a patched run adds.
    pub(super) fn log(&mut self, kind: &str, patched: Vec<usize>, outcome: String, t0: Instant) -> &mut ReRun {
        let n = self.runs.len() + 1;
        self.runs.push(ReRun { n, kind: kind.into(), patched, outcome, flipped: None, token: None, logits_max_abs_diff: None, seconds: t0.elapsed().as_secs_f64() });
        self.runs.last_mut().expect("just pushed")
    }

    /// Patches of b's values at candidates `set` into run a.
    pub(super) fn patches_into_a(&self, set: &[usize]) -> Vec<Patch> {
        set.iter().filter_map(|&i| self.b_values.get(&self.key_b(i)).map(|v| v.patch(self.key_a(i)))).collect()
    }

    /// What a patched run of a produced at the step compared, against b's tokens.
    pub(super) fn judge(&self, g: &Generation, want: &[u32], other: &[u32], row: u32) -> (bool, Option<u32>, String) {
        let got = g.tokens.get(row as usize).map(Vec::as_slice).unwrap_or(&[]);
        let s = self.step;
        match got.iter().zip(want).position(|(x, y)| x != y) {
            _ if got.len() <= s => (false, None, format!("stopped after {} tokens", got.len())),
            None => (true, Some(got[s]), format!("token {s} flipped to {}", got[s])),
            Some(k) if k < s => (false, Some(got[s]), format!("an earlier token flipped (token {k})")),
            Some(_) if other.get(s) == Some(&got[s]) => (false, Some(got[s]), format!("token {s} unchanged ({})", got[s])),
            Some(_) => (false, Some(got[s]), format!("token {s} became another token ({})", got[s])),
        }
    }

    /// Runs a with b's values at `set`; `None` when the run budget is spent.
    pub(super) fn test(&mut self, set: &[usize]) -> Result<Option<bool>> {
        let mut key = set.to_vec();
        key.sort_unstable();
        if let Some(&r) = self.cache.get(&key) {
            return Ok(Some(r));
        }
        if !self.budget_left() {
            return Ok(None);
        }
        let t0 = Instant::now();
        let patches = self.patches_into_a(set);
        let (g, cap, _) = self.a.go(patches, vec![self.a_logits.clone()], self.tokens, false)?;
        let (ok, token, outcome) = self.judge(&g, &self.b_tokens, &self.a_tokens, self.a.row);
        let diff = match (cap.get(&self.a_logits).map(|c| &c.values), self.b_all.last()) {
            (Some(x), Some(y)) => Some(max_abs_diff(x, y)?),
            _ => None,
        };
        let r = self.log("patch", key.clone(), outcome, t0);
        (r.flipped, r.token, r.logits_max_abs_diff) = (Some(ok), token, diff);
        self.cache.insert(key, ok);
        Ok(Some(ok))
    }

    /// Re-runs run `which` (`a` or `b`) traced in memory and checks it against its trace bit for
    /// bit, reading out its values at every candidate and its final logits at every step.
    pub(super) fn reproduce(&mut self, which: char, trace: &Trace) -> Result<()> {
        let t0 = Instant::now();
        let all: Vec<usize> = (0..self.candidates.len()).collect();
        let (mut keys, steps) =
            if which == 'a' { (all.iter().map(|&i| self.key_a(i)).collect::<Vec<_>>(), self.a_steps.clone()) } else { (all.iter().map(|&i| self.key_b(i)).collect(), self.b_steps.clone()) };
        keys.extend(steps.iter().cloned());
        let tokens = self.tokens;
        let side = if which == 'a' { &mut self.a } else { &mut self.b };
        let (_, mut cap, sink) = side.go(Vec::new(), keys, tokens, true)?;
        let rerun = sink.expect("traced").trace(&format!("{which} (re-run here)"), &side.run.header);
        let r = bisect(&rerun, trace)?;
        if r.differing > 0 || r.first_token_divergence.is_some() {
            let at = r.first_divergence.as_ref().map_or_else(|| "its tokens".to_string(), |d| format!("{} at position {}", d.path.text(), d.position));
            return Err(Error::Mismatch(format!(
                "--causal: run {which} ({}) does not reproduce on this machine (first difference: {at}); patching needs both runs to re-run bit for bit here{}",
                file_name(trace),
                if r.env_diff.iter().any(|e| e.key.starts_with("env.")) { " (the environment differs: see bisect's settings and environment)" } else { "" }
            )));
        }
        let every: Vec<Tensor> = steps.iter().filter_map(|k| cap.remove(k)).map(|c| c.values).collect();
        if every.len() != steps.len() {
            return Err(Error::Mismatch(format!("--causal: run {which} did not produce the final logits of every step")));
        }
        if which == 'a' {
            (self.a_all, self.a_values) = (every, cap);
        } else {
            self.b_all = every;
            // Values already read from b's dumps stay (they are b's recorded bits).
            for (k, v) in cap {
                self.b_values.entry(k).or_insert(v);
            }
            self.b_checked = true;
        }
        self.log(&format!("reproduce_{which}"), Vec::new(), format!("{} re-run here: identical to the trace", file_name(trace)), t0);
        Ok(())
    }

    /// Captures b's values at candidates `idx` (one re-run of b).
    pub(super) fn capture_b(&mut self, idx: &[usize]) -> Result<()> {
        let keys: Vec<SliceKey> = idx.iter().map(|&i| self.key_b(i)).collect();
        let t0 = Instant::now();
        let (_, cap, _) = self.b.go(Vec::new(), keys.clone(), self.tokens, false)?;
        let missing = keys.iter().filter(|k| !cap.contains_key(k)).count();
        self.b_values.extend(cap);
        self.log("capture_b", Vec::new(), format!("read b's values at {} new entry points ({missing} not produced)", keys.len()), t0);
        Ok(())
    }
}

/// Delta debugging (`ddmin`): a 1-minimal subset of `c` for which `test` holds, given that it
/// holds for `c`. Returns the set and whether minimality was established (false when `test`
/// returned `None`: the run budget ran out).
pub(super) fn ddmin(mut c: Vec<usize>, test: &mut dyn FnMut(&[usize]) -> Result<Option<bool>>) -> Result<(Vec<usize>, bool)> {
    let mut n = 2usize;
    while c.len() >= 2 {
        let size = c.len().div_ceil(n);
        let chunks: Vec<Vec<usize>> = c.chunks(size).map(<[usize]>::to_vec).collect();
        let mut reduced = false;
        for ch in &chunks {
            match test(ch)? {
                None => return Ok((c, false)),
                Some(true) => {
                    c = ch.clone();
                    n = 2;
                    reduced = true;
                    break;
                }
                Some(false) => {}
            }
        }
        if !reduced && chunks.len() > 2 {
            for ch in &chunks {
                let comp: Vec<usize> = c.iter().copied().filter(|x| !ch.contains(x)).collect();
                match test(&comp)? {
                    None => return Ok((c, false)),
                    Some(true) => {
                        c = comp;
                        n = (n - 1).max(2);
                        reduced = true;
                        break;
                    }
                    Some(false) => {}
                }
            }
        }
        if !reduced {
            if n >= c.len() {
                break;
            }
            n = (2 * n).min(c.len());
        }
    }
    Ok((c, true))
}

/// Step 1: re-runs a (and b, unless b's dumps hold its values at every entry point) and reads
/// the values patches need.
pub(super) fn read_values(s: &mut Search, out: &mut CausalReport, a: &Trace, b: &Trace) -> Result<()> {
    // 1. Both runs must reproduce here; meanwhile read their values at the entry points. B's
    // values may come from its dumps instead (`--dump` covering them): then b is re-run only if
    // a later step needs it (more entry points, the reverse check).
    s.reproduce('a', a)?;
    let keys: Vec<(String, u32, u32)> = (0..s.candidates.len()).map(|i| s.key_b(i)).chain(s.b_steps.iter().cloned()).map(|k| (k.path, k.row, k.pos)).collect();
    let dumped = candle_trace_compare::bisect::dumped_slices(b, &keys)?;
    let n = s.candidates.len();
    if n > 0 && dumped[..n].iter().all(Option::is_some) {
        for (i, d) in dumped[..n].iter().enumerate() {
            let (dtype, v) = d.clone().expect("checked");
            s.b_values.insert(s.key_b(i), Captured { values: values_tensor(&dtype, v)?, rows: None });
        }
        if dumped[n..].iter().all(Option::is_some) {
            s.b_all = dumped[n..].iter().map(|d| d.clone().map(|(t, v)| values_tensor(&t, v)).expect("checked")).collect::<Result<_>>()?;
        }
        out.notes.push(format!("b's values at the {n} entry points come from its dumps (b was not re-run for them)"));
    } else {
        s.reproduce('b', b)?;
    }
    Ok(())
}

/// The flip: grow the candidates until patching all of them reproduces it, shrink with ddmin,
/// then the reverse check.
pub(super) fn search(s: &mut Search, out: &mut CausalReport, b: &Trace, named: Option<usize>) -> Result<()> {
    if !patch_until_flip(s, out, b)? {
        return Ok(());
    }
    // The question a maintainer asks first: is the root cause bisect names enough on its own?
    if let Some(j) = named {
        if let Some(ok) = s.test(&[j])? {
            out.bisect_root_alone = Some((j, ok));
        }
    }
    let all: Vec<usize> = (0..s.candidates.len()).collect();
    let (set, minimal) = match out.bisect_root_alone {
        // One entry point that flips the token is a minimal set (a itself does not flip).
        Some((j, true)) => (vec![j], true),
        _ => ddmin(all, &mut |set| s.test(set))?,
    };
    out.verdict = CausalVerdict::Found;
    out.set = set;
    out.minimal = minimal;
    if !minimal {
        out.notes.push(format!("--max-runs {} reached: the set reproduces the flip but was not shrunk to a minimal one", s.max_runs_given));
    }
    reverse_check(s, out, b)
}

/// Patches all candidates into a until the flip is reproduced, adding the entry points the
/// patched run still has against b after each round. `false` (with the verdict and a note set):
/// the budget ran out, b cannot re-run, or no further entry point exists.
fn patch_until_flip(s: &mut Search, out: &mut CausalReport, b: &Trace) -> Result<bool> {
    let mut round = 0u32;
    loop {
        let all: Vec<usize> = (0..s.candidates.len()).collect();
        match s.test(&all)? {
            Some(true) => return Ok(true),
            None => {
                out.verdict = CausalVerdict::NotFound;
                out.notes.push(format!("the --max-runs {} budget ran out before patching reproduced the flip", s.max_runs_given));
                return Ok(false);
            }
            Some(false) => {}
        }
        // Find the entry points the patched run still has against b.
        if s.runs.len() + 3 > s.max_runs {
            out.verdict = CausalVerdict::NotFound;
            out.notes.push(format!("patching all {} entry points did not reproduce the flip, and --max-runs {} leaves no room to look for more", all.len(), s.max_runs_given));
            return Ok(false);
        }
        if !s.b_checked {
            if let Err(e) = s.reproduce('b', b) {
                out.verdict = CausalVerdict::NotFound;
                out.notes.push(format!("patching all {} entry points did not reproduce the flip, and b cannot be re-run to look for more: {e}", all.len()));
                return Ok(false);
            }
        }
        round += 1;
        let t0 = Instant::now();
        let patches = s.patches_into_a(&all);
        let (_, _, sink) = s.a.go(patches, Vec::new(), s.tokens, true)?;
        let patched = sink.expect("traced").trace("a (patched)", &s.a.run.header);
        let (_, more) = bisect_with_entries(&patched, b)?;
        let known: HashSet<(String, u32)> = s.candidates.iter().map(|c| (c.path.to_string(), c.position)).collect();
        let new: Vec<Candidate> =
            more.into_iter().filter(|e| e.row == s.a.row && e.position <= s.a_logits.pos && !known.contains(&(e.path.to_string(), e.position))).map(|entry| Candidate { entry, round }).collect();
        s.log("find_more", all.clone(), format!("patched a bisected against b: {} new entry points", new.len()), t0);
        if new.is_empty() {
            out.verdict = CausalVerdict::NotFound;
            out.notes.push(format!("patching all {} entry points did not reproduce the flip, and the patched run has no further entry point", all.len()));
            return Ok(false);
        }
        let first_new = s.candidates.len();
        s.candidates.extend(new);
        let idx: Vec<usize> = (first_new..s.candidates.len()).collect();
        s.capture_b(&idx)?;
    }
}

/// The reverse check: a's values at the set patched into b must turn b's token into a's.
fn reverse_check(s: &mut Search, out: &mut CausalReport, b: &Trace) -> Result<()> {
    // Reverse: a's values at the set into b.
    let missing: Vec<usize> = out.set.iter().copied().filter(|&i| !s.a_values.contains_key(&s.key_a(i))).collect();
    if !missing.is_empty() && s.runs.len() < s.max_runs {
        let t0 = Instant::now();
        let keys: Vec<SliceKey> = missing.iter().map(|&i| s.key_a(i)).collect();
        let (_, cap, _) = s.a.go(Vec::new(), keys, s.tokens, false)?;
        s.a_values.extend(cap);
        s.log("capture_a", Vec::new(), format!("read a's values at {} entry points", missing.len()), t0);
    }
    if !s.b_checked && s.runs.len() + 1 < s.max_runs {
        // b's values came from its dumps; the reverse check needs b itself to re-run here.
        if let Err(e) = s.reproduce('b', b) {
            out.notes.push(format!("no reverse check: {e}"));
        }
    }
    let complete = out.set.iter().all(|&i| s.a_values.contains_key(&s.key_a(i)));
    if complete && s.b_checked && s.runs.len() < s.max_runs {
        let t0 = Instant::now();
        let patches: Vec<Patch> = out.set.iter().map(|&i| s.a_values[&s.key_a(i)].patch(s.key_b(i))).collect();
        let (g, cap, _) = s.b.go(patches, vec![s.b_logits.clone()], s.tokens, false)?;
        let (ok, token, outcome) = s.judge(&g, &s.a_tokens, &s.b_tokens, s.b.row);
        let diff = match (cap.get(&s.b_logits).map(|c| &c.values), s.a_all.last()) {
            (Some(x), Some(y)) => Some(max_abs_diff(x, y)?),
            _ => None,
        };
        let r = s.log("reverse", out.set.clone(), outcome, t0);
        (r.flipped, r.token, r.logits_max_abs_diff) = (Some(ok), token, diff);
        out.reverse = Some(ok);
    } else if s.runs.len() >= s.max_runs {
        out.notes.push("the reverse check (a's values into b) was not run: --max-runs reached".into());
    }
    Ok(())
}

/// No flip: each candidate patched alone, ranked by how far it moves a's final logits.
pub(super) fn rank(s: &mut Search, out: &mut CausalReport) -> Result<()> {
    out.verdict = CausalVerdict::NoFlip;
    // Live entry points first: they reached the residual stream.
    let mut order: Vec<usize> = (0..s.candidates.len()).collect();
    order.sort_by_key(|&i| !s.candidates[i].live);
    for i in order {
        if !s.budget_left() {
            out.notes.push(format!("--max-runs {} reached: ranked {} of {} entry points (live ones first)", s.max_runs_given, out.ranking.len(), s.candidates.len()));
            break;
        }
        let t0 = Instant::now();
        let patches = s.patches_into_a(&[i]);
        let (_, mut cap, _) = s.a.go(patches, s.a_steps.clone(), s.tokens, false)?;
        let l: Vec<Tensor> = s.a_steps.iter().filter_map(|k| cap.remove(k)).map(|c| c.values).collect();
        let (moved, remaining) = (max_step_diff(&l, &s.a_all)?, max_step_diff(&l, &s.b_all)?);
        s.log("rank", vec![i], format!("final logits moved {moved:.3e}, {remaining:.3e} from b"), t0).logits_max_abs_diff = Some(remaining);
        out.ranking.push(Ranked { candidate: i, moved, remaining });
    }
    // Closest to b first (the patch that explains most of the difference), then by effect.
    out.ranking.sort_by(|x, y| x.remaining.total_cmp(&y.remaining).then(y.moved.total_cmp(&x.moved)));
    if s.candidates.iter().any(|c| c.class == CauseClass::DtypeDiffers) {
        out.notes.push("the runs differ in dtype: b's values are rounded to a's dtype when patched in, so a patch cannot carry b's precision".into());
    }
    Ok(())
}

/// Re-runs a to its full length with the set patched, into a trace file.
pub(super) fn write_patched(s: &mut Search, out: &CausalReport, path: &std::path::Path) -> Result<()> {
    let set: Vec<usize> = if out.set.is_empty() { out.ranking.first().map(|r| vec![r.candidate]).unwrap_or_default() } else { out.set.clone() };
    let t0 = Instant::now();
    let mut header = s.a.run.header.clone();
    let marks = set.iter().map(|&i| Alteration::Patch { path: s.candidates[i].path.to_string(), position: s.candidates[i].position });
    let list: Vec<Alteration> = header.run.alterations()?.into_iter().chain(marks).collect();
    header.run.set_alterations(&list);
    let writer = candle_trace_format::format::TraceWriter::create(path, &header, Some(&crate::env::build_info()))?;
    let mut tracer = Tracer::new(Box::new(writer)).with_perturbs(s.a.opts.perturb.clone()).with_patches(s.patches_into_a(&set));
    let opts = s.a.opts.clone();
    let g = match run_decoder(&mut s.a.run, &opts, &mut tracer) {
        Ok(g) => g,
        Err(e) => {
            let _ = tracer.end_forward();
            return Err(e);
        }
    };
    tracer.finish(&crate::recorder::footer(&tracer, &g))?;
    let text = g.texts.get(s.a.row as usize).cloned().unwrap_or_default();
    // The file name only: reports are pasted into public bug reports.
    let name = path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned());
    s.log("write", set, format!("wrote {name} ({} tokens): \"{text}\"", g.tokens.first().map_or(0, Vec::len)), t0);
    Ok(())
}
