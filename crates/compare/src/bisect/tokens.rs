//! Requests and tokens: which row of b holds which request of a, the first generated token
//! that differs, the sampler's verdict, and the environment keys that differ.

use super::*;

/// Classifies a sampled divergence from the two runs' records of the step (see
/// [`SamplingVerdict`]).
pub fn classify_sampling(a: &candle_trace_format::record::SamplingStep, b: &candle_trace_format::record::SamplingStep) -> SamplingVerdict {
    classify_penalised(a, b, ("", ""))
}

/// [`classify_sampling`] for runs whose repeat penalties are `penalties` in words (empty: none;
/// [`penalty_words`]): penalties that differ are sampler settings that differ.
fn classify_penalised(a: &candle_trace_format::record::SamplingStep, b: &candle_trace_format::record::SamplingStep, penalties: (&str, &str)) -> SamplingVerdict {
    let mut tokens: Vec<u32> = a.boundary.iter().chain(&b.boundary).map(|x| x.0).collect();
    tokens.sort_unstable();
    tokens.dedup();
    let (a_draw, b_draw) = (a.draw, b.draw);
    let same_draw = a_draw.map(f32::to_bits) == b_draw.map(f32::to_bits);
    // The sets differ at the boundary: an exact tie or 1-ULP neighbour at a cut-off, or the
    // least likely kept token changed while the cut-off probabilities stayed within 1%.
    let near = |x: Option<(f32, f32)>, y: Option<(f32, f32)>| match (x, y) {
        (Some((p, _)), Some((q, _))) => (p - q).abs() <= 0.01 * p.max(q),
        _ => false,
    };
    let moved = a.set_digest != b.set_digest && a.cutoff_token != b.cutoff_token && (near(a.k_cutoff, b.k_cutoff) || near(a.p_cutoff, b.p_cutoff));
    if moved {
        tokens.extend(a.cutoff_token.into_iter().chain(b.cutoff_token));
        tokens.sort_unstable();
        tokens.dedup();
    }
    let sets_differ = moved || (a.set_digest != b.set_digest && !tokens.is_empty());
    let (settings_a, settings_b) = (sampler_settings(a, penalties.0), sampler_settings(b, penalties.1));
    let (class, explanation) = if settings_a != settings_b {
        // Other settings give other probabilities (temperature) or another candidate set
        // (top-k, top-p) from the same logits: neither a draw nor the forward pass to blame.
        (
            "sampler_settings",
            format!(
                "the sampler settings differ (a {}, b {}): from the same logits they give other probabilities or another candidate set (draws a {}, b {})",
                settings_a,
                settings_b,
                a_draw.map_or("-".into(), |d| d.to_string()),
                b_draw.map_or("-".into(), |d| d.to_string())
            ),
        )
    } else if a.probs_digest == b.probs_digest {
        (
            "different_draw",
            format!(
                "the same probabilities met a different random draw (a {}, b {}): the seed, the sampler settings or the order draws were consumed differ",
                a_draw.map_or("-".into(), |d| d.to_string()),
                b_draw.map_or("-".into(), |d| d.to_string())
            ),
        )
    } else if same_draw && a.mode != "argmax" && sets_differ {
        let list: Vec<String> = tokens.iter().map(u32::to_string).collect();
        (
            "boundary",
            format!(
                "the same draw met a different candidate set: at the {} cut-off, token(s) {} tie or nearly tie and changed places (set sizes a {}/{}, b {}/{} after top-k/top-p)",
                if a.after_top_k != b.after_top_k || a.k_cutoff.is_some() { "top-k" } else { "top-p" },
                if list.is_empty() { "?".into() } else { list.join(", ") },
                a.after_top_k,
                a.after_top_p,
                b.after_top_k,
                b.after_top_p
            ),
        )
    } else if a.mode == "argmax" {
        ("distribution_differed", "greedy decoding: the logits differ, and the maximum moved (see the root cause)".to_string())
    } else {
        ("distribution_differed", "the probabilities differ: the forward pass computed other logits (see the root cause)".to_string())
    };
    SamplingVerdict { class: class.into(), explanation, a_draw, b_draw, tokens }
}

/// A step's sampler settings in words: `greedy`, or the temperature and the cut-offs applied
/// (`temperature 0.8, top-k 3`).
fn sampler_settings(s: &candle_trace_format::record::SamplingStep, penalty: &str) -> String {
    let mut parts = if s.mode == "argmax" {
        vec!["greedy".to_string()]
    } else {
        let mut parts = vec![format!("temperature {}", s.temperature.map_or("-".into(), |t| t.to_string()))];
        parts.extend(s.top_k.map(|k| format!("top-k {k}")));
        parts.extend(s.top_p.map(|p| format!("top-p {p}")));
        parts
    };
    parts.extend((!penalty.is_empty()).then(|| penalty.to_string()));
    parts.join(", ")
}

