//! Which root cause bisect reports: the roots the alignment found (an op whose output differs
//! while its inputs matched, `crate::align`), their classes and groups, those absorbed
//! downstream, a fork in the op graph, and inputs that differ.

use super::*;

/// The op of a module path without its layer: `layers.3.self_attn.scores` → `self_attn.scores`.
pub(super) fn op_kind(path: &str, op: &str) -> String {
    let rest = match layer_of(path) {
        Some(l) => path.strip_prefix(&format!("layers.{l}.")).or_else(|| path.strip_prefix(&format!("encoder.layer.{l}."))).unwrap_or(path),
        None => path,
    };
    format!("{rest} ({op})")
}

/// The cause class of a root at records `ra` (run a) and `rb` (run b); see [`CauseClass`].
pub(super) fn classify(sa: &Side, ra: &OpRecord, sb: &Side, rb: &OpRecord, env: &[EnvDiff]) -> CauseClass {
    let (ha, hb) = (&sa.trace.header.run, &sb.trace.header.run);
    if ra.perturbed || rb.perturbed {
        return CauseClass::Perturbed;
    }
    if ha.dtype != hb.dtype || ra.dtype != rb.dtype {
        return CauseClass::DtypeDiffers;
    }
    let ctx = |s: &Side, r: &OpRecord| s.forwards.get(&r.step).map(|f| (f.seq_len, f.batch));
    if ra.shape != rb.shape || ctx(sa, ra) != ctx(sb, rb) {
        return CauseClass::ShapesDiffer;
    }
    if ha.threads != hb.threads || sa.trace.header.env.threads != sb.trace.header.env.threads {
        return CauseClass::ThreadsDiffer;
    }
    super::cause::class_of(env)
}

/// Groups roots by (op kind, class), largest group first (then by first appearance).
pub(super) fn group_roots(roots: &[OpDivergence]) -> Vec<RootGroup> {
    let mut groups: Vec<RootGroup> = Vec::new();
    for d in roots {
        let kind = op_kind(&d.path, &d.op);
        match groups.iter_mut().find(|g| g.kind == kind && g.class == d.class) {
            Some(g) => g.count += 1,
            None => groups.push(RootGroup {
                first: format!("{} @ {}", &*d.path, d.position).into(),
                description: d.class.describe().into(),
                remedy: d.class.remedy().into(),
                kind: kind.into(),
                class: d.class,
                count: 1,
            }),
        }
    }
    groups.sort_by_key(|g| std::cmp::Reverse(g.count));
    groups
}

/// Whether the headers show different inputs (prompts, or texts no row of the other holds),
/// and how to say so.
pub(super) fn header_inputs(
    a: &Trace,
    b: &Trace,
    both_hold: bool,
    (keys_a, keys_b): (&[String], &[String]),
    pairs: &[(u32, u32)],
    (inputs_a, inputs_b): (&[String], &[String]),
    fed: &super::sequence::Fed,
) -> (bool, Option<InputsDiffer>) {
    // Different prompts: the inputs differ, no op is to blame.
    let (pa, pb) = (&a.header.run.prompt_tokens, &b.header.run.prompt_tokens);
    // Batches of texts (encoders, or decoders given several prompts): the rows are the requests,
    // and they differ when no row of one run holds a request of the other.
    // A redacted trace holds no prompt: its ids are compared through the input_ids records' digests.
    let (ta, tb) = (&a.header.run.texts, &b.header.run.texts);
    let by_rows = !ta.is_empty() || !tb.is_empty();
    // One prompt continuing the other run's output is no difference ([`super::sequence`]).
    let prompt_differs = both_hold && keys_a != keys_b && if by_rows { pairs.is_empty() } else { pa != pb && !matches!(fed, super::sequence::Fed::Continues { .. }) };
    let mut header_inputs = None;
    if prompt_differs && by_rows {
        let row = inputs_a.iter().zip(inputs_b.iter()).position(|(x, y)| x != y).unwrap_or(0);
        header_inputs = Some(InputsDiffer { position: 0, row: row as u32, in_prompt: true, explanation: format!("the texts differ (row {row}): the runs had different inputs, so no op is to blame") });
    } else if let (true, super::sequence::Fed::Differ { position, explanation }) = (prompt_differs, fed) {
        header_inputs = Some(InputsDiffer { position: *position, row: 0, in_prompt: true, explanation: explanation.clone() });
    } else if let (false, super::sequence::Fed::Differ { position, explanation }) = (both_hold, fed) {
        // A redacted trace: the prompts' input-id digests differ ([`super::sequence`]).
        header_inputs = Some(InputsDiffer { position: *position, row: 0, in_prompt: true, explanation: explanation.clone() });
        return (true, header_inputs);
    } else if prompt_differs {
        let at = pa.iter().zip(pb.iter()).position(|(x, y)| x != y).unwrap_or(pa.len().min(pb.len()));
        header_inputs = Some(InputsDiffer {
            position: at as u32,
            row: 0,
            in_prompt: true,
            explanation: format!("the prompts differ ({} vs {} tokens, first difference at position {at}): the runs had different inputs, so no op is to blame", pa.len(), pb.len()),
        });
    }
    (prompt_differs, header_inputs)
}

