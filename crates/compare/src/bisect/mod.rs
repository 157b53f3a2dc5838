//! Bisect: where two runs parted ways.
//!
//! The two traces are aligned by (module path, batch row, absolute token position): every op
//! output at a position is compared with the same op's output at the same position in the other
//! run, whatever the forward pass that computed it (so whole-prompt prefill compares with chunked
//! prefill, and row 0 of a batch-4 run with a batch-1 run). KV-cache records hold only the
//! positions their pass wrote, so a cached K/V slice is compared once.
//!
//! The root cause is the first divergent (position, op) — ordered by position, then by execution
//! order in trace A — whose inputs matched bit for bit at the positions it reads (its own position,
//! or `0..=p` of the KV cache for attention): "non-determinism entered here". When the first thing
//! that differs is the token ids themselves, the inputs differ and no op is blamed.

use crate::align::{Alignment, Found};
use crate::bound::{diff_bound, slice_len};
use candle_trace_format::error::{Error, Result};
use candle_trace_format::format::Trace;
use candle_trace_format::record::TokenStat;
use candle_trace_format::record::{Dump, Forward, Header, Item, OpRecord, TokenEvent};
pub use candle_trace_format::site::{layer_group, layer_of};
use serde::Serialize;
use std::collections::{HashMap, HashSet};
use std::path::Path;

mod cause;
mod drift;
mod model;
mod root;
mod sequence;
mod side;
mod tokens;
pub use cause::{class_of, key_class, remedy};
pub use drift::cosine;
use drift::*;
pub use model::*;
pub(crate) use root::reported;
use root::*;
use side::*;
use tokens::*;
pub use tokens::{classify_sampling, env_diff, environment_fields, penalty_words, take_flip};

/// Compares two traces.
///
/// # Errors
/// [`Error::Mismatch`] when the traces record different models (by sha256) or architectures;
/// [`Error::Trace`] for an internally inconsistent trace.
pub fn bisect(a: &Trace, b: &Trace) -> Result<Report> {
    bisect_with_entries(a, b).map(|(r, _)| r)
}

/// Refuses two traces of different models (by sha256 and architecture).
pub(crate) fn same_model(a: &Header, b: &Header, pa: &Path, pb: &Path) -> Result<()> {
    let (ma, mb) = (&a.run.model, &b.run.model);
    if ma.sha256 != mb.sha256 || ma.architecture != mb.architecture {
        return Err(Error::Mismatch(format!(
            "{} and {} record different models ({} {} vs {} {}): bisect compares runs of one model",
            pa.display(),
            pb.display(),
            ma.name,
            &ma.sha256.get(..12).unwrap_or(""),
            mb.name,
            &mb.sha256.get(..12).unwrap_or("")
        )));
    }
    Ok(())
}

/// The largest difference per layer along the whole run (every compared row and position: a
/// padded batch's rows as paired with their requests), for a chart; in the alignment of
/// [`bisect`].
///
/// # Errors
/// As [`bisect`] for traces that do not align.
pub fn layer_profile(a: &Trace, b: &Trace) -> Result<Vec<LayerPoint>> {
    same_model(&a.header, &b.header, &a.path, &b.path)?;
    let al = Alignment::run(crate::level::coarser(a.level, b.level), &mut a.items.iter(), &mut b.items.iter(), b_rows(&pairing(&a.header, &b.header)), [&a.path, &b.path])?;
    Ok(profile(&al))
}

/// [`layer_profile`] from an alignment (the streaming bisect's, too): the per-path comparisons
/// summed by layer (`layers.3`, `embed_tokens`, ...), in the order the paths were first seen.
/// `input` ops are left out: their values are token ids, and after a flip their "difference"
/// is the distance between two ids.
pub fn profile(al: &Alignment) -> Vec<LayerPoint> {
    let mut out: Vec<LayerPoint> = Vec::new();
    for (path, compared, differing, max) in al.per_path().into_iter().filter(|p| !al.is_input(p.0)) {
        let layer = layer_group(path);
        let i = match out.iter().position(|p| p.layer == layer) {
            Some(i) => i,
            None => {
                out.push(LayerPoint { layer: layer.into(), max_abs_diff: 0.0, differing: 0, compared: 0 });
                out.len() - 1
            }
        };
        let p = &mut out[i];
        (p.compared, p.differing) = (p.compared + compared, p.differing + differing);
        p.max_abs_diff = if max.is_nan() || p.max_abs_diff.is_nan() { f64::NAN } else { p.max_abs_diff.max(max) };
    }
    out
}