/// A run's repeat penalty in words (`repeat penalty 1.5 over the last 64 tokens`) from its
/// settings frame; empty without one. Values that are not numbers of their type (a crafted
/// trace) read `?`.
pub fn penalty_words(settings: &candle_trace_format::record::Settings) -> String {
    let penalty = settings.get("repeat_penalty").map(|v| serde_json::from_str::<f32>(v).map_or("?".to_string(), |x| format!("{x:?}")));
    let window = settings.get("repeat_last_n").and_then(|v| serde_json::from_str::<u64>(v).ok()).map_or("?".to_string(), |n| n.to_string());
    match penalty {
        Some(p) => format!("repeat penalty {p} over the last {window} tokens"),
        None => String::new(),
    }
}

/// (row of a, row of b) pairs holding the same request: each row of b with the first row of a
/// not yet taken that holds its request, else (more copies in b than in a) with the first row
/// of a that holds it; then each row of a left over (more copies in a) with the first row of b
/// holding its request. Every copy of a request gets its answer; op outputs are aligned on the
/// first pair of each row of b ([`super::b_rows`]).
pub(super) fn row_pairs(a: &[String], b: &[String]) -> Vec<(u32, u32)> {
    let mut taken = vec![false; a.len()];
    let mut out = Vec::new();
    for (rb, x) in b.iter().enumerate() {
        let free = (0..a.len()).find(|&ra| !taken[ra] && a[ra] == *x);
        if let Some(ra) = free.or_else(|| (0..a.len()).find(|&ra| a[ra] == *x)) {
            taken[ra] = true;
            out.push((ra as u32, rb as u32));
        }
    }
    for (ra, x) in a.iter().enumerate().filter(|(ra, _)| !taken[*ra]) {
        if let Some(rb) = b.iter().position(|y| y == x) {
            out.push((ra as u32, rb as u32));
        }
    }
    out.sort_unstable();
    out
}

/// Fields of two headers that differ, flattened as `run.seed`, `env.threads`, `run.model.name`….
pub fn env_diff(a: &Header, b: &Header) -> Vec<EnvDiff> {
    fn short(v: &serde_json::Value) -> String {
        let s = match v {
            // Quoted and escaped, so a trailing newline or tab is visible.
            serde_json::Value::String(s) => format!("{s:?}"),
            other => other.to_string(),
        };
        if s.chars().count() > 80 {
            format!("{}…", s.chars().take(80).collect::<String>())
        } else {
            s
        }
    }
    let to = |h: &Header| {
        // RAYON_NUM_THREADS as traces before 2026-12-04 kept it: env.threads is the count in
        // effect, which the variable decided unless --threads overrode it.
        let mut env = h.env.clone();
        env.env_vars.retain(|(k, _)| k != "RAYON_NUM_THREADS");
        let mut v = serde_json::json!({ "run": h.run, "env": env });
        // Hyper-parameters as an object, so each differing key is its own line.
        // Each value is stored as JSON text: shown as that JSON (`"upstream"`, not `"\"upstream\""`).
        let cfg: serde_json::Map<String, serde_json::Value> =
            h.run.model.config.iter().map(|(k, x)| (k.clone(), serde_json::from_str(x).unwrap_or_else(|_| serde_json::Value::String(x.clone())))).collect();
        v["run"]["model"]["config"] = serde_json::Value::Object(cfg);
        v
    };
    let (mut ja, mut jb) = (to(a), to(b));
    // Traces written before the CPU string named its caches (2026-12-04) compare by the CPU's
    // name alone: the caches are unknown there, not different.
    if caches_of(&a.env.cpu).is_some() != caches_of(&b.env.cpu).is_some() {
        ja["env"]["cpu"] = serde_json::Value::String(cpu_name(&a.env.cpu).to_string());
        jb["env"]["cpu"] = serde_json::Value::String(cpu_name(&b.env.cpu).to_string());
    }
    let (fa, fb) = (crate::text::flatten_json(&ja), crate::text::flatten_json(&jb));
    let in_b: std::collections::HashMap<&str, &serde_json::Value> = fb.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let in_a: std::collections::HashSet<&str> = fa.iter().map(|(k, _)| k.as_str()).collect();
    let null = serde_json::Value::Null;
    // Keys of either side: one only b has differs as much as one only a has.
    let pairs = fa.iter().map(|(k, va)| (k, va, *in_b.get(k.as_str()).unwrap_or(&&null)));
    let pairs = pairs.chain(fb.iter().filter(|(k, _)| !in_a.contains(k.as_str())).map(|(k, vb)| (k, &null, vb)));
    let show = |key: &str, v: &serde_json::Value| match (key, v.as_u64()) {
        ("run.prefill_chunk", Some(0)) => "0 (whole prompt)".to_string(),
        _ => short(v),
    };
    pairs.filter(|(_, va, vb)| va != vb).map(|(k, va, vb)| EnvDiff { a: show(k, va).into(), b: show(k, vb).into(), key: k.as_str().into() }).collect()
}

