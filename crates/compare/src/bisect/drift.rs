//! Around a root cause: how its difference grows through the layers and along positions, and
//! elementwise metrics (ULP) where values were dumped.

use super::*;

/// The drift table of `path` at `row`, and whether the root cause's difference follows position:
/// where this op is a root (its inputs matched) at 8 positions or more, and at half or more of
/// the positions where it differs, either it is
/// identical at position 0 and a root at later ones (a rotation is the identity at position 0),
/// or the largest difference in the last quarter of them is over twice the largest in the
/// first. Positions downstream of a root differ because their inputs did: they are listed, not
/// judged.
pub(super) fn drift_table(al: &Alignment, path: &str, row: u32, at: u32, roots: &HashSet<u32>) -> (Vec<PositionDrift>, bool) {
    let all = al.drift(path, row);
    if all.len() < 3 || all.iter().all(|&(_, d)| d == 0.0) {
        return (Vec::new(), false);
    }
    let judged: Vec<f64> = all.iter().filter(|(p, _)| roots.contains(p)).map(|&(_, d)| d).collect();
    let differing = all.iter().filter(|&&(_, d)| d != 0.0).count();
    // Judged only where the difference mostly enters here: a kernel that depends on the pass's
    // shape is a root at a few positions, whose later differences come from upstream.
    let follows = judged.len() >= 8 && judged.len() * 2 >= differing && {
        let quarter = judged.len().div_ceil(4);
        let max = |xs: &[f64]| xs.iter().copied().fold(0.0, f64::max);
        let grows = max(&judged[judged.len() - quarter..]) > 2.0 * max(&judged[..quarter]);
        let zero_at_0 = all.first().is_some_and(|&(p, d)| p == 0 && d == 0.0);
        grows || zero_at_0
    };
    let rows = drift_rows(&all, at).into_iter().map(|i| PositionDrift { position: all[i].0, max_abs_diff: all[i].1, inputs_matched: roots.contains(&all[i].0) }).collect();
    (rows, follows)
}

/// Which of the `all` positions the table shows (indexes, in order): at most [`MAX_DRIFT_ROWS`],
/// always the first and last, the root's position `at`, the first and the largest difference,
/// and as many evenly spaced others as fit.
pub(super) fn drift_rows(all: &[(u32, f64)], at: u32) -> Vec<usize> {
    let n = all.len();
    if n <= MAX_DRIFT_ROWS {
        // Every position fits (evenly spaced picks among the rest could miss one).
        return (0..n).collect();
    }
    let largest = all.iter().enumerate().max_by(|a, b| a.1 .1.total_cmp(&b.1 .1)).map_or(0, |(i, _)| i);
    let first_diff = all.iter().position(|&(_, d)| d != 0.0).unwrap_or(0);
    let root = all.iter().position(|&(p, _)| p == at).unwrap_or(0);
    let mut picks: Vec<usize> = vec![0, n - 1, root, first_diff, largest];
    picks.sort_unstable();
    picks.dedup();
    let room = MAX_DRIFT_ROWS.saturating_sub(picks.len());
    let spaced: Vec<usize> = (1..=room).map(|k| k * (n - 1) / (room + 1)).collect();
    picks.extend(spaced);
    picks.sort_unstable();
    picks.dedup();
    picks
}

/// How the difference grew through the layers at the root's position, and how the root's op
/// differs along the positions (with a note when that grows).
pub(super) fn around_root(sa: &Side, sb: &Side, al: &Alignment, fd: &OpDivergence, notes: &mut Vec<String>) -> (Vec<LayerGrowth>, Vec<PositionDrift>, bool) {
    let growth = growth_table(sa, sb, fd.row, fd.position);
    let roots: HashSet<u32> = al.roots().iter().filter(|f| f.row == fd.row && al.path_of(0, f.seq_a) == Some(fd.path.unescaped())).map(|f| f.pos).collect();
    let (drift, grows) = drift_table(al, &fd.path, fd.row, fd.position, &roots);
    // A cause already named (a perturbation, other shapes or dtypes) explains the pattern.
    let grows = grows && !matches!(fd.class, CauseClass::Perturbed | CauseClass::ShapesDiffer | CauseClass::DtypeDiffers);
    if grows {
        notes.push(format!(
            "{} is a root cause at {} positions and its difference follows position (see the table): the signature of a position-dependent fault, such as a wrong rotary (rope) layout or base",
            &*fd.path,
            roots.len()
        ));
    }
    (growth, drift, grows)
}