/// Batch row `row`'s difference by layer and position ([`Heat`]), from an alignment: the
/// per-path cells ([`Alignment::per_position`]) merged by layer, the largest kept (NaN wins).
pub fn heat(al: &Alignment, row: u32) -> Heat {
    let mut h = Heat { row, ..Heat::default() };
    let mut merged: Vec<HashMap<u32, f64>> = Vec::new();
    for ((path, ..), cells) in al.per_path().into_iter().zip(al.per_position(row)) {
        let Some(cells) = cells.filter(|c| !c.is_empty()) else { continue };
        let layer = layer_group(path);
        let i = match h.layers.iter().position(|l| *l == layer) {
            Some(i) => i,
            None => {
                h.layers.push(layer.into());
                merged.push(HashMap::new());
                merged.len() - 1
            }
        };
        for (p, d) in cells {
            let m = merged[i].entry(p).or_insert(0.0);
            *m = if d.is_nan() || m.is_nan() { f64::NAN } else { m.max(d) };
        }
    }
    h.cells = merged
        .into_iter()
        .map(|m| {
            let mut v: Vec<(u32, f64)> = m.into_iter().collect();
            v.sort_unstable_by_key(|c| c.0);
            v
        })
        .collect();
    h
}

/// A dumped slice: its dtype (`f32`, `f16`, `bf16`) and its values in order.
pub type DumpedSlice = (String, Vec<f64>);

/// The dumped values of op outputs in `t` at `(module path, own batch row, position)` keys, one
/// answer per key: the dtype and the slice's values in order (the elements its per-token digest
/// covers, as [`candle_trace_format::record::token_slice`] lists them), or `None` where the op's output was
/// not dumped (`--dump`), the key names no record, or the batch is padded.
///
/// # Errors
/// A trace whose site table is out of order.
pub fn dumped_slices(t: &Trace, keys: &[(String, u32, u32)]) -> Result<Vec<Option<DumpedSlice>>> {
    let side = Side::new(t, None)?;
    Ok(keys
        .iter()
        .map(|(path, row, pos)| {
            let site = *side.site_by_path.get(path.as_str())?;
            let (r, _) = side.token(site, *row, *pos)?;
            let (v, idx) = side.slice(r, *row, *pos)?;
            let vals: Option<Vec<f64>> = idx.iter().map(|&i| v.f64.get(i).copied()).collect();
            Some((v.dtype.clone(), vals?))
        })
        .collect())
}

/// [`bisect`], also returning every entry point (not only the reported root cause and the
/// absorbed ones before it), in (position, execution) order.
///
/// # Errors
/// As [`bisect`].
pub fn bisect_with_entries(a: &Trace, b: &Trace) -> Result<(Report, Vec<EntryPoint>)> {
    if a.level != b.level {
        // Recorded at different levels: the finer one as if recorded at the coarser.
        let level = crate::level::coarser(a.level, b.level);
        let (mut r, entries) = aligned(&crate::level::project(a.clone(), level), &crate::level::project(b.clone(), level))?;
        // The report gives each file's own record count; the note says what was compared.
        (r.a.op_records, r.b.op_records) = (crate::level::op_records(a), crate::level::op_records(b));
        return Ok((r, entries));
    }
    aligned(a, b)
}

/// [`bisect_with_entries`] of two traces that hold the same level of records.
fn aligned(a: &Trace, b: &Trace) -> Result<(Report, Vec<EntryPoint>)> {
    same_model(&a.header, &b.header, &a.path, &b.path)?;
    let pairs = pairing(&a.header, &b.header);
    let al = Alignment::run(a.level, &mut a.items.iter(), &mut b.items.iter(), b_rows(&pairs), [&a.path, &b.path])?;
    report(a, b, &pairs, &al)
}

/// (row of a, row of b) pairs holding the same request, when the batches differ; empty when
/// they hold the same requests (every row compared as itself).
pub(crate) fn pairing(a: &Header, b: &Header) -> Vec<(u32, u32)> {
    let (keys_a, keys_b) = (row_keys(a), row_keys(b));
    if keys_a != keys_b {
        row_pairs(&keys_a, &keys_b)
    } else {
        Vec::new()
    }
}