/// The caches a header's CPU string names (` (L1d 32K 8-way, ...)` at its end, as
/// `candle_trace_instrument::env` writes it), if it names them.
fn caches_of(cpu: &str) -> Option<&str> {
    let i = cpu.rfind(" (L")?;
    (cpu.ends_with(')') && cpu[i + 3..].starts_with(|c: char| c.is_ascii_digit())).then(|| &cpu[i..])
}

/// A header's CPU string without the caches it names.
fn cpu_name(cpu: &str) -> &str {
    match caches_of(cpu) {
        Some(c) => &cpu[..cpu.len() - c.len()],
        None => cpu,
    }
}

/// The settings that differ, less the prompts unless both traces hold theirs (`both_hold`; a
/// redacted trace's placeholder differs from any prompt). When the batches differ and rows were
/// paired by request (`pairs`, (row of a, row of b)), the prompt keys (a header's `run.prompt` is
/// its row 0's) give way to one `run.requests` line: how many rows and distinct requests each
/// batch holds (`keys`: a request's key per row), and which rows hold the same one.
pub(super) fn reported_env(mut d: Vec<EnvDiff>, both_hold: bool, pairs: &[(u32, u32)], (keys_a, keys_b): (&[String], &[String])) -> Vec<EnvDiff> {
    let is_prompt = |x: &EnvDiff| matches!(x.key.unescaped(), "run.prompt" | "run.prompt_tokens") || x.key.starts_with("run.texts");
    if !both_hold || !pairs.is_empty() {
        d.retain(|x| !is_prompt(x));
    }
    if !pairs.is_empty() {
        // Each own row with the other run's rows holding its request ("row 0 is b's rows 0, 1"),
        // then the rows the other run does not hold ("row 2 only in b").
        let list = |side: usize| {
            let (own, other, n) = if side == 0 { ("b", pairs.iter().map(|p| (p.0, p.1)).collect::<Vec<_>>(), keys_a.len()) } else { ("a", pairs.iter().map(|p| (p.1, p.0)).collect(), keys_b.len()) };
            let mut rows: std::collections::BTreeMap<u32, Vec<u32>> = std::collections::BTreeMap::new();
            for (r, o) in other {
                rows.entry(r).or_default().push(o);
            }
            let alone: Vec<String> = (0..n as u32).filter(|r| !rows.contains_key(r)).map(|r| r.to_string()).collect();
            let one = |(r, mut os): (u32, Vec<u32>)| {
                os.sort_unstable();
                os.dedup();
                let list = os.iter().map(u32::to_string).collect::<Vec<_>>().join(", ");
                format!("row {r} is {own}'s {}", if os.len() == 1 { format!("row {list}") } else { format!("rows {list}") })
            };
            let mut parts: Vec<String> = rows.into_iter().map(one).collect();
            if !alone.is_empty() {
                parts.push(format!("{} only in {}", if alone.len() == 1 { format!("row {}", alone[0]) } else { format!("rows {}", alone.join(", ")) }, if side == 0 { "a" } else { "b" }));
            }
            parts.join("; ")
        };
        // Copies of one request are rows, not requests: "2 rows, 1 request".
        let n = |keys: &[String]| {
            let distinct = keys.iter().collect::<std::collections::HashSet<_>>().len();
            let req = if distinct == 1 { "1 request".to_string() } else { format!("{distinct} requests") };
            if keys.len() == distinct {
                req
            } else {
                format!("{} rows, {req}", keys.len())
            }
        };
        let at = d.iter().position(|x| x.key.as_str() > "run.requests").unwrap_or(d.len());
        d.insert(at, EnvDiff { key: "run.requests".into(), a: format!("{}, {}", n(keys_a), list(0)).into(), b: format!("{}, {}", n(keys_b), list(1)).into() });
    }
    d
}

