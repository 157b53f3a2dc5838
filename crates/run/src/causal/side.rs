//! One side of the search: the model re-loaded from a trace's header (checked to be the file
//! the run used), the request followed, and the refusals made before any work.

use super::*;

/// One run made ready to re-run.
pub(super) struct RunSide {
    pub(super) run: DecoderRun,
    pub(super) opts: RecordOptions,
    /// Own batch row of the request followed, and the padding before it.
    pub(super) row: u32,
    pub(super) pad: u32,
}

impl RunSide {
    /// Re-runs generation for `max_tokens` tokens with `patches`, reading out `captures`;
    /// traced into memory when `traced`.
    pub(super) fn go(&mut self, patches: Vec<Patch>, captures: Vec<SliceKey>, max_tokens: usize, traced: bool) -> Result<(Generation, HashMap<SliceKey, Captured>, Option<MemorySink>)> {
        if self.opts.threads > 0 {
            crate::env::pin_threads(self.opts.threads)?;
        }
        let sink = traced.then(MemorySink::default);
        let tracer = match &sink {
            Some(s) => Tracer::new(Box::new(s.clone())),
            None => Tracer::untraced(),
        };
        let mut tracer = tracer.with_perturbs(self.opts.perturb.clone()).with_patches(patches).with_captures(captures);
        let mut opts = self.opts.clone();
        opts.gen.max_tokens = max_tokens;
        let g = run_decoder(&mut self.run, &opts, &mut tracer)?;
        if let Some(k) = tracer.patches_left().first() {
            return Err(Error::usage(format!("--causal: patch {k} was never applied (the op never produced that position)")));
        }
        tracer.finish(&crate::recorder::footer(&tracer, &g))?;
        Ok((g, tracer.take_captured(), sink))
    }

    /// The final logits that chose the token at `token_pos`: op `site` at the position before.
    pub(super) fn logits_key(&self, site: &str, token_pos: u32) -> SliceKey {
        SliceKey { path: site.into(), row: self.row, pos: token_pos.saturating_sub(1 + self.pad) }
    }
}

pub(super) fn file_name(t: &Trace) -> String {
    t.path.file_name().map_or_else(|| t.path.display().to_string(), |n| n.to_string_lossy().into_owned())
}

/// Refuses what `--causal` cannot do before any work: a `--max-runs` too small, a bad
/// `--causal-out`, a redacted trace.
pub(super) fn refuse_early(a: &Trace, b: &Trace, opts: &CausalOptions) -> Result<()> {
    let least = 3 + usize::from(opts.out.is_some());
    if opts.max_runs < least {
        let with = if opts.out.is_some() { " and the run --causal-out writes" } else { "" };
        return Err(Error::usage(format!("--max-runs {}: at least {least} (the two reproductions, one patched run{with})", opts.max_runs)));
    }
    if let Some(o) = &opts.out {
        let parent = o.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
        if o.is_dir() || !parent.is_dir() {
            return Err(Error::usage(format!("--causal-out {}: {}", o.display(), if o.is_dir() { "is a directory" } else { "its folder does not exist" })));
        }
    }
    for t in [a, b] {
        if tokens_redacted(t) {
            return Err(Error::trace(&t.path, "is redacted: it holds no generated token ids, so --causal cannot re-run and compare it; use the unredacted trace"));
        }
    }
    Ok(())
}

/// Refuses a missing `--model` (runs of a model file) or a superfluous one (builtin runs).
pub(super) fn check_model(a: &Trace, opts: &CausalOptions) -> Result<()> {
    let hm = &a.header.run.model;
    let builtin = hm.name == "builtin" && hm.size == 0;
    match (&opts.model, builtin) {
        (None, false) => return Err(Error::usage(format!("--causal re-runs the model: give --model with the file the runs used ({}, sha256 {})", hm.name, hm.sha256.get(..12).unwrap_or("")))),
        (Some(p), true) => return Err(Error::usage(format!("--model {}: the runs used the builtin model; leave --model out", p.display()))),
        _ => {}
    }
    Ok(())
}

/// Loads the model for re-running `t` from its header, and checks it is the one `t` used.
pub(super) fn prepare_side(t: &Trace, opts: &CausalOptions, env_vars: &[(String, String)]) -> Result<RunSide> {
    let mut o = options_from_header(&t.header, &t.extras.settings, opts.model.clone()).map_err(|e| Error::trace(&t.path, e.to_string()))?;
    o.device = opts.device;
    o.env_vars = env_vars.to_vec();
    let device = o.device.open()?;
    let run = prepare_decoder(&o, &device)?;
    if run.header.run.model.sha256 != t.header.run.model.sha256 {
        let p = opts.model.clone().unwrap_or_default();
        return Err(Error::model(
            &p,
            format!(
                "sha256 {} is not the {} {} recorded: --causal needs the model the runs used",
                run.header.run.model.sha256.get(..12).unwrap_or(""),
                t.header.run.model.sha256.get(..12).unwrap_or(""),
                file_name(t)
            ),
        ));
    }
    Ok(RunSide { run, opts: o, row: 0, pad: 0 })
}

/// The request followed (the flip's row, or the first request both runs hold) as (a's row, b's
/// row), set on both sides with the left padding of that row in its batch.
pub(super) fn follow_rows(report: &candle_trace_compare::bisect::Report, sa: &mut RunSide, sb: &mut RunSide) -> (u32, u32) {
    let row_a = report.first_token_divergence.as_ref().map(|f| f.row).or_else(|| report.rows.first().map(|r| r.a_row)).unwrap_or(0);
    let row_b = report.rows.iter().find(|r| r.a_row == row_a).map_or(row_a, |r| r.b_row);
    for (s, row) in [(sa, row_a), (sb, row_b)] {
        s.row = row;
        let longest = s.run.rows.iter().map(Vec::len).max().unwrap_or(0);
        s.pad = if s.run.rows.len() > 1 { (longest - s.run.rows.get(row as usize).map_or(longest, Vec::len)) as u32 } else { 0 };
    }
    (row_a, row_b)
}

/// The op that outputs the final logits: `logits` (the f32 conversion, when activations are not
/// f32), else `lm_head`.
pub(super) fn logits_site(t: &Trace) -> &'static str {
    if t.items.iter().any(|i| matches!(i, Item::Site { path, .. } if path == "logits")) {
        "logits"
    } else {
        "lm_head"
    }
}

/// Notes on how far the runs are compared: a truncated trace, or runs that generated different
/// counts of tokens (`counts`) without a flip.
pub(super) fn step_notes((a, b): (&Trace, &Trace), counts: (usize, usize), step: usize, flipped: bool) -> Vec<String> {
    let mut notes = Vec::new();
    for t in [a, b] {
        if t.truncated {
            notes.push(format!("{} is truncated (the run did not finish, or the file was cut): compared through token {step}, the part it holds", file_name(t)));
        }
    }
    if counts.0 != counts.1 && !flipped {
        notes.push(format!("the runs generated {} and {} tokens: compared through token {step}", counts.0, counts.1));
    }
    notes
}