/// Outputs without a token axis, compared whole: (compared, differing, paths that differ). A
/// batch output is compared only when each row of a is paired with the same row of b (`pairs`,
/// [`super::pairing`]): the same requests in another order have their rows elsewhere, and each
/// request is then compared through its per-token records and its embedding instead (a note
/// in `notes` says how many were left out).
pub(super) fn align_whole(sa: &Side, sb: &Side, pairs: &[(u32, u32)], notes: &mut Vec<String>) -> (u64, u64, Vec<String>) {
    let permuted = pairs.iter().any(|(ra, rb)| ra != rb);
    let mut uncompared = 0u64;
    // Outputs without a token axis (pooled embeddings): the n-th record of a path in one trace
    // against the n-th of the same path in the other, by whole-tensor digest.
    let (mut compared, mut differing) = (0u64, 0u64);
    let mut whole_differ: Vec<String> = Vec::new();
    {
        let mut seen_a: HashMap<u32, usize> = HashMap::new();
        let mut by_site_b: HashMap<u32, Vec<&OpRecord>> = HashMap::new();
        for r in sb.recs.iter().filter(|r| r.tokens.is_empty()) {
            by_site_b.entry(r.site).or_default().push(r);
        }
        for r in sa.recs.iter().filter(|r| r.tokens.is_empty()) {
            let n = seen_a.entry(r.site).or_insert(0);
            let k = *n;
            *n += 1;
            let Some(&site_b) = sb.site_by_path.get(sa.path(r.site)) else { continue };
            let Some(rb) = by_site_b.get(&site_b).and_then(|v| v.get(k)) else { continue };
            if r.shape.first() != rb.shape.first() {
                continue; // another batch size: rows are compared through the per-token records
            }
            if permuted && r.shape.first().is_some_and(|&n| n > 1) {
                uncompared += 1;
                continue;
            }
            compared += 1;
            if r.digest != rb.digest || r.shape != rb.shape || r.dtype != rb.dtype {
                differing += 1;
                whole_differ.push(sa.path(r.site).to_string());
            }
        }
    }
    if uncompared > 0 {
        notes
            .push(format!("{uncompared} batch output(s) without a token axis were not compared: the runs hold their requests in another row order, so each request was compared through its own rows"));
    }
    (compared, differing, whole_differ)
}

/// A root inside layer L is absorbed when layer L's output ([`Alignment::layer_output`]: the
/// last op the layer records, not a name) at its (row, position) still matches.
pub(super) fn absorbed(al: &Alignment, path: &str, row: u32, pos: u32) -> bool {
    layer_of(path).and_then(|l| al.layer_output(l)).is_some_and(|out| al.matched(out, row, pos))
}