/// Both runs' model file and environment, whether or not they differ: what a maintainer asks
/// for first (the model by name, sha256 and storage; versions, OS, CPU, SIMD, threads, device).
pub(super) fn environment(a: &Header, b: &Header) -> Vec<EnvDiff> {
    environment_fields(a).into_iter().zip(environment_fields(b)).map(|((k, x), (_, y))| EnvDiff { key: k.into(), a: x.into(), b: y.into() }).collect()
}

/// A run's model file and environment as (name, value) pairs: `model`, `model sha256`,
/// `weights in the file` (how the file stores them), `computed in` (the run's `--dtype`: "q"
/// keeps quantized weights as stored), `candle-trace`, `candle`, `rustc`, `os`, `arch`, `cpu`, `simd`, `threads`,
/// `device`. The values are the header's, unescaped.
pub fn environment_fields(h: &Header) -> Vec<(&'static str, String)> {
    let (m, e) = (&h.run.model, &h.env);
    vec![
        ("model", m.name.clone()),
        ("model sha256", m.sha256.clone()),
        ("weights in the file", m.weights.clone()),
        ("computed in", if h.run.dtype == "q" { "q (quantized weights as stored)".into() } else { h.run.dtype.clone() }),
        ("candle-trace", e.crate_version.clone()),
        ("candle", e.candle_version.clone()),
        ("rustc", e.rustc.clone()),
        ("os", e.os.clone()),
        ("arch", e.arch.clone()),
        ("cpu", e.cpu.clone()),
        ("simd", e.simd.join(" ")),
        ("threads", e.threads.to_string()),
        ("device", e.device.clone()),
    ]
}

/// Notes on how the rows were paired and which trace is truncated.
pub(super) fn pairing_notes(sa: &Side, sb: &Side, pairs: &[(u32, u32)]) -> Vec<String> {
    let mut notes = Vec::new();
    if !pairs.is_empty() {
        let list: Vec<String> = pairs.iter().map(|(ra, rb)| format!("a row {ra} = b row {rb}")).collect();
        let unpaired = |n: usize, side: usize| (0..n as u32).any(|r| !pairs.iter().any(|p| if side == 0 { p.0 == r } else { p.1 == r }));
        let rest = if unpaired(row_inputs(&sa.trace.header).len(), 0) || unpaired(row_inputs(&sb.trace.header).len(), 1) { "; other rows have no counterpart" } else { "" };
        let shared = if pairs.iter().any(|p| pairs.iter().filter(|q| q.0 == p.0).count() > 1) {
            "; op outputs are compared with the first copy of a request, tokens and embeddings with every copy"
        } else {
            ""
        };
        notes.push(format!("rows compared by request: {}{rest}{shared}", list.join(", ")));
    }
    for (name, s) in [("a", sa), ("b", sb)] {
        notes.extend(crate::copies::disagreements(s.trace).iter().map(|d| format!("{name}: {}", d.line())));
    }
    for s in [sa, sb] {
        if s.trace.truncated {
            notes.push(format!(
                "{} is truncated (the run did not finish, or the file was cut): compared its {} complete records",
                s.trace.path.file_name().map_or_else(|| s.trace.path.display().to_string(), |n| n.to_string_lossy().into_owned()),
                s.records
            ));
        }
    }
    notes
}

/// Why a sampled token flipped, from both runs' sampling records of that step.
pub(super) fn sampling_of(a: &Trace, b: &Trace, sb: &Side, t: &TokenDivergence) -> Option<SamplingVerdict> {
    let x = a.sampling.iter().find(|s| s.index == t.step && s.row == t.row)?;
    let y = b.sampling.iter().find(|s| s.index == t.step && s.row == sb.own_row(t.row))?;
    Some(classify_penalised(x, y, (&penalty_words(&a.extras.settings), &penalty_words(&b.extras.settings))))
}

/// How batch row `row` of a finished run stopped: `eos` when it generated fewer tokens than the
/// run's longest row (rows stop at their own end of sequence while the others go on), else the
/// run's stop (the footer's); `None` for a run without a footer.
fn row_stop<'t>(s: &Side<'t>, row: u32) -> Option<&'t str> {
    let stop = s.trace.footer.as_ref()?.stop.as_str();
    let count = |r: u32| s.tokens.iter().filter(|e| e.rows.iter().any(|c| c.row == r)).count();
    let longest = s.tokens.iter().flat_map(|e| e.rows.iter().map(|c| c.row)).collect::<std::collections::BTreeSet<u32>>().into_iter().map(count).max().unwrap_or(0);
    Some(if count(row) < longest { "eos" } else { stop })
}