/// Run b's own row → the row of a it is compared as (`None`: every row as itself); a row of b
/// paired with several copies in a is compared, op by op, as the first of them.
pub(crate) fn b_rows(pairs: &[(u32, u32)]) -> Option<HashMap<u32, u32>> {
    (!pairs.is_empty()).then(|| {
        let mut m = HashMap::new();
        for &(ra, rb) in pairs {
            let e = m.entry(rb).or_insert(ra);
            *e = (*e).min(ra);
        }
        m
    })
}

/// What differs between the runs' settings, environments and builds: the headers' keys
/// ([`env_diff`]), the build fingerprints' and the record level (`run.level`, kept in the frame
/// after the header).
fn settings_diff(a: &Trace, b: &Trace) -> Vec<EnvDiff> {
    let mut envd = env_diff(&a.header, &b.header);
    envd.extend(crate::build_diff::build_diff(a.build.as_ref(), b.build.as_ref()).into_iter().map(|(key, a, b)| EnvDiff { key: key.into(), a: a.into(), b: b.into() }));
    if a.level != b.level {
        envd.push(EnvDiff { key: "run.level".into(), a: a.level.as_str().into(), b: b.level.as_str().into() });
    }
    envd.extend(extras_diff(&a.extras.settings, &b.extras.settings));
    envd
}

/// The settings frames' keys that differ (format 2.7), as `run.KEY` with the JSON values; a key
/// one run lacks is `null` there (the setting's default: a trace without the frame had no
/// repeat penalty).
fn extras_diff(a: &candle_trace_format::record::Settings, b: &candle_trace_format::record::Settings) -> Vec<EnvDiff> {
    let keys: std::collections::BTreeSet<&str> = a.0.iter().chain(&b.0).map(|(k, _)| k.as_str()).collect();
    keys.into_iter().filter(|k| a.get(k) != b.get(k)).map(|k| EnvDiff { key: format!("run.{k}").into(), a: a.get(k).unwrap_or("null").into(), b: b.get(k).unwrap_or("null").into() }).collect()
}