/// The sampler's header keys that differ, with both values (`run.repeat_penalty (a unset, b
/// 1.5)`); a value that is not a number (a crafted trace) is shown as `?`.
fn sampler_keys(envd: &[EnvDiff]) -> String {
    const KEYS: [&str; 6] = ["run.temperature", "run.top_k", "run.top_p", "run.seed", "run.repeat_penalty", "run.repeat_last_n"];
    let value = |v: &str| match serde_json::from_str::<serde_json::Value>(v) {
        Ok(serde_json::Value::Null) => "unset".to_string(),
        Ok(n @ serde_json::Value::Number(_)) => n.to_string(),
        _ => "?".to_string(),
    };
    let keys: Vec<String> = envd.iter().filter(|e| KEYS.contains(&e.key.unescaped())).map(|e| format!("{} (a {}, b {})", e.key.unescaped(), value(e.a.unescaped()), value(e.b.unescaped()))).collect();
    keys.join("; ")
}

/// The root the report names: the first that reaches its layer's output, else the first.
pub(crate) fn reported(al: &Alignment, roots: &[Found]) -> Option<Found> {
    let path = |f: &Found| al.path_of(0, f.seq_a).unwrap_or_default();
    roots.iter().find(|f| !absorbed(al, path(f), f.row, f.pos)).or(roots.first()).copied()
}

/// The first pass's root causes as the report states them (records read back from both traces),
/// and the first point where the token ids themselves differ (no op is blamed for that).
pub(super) fn find_roots(sa: &Side, sb: &Side, al: &Alignment, envd: &[EnvDiff]) -> (Vec<OpDivergence>, Option<InputsDiffer>) {
    let inputs_differ = al.input_differs.map(|f| {
        let in_prompt = f.pos < sa.prompt_len().min(sb.prompt_len());
        let explanation = if in_prompt {
            format!("the token ids entering the model differ at prompt position {}: the runs had different prompts", f.pos)
        } else {
            let sampler = sampler_keys(envd);
            if !sampler.is_empty() {
                format!(
                    "the token ids differ at generated position {} although everything before matched: the sampling chose differently, under other sampler settings (a run setting): {sampler}",
                    f.pos
                )
            } else {
                format!("the token ids differ at generated position {} although everything before matched: the sampling chose differently (see the settings that differ)", f.pos)
            }
        };
        InputsDiffer { position: f.pos, row: f.row, in_prompt, explanation }
    });
    let roots = al
        .roots()
        .into_iter()
        .filter_map(|f| {
            let (ra, ta) = sa.entry(f.seq_a, f.row, f.pos)?;
            let (rb, tb) = sb.entry(f.seq_b, f.row, f.pos)?;
            let (d, rel) = diff_bound(ta, tb, slice_len(ra, f.row, f.pos));
            let path = sa.path(ra.site).to_string();
            Some(OpDivergence {
                seq: ra.seq,
                step: ra.step,
                layer: layer_of(&path),
                path: path.into(),
                op: sa.sites[ra.site as usize].1.into(),
                b_op: Some(sb.sites[rb.site as usize].1).filter(|&o| o != sa.sites[ra.site as usize].1).map(Into::into),
                position: f.pos,
                row: f.row,
                b_row: sb.own_row(f.row),
                inputs_matched: true,
                max_abs_diff: d,
                max_rel_diff: rel,
                below_resolution: d == 0.0 && ta.digest != tb.digest,
                nonfinite: (ta.nonfinite, tb.nonfinite),
                class: classify(sa, ra, sb, rb, envd),
                a: entry_view(sa, ra, ta),
                b: entry_view(sb, rb, tb),
                elementwise: None,
            })
        })
        .collect();
    (roots, inputs_differ)
}

/// The entry point a root is, `live` when it reached its layer's output.
pub(super) fn entry_point(d: &OpDivergence, live: bool) -> EntryPoint {
    EntryPoint { path: d.path.clone(), op: d.op.clone(), layer: d.layer, position: d.position, row: d.row, b_row: d.b_row, class: d.class, max_abs_diff: d.max_abs_diff, live }
}