/// Notes on how the runs ended: requests that stopped differently (each compared request's own
/// stop, per paired row: a batch that ran to `--max-tokens` holds rows that stopped at their end
/// of sequence), or identical only over the common part. `pairs` as [`row_answers`] takes them.
pub(super) fn ending_notes(sa: &Side, sb: &Side, identical: bool, pairs: &[(u32, u32)]) -> Vec<String> {
    let (a, b) = (sa.trace, sb.trace);
    let mut notes = Vec::new();
    let pairs: Vec<(u32, u32)> = if pairs.is_empty() { (0..row_inputs(&a.header).len().min(row_inputs(&b.header).len()) as u32).map(|r| (r, r)).collect() } else { pairs.to_vec() };
    let differ: Vec<String> = pairs
        .iter()
        .filter_map(|&(ra, rb)| match (row_stop(sa, ra), row_stop(sb, rb)) {
            (Some(x), Some(y)) if x != y => Some(format!("a row {ra} {x}, b row {rb} {y}")),
            _ => None,
        })
        .collect();
    let stops = (a.footer.as_ref().map(|f| f.stop.as_str()), b.footer.as_ref().map(|f| f.stop.as_str()));
    let unpaired = |s: &Side, side: usize| (0..row_inputs(&s.trace.header).len() as u32).any(|r| !pairs.iter().any(|p| if side == 0 { p.0 == r } else { p.1 == r }));
    if !differ.is_empty() {
        notes.push(format!("the requests stopped differently: {}", differ.join("; ")));
    } else if let (Some(x), Some(y)) = stops {
        // Every compared request stopped alike: a run's own stop differs only through its rows
        // without a counterpart, said as theirs.
        if x != y {
            let alike: Vec<&str> = pairs.iter().filter_map(|&(ra, _)| row_stop(sa, ra)).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
            let others: Vec<String> = [("a", x, unpaired(sa, 0)), ("b", y, unpaired(sb, 1))].into_iter().filter(|o| o.2).map(|(n, stop, _)| format!("{n}'s other rows ran to {stop}")).collect();
            let tail = if others.is_empty() { String::new() } else { format!("; {}", others.join(", ")) };
            notes.push(format!("the compared requests stopped alike ({}){tail}", alike.join(", ")));
        }
    }
    // Records counts differ whenever the runs schedule their passes differently (chunked
    // against whole prefill, other batches) with every output compared: not a sign of a part
    // left out.
    if identical && (a.truncated || b.truncated || sa.tokens.len() != sb.tokens.len()) {
        notes.push("identical over the part both traces hold; the longer run was not compared past it".into());
    }
    // A fault injected and nothing recorded changed: said, so "identical" does not read as the
    // fault missing (the settings list the spec).
    if identical && a.header.run.perturb != b.header.run.perturb {
        // `--causal`'s patches (`patch:`) are no fault.
        let fault = |p: &Option<String>| p.iter().flat_map(|p| p.split(',')).filter(|s| !s.starts_with("patch:")).map(crate::text::clean).collect::<Vec<String>>().join(",");
        let faults: Vec<String> =
            [("a", fault(&a.header.run.perturb)), ("b", fault(&b.header.run.perturb))].into_iter().filter(|(_, f)| !f.is_empty()).map(|(n, f)| format!("{n} ran with --perturb {f}")).collect();
        if !faults.is_empty() {
            notes.push(format!("{}, and no recorded output differs: the flipped bit was rounded away before anything the traces hold", faults.join("; ")));
        }
    }
    notes
}

