//! `trace bisect A B --tolerance auto|REL`: two traces compared by value under the
//! [`crate::tolerance`] model, for runs that are not meant to agree bit for bit (another dtype,
//! another implementation, a port). Run a is the reference.
//!
//! The chain is built from the ops both traces recorded with their output values (`--dump`):
//! matched by module path and occurrence within the forward pass over the same positions (the
//! k-th record of a path in a's pass over positions `p .. p + n` against the k-th in b's, so a
//! prompt prefilled in other chunks still pairs its decode steps), in a's execution order; each op's inputs are the records it read (a's `inputs`), among the
//! matched ones. Ops with values on one side only, or at a path the other lacks, are counted as
//! unmatched.

use crate::head_order::{holds_head_dims, interleaved_head_dim, to_checkpoint_order};
use crate::passes::PassKey;
use crate::tolerance::{condition, judge, relative_error, Carry, Judged, OpError, Tolerance, GAIN, Q8_STEP};
use crate::untrusted::Untrusted;
use candle_trace_format::error::Result;
use candle_trace_format::format::Trace;
use candle_trace_format::record::{Dump, Item, OpRecord};
use serde::Serialize;
use std::collections::HashMap;
use std::fmt::Write;

/// One op of the chain in the report.
#[derive(Clone, Debug, Serialize)]
pub struct ChainOp {
    /// Module path.
    pub path: Untrusted,
    /// Forward pass (step) of a's record.
    pub step: u32,
    /// How it was judged.
    pub judged: Judged,
    /// Where the two outputs differ most, and both values there.
    pub worst: Worst,
}

/// The element where two outputs of one op differ most.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Worst {
    /// Batch row and absolute token position, when a's record has a token axis and both
    /// outputs have one shape.
    pub at: Option<(u32, u32)>,
    /// Index of the element within the position (or within the output, without one).
    pub element: u64,
    /// a's value there.
    pub a: f64,
    /// b's value there.
    pub b: f64,
}

/// Pooled sentence embeddings of both runs (encoders), compared vector by vector.
#[derive(Clone, Debug, Serialize)]
pub struct EmbeddingDelta {
    /// Vectors compared (the fewer of the two runs').
    pub vectors: usize,
    /// Largest |a - b| over every component of every vector.
    pub max_abs_diff: f64,
    /// Smallest cosine similarity between a's and b's vector of one text.
    pub min_cosine: f64,
}

/// Op records of one side that were not compared, grouped by module path and reason.
#[derive(Clone, Debug, Serialize)]
pub struct Unmatched {
    /// `a` or `b`.
    pub side: char,
    /// Module path.
    pub path: Untrusted,
    /// Records at this path left out for this reason.
    pub records: usize,
    /// Why: no record at this path on the other side, values not dumped, shapes that share no
    /// position.
    pub why: String,
}

/// What `bisect --tolerance` found.
#[derive(Clone, Debug, Serialize)]
pub struct AcrossReport {
    /// Ops compared by value, in a's execution order.
    pub compared: usize,
    /// Op records of a with no counterpart in b to compare with (no record at the path, or
    /// shapes that share no position), and of b likewise.
    pub unmatched: (usize, usize),
    /// The same, by module path and reason, a's first.
    pub unmatched_paths: Vec<Unmatched>,
    /// Op records paired by path whose values a, and b, did not dump (`--dump` selected other
    /// ops): not compared, and not counted as unmatched.
    pub not_dumped: (usize, usize),
    /// The first forward pass the two runs were fed different token ids (their generated tokens
    /// differ by then): it and later passes are not compared. `None`: every pass was.
    pub fed_differ_at: Option<u32>,
    /// Each run's generated text (row 0), a's then b's.
    pub texts: (Untrusted, Untrusted),
    /// The first generated token (index) that differs, if any.
    pub first_token_differs: Option<u32>,
    /// The root: the first op whose error its inputs' error and rounding do not explain.
    pub root: Option<ChainOp>,
    /// Per layer (a's order): the largest output error among its ops.
    pub layers: Vec<(Untrusted, f64)>,
    /// The ops that amplify most (largest amplification first, at most 5; only those above 1,
    /// whose error exceeds both their inputs' error and their own rounding).
    pub amplifying: Vec<ChainOp>,
    /// Encoder runs: the pooled embeddings compared.
    pub embeddings: Option<EmbeddingDelta>,
    /// The side (`a` or `b`) that computes queries and keys in llama.cpp's interleaved GGUF
    /// order while the other keeps the checkpoint's, and the ops (module-path leaves, e.g.
    /// `q_proj, rope_q`) whose values were put in the checkpoint's order before comparing
    /// ([`crate::head_order`]).
    pub reordered: Option<(char, String)>,
}

/// Op records with their module path and op name, in file order.
type Records<'t> = Vec<(&'t str, &'t str, &'t OpRecord)>;

/// What the comparison reads of one trace: its op records, dumped outputs, the ids each forward
/// pass was fed, and the generated tokens of row 0 (id, text).
struct Side<'t> {
    recs: Records<'t>,
    dumps: HashMap<u64, &'t Dump>,
    passes: crate::passes::Passes<'t>,
    tokens: Vec<(u32, &'t str)>,
    embeddings: Option<&'t [Vec<f32>]>,
    /// Whether its op records say which records they read (a reference imported from another
    /// implementation records outputs only).
    graph: bool,
    /// The largest row L2 norm of each linear op's weight, by module path (written with dumps).
    norms: HashMap<&'t str, f64>,
    /// Op records by id, with their module path.
    by_seq: HashMap<u64, (&'t str, &'t OpRecord)>,
    /// Its dumps decoded lately.
    decoded: Decoded,
}