/// The report of `a` against `b`, from the first pass `al` over them; `a` and `b` hold at least
/// the records the report names (the whole traces, or what
/// [`crate::bisect_file::bisect_files`] read back).
pub(crate) fn report(a: &Trace, b: &Trace, pairs: &[(u32, u32)], al: &Alignment) -> Result<(Report, Vec<EntryPoint>)> {
    // A batch of different requests: each row of b is compared with the row of a that holds the
    // same request (a prompt alone against the same prompt among others).
    let (inputs_a, inputs_b) = (row_inputs(&a.header), row_inputs(&b.header));
    let (keys_a, keys_b) = (row_keys(&a.header), row_keys(&b.header));
    let both_hold = candle_trace_format::redact::holds_prompt(&a.header) && candle_trace_format::redact::holds_prompt(&b.header);
    let pairs = pairs.to_vec();
    let (mut sa, mut sb) = (Side::new(a, None)?, Side::new(b, b_rows(&pairs))?);
    (sa.records, sb.records) = (al.records(0), al.records(1));
    let mut notes = pairing_notes(&sa, &sb, &pairs);
    notes.extend(crate::level::note(a.level, b.level));
    let (envd, both_invariant) = (settings_diff(a, b), cause::invariant(&a.header) && cause::invariant(&b.header));
    // One prompt continuing the other run's output: generated tokens are compared by position.
    let (info_a, info_b) = (side_info(&sa), side_info(&sb));
    let (fed, positions) = sequence::align_sides(both_hold, (&mut sa, &mut sb), al, &mut notes);
    let (prompt_differs, header_inputs) = header_inputs(a, b, both_hold, (&keys_a, &keys_b), &pairs, (&inputs_a, &inputs_b), &fed);
    let (first_token_divergence, tokens, sampling_verdict) = token_flip((a, b), (&sa, &sb), al.input_differs, &mut notes);
    let (wc, wd, whole_differ) = align_whole(&sa, &sb, &pairs, &mut notes);
    let (compared, differing) = (al.compared + wc, al.differing + wd);
    let (roots, inputs_differ) = find_roots(&sa, &sb, al, &envd);
    if al.roots_total > roots.len() as u64 {
        notes.push(format!("{} root causes found; the earliest {} are listed", al.roots_total, roots.len()));
    }
    let live: Vec<bool> = roots.iter().map(|d| !absorbed(al, &d.path, d.row, d.position)).collect();
    let rows = with_redacted_flip(row_answers(&sa, &sb, &pairs, &inputs_a, (&roots, &live)), first_token_divergence.as_ref());
    let Picked { entries, groups, first: first_divergence, absorbed: absorbed_roots, absorbed_count } = pick_root(al, roots);
    let (inputs_differ, mut first_divergence) = reconcile(inputs_differ, first_divergence, header_inputs);
    let graph_fork = if inputs_differ.is_none() { graph_fork(al, &mut first_divergence, &mut notes) } else { None };
    if let Some(fd) = first_divergence.as_mut() {
        notes.extend(add_elementwise(&sa, &sb, fd));
    }
    let first_divergence_reported = first_divergence.is_some();
    let (growth, drift, drift_grows) = match &first_divergence {
        Some(fd) => around_root(&sa, &sb, al, fd, &mut notes),
        None => (Vec::new(), Vec::new(), false),
    };
    if compared == 0 {
        return Err(nothing_in_common((a, sa.records), (b, sb.records)));
    }
    if let Some(first) = whole_differ.first() {
        notes.push(format!("{} output(s) without a token axis differ, first {first} (compared whole, by digest)", whole_differ.len()));
    }
    let identical = differing == 0 && first_token_divergence.is_none() && !prompt_differs;
    // Identical so far, but a run did not finish or generated less: not a pass.
    let incomplete = identical && (a.truncated || b.truncated || sa.tokens.len() != sb.tokens.len());
    notes.extend(ending_notes(&sa, &sb, identical, &pairs));
    let verdict = match (identical, incomplete) {
        (_, true) => Verdict::Incomplete,
        (true, false) => Verdict::Identical,
        (false, false) => Verdict::Diverged,
    };
    let report = Report {
        verdict,
        both_invariant,
        level: crate::level::coarser(a.level, b.level),
        rows,
        positions,
        a: info_a,
        b: info_b,
        first_token_divergence,
        tokens,
        sampling: sampling_verdict,
        first_divergence,
        inputs_differ,
        growth,
        drift,
        drift_grows,
        absorbed: absorbed_roots,
        absorbed_count,
        groups: if first_divergence_reported { groups.into_iter().map(|g| RootGroup { remedy: remedy(g.class, &envd, both_invariant), ..g }).collect() } else { Vec::new() },
        nonfinite: nonfinite_sides(al),
        env_diff: reported_env(envd, both_hold, &pairs, (&keys_a, &keys_b)),
        environment: environment(&a.header, &b.header),
        compared,
        differing,
        notes: notes.into_iter().map(Untrusted::from).collect(),
        graph_fork,
    };
    Ok((report, entries))
}

/// The refusal of two traces with no op output in common, each with its record count (and
/// whether it is truncated: a run that died before its first op).
fn nothing_in_common((a, ra): (&Trace, usize), (b, rb): (&Trace, usize)) -> Error {
    let cut = |t: &Trace| if t.truncated { ", truncated" } else { "" };
    Error::Mismatch(format!("nothing to compare: {} ({ra} op records{}) and {} ({rb} op records{}) have no op output in common", a.path.display(), cut(a), b.path.display(), cut(b)))
}

#[cfg(test)]
mod tests {
    use super::{drift_rows, MAX_DRIFT_ROWS};

    #[test]
    fn drift_rows_keep_the_root_the_first_difference_and_the_largest() {
        let mut all: Vec<(u32, f64)> = (0..100).map(|p| (p, 0.0)).collect();
        all[29].1 = 1e-6;
        all[61].1 = 5.0;
        all[62].1 = 1e-7;
        let rows = drift_rows(&all, 29);
        assert!(rows.len() <= MAX_DRIFT_ROWS, "{rows:?}");
        for must in [0, 29, 61, 99] {
            assert!(rows.contains(&must), "{must} missing from {rows:?}");
        }
        assert!(rows.windows(2).all(|w| w[0] < w[1]), "{rows:?}");
        assert_eq!(drift_rows(&all[..4], 2), vec![0, 1, 2, 3]);
        // As many positions as rows: all of them (position 14 of 16 was left out).
        assert_eq!(drift_rows(&all[..MAX_DRIFT_ROWS], 3), (0..MAX_DRIFT_ROWS).collect::<Vec<_>>());
    }
}