/// The per-request answers: each paired row (or rows 0.. of both when the batches hold the same
/// requests), with its embedding difference (encoders) or first token flip and final-logits
/// difference per step (decoders), and its first root.
/// `live[i]`: whether `roots[i]`'s difference reached its layer's output; a row's first root is
/// picked as the report's is (its first live root, else its first).
pub(super) fn row_answers(sa: &Side, sb: &Side, pairs: &[(u32, u32)], inputs_a: &[String], (roots, live): (&[OpDivergence], &[bool])) -> Vec<RowAnswer> {
    let tokens_held = ids_held(sa) && ids_held(sb);
    let pairs: Vec<(u32, u32)> = if pairs.is_empty() {
        let n = inputs_a.len().min(row_inputs(&sb.trace.header).len()) as u32;
        (0..n).map(|r| (r, r)).collect()
    } else {
        pairs.to_vec()
    };
    // The final logits: `logits` (a cast to f32) when the model has it, else `lm_head`.
    let logits_site = ["logits", "lm_head"].into_iter().find(|p| sa.site_by_path.contains_key(p) && sb.site_by_path.contains_key(p));
    let logit_recs: Vec<&OpRecord> = match logits_site {
        Some(path) => sa.recs.iter().copied().filter(|r| r.site == sa.site_by_path[path]).collect(),
        None => Vec::new(),
    };
    pairs
        .iter()
        .map(|&(ra, rb)| {
            let input: String = inputs_a.get(ra as usize).map(|t| t.chars().take(80).collect()).unwrap_or_default();
            let embedding = match (sa.embeddings.and_then(|v| v.get(ra as usize)), sb.embeddings.and_then(|v| v.get(rb as usize))) {
                (Some(x), Some(y)) if x.len() == y.len() => Some(EmbeddingDiff {
                    identical: x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
                    // NaN when a component is NaN on one side (f64::max would skip it).
                    max_abs_diff: x.iter().zip(y).map(|(p, q)| (*p as f64 - *q as f64).abs()).fold(0.0, |m, d| if d.is_nan() || m.is_nan() { f64::NAN } else { m.max(d) }),
                    cosine: cosine(x, y),
                    dims: x.len(),
                }),
                _ => None,
            };
            let (mut compared, mut first_flip) = (0u32, None);
            for (k, (ea, eb)) in sa.tokens.iter().zip(&sb.tokens).enumerate().filter(|_| tokens_held) {
                let (Some(ca), Some(cb)) = (ea.rows.iter().find(|c| c.row == ra), eb.rows.iter().find(|c| c.row == rb)) else {
                    break;
                };
                compared += 1;
                if ca.token != cb.token {
                    first_flip = Some(k as u32);
                    break;
                }
            }
            let mut logits_max_abs_diff = Vec::new();
            if let Some(path) = logits_site {
                let site_b = sb.site_by_path[path];
                for r in &logit_recs {
                    for t in r.tokens.iter().filter(|t| t.row == ra) {
                        // b's record at a's position, then row rb's own slice of it (a copy of
                        // the request is compared as the first copy's row).
                        let own = sb.token(site_b, ra, t.pos).and_then(|(rec, tb)| Some((rec, rec.tokens.iter().find(|x| x.row == rb && x.pos == tb.pos)?)));
                        if let Some((rb_rec, tb)) = own {
                            let d = if t.digest == tb.digest { 0.0 } else { diff_bound(t, tb, slice_len(r, ra, t.pos).or(slice_len(rb_rec, rb, t.pos))).0 };
                            logits_max_abs_diff.push(d);
                        }
                    }
                    if first_flip.is_some_and(|f| logits_max_abs_diff.len() > f as usize) {
                        break;
                    }
                }
            }
            let of_row = || roots.iter().zip(live).filter(|(d, _)| d.row == ra);
            let first_root = of_row().find(|(_, l)| **l).or_else(|| of_row().next()).map(|(d, _)| format!("{} @ {}", &*d.path, d.position).into());
            RowAnswer { a_row: ra, b_row: rb, input: input.into(), embedding, tokens_compared: compared, first_flip, logits_max_abs_diff, first_root }
        })
        .collect()
}

pub(super) fn first_token_flip(sa: &Side, sb: &Side) -> Option<TokenDivergence> {
    for (k, (ea, eb)) in sa.tokens.iter().zip(&sb.tokens).enumerate() {
        for ca in &ea.rows {
            // Run b's choice for the same request (row mapping), if b has that row.
            let Some(cb) = eb.rows.iter().find(|c| sb.compared_row(c.row) == Some(ca.row)) else { continue };
            if ca.token != cb.token {
                let common_text = sa.tokens[..k].iter().filter_map(|t| t.rows.iter().find(|c| c.row == ca.row)).map(|c| c.text.as_str()).collect::<String>().into();
                return Some(TokenDivergence {
                    step: ea.index,
                    row: ca.row,
                    pos: ea.pos,
                    b_pos: eb.pos,
                    a_token: Some(ca.token),
                    b_token: Some(cb.token),
                    a_text: ca.text.as_str().into(),
                    b_text: cb.text.as_str().into(),
                    a_margin: ca.margin,
                    b_margin: cb.margin,
                    a_tie: ca.tie,
                    b_tie: cb.tie,
                    common_text,
                    ids_redacted: false,
                });
            }
        }
    }
    None
}

/// `rows` with the flip found without token ids (through the input digests, [`token_flip`])
/// in its request's answer too.
pub(super) fn with_redacted_flip(mut rows: Vec<RowAnswer>, flip: Option<&TokenDivergence>) -> Vec<RowAnswer> {
    if let Some(t) = flip.filter(|t| t.ids_redacted) {
        for x in rows.iter_mut().filter(|x| x.a_row == t.row) {
            (x.first_flip, x.tokens_compared) = (Some(t.step), t.step + 1);
        }
    }
    rows
}

