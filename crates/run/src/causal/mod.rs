//! `trace bisect A B --causal`: which of the differences between two runs changed the answer.
//!
//! Bisect lists the entry points of a divergence: op outputs that differ at one (row, position)
//! while the op's inputs matched ([`candle_trace_compare::bisect::EntryPoint`]). Most die out; some reach the
//! logits; which of them flipped the token is a causal question, answered here by activation
//! patching: run A is re-run with chosen entry points' outputs replaced by run B's values
//! ([`crate::patch`], applied by the tracer on the live op path), and we watch whether A then
//! produces B's token at the first flip.
//!
//! 1. Both runs are re-run here from their headers, traced in memory, and must reproduce their
//!    traces bit for bit (otherwise patching would mix this machine's numbers with theirs); these
//!    runs also capture B's (and A's) values at the entry points.
//! 2. Patching every entry point at or before the flip must reproduce B's token. When it does
//!    not, the patched run is bisected against B: ops whose inputs now match B but whose outputs
//!    still differ are new entry points (the same op computed by A's kernel on B's inputs); they
//!    are captured from B and added, round after round.
//! 3. Delta debugging (Zeller and Hildebrandt, "Simplifying and Isolating Failure-Inducing
//!    Input", IEEE TSE 28(2), 2002: the `ddmin` algorithm) shrinks the set to one where removing
//!    any member loses the flip (1-minimal), in O(k log n) re-runs for k causes among n points.
//! 4. The reverse check patches A's values at the set into B: B then produces A's token when the
//!    set is the cause in both directions.
//!
//! Runs whose tokens never flip get a ranking instead: each entry point patched alone, with how
//! far it moves A's final logits (max |patched - a|) and how far they remain from B's.
//!
//! Unlike `trace bisect`, `--causal` reads both traces whole (through the same alignment,
//! [`bisect_with_entries`]): step 1 re-records both runs into memory to compare them with
//! their traces, so holding the files as well at most doubles what the search holds, and the
//! search reads values back from both traces at every round.

use crate::generate::Generation;
use crate::patch::{Captured, Patch, SliceKey};
use crate::recorder::{options_from_header, prepare_decoder, run_decoder, DecoderRun, RecordOptions};
use crate::tracer::{MemorySink, Tracer};
use candle_core::Tensor;
use candle_trace_compare::bisect::{bisect, bisect_with_entries, CauseClass, EntryPoint, TokenDivergence};
use candle_trace_compare::rerun::{row_tokens, step_positions, tokens_redacted};
use candle_trace_format::error::{Error, Result};
use candle_trace_format::fields::Alteration;
use candle_trace_format::format::Trace;
use candle_trace_format::record::Item;
use serde::Serialize;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::time::Instant;

mod model;
mod render;
mod search;
mod side;
pub use model::*;
pub use render::text;
use search::*;
use side::*;