fn side(t: &Trace) -> Side<'_> {
    let mut sites: Vec<(&str, &str)> = Vec::new();
    let mut s = Side {
        recs: Vec::new(),
        dumps: HashMap::new(),
        passes: crate::passes::Passes::default(),
        tokens: Vec::new(),
        embeddings: None,
        graph: false,
        norms: HashMap::new(),
        by_seq: HashMap::new(),
        decoded: Decoded::default(),
    };
    for i in &t.items {
        match i {
            Item::Site { path, op, .. } => sites.push((path, op)),
            Item::Op(r) => {
                let (p, o) = sites.get(r.site as usize).copied().unwrap_or(("?", "?"));
                s.graph |= !r.inputs.is_empty();
                s.by_seq.insert(r.seq, (p, r));
                s.recs.push((p, o, r));
            }
            Item::Dump(d) => {
                s.dumps.insert(d.seq, d);
            }
            Item::Forward(f) => s.passes.add(f),
            Item::Embeddings(v) => s.embeddings = Some(v),
            Item::WeightNorm(w) => {
                if let Some((p, _)) = sites.get(w.site as usize) {
                    s.norms.insert(p, w.max_row_l2);
                }
            }
            Item::Token(e) => s.tokens.extend(e.rows.iter().filter(|c| c.row == 0).map(|c| (c.token, c.text.as_str()))),
            _ => {}
        }
    }
    s
}

fn values(d: &Dump) -> Result<Vec<f64>> {
    Ok(candle_trace_format::dump::decode(d)?.f64)
}

/// Dumps decoded lately, so that an op's inputs, decoded as the outputs of the ops before it,
/// are not decoded again: the last [`Decoded::KEEP`], by dump.
#[derive(Default)]
struct Decoded(std::cell::RefCell<std::collections::VecDeque<(*const Dump, Values)>>);

/// One dump's values, shared.
type Values = std::rc::Rc<Vec<f64>>;

impl Decoded {
    /// Outputs kept: a layer's ops and the residual stream's last few.
    const KEEP: usize = 48;

    /// `d`'s values, decoded once while among the last [`Decoded::KEEP`].
    fn get(&self, d: &Dump) -> Result<Values> {
        let key = std::ptr::from_ref(d);
        if let Some((_, v)) = self.0.borrow().iter().find(|(k, _)| *k == key) {
            return Ok(v.clone());
        }
        let v = std::rc::Rc::new(values(d)?);
        let mut kept = self.0.borrow_mut();
        if kept.len() == Self::KEEP {
            kept.pop_front();
        }
        kept.push_back((key, v.clone()));
        Ok(v)
    }
}

/// a's and b's values of one op, or why they cannot be compared.
type Paired = std::result::Result<(Values, Values), String>;

/// a's and b's values of one op, over the positions both hold when their shapes differ.
fn paired((sa, ra, x): (&Side, &OpRecord, &Dump), (sb, rb, y): (&Side, &OpRecord, &Dump)) -> Result<Paired> {
    let (va, vb) = (sa.decoded.get(x)?, sb.decoded.get(y)?);
    if x.shape == y.shape {
        return Ok(Ok((va, vb)));
    }
    if let Some((xa, xb)) = latest_keys((ra, &x.shape, &va), (rb, &y.shape, &vb)) {
        return Ok(Ok((std::rc::Rc::new(xa), std::rc::Rc::new(xb))));
    }
    Ok(match crate::overlap::common(ra, &va, rb, &vb) {
        Some((xa, xb, _)) => Ok((std::rc::Rc::new(xa), std::rc::Rc::new(xb))),
        None => Err(format!("shapes {:?} and {:?} share no token position of one size", x.shape, y.shape)),
    })
}

/// The error of the positions a cache append held before its pass appended `n` (its output
/// `[b, kv_heads, kv, head_dim]`, a's values `a`, b's `b`), relative to a's largest magnitude
/// over the whole output as [`relative_error`]; infinite for another rank or size.
fn held_error(a: &[f64], b: &[f64], shape: &[u32], n: u32) -> f64 {
    let [rows, h, kv, d] = shape.iter().map(|&x| x as usize).collect::<Vec<_>>()[..] else { return f64::INFINITY };
    let n = (n as usize).min(kv);
    if a.len() != rows * h * kv * d || b.len() != a.len() || kv * d == 0 {
        return f64::INFINITY;
    }
    let old = a.chunks(kv * d).zip(b.chunks(kv * d)).flat_map(|(x, y)| x[..(kv - n) * d].iter().zip(&y[..(kv - n) * d]));
    let diff = old.filter(|(x, y)| x.is_finite() && y.is_finite()).fold(0.0f64, |m, (x, y)| m.max((x - y).abs()));
    let scale = crate::tolerance::max_abs(a);
    if scale == 0.0 {
        diff
    } else {
        diff / scale
    }
}