/// Puts the first flipped token of `orig` (the bisect of two traces) into `report` (the bisect
/// of their redacted copies) when the copies could not show it or showed a later one: a
/// redacted trace compares its tokens through the input ids that fed them back, so a flip at a
/// run's last token, never fed back, is invisible there. The flip goes in without its token ids
/// and texts (where it is and the two margins are no secret), with what follows from it: the
/// verdict diverged, the request's row flipped there, and no note left saying the tokens agree.
/// Returns whether `report` changed.
pub fn take_flip(report: &mut Report, orig: &Report) -> bool {
    let Some(t) = orig.first_token_divergence.as_ref() else { return false };
    if report.first_token_divergence.as_ref().is_some_and(|r| r.step <= t.step) {
        return false;
    }
    let none = Untrusted::default();
    let t = TokenDivergence { a_token: None, b_token: None, a_text: none.clone(), b_text: none.clone(), common_text: none, ids_redacted: true, ..t.clone() };
    report.rows = with_redacted_flip(std::mem::take(&mut report.rows), Some(&t));
    report.first_token_divergence = Some(t);
    report.verdict = Verdict::Diverged;
    report.notes.retain(|n| !n.contains(" compared agree") && !n.contains("identical over the part both traces hold"));
    true
}

/// Whether every decode-step choice of `s` holds its token id (redaction clears the ids and the
/// top-5 a recorded choice always has).
pub(super) fn ids_held(s: &Side) -> bool {
    s.tokens.iter().all(|e| e.rows.iter().all(|c| !c.top.is_empty()))
}

/// The first generated token that differs when a trace holds no token ids: the token at the
/// first generated position whose `input_ids` digests differ (`input`, from the first pass),
/// found when a later step fed it back.
fn flip_from_input_digests(sa: &Side, sb: &Side, input: Option<crate::align::Found>) -> Option<TokenDivergence> {
    let f = input.filter(|f| f.pos >= sa.prompt_len().min(sb.prompt_len()))?;
    let (k, ea) = sa.tokens.iter().enumerate().find(|(_, e)| e.pos == f.pos)?;
    let eb = sb.tokens.get(k)?;
    let ca = ea.rows.iter().find(|c| c.row == f.row)?;
    let cb = eb.rows.iter().find(|c| sb.compared_row(c.row) == Some(ca.row))?;
    let (held_a, held_b) = (ids_held(sa), ids_held(sb));
    Some(TokenDivergence {
        step: ea.index,
        row: f.row,
        pos: ea.pos,
        b_pos: eb.pos,
        a_token: held_a.then_some(ca.token),
        b_token: held_b.then_some(cb.token),
        a_text: if held_a { ca.text.clone().into() } else { Untrusted::default() },
        b_text: if held_b { cb.text.clone().into() } else { Untrusted::default() },
        a_margin: ca.margin,
        b_margin: cb.margin,
        a_tie: ca.tie,
        b_tie: cb.tie,
        common_text: Untrusted::default(),
        ids_redacted: true,
    })
}

/// The first generated token that differs, how the tokens were compared, and the sampler's
/// verdict on the flip. Without token ids on a side (a redacted trace) they are compared
/// through the digests of the input ids that fed them back (`input`: where those first differ).
pub(super) fn token_flip(
    (a, b): (&Trace, &Trace),
    (sa, sb): (&Side, &Side),
    input: Option<crate::align::Found>,
    notes: &mut Vec<String>,
) -> (Option<TokenDivergence>, TokenComparison, Option<SamplingVerdict>) {
    let common = sa.tokens.len().min(sb.tokens.len()) as u32;
    let (first_token_divergence, how): (_, TokenComparison) = if ids_held(sa) && ids_held(sb) {
        (first_token_flip(sa, sb), TokenComparison::Ids { compared: common })
    } else {
        let flip = flip_from_input_digests(sa, sb, input);
        notes.push("a redacted trace holds no token ids: generated tokens were compared through the digests of the input ids that fed them back (the last token of a run never is)".into());
        (flip, TokenComparison::InputDigests { compared: common.saturating_sub(1) })
    };
    let sampling_verdict = first_token_divergence.as_ref().filter(|t| !t.ids_redacted).and_then(|t| sampling_of(a, b, sb, t));
    // Each run's own count (a continuation's side was trimmed of the tokens the other run took
    // as prompt), and what was compared (a redacted trace's last token never is).
    let made = |t: &Trace| t.items.iter().filter(|i| matches!(i, Item::Token(_))).count();
    let compared = how.compared();
    if sa.tokens.len() != sb.tokens.len() && first_token_divergence.is_none() && compared > 0 {
        notes.push(format!("the runs generated {} and {} tokens; the {compared} compared agree", made(a), made(b)));
    }
    (first_token_divergence, how, sampling_verdict)
}