/// Runs `--causal` on traces `a` and `b` (see the module docs).
///
/// # Errors
/// [`Error::Mismatch`] when the runs had different inputs (nothing to patch: the inputs are the
/// difference); [`Error::Usage`] without the model file, for an encoder or redacted trace, or a
/// `--max-runs` below 3 (4 with `--causal-out`); [`Error::Model`] when the model's sha256 is not the traces'; and
/// [`Error::Mismatch`] when a run does not reproduce its trace on this machine. Candle errors.
pub fn causal(a: &Trace, b: &Trace, opts: &CausalOptions) -> Result<CausalReport> {
    // --causal-out's run of the patched a, to its full length, is one of the --max-runs.
    let write_run = usize::from(opts.out.is_some());
    refuse_early(a, b, opts)?;
    // Before any re-run sets RAYON_NUM_THREADS: the environment the patched trace records.
    let env_vars = crate::env::numeric_env_vars();
    let (report, entries) = bisect_with_entries(a, b)?;
    let mut out = CausalReport::new(file_name(a), file_name(b), report.first_token_divergence.clone());
    if let Some(inp) = &report.inputs_differ {
        return Err(Error::Mismatch(format!(
            "--causal: {}; patching explains one computation done two ways (`trace bisect {} {}` lists the settings that differ)",
            inp.explanation,
            file_name(a),
            file_name(b)
        )));
    }
    if report.verdict == candle_trace_compare::bisect::Verdict::Identical {
        return Ok(out);
    }
    check_model(a, opts)?;
    let (mut sa, mut sb) = (prepare_side(a, opts, &env_vars)?, prepare_side(b, opts, &env_vars)?);
    let (row_a, row_b) = follow_rows(&report, &mut sa, &mut sb);
    let (ta, tb) = (row_tokens(a, row_a), row_tokens(b, row_b));
    // The step compared: the flip, or (no flip) the last step both runs made.
    let step = match &report.first_token_divergence {
        Some(f) => f.step as usize,
        None => ta.len().min(tb.len()).checked_sub(1).ok_or_else(|| Error::Mismatch("--causal: the runs generated no token to compare".into()))?,
    };
    let (pos_a, pos_b) = step_positions(&ta, &tb, step)?;
    let a_logits = sa.logits_key(logits_site(a), pos_a);
    let b_logits = sb.logits_key(logits_site(b), pos_b);
    let a_steps: Vec<SliceKey> = ta[..=step].iter().map(|x| sa.logits_key(logits_site(a), x.1)).collect();
    let b_steps: Vec<SliceKey> = tb[..=step].iter().map(|x| sb.logits_key(logits_site(b), x.1)).collect();
    out.step = Some(step as u32);
    out.notes.extend(step_notes((a, b), (ta.len(), tb.len()), step, report.first_token_divergence.is_some()));
    let last_pos = a_logits.pos;
    out.candidates = entries.iter().filter(|e| e.row == row_a && e.position <= last_pos).map(|e| Candidate { entry: e.clone(), round: 0 }).collect();
    let mut s = Search {
        a: sa,
        b: sb,
        candidates: out.candidates.clone(),
        b_values: HashMap::new(),
        a_values: HashMap::new(),
        runs: Vec::new(),
        max_runs: opts.max_runs - write_run,
        max_runs_given: opts.max_runs,
        started: Instant::now(),
        tokens: step + 1,
        step,
        a_tokens: ta.iter().take(step + 1).map(|x| x.0).collect(),
        b_tokens: tb.iter().take(step + 1).map(|x| x.0).collect(),
        a_logits: a_logits.clone(),
        b_logits: b_logits.clone(),
        a_steps,
        b_steps,
        a_all: Vec::new(),
        b_all: Vec::new(),
        cache: HashMap::new(),
        b_checked: false,
    };

    read_values(&mut s, &mut out, a, b)?;
    out.logits_max_abs_diff = Some(max_step_diff(&s.a_all, &s.b_all)?).filter(|d| !d.is_nan());

    if report.first_token_divergence.is_none() {
        rank(&mut s, &mut out)?;
    } else {
        let named = report.first_divergence.as_ref().and_then(|d| s.candidates.iter().position(|c| c.path == d.path && c.position == d.position));
        search(&mut s, &mut out, b, named)?;
    }
    if let Some(path) = &opts.out {
        write_patched(&mut s, &out, path)?;
    }
    out.candidates = s.candidates;
    out.seconds = s.started.elapsed().as_secs_f64();
    out.runs = s.runs;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::{ddmin, step_positions};

    /// Regression: bisect's flip step, read from a crafted file, past the token list of either
    /// side was an index panic (`ta[step]`).
    #[test]
    fn a_step_past_either_token_list_is_refused() {
        let (ta, tb) = (vec![(5, 8), (6, 9)], vec![(5, 8)]);
        assert_eq!(step_positions(&ta, &tb, 0).unwrap(), (8, 8));
        for step in [1, 2, usize::MAX] {
            let e = step_positions(&ta, &tb, step).unwrap_err().to_string();
            assert!(e.contains("hold 2 and 1 generated tokens") && e.contains(&format!("token {step}")), "{e}");
        }
    }

    #[test]
    fn ddmin_finds_the_one_and_the_pair() {
        // One cause among 100.
        let mut runs = 0;
        let (set, minimal) = ddmin((0..100).collect(), &mut |s| {
            runs += 1;
            Ok(Some(s.contains(&37)))
        })
        .unwrap();
        assert_eq!((set, minimal), (vec![37], true));
        assert!(runs <= 20, "{runs} tests for one cause among 100");
        // Two causes needed together.
        let (set, minimal) = ddmin((0..50).collect(), &mut |s| Ok(Some(s.contains(&3) && s.contains(&41)))).unwrap();
        assert_eq!((set, minimal), (vec![3, 41], true));
        // Budget out: the current set, not shown minimal.
        let mut left = 2;
        let (set, minimal) = ddmin((0..8).collect(), &mut |s| {
            if left == 0 {
                return Ok(None);
            }
            left -= 1;
            Ok(Some(s.contains(&5)))
        })
        .unwrap();
        assert!(!minimal && set.contains(&5));
    }
}