/// a's record of b's record `seq`, appended to `out`; when a has none (a reference records
/// fewer ops: a mask a decode step needs on one side only), those of the ops it read, up to
/// `depth` ops up, so an op's error is still carried from the nearest ops both compared.
fn paired_input(seq: u64, sb: &Side, a_of_b: &HashMap<u64, u64>, depth: u8, out: &mut Vec<u64>) {
    match (a_of_b.get(&seq), sb.by_seq.get(&seq)) {
        (Some(&a), _) if !out.contains(&a) => out.push(a),
        (None, Some((_, r))) if depth > 0 => r.inputs.iter().for_each(|i| paired_input(i.seq, sb, a_of_b, depth - 1, out)),
        _ => {}
    }
}

/// `s`'s records that `kept` keeps, by (module path, pass key, occurrence within the pass).
fn by_pass<'t>(s: &Side<'t>, kept: impl Fn(&OpRecord) -> bool) -> HashMap<(&'t str, PassKey, usize), (&'t str, &'t OpRecord)> {
    let mut nth: HashMap<(&str, PassKey), usize> = HashMap::new();
    let mut out = HashMap::new();
    for &(p, kind, r) in s.recs.iter().filter(|x| kept(x.2)) {
        let key = s.passes.key(r.step);
        let k = nth.entry((p, key)).or_insert(0);
        out.insert((p, key, *k), (kind, r));
        *k += 1;
    }
    out
}

/// Counts b's records no record of a took (`rest`), in b's order, with the reason.
fn leave_out_rest(list: &mut Vec<Unmatched>, rest: HashMap<(&str, PassKey, usize), (&str, &OpRecord)>, a_paths: &std::collections::HashSet<&str>) {
    let mut rest: Vec<(&str, u64)> = rest.iter().map(|((p, _, _), (_, r))| (*p, r.seq)).collect();
    rest.sort_by_key(|x| x.1);
    for (p, _) in rest {
        leave_out(list, 'b', p, if a_paths.contains(p) { ELSEWHERE_IN_A } else { "no record at this path in a" });
    }
}

/// Queries and keys of a llama GGUF file against the checkpoint's order (`order`: each side's
/// interleaved head dim): compared in the checkpoint's ([`crate::head_order`]); notes `p` in
/// `reordered` when it permuted one.
fn checkpoint_order(p: &str, order: (Option<usize>, Option<usize>), (va, vb): (&mut Values, &mut Values), reordered: &mut std::collections::BTreeSet<String>) {
    if order.0.is_some() == order.1.is_some() || !holds_head_dims(p) {
        return;
    }
    for (v, d) in [(va, order.0), (vb, order.1)] {
        if let Some(permuted) = d.and_then(|d| to_checkpoint_order(v, d)) {
            *v = std::rc::Rc::new(permuted);
            reordered.insert(p.to_string());
        }
    }
}

/// Why a record of a path both runs hold was left out: the other run holds none in the pass over
/// the same positions (a prompt prefilled in other chunks; a reference that recorded some passes).
const ELSEWHERE_IN_B: &str = "b holds this path, but no record of it in a pass over the same positions";
const ELSEWHERE_IN_A: &str = "a holds this path, but no record of it in a pass over the same positions";

/// Attention scores or probabilities (`[b, heads, q, kv]`, causal) of a run that held fewer keys
/// than the other (a rolling window cache keeps the latest): both over the keys the shorter one
/// held, the last of each query's row. `None` when the shapes differ otherwise.
fn latest_keys((ra, sa, va): (&OpRecord, &[u32], &[f64]), (rb, sb, vb): (&OpRecord, &[u32], &[f64])) -> Option<(Vec<f64>, Vec<f64>)> {
    let causal = |r: &OpRecord| r.axis.as_ref().is_some_and(|a| a.causal);
    let (n, (ka, kb)) = (sa.len(), (*sa.last()? as usize, *sb.last()? as usize));
    if !(causal(ra) || causal(rb)) || n < 2 || sb.len() != n || sa[..n - 1] != sb[..n - 1] || ka == 0 || kb == 0 || va.len() % ka != 0 || vb.len() % kb != 0 {
        return None;
    }
    let k = ka.min(kb);
    let tail = |v: &[f64], kv: usize| -> Vec<f64> { v.chunks(kv).flat_map(|row| &row[kv - k..]).copied().collect() };
    Some((tail(va, ka), tail(vb, kb)))
}

/// Counts one left-out record under (side, path, why).
fn leave_out(list: &mut Vec<Unmatched>, side: char, path: &str, why: &str) {
    match list.iter_mut().find(|u| u.side == side && u.path.as_str() == path && u.why == why) {
        Some(u) => u.records += 1,
        None => list.push(Unmatched { side, path: path.into(), records: 1, why: why.into() }),
    }
}