/// Where the op graphs part ([`Alignment::fork`]), by module path, when that comes before the
/// op blamed (`fd`): the graphs parted first, so `fd` is no longer the first divergence; a note
/// names it.
pub(super) fn graph_fork(al: &Alignment, fd: &mut Option<OpDivergence>, notes: &mut Vec<String>) -> Option<GraphFork> {
    let (f, ia, ib) = al.fork()?;
    if let Some(d) = fd.as_ref() {
        if (d.position, d.seq) <= (f.pos, f.seq_a) {
            return None;
        }
        notes.push(format!("after the graphs part, {} ({}) at token position {} differs with matching inputs: {}", &*d.path, &*d.op, d.position, d.class.describe()));
        *fd = None;
    }
    let owned = |v: Vec<&str>| v.into_iter().map(Untrusted::from).collect();
    Some(GraphFork { path: al.path_of(0, f.seq_a)?.into(), row: f.row, position: f.pos, a_inputs: owned(ia), b_inputs: owned(ib) })
}

/// Each side's first non-finite op output, when they differ in where (or whether) one appears.
pub(super) fn nonfinite_sides(al: &Alignment) -> Option<NonFiniteSides> {
    let [x, y] = al.nonfinite();
    let same = match (&x, &y) {
        (None, None) => true,
        (Some(p), Some(q)) => (&p.path, p.position) == (&q.path, q.position),
        _ => false,
    };
    (!same).then_some(NonFiniteSides { a: x, b: y })
}

/// Inputs that differ at or before the root cause explain it: no op is blamed then; a root
/// before the first differing input stands. Differing inputs seen in the headers win.
pub(super) fn reconcile(mut inputs_differ: Option<InputsDiffer>, mut first_divergence: Option<OpDivergence>, header_inputs: Option<InputsDiffer>) -> (Option<InputsDiffer>, Option<OpDivergence>) {
    if let (Some(inp), Some(fd)) = (&inputs_differ, &first_divergence) {
        if inp.position <= fd.position && inp.in_prompt {
            first_divergence = None;
        }
    }
    if let (Some(inp), Some(fd)) = (&inputs_differ, &first_divergence) {
        if inp.position > fd.position {
            inputs_differ = None;
        }
    }
    if header_inputs.is_some() {
        inputs_differ = header_inputs;
        first_divergence = None;
    }
    (inputs_differ, first_divergence)
}

/// The roots as reported: the entry points `--causal` may patch, the causes by group, the
/// reported root and the roots absorbed before it.
pub(super) struct Picked {
    pub(super) entries: Vec<EntryPoint>,
    pub(super) groups: Vec<RootGroup>,
    pub(super) first: Option<OpDivergence>,
    pub(super) absorbed: Vec<Absorbed>,
    pub(super) absorbed_count: usize,
}

/// Which root is reported. A root cause inside layer L is absorbed when layer L's output at that
/// (row, position) still matches: later ops rounded the difference away (softmax over one key,
/// for example). The first root that reaches the residual stream is reported; the absorbed ones
/// before it are listed (at most [`MAX_ABSORBED_LISTED`]). No live root: the first one. The
/// groups count every root kept, those after the reported one too: each is an op whose inputs
/// matched and whose output differs, so a second, independent cause (a second fault, another
/// position) is listed, not only the reported one's (a fresh-user trial: two perturbations
/// gave "1 reported root").
pub(super) fn pick_root(al: &Alignment, mut roots: Vec<OpDivergence>) -> Picked {
    let entries: Vec<EntryPoint> = roots.iter().map(|d| entry_point(d, !absorbed(al, &d.path, d.row, d.position))).collect();
    let live = roots.iter().position(|d| !absorbed(al, &d.path, d.row, d.position));
    let groups = group_roots(&roots);
    let (first, mut absorbed) = match live {
        Some(i) => {
            let before: Vec<Absorbed> = roots[..i].iter().map(Absorbed::from).collect();
            (Some(roots.swap_remove(i)), before)
        }
        None => (roots.first().cloned(), Vec::new()),
    };
    let absorbed_count = absorbed.len();
    absorbed.truncate(MAX_ABSORBED_LISTED);
    Picked { entries, groups, first, absorbed, absorbed_count }
}