#[cfg(test)]
mod tests {
    use candle_trace_format::format::Trace;
    use candle_trace_format::record::{Choice, Forward, Header, Item, OpRecord, Phase, TokenAxis, TokenEvent, TokenStat};

    /// A run of one op over a 3-token prompt and 2 decode steps, its prefill in passes of
    /// `chunk` tokens: the same per-token digests whatever the chunking.
    fn run(chunk: u32, tokens: u32) -> Trace {
        let mut header = Header::default();
        header.run.prompt_tokens = vec![5, 6, 7];
        let mut items = vec![Item::Site { id: 0, path: "layers.0.mlp".into(), op: "add".into() }];
        // One forward pass of `len` tokens from `from`; its op record is record `step`.
        fn pass(items: &mut Vec<Item>, step: &mut u32, from: u32, len: u32, phase: Phase) {
            items.push(Item::Forward(Forward { step: *step, phase, index_pos: from, seq_len: len, batch: 1, ids: (from..from + len).collect() }));
            let toks = (from..from + len).map(|pos| TokenStat { row: 0, pos, digest: 1000 + pos as u64, sum: pos as f64, abs_max: 1.0, nonfinite: 0, samples: [0.0; 4] }).collect();
            let axis = Some(TokenAxis { seq_dim: Some(1), first_pos: from, keep_from: 0, causal: false });
            items.push(Item::Op(OpRecord { seq: *step as u64, step: *step, site: 0, dtype: "f32".into(), shape: vec![1, len, 4], tokens: toks, axis, samples: vec![0.0; 4], ..OpRecord::default() }));
            *step += 1;
        }
        let mut step = 0u32;
        let mut from = 0;
        while from < 3 {
            let len = chunk.min(3 - from);
            pass(&mut items, &mut step, from, len, Phase::Prefill);
            from += len;
        }
        for i in 0..tokens {
            let c = Choice { row: 0, token: 9, text: String::new(), top: vec![(9, 1.0)], margin: 1.0, tie: false };
            items.push(Item::Token(TokenEvent { step: step - 1, index: i, pos: 3 + i, rows: vec![c] }));
            if i + 1 < tokens {
                pass(&mut items, &mut step, 3 + i, 1, Phase::Decode);
            }
        }
        Trace { path: format!("chunk{chunk}.trace").into(), header, items, footer: None, truncated: false, sampling: Vec::new(), build: None, level: Default::default(), extras: Default::default() }
    }

    /// A CPU string from before the caches were named compares by the CPU's name with one that
    /// names them; two that both name caches, or other CPUs, still differ.
    #[test]
    fn cpu_caches_unknown_on_one_side_are_no_difference() {
        let h = |cpu: &str| {
            let mut h = Header::default();
            h.env.cpu = cpu.into();
            h
        };
        let cpu_keys = |a: &str, b: &str| crate::bisect::env_diff(&h(a), &h(b)).iter().filter(|d| d.key.contains("cpu")).count();
        assert_eq!(cpu_keys("AMD EPYC", "AMD EPYC (L1d 32K 8-way, L2 1024K 8-way, L3 32768K 16-way)"), 0);
        assert_eq!(cpu_keys("AMD EPYC (L1d 48K 12-way)", "AMD EPYC"), 0);
        assert_eq!(cpu_keys("AMD EPYC (L1d 32K 8-way)", "AMD EPYC (L1d 48K 12-way)"), 1);
        assert_eq!(cpu_keys("Intel Xeon", "AMD EPYC (L1d 32K 8-way)"), 1);
    }

    /// Runs that schedule their prefill differently hold different record counts with every
    /// output compared: identical, with no note that part of a run went uncompared (a
    /// fresh-user trial found that note under chunked-against-whole verdicts); a run that made
    /// fewer tokens is incomplete and says so.
    #[test]
    fn identical_runs_of_other_schedules_are_not_called_partial() {
        let (whole, chunked) = (run(3, 2), run(1, 2));
        let r = crate::bisect::bisect(&whole, &chunked).unwrap();
        assert_eq!(r.verdict, crate::bisect::Verdict::Identical, "{:?}", r.notes);
        assert!(!r.notes.iter().any(|n| n.contains("not compared past")), "{:?}", r.notes);
        let r = crate::bisect::bisect(&whole, &run(1, 1)).unwrap();
        assert_eq!(r.verdict, crate::bisect::Verdict::Incomplete, "{:?}", r.notes);
        assert!(r.notes.iter().any(|n| n.contains("not compared past")), "{:?}", r.notes);
    }
}