/// Compares `a` (the reference) and `b` under `tol` (see the module docs).
///
/// # Errors
/// A dump whose bytes do not match its dtype and shape.
pub fn compare(a: &Trace, b: &Trace, tol: Tolerance) -> Result<AcrossReport> {
    let (sa, sb) = (side(a), side(b));
    let order = (interleaved_head_dim(&a.header), interleaved_head_dim(&b.header));
    let mut reordered: std::collections::BTreeSet<String> = std::collections::BTreeSet::new();
    // Passes that end after the first position fed other ids are left out on both sides.
    let fed = crate::passes::fed_differ_at(&sa.passes, &sb.passes);
    let kept = |s: &Side, r: &OpRecord| fed.is_none_or(|(_, p)| s.passes.end(r.step) <= p);
    let mut b_by = by_pass(&sb, |r| kept(&sb, r));
    let mut nth: HashMap<(&str, PassKey), usize> = HashMap::new();
    let b_paths: std::collections::HashSet<&str> = b_by.keys().map(|k| k.0).collect();
    let mut a_paths: std::collections::HashSet<&str> = std::collections::HashSet::new();
    let mut appends_only: std::collections::HashSet<&str> = std::collections::HashSet::new();
    let (mut chain, mut meta, mut index_of) = (Vec::new(), Vec::new(), HashMap::new());
    let (mut left_out, mut not_dumped) = (Vec::new(), (0, 0));
    // b's record id -> a's record id of the same op: the graph comes from b when a has none (a
    // reference imported from another implementation records outputs only).
    let mut a_of_b: HashMap<u64, u64> = HashMap::new();
    let mut b_of_a: HashMap<u64, u64> = HashMap::new();
    let mut last_at: HashMap<&str, usize> = HashMap::new();
    for (p, kind, r) in sa.recs.iter().filter(|x| kept(&sa, x.2)) {
        let key = sa.passes.key(r.step);
        let k = nth.entry((p, key)).or_insert(0);
        let other = b_by.remove(&(*p, key, *k));
        *k += 1;
        a_paths.insert(p);
        let Some((kind_b, rb)) = other else {
            leave_out(&mut left_out, 'a', p, if b_paths.contains(p) { ELSEWHERE_IN_B } else { "no record at this path in b" });
            continue;
        };
        let (Some(x), Some(y)) = (sa.dumps.get(&r.seq), sb.dumps.get(&rb.seq)) else {
            // A pair whose values one side did not keep: the user's choice of --dump, counted.
            not_dumped.0 += usize::from(!sa.dumps.contains_key(&r.seq));
            not_dumped.1 += usize::from(!sb.dumps.contains_key(&rb.seq));
            continue;
        };
        let (mut va, mut vb) = match paired((&sa, r, x), (&sb, rb, y))? {
            Ok(v) => v,
            Err(why) => {
                leave_out(&mut left_out, 'a', p, &why);
                leave_out(&mut left_out, 'b', p, &why);
                continue;
            }
        };
        checkpoint_order(p, order, (&mut va, &mut vb), &mut reordered);
        // A cache append whose first compared record comes after position 0 (a prefill outside
        // the dump's bound, or split in other chunks): its cached positions hold the error of
        // passes not compared here, measured and allowed as an input's (they are copies, no
        // root), for this append and every later one of the path.
        let cache = *kind == "cat" && p.ends_with("_cache") && x.shape == y.shape;
        if cache && !last_at.contains_key(p) && key.0 > 0 && key.0 != u32::MAX {
            appends_only.insert(*p);
        }
        let held = if cache && appends_only.contains(p) { held_error(&va, &vb, &x.shape, key.1) } else { 0.0 };
        a_of_b.insert(rb.seq, r.seq);
        b_of_a.insert(r.seq, rb.seq);
        let pair = Pair { path: p, kind, kind_b, r, rb, x, y };
        let links = Links { index_of: &index_of, a_of_b: &a_of_b, b_of_a: &b_of_a, last_at: &last_at };
        let (inputs, carry, own) = op_inputs(&pair, &links, (&sa, &sb), order.0.is_some() != order.1.is_some(), &va)?;
        let own = own + held;
        // The coarser dtype of the two sets the rounding.
        let eps = crate::tolerance::epsilon;
        let dtype = if eps(&y.dtype) > eps(&x.dtype) { y.dtype.clone() } else { x.dtype.clone() };
        last_at.insert(*p, chain.len());
        index_of.insert(r.seq, chain.len());
        chain.push(OpError { path: p.to_string(), dtype, error: relative_error(&vb, &va), inputs, carry, own });
        meta.push((*p, r.step, worst(r, x.shape == y.shape, &va, &vb)));
    }
    leave_out_rest(&mut left_out, b_by, &a_paths);
    let mut r = report(chain, meta, left_out, fed.map(|f| f.0), (&sa, &sb), tol);
    r.not_dumped = not_dumped;
    if !reordered.is_empty() {
        let side = if order.0.is_some() { 'a' } else { 'b' };
        let leaves: std::collections::BTreeSet<&str> = reordered.iter().map(|p| p.rsplit('.').next().unwrap_or(p)).collect();
        r.reordered = Some((side, leaves.into_iter().collect::<Vec<_>>().join(", ")));
    }
    Ok(r)
}

/// One op both traces recorded with values: its module path, a's and b's op names, records and
/// dumped outputs.
struct Pair<'t> {
    path: &'t str,
    kind: &'t str,
    kind_b: &'t str,
    r: &'t OpRecord,
    rb: &'t OpRecord,
    x: &'t Dump,
    y: &'t Dump,
}

/// What the chain built so far links: record ids to chain indices, a's and b's records of one
/// op to each other, and the last chain index of each module path.
struct Links<'m, 't> {
    index_of: &'m HashMap<u64, usize>,
    a_of_b: &'m HashMap<u64, u64>,
    b_of_a: &'m HashMap<u64, u64>,
    last_at: &'m HashMap<&'t str, usize>,
}