pub(super) fn elementwise(sa: &Side, ra: &OpRecord, sb: &Side, rb: &OpRecord, row: u32, pos: u32) -> Option<Elementwise> {
    let (va, ia) = sa.slice(ra, row, pos)?;
    let (vb, ib) = sb.slice(rb, row, pos)?;
    if ia.len() != ib.len() {
        return None;
    }
    let same_dtype = va.dtype == vb.dtype;
    let mut e = Elementwise {
        count: ia.len() as u64,
        differing: 0,
        max_abs_diff: 0.0,
        max_rel_diff: 0.0,
        max_ulp: same_dtype.then_some(0),
        ulp_histogram: Vec::new(),
        worst_index: 0,
        a_worst: va.f64.get(*ia.first()?).copied().unwrap_or(0.0),
        b_worst: vb.f64.get(*ib.first()?).copied().unwrap_or(0.0),
    };
    let mut buckets = [0u64; 34];
    for (k, (&i, &j)) in ia.iter().zip(&ib).enumerate() {
        let (x, y) = (va.f64[i], vb.f64[j]);
        let ulp = va.ordered[i].abs_diff(vb.ordered[j]);
        let differs = if same_dtype { ulp != 0 } else { x.to_bits() != y.to_bits() };
        if same_dtype {
            let b = if ulp == 0 { 0 } else { (64 - ulp.leading_zeros()) as usize };
            buckets[b.min(33)] += 1;
            e.max_ulp = e.max_ulp.map(|m| m.max(ulp));
        }
        if !differs {
            continue;
        }
        e.differing += 1;
        let d = (x - y).abs();
        if d > e.max_abs_diff || (d.is_nan() && !e.max_abs_diff.is_nan()) {
            e.max_abs_diff = d;
            e.worst_index = k;
            e.a_worst = x;
            e.b_worst = y;
        }
        let scale = x.abs().max(y.abs());
        if scale > 0.0 && d / scale > e.max_rel_diff {
            e.max_rel_diff = d / scale;
        }
    }
    if same_dtype {
        e.ulp_histogram = buckets
            .iter()
            .enumerate()
            .filter(|(_, n)| **n > 0)
            .map(|(b, n)| {
                let label = match b {
                    0 => "0".to_string(),
                    1 => "1".to_string(),
                    33 => ">=2^32".to_string(),
                    _ => format!("{}-{}", 1u64 << (b - 1), (1u64 << b) - 1),
                };
                (label, *n)
            })
            .collect();
    }
    Some(e)
}

/// Fills in the root cause's elementwise metrics from both traces' dumps; without them, the
/// note saying which `--dump` gives them.
pub(super) fn add_elementwise(sa: &Side, sb: &Side, fd: &mut OpDivergence) -> Option<String> {
    if let (Some(ra), Some(rb)) = (sa.record(fd.seq), sb.record(fd.b.seq)) {
        fd.elementwise = elementwise(sa, ra, sb, rb, fd.row, fd.position);
    }
    fd.elementwise.is_none().then(|| {
        let pattern = candle_trace_format::site::layer_dump_pattern(&fd.path).unwrap_or_else(|| fd.path.to_string());
        match crate::level::coarser(sa.trace.level, sb.trace.level) {
            candle_trace_format::site::Level::Ops => format!("for elementwise metrics (ULP distances) of the root cause, re-record both runs with --dump '{pattern}'"),
            // A layer's output: the op where the difference entered is among the layer's ops.
            l => format!(
                "for the op where the difference entered and its elementwise metrics (ULP distances), re-record both runs at --level ops with --dump '{pattern}' (this is --level {})",
                l.as_str()
            ),
        }
    })
}

/// Per layer (then `norm`, `lm_head`): how much its ops' outputs differ at (row, pos).
pub(super) fn growth_table(sa: &Side, sb: &Side, row: u32, pos: u32) -> Vec<LayerGrowth> {
    let mut order: Vec<String> = Vec::new();
    let mut acc: HashMap<String, LayerGrowth> = HashMap::new();
    for r in &sa.recs {
        for t in &r.tokens {
            if t.row != row || t.pos != pos {
                continue;
            }
            let path = sa.path(r.site);
            let Some(&site_b) = sb.site_by_path.get(path) else { continue };
            let Some((rb, tb)) = sb.token(site_b, row, pos) else { continue };
            let group = layer_group(path);
            let g = acc.entry(group.clone()).or_insert_with(|| {
                order.push(group.clone());
                LayerGrowth { layer: group.into(), identical: true, ops_differing: 0, ops_compared: 0, max_abs_diff: 0.0, max_rel_diff: 0.0, exact_max_abs_diff: None, max_ulp: None }
            });
            g.ops_compared += 1;
            if t.digest != tb.digest {
                g.identical = false;
                g.ops_differing += 1;
                let (d, rel) = diff_bound(t, tb, slice_len(r, row, pos));
                if d.is_nan() || g.max_abs_diff.is_nan() {
                    g.max_abs_diff = f64::NAN;
                    g.max_rel_diff = f64::NAN;
                } else {
                    g.max_abs_diff = g.max_abs_diff.max(d);
                    g.max_rel_diff = g.max_rel_diff.max(rel);
                }
                if let Some(e) = elementwise(sa, r, sb, rb, row, pos) {
                    g.exact_max_abs_diff = Some(g.exact_max_abs_diff.unwrap_or(0.0).max(e.max_abs_diff));
                    if let Some(u) = e.max_ulp {
                        g.max_ulp = Some(g.max_ulp.unwrap_or(0).max(u));
                    }
                }
            }
        }
    }
    order.into_iter().filter_map(|k| acc.remove(&k)).collect()
}

/// Cosine similarity of two vectors, in f64: `a·b / (|a| |b|)` (0 when either is zero).
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (*x as f64, *y as f64);
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    if aa == 0.0 || bb == 0.0 {
        0.0
    } else {
        ab / (aa.sqrt() * bb.sqrt())
    }
}