/// How op `o` is judged: the chain indices of what it read, how their errors reach its output
/// ([`Carry`]) and what it adds itself ([`OpError::own`]). A linear op is bounded outright when
/// a weight norm is known ([`linear_bound`]); sums, products, activations, softmax and RMS norms
/// carry what their function does to both sides' inputs ([`exact`]); else gains and conditions
/// ([`carry`]), or, when neither trace records its graph, the largest error before it.
/// `reorders`: one side computes queries and keys in llama.cpp's order; `va`: a's output.
fn op_inputs(o: &Pair, l: &Links, (sa, sb): (&Side, &Side), reorders: bool, va: &[f64]) -> Result<(Vec<usize>, Carry, f64)> {
    let (p, kind, kind_b, r, rb, x, y) = (o.path, o.kind, o.kind_b, o.r, o.rb, o.x, o.y);
    let graph: Vec<u64> = if r.inputs.is_empty() {
        let mut g = Vec::new();
        rb.inputs.iter().for_each(|i| paired_input(i.seq, sb, l.a_of_b, 4, &mut g));
        g
    } else {
        r.inputs.iter().map(|i| i.seq).collect()
    };
    let mut inputs: Vec<usize> = graph.iter().filter_map(|s| l.index_of.get(s).copied()).collect();
    let quantizes = (kind == "qmatmul", kind_b == "qmatmul");
    let linear = match (kind, graph.first()) {
        ("linear" | "qmatmul", Some(&input)) if x.shape == y.shape => linear_bound(p, (input, l.b_of_a.get(&input).copied()), (sa, sb), quantizes, (&x.dtype, &y.dtype), va)?,
        _ => None,
    };
    let exact = match kind {
        "add" | "mul" | "silu" | "gelu" | "softmax" | "rms_norm" if x.shape == y.shape && linear.is_none() => exact(kind, &graph, (sa, sb), l.b_of_a, (reorders, &x.shape), va)?,
        _ => None,
    };
    let carry = match (linear, exact) {
        (Some((c, _)), _) | (None, Some(c)) => Carry::Outright(c),
        (None, None) if !sa.graph && !sb.graph => Carry::Before(GAIN),
        (None, None) => carry(kind, &graph, l.index_of, sa, (&x.shape, va))?,
    };
    // A cache append (`k_cache`, `v_cache`) holds what the previous one held: it reads it.
    if kind == "cat" && p.ends_with("_cache") {
        if let Some(&j) = l.last_at.get(p) {
            inputs.push(j);
        }
    }
    // Gains are per input: inputs not in the chain, or one added, fall back to the default.
    let carry = match carry {
        Carry::Each(g) if g.len() != inputs.len() => Carry::Largest(GAIN),
        c => c,
    };
    // Activations quantized to 8-bit blocks before a quantized matmul, on one side or both.
    let own = match (linear, quantizes) {
        (Some((_, own)), _) => own,
        (None, (true, true)) => GAIN * Q8_STEP,
        (None, (true, false) | (false, true)) => GAIN * Q8_STEP / 2.0,
        (None, (false, false)) => 0.0,
    };
    Ok((inputs, carry, own))
}

/// How the errors of the records `graph` (a's record ids) reach the output `y` (a's values) of
/// an op of kind `kind` ([`Carry`]): per input by the gains of sums, elementwise products and
/// products of two activations ([`crate::gains`]) when every input is in the chain with its
/// values, by the condition of a softmax, `exp` or RMS norm over its first input when that is
/// laid out as the output (`shape`), else [`GAIN`].
fn carry(kind: &str, graph: &[u64], index_of: &HashMap<u64, usize>, sa: &Side, (shape, y): (&[u32], &[f64])) -> Result<Carry> {
    let dumped: Vec<&Dump> = graph.iter().filter(|s| index_of.contains_key(s)).filter_map(|s| sa.dumps.get(s).copied()).collect();
    let all = dumped.len() == graph.len() && !graph.is_empty();
    Ok(match kind {
        "add" | "mul" | "matmul" if all => {
            let vals: Vec<Values> = dumped.iter().map(|d| sa.decoded.get(d)).collect::<Result<_>>()?;
            let refs: Vec<&[f64]> = vals.iter().map(|v| v.as_slice()).collect();
            let shape = |d: &Dump| d.shape.iter().map(|&x| x as usize).collect::<Vec<usize>>();
            let g = match (kind, refs.as_slice()) {
                ("add", _) => crate::gains::add(&refs, y),
                ("mul", _) => crate::gains::mul(&refs, y),
                (_, [a, b]) => crate::gains::matmul((a, &shape(dumped[0])), (b, &shape(dumped[1])), y),
                _ => None,
            };
            g.map_or(Carry::Largest(GAIN), Carry::Each)
        }
        "softmax" | "exp" | "rms_norm" => {
            // Their condition from their input's values (a's) and output, when dumped.
            // Element for element only when the input is laid out as the output (a norm over
            // heads reads a transposed view of its input's record).
            let input = graph.first().and_then(|s| sa.dumps.get(s)).filter(|d| same_layout(&d.shape, shape));
            let row = input.and_then(|d| d.shape.last()).map_or(0, |&n| n as usize);
            Carry::Largest(input.map(|d| sa.decoded.get(d)).transpose()?.and_then(|v| condition(kind, &v, row, y)).unwrap_or(GAIN))
        }
        _ => Carry::Largest(GAIN),
    })
}

/// Whether two shapes lay out their elements alike: equal once their dims of size 1 are dropped
/// (a decode step's `[1, 1, n]` stream and its norm's `[1, n]`).
fn same_layout(a: &[u32], b: &[u32]) -> bool {
    a.iter().filter(|&&d| d != 1).eq(b.iter().filter(|&&d| d != 1))
}

/// The last position of each batch row of `v` (`[b, s, n]`) when the op's output (`out`) holds
/// just that (`[b, n]` up to dims of size 1: a final norm's); `None` otherwise.
fn last_positions(v: &[f64], shape: &[u32], out: &[u32]) -> Option<Vec<f64>> {
    let &[b, s, n] = shape else { return None };
    let (b, s, n) = (b as usize, s as usize, n as usize);
    if s == 0 || v.len() != b * s * n || !same_layout(&[b as u32, n as u32], out) {
        return None;
    }
    Some((0..b).flat_map(|r| v[(r * s + s - 1) * n..(r * s + s) * n].iter().copied()).collect())
}

/// What the input difference carries to the output of an `add`, `mul`, `silu`, `gelu`,
/// `softmax` or `rms_norm` op of output shape `shape`, computed outright ([`crate::carried`])
/// from a's inputs `graph` and b's records of them (`b_of_a`); `None` when an input was not
/// dumped on both sides, their shapes differ, an input of the output's size is laid out
/// otherwise (a norm over heads reads a transposed view of its input's record), or an input
/// holds queries or keys in another element order on each side (`reorders`).
fn exact(kind: &str, graph: &[u64], (sa, sb): (&Side, &Side), b_of_a: &HashMap<u64, u64>, (reorders, shape): (bool, &[u32]), y: &[f64]) -> Result<Option<f64>> {
    let mut xs: Vec<(Values, Values, usize)> = Vec::with_capacity(graph.len());
    for s in graph {
        let Some(bs) = b_of_a.get(s) else { return Ok(None) };
        let (Some(da), Some(db)) = (sa.dumps.get(s), sb.dumps.get(bs)) else { return Ok(None) };
        let broadcast = matches!(kind, "add" | "mul") && da.shape.iter().product::<u32>() != shape.iter().product::<u32>();
        if da.shape != db.shape || (reorders && sa.by_seq.get(s).is_some_and(|x| holds_head_dims(x.0))) {
            return Ok(None);
        }
        let (va, vb) = (sa.decoded.get(da)?, sb.decoded.get(db)?);
        let row = da.shape.last().map_or(0, |&n| n as usize);
        if same_layout(&da.shape, shape) || broadcast {
            xs.push((va, vb, row));
            continue;
        }
        // A final norm over each row's last position reads the whole stream.
        match (kind, last_positions(&va, &da.shape, shape), last_positions(&vb, &db.shape, shape)) {
            ("rms_norm", Some(la), Some(lb)) => xs.push((std::rc::Rc::new(la), std::rc::Rc::new(lb), row)),
            _ => return Ok(None),
        }
    }
    Ok(match (kind, xs.as_slice()) {
        ("softmax", [(a, b, row)]) => crate::carried::softmax(a, b, *row, y),
        ("rms_norm", [(a, b, row)]) => crate::carried::rms_norm(a, b, *row, y),
        ("add" | "mul" | "silu" | "gelu", _) => {
            let (a, b): (Vec<&[f64]>, Vec<&[f64]>) = xs.iter().map(|(a, b, _)| (a.as_slice(), b.as_slice())).unzip();
            crate::carried::elementwise(kind, &a, &b, y)
        }
        _ => None,
    })
}

/// A linear op's bounds outright, carried and own ([`crate::gains::linear`]), at module path `p`, from its input
/// records (a's id, b's id) and the weight norm a holds for `p` (else b's); `None` when neither
/// holds one, an input was not dumped on both sides or the two differ in shape. `dtypes` are
/// the op's output dtypes on a and b (a weight held in half precision on one side only is
/// rounded there); `y` is a's output.
fn linear_bound(p: &str, (a_in, b_in): (u64, Option<u64>), (sa, sb): (&Side, &Side), quantizes: (bool, bool), dtypes: (&str, &str), y: &[f64]) -> Result<Option<(f64, f64)>> {
    // The reference's weight is the intended one (b's may be the fault: a corrupted block).
    let Some(&w2) = sa.norms.get(p).or_else(|| sb.norms.get(p)) else { return Ok(None) };
    let (Some(xa), Some(xb)) = (sa.dumps.get(&a_in), b_in.and_then(|s| sb.dumps.get(&s))) else { return Ok(None) };
    if xa.shape != xb.shape {
        return Ok(None);
    }
    let axis = sa.by_seq.get(&a_in).and_then(|r| r.1.axis.clone()).or_else(|| b_in.and_then(|s| sb.by_seq.get(&s)).and_then(|r| r.1.axis.clone()));
    let dims: Vec<usize> = xa.shape.iter().map(|&d| d as usize).collect();
    let Some(&rows) = dims.first() else { return Ok(None) };
    let per_row = dims[1..].iter().product::<usize>().max(1);
    let (n, inner) = match axis.and_then(|a| a.seq_dim).map(|d| d as usize).filter(|&d| d >= 1 && d < dims.len()) {
        Some(d) => (dims[d], dims[d + 1..].iter().product::<usize>().max(1)),
        None => (1, per_row),
    };
    let position = move |i: usize| (i / per_row) * n + (i / inner) % n.max(1);
    let (va, vb) = (sa.decoded.get(xa)?, sb.decoded.get(xb)?);
    let eps = crate::tolerance::epsilon;
    let u = if eps(dtypes.0) != eps(dtypes.1) { eps(dtypes.0).max(eps(dtypes.1)) / 2.0 } else { 0.0 };
    let x = crate::gains::LinearInput { a: &va, b: &vb, position: &position, positions: rows * n.max(1) };
    Ok(crate::gains::linear(w2, &x, quantizes, u, y))
}

/// Judges the chain and assembles the report.
fn report(chain: Vec<OpError>, meta: Vec<(&str, u32, Worst)>, left_out: Vec<Unmatched>, fed: Option<u32>, (sa, sb): (&Side, &Side), tol: Tolerance) -> AcrossReport {
    let (judged, root) = judge(&chain, tol);
    let op = |i: usize| ChainOp { path: meta[i].0.into(), step: meta[i].1, judged: judged[i].clone(), worst: meta[i].2.clone() };
    let mut layers: Vec<(Untrusted, f64)> = Vec::new();
    for (i, c) in chain.iter().enumerate() {
        let l = crate::bisect::layer_group(&c.path);
        match layers.iter_mut().find(|x| x.0.as_str() == l) {
            Some(x) => x.1 = x.1.max(judged[i].error),
            None => layers.push((l.into(), judged[i].error)),
        }
    }
    // Only ops that made the error larger than both their inputs' error and their rounding.
    let mut order: Vec<usize> = (0..chain.len()).filter(|&i| judged[i].amplification.is_finite() && judged[i].amplification > 1.0).collect();
    order.sort_by(|&x, &y| judged[y].amplification.total_cmp(&judged[x].amplification));
    let count = |s: char| left_out.iter().filter(|u| u.side == s).map(|u| u.records).sum();
    let text = |s: &Side| -> Untrusted { s.tokens.iter().map(|t| t.1).collect::<String>().into() };
    let first_token_differs = (0..sa.tokens.len().max(sb.tokens.len())).find(|&i| sa.tokens.get(i).map(|t| t.0) != sb.tokens.get(i).map(|t| t.0)).map(|i| i as u32);
    AcrossReport {
        compared: chain.len(),
        unmatched: (count('a'), count('b')),
        unmatched_paths: left_out,
        not_dumped: (0, 0),
        fed_differ_at: fed,
        texts: (text(sa), text(sb)),
        first_token_differs,
        root: root.map(op),
        layers,
        amplifying: order.into_iter().take(5).map(op).collect(),
        embeddings: embedding_delta(sa.embeddings, sb.embeddings),
        reordered: None,
    }
}

/// The element of largest |a - b| (the first of equals; non-finite on one side counts as
/// largest), located by `r`'s token axis when `located`.
fn worst(r: &OpRecord, located: bool, a: &[f64], b: &[f64]) -> Worst {
    let diff = |x: f64, y: f64| {
        if x.is_finite() && y.is_finite() {
            (x - y).abs()
        } else if x == y {
            0.0
        } else {
            f64::INFINITY
        }
    };
    let Some((i, _)) = a.iter().zip(b).map(|(x, y)| diff(*x, *y)).enumerate().fold(None, |m: Option<(usize, f64)>, (i, d)| if m.is_none_or(|m| d > m.1) { Some((i, d)) } else { m }) else {
        return Worst::default();
    };
    let dims: Vec<u64> = r.shape.iter().map(|&d| u64::from(d)).collect();
    let i64_ = i as u64;
    let at_pos = |axis: &candle_trace_format::record::TokenAxis| -> Option<((u32, u32), u64)> {
        let rows = *dims.first()?;
        let per_row = dims.iter().skip(1).product::<u64>().max(1);
        let row = u32::try_from(i64_ / per_row).ok().filter(|&x| u64::from(x) < rows)?;
        match axis.seq_dim {
            None => Some(((row, axis.first_pos), i64_ % per_row)),
            Some(d) => {
                let d = d as usize;
                let inner: u64 = dims.get(d + 1..)?.iter().product();
                let n = *dims.get(d)?;
                let pos = axis.first_pos.checked_add(u32::try_from((i64_ / inner.max(1)) % n.max(1)).ok()?)?;
                Some(((row, pos), i64_ % inner.max(1)))
            }
        }
    };
    let found = r.axis.as_ref().filter(|_| located).and_then(at_pos);
    Worst { at: found.map(|f| f.0), element: found.map_or(i64_, |f| f.1), a: a[i], b: b[i] }
}

/// Largest component difference and smallest cosine over the texts both runs embedded.
fn embedding_delta(a: Option<&[Vec<f32>]>, b: Option<&[Vec<f32>]>) -> Option<EmbeddingDelta> {
    let (a, b) = (a?, b?);
    let (mut max_abs_diff, mut min_cosine) = (0.0f64, 1.0f64);
    for (x, y) in a.iter().zip(b) {
        let dot: f64 = x.iter().zip(y).map(|(p, q)| f64::from(*p) * f64::from(*q)).sum();
        let norm = |v: &[f32]| v.iter().map(|p| f64::from(*p).powi(2)).sum::<f64>().sqrt();
        let cos = if x.len() == y.len() { dot / (norm(x) * norm(y)) } else { f64::NAN };
        min_cosine = if cos.is_nan() { f64::NAN } else { min_cosine.min(cos) };
        max_abs_diff = x.iter().zip(y).fold(max_abs_diff, |m, (p, q)| m.max((f64::from(*p) - f64::from(*q)).abs()));
    }
    Some(EmbeddingDelta { vectors: a.len().min(b.len()), max_abs_diff, min_cosine })
}

/// Plain-text rendering of an [`AcrossReport`].
pub fn text(r: &AcrossReport) -> String {
    let g = crate::text::g;
    let mut o = format!("compared by value under the tolerance model (docs/tolerance.md): {} ops; unmatched a {}, b {}\n", r.compared, r.unmatched.0, r.unmatched.1);
    if r.not_dumped != (0, 0) {
        let _ = writeln!(o, "not dumped (values not kept, so not compared): a {} records, b {}", r.not_dumped.0, r.not_dumped.1);
    }
    if !r.texts.0.as_str().is_empty() || !r.texts.1.as_str().is_empty() {
        let _ = writeln!(o, "text a: {}\ntext b: {}", r.texts.0.quoted(), r.texts.1.quoted());
        match r.first_token_differs {
            Some(i) => {
                let _ = writeln!(o, "generated token {i} differs");
            }
            None => o.push_str("generated tokens: identical\n"),
        }
    }
    if let Some(e) = &r.embeddings {
        let _ = writeln!(o, "embeddings: {} vectors, max |a - b| {}, smallest cosine {:.9}", e.vectors, g(e.max_abs_diff), e.min_cosine);
    }
    if let Some((side, ops)) = &r.reordered {
        let _ = writeln!(o, "{side} is a llama GGUF file, whose q and k rows llama.cpp's converter permutes for the interleaved rotary embedding: its {ops} compared in the checkpoint's order");
    }
    if let Some(s) = r.fed_differ_at {
        let _ = writeln!(o, "forward pass {s} and later were fed different token ids: compared up to pass {}", s.saturating_sub(1));
    }
    match &r.root {
        Some(x) => {
            let j = &x.judged;
            let _ = writeln!(
                o,
                "root: {} (step {}): error {} where its inputs' error {} and rounding explain {} (amplification {})",
                x.path.text(),
                x.step,
                g(j.error),
                g(j.input_error),
                g(j.allowed),
                g(j.amplification)
            );
            let w = &x.worst;
            let at = w.at.map_or(String::new(), |(row, pos)| format!("row {row} position {pos} "));
            let _ = writeln!(o, "  largest difference at {at}element {}: a {} b {}", w.element, w.a, w.b);
        }
        None => o.push_str("no root: every op's error is explained by its inputs' error and its rounding\n"),
    }
    o.push_str("error by layer (largest relative error of its ops):\n");
    for (l, e) in &r.layers {
        let _ = writeln!(o, "  {:<16} {}", l.text(), g(*e));
    }
    if r.amplifying.is_empty() {
        o.push_str("ops that amplify: none (no op's error exceeds both its inputs' error and its own rounding)\n");
    } else {
        o.push_str("ops that amplify most (error over the larger of its inputs' error and its own rounding):\n");
    }
    for x in &r.amplifying {
        let j = &x.judged;
        let _ = writeln!(o, "  {} (step {}): x{} (error {}; inputs' error {}, rounding {})", x.path.text(), x.step, g(j.amplification), g(j.error), g(j.input_error), g(j.rounding));
    }
    // Records of passes the other run split otherwise: one line a side (the JSON lists paths).
    let elsewhere = |u: &&Unmatched| u.why == ELSEWHERE_IN_A || u.why == ELSEWHERE_IN_B;
    for side in ['a', 'b'] {
        let n: usize = r.unmatched_paths.iter().filter(elsewhere).filter(|u| u.side == side).map(|u| u.records).sum();
        if n > 0 {
            let _ = writeln!(o, "not compared: {n} records of {side} in passes over positions the other run split otherwise (another --prefill-chunk) or did not record");
        }
    }
    let listed: Vec<&Unmatched> = r.unmatched_paths.iter().filter(|u| !elsewhere(u)).collect();
    if !listed.is_empty() {
        o.push_str("unmatched (side, module path, records, why):\n");
        for u in listed {
            let _ = writeln!(o, "  {} {} x{}: {}", u.side, u.path.text(), u.records, u.why);
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::{last_positions, same_layout};

    /// A decode step's stream `[1, 1, n]` and its final norm's `[1, n]` are laid out alike; a
    /// projection's `[b, s, h·d]` and a per-head norm's `[b, h, s, d]` are not.
    #[test]
    fn layouts_alike_only_up_to_dims_of_one() {
        assert!(same_layout(&[1, 1, 640], &[1, 640]) && same_layout(&[2, 7, 64], &[2, 7, 64]));
        assert!(!same_layout(&[1, 7, 1024], &[1, 4, 7, 256]) && !same_layout(&[1, 7, 640], &[1, 640]));
    }

    /// A prefill's final norm reads `[b, s, n]` and outputs each row's last position.
    #[test]
    fn a_final_norm_reads_each_rows_last_position() {
        let v: Vec<f64> = (0..12).map(f64::from).collect();
        assert_eq!(last_positions(&v, &[2, 3, 2], &[2, 2]), Some(vec![4.0, 5.0, 10.0, 11.0]));
        assert_eq!(last_positions(&v[..6], &[1, 3, 2], &[1, 2]), Some(vec![4.0, 5.0]));
        assert_eq!(last_positions(&v, &[2, 3, 2], &[2, 3, 2]), None);
    }
}
