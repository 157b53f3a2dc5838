//! `trace bisect A B --tolerance auto|REL`: two traces compared by value under the
//! [`crate::tolerance`] model, for runs that are not meant to agree bit for bit (another dtype,
//! another implementation, a port). Run a is the reference.
//!
//! The chain is built from the ops both traces recorded with their output values (`--dump`):
//! matched by module path and occurrence (the k-th record of a path in a against the k-th in b),
//! in a's execution order; each op's inputs are the records it read (a's `inputs`), among the
//! matched ones. Ops with values on one side only, or at a path the other lacks, are counted as
//! unmatched.

use crate::tolerance::{condition, judge, relative_error, Judged, OpError, Tolerance};
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
}

/// What `bisect --tolerance` found.
#[derive(Clone, Debug, Serialize)]
pub struct AcrossReport {
    /// Ops compared by value, in a's execution order.
    pub compared: usize,
    /// Op records of a with no value-carrying counterpart in b (or no dump), and of b likewise.
    pub unmatched: (usize, usize),
    /// The root: the first op whose error its inputs' error and rounding do not explain.
    pub root: Option<ChainOp>,
    /// Per layer (a's order): the largest output error among its ops.
    pub layers: Vec<(Untrusted, f64)>,
    /// The ops that amplify most (largest amplification first, at most 5).
    pub amplifying: Vec<ChainOp>,
}

/// Op records with their module path and op name, in file order.
type Records<'t> = Vec<(&'t str, &'t str, &'t OpRecord)>;

/// Each op record of `t` with its module path and op name, and the dumped outputs by record.
fn outputs(t: &Trace) -> (Records<'_>, HashMap<u64, &Dump>) {
    let mut sites: Vec<(&str, &str)> = Vec::new();
    let (mut recs, mut dumps) = (Vec::new(), HashMap::new());
    for i in &t.items {
        match i {
            Item::Site { path, op, .. } => sites.push((path, op)),
            Item::Op(r) => {
                let (p, o) = sites.get(r.site as usize).copied().unwrap_or(("?", "?"));
                recs.push((p, o, r));
            }
            Item::Dump(d) => {
                dumps.insert(d.seq, d);
            }
            _ => {}
        }
    }
    (recs, dumps)
}

fn values(d: &Dump) -> Result<Vec<f64>> {
    Ok(candle_trace_format::dump::decode(d)?.f64)
}

/// Compares `a` (the reference) and `b` under `tol` (see the module docs).
///
/// # Errors
/// A dump whose bytes do not match its dtype and shape.
pub fn compare(a: &Trace, b: &Trace, tol: Tolerance) -> Result<AcrossReport> {
    let ((ra, da), (rb, db)) = (outputs(a), outputs(b));
    let mut nth: HashMap<&str, usize> = HashMap::new();
    let mut b_by: HashMap<(&str, usize), &OpRecord> = HashMap::new();
    for (p, _, r) in &rb {
        let k = nth.entry(p).or_insert(0);
        b_by.insert((p, *k), r);
        *k += 1;
    }
    nth.clear();
    let (mut chain, mut meta, mut index_of) = (Vec::new(), Vec::new(), HashMap::new());
    let mut unmatched_a = 0;
    for (p, kind, r) in &ra {
        let k = nth.entry(p).or_insert(0);
        let other = b_by.get(&(*p, *k)).copied();
        *k += 1;
        let (Some(x), Some(rb)) = (da.get(&r.seq), other) else {
            unmatched_a += 1;
            continue;
        };
        let Some(y) = db.get(&rb.seq) else {
            unmatched_a += 1;
            continue;
        };
        let (va, vb) = (values(x)?, values(y)?);
        let inputs: Vec<usize> = r.inputs.iter().filter_map(|i| index_of.get(&i.seq).copied()).collect();
        // Softmax and exp: their condition from their input's values (a's), when dumped; no
        // other op has one, so no other op's input is decoded again.
        let input = r.inputs.first().and_then(|i| da.get(&i.seq)).filter(|_| matches!(*kind, "softmax" | "exp"));
        let cond = input.map(|d| values(d)).transpose()?.and_then(|v| condition(kind, &v));
        // The coarser dtype of the two sets the rounding.
        let eps = crate::tolerance::epsilon;
        let dtype = if eps(&y.dtype) > eps(&x.dtype) { y.dtype.clone() } else { x.dtype.clone() };
        index_of.insert(r.seq, chain.len());
        chain.push(OpError { path: p.to_string(), dtype, error: relative_error(&vb, &va), inputs, condition: cond });
        meta.push((*p, r.step));
    }
    let unmatched_b = rb.len() - chain.len().min(rb.len());
    let (judged, root) = judge(&chain, tol);
    let op = |i: usize| ChainOp { path: meta[i].0.into(), step: meta[i].1, judged: judged[i].clone() };
    let mut layers: Vec<(Untrusted, f64)> = Vec::new();
    for (i, c) in chain.iter().enumerate() {
        let l = crate::bisect::layer_group(&c.path);
        match layers.iter_mut().find(|x| x.0.as_str() == l) {
            Some(x) => x.1 = x.1.max(judged[i].error),
            None => layers.push((l.into(), judged[i].error)),
        }
    }
    let mut order: Vec<usize> = (0..chain.len()).filter(|&i| judged[i].amplification.is_finite()).collect();
    order.sort_by(|&x, &y| judged[y].amplification.total_cmp(&judged[x].amplification));
    Ok(AcrossReport { compared: chain.len(), unmatched: (unmatched_a, unmatched_b), root: root.map(op), layers, amplifying: order.into_iter().take(5).map(op).collect() })
}

/// Plain-text rendering of an [`AcrossReport`].
pub fn text(r: &AcrossReport) -> String {
    let g = crate::text::g;
    let mut o = format!("compared by value under the tolerance model (docs/tolerance.md): {} ops; unmatched a {}, b {}\n", r.compared, r.unmatched.0, r.unmatched.1);
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
        }
        None => o.push_str("no root: every op's error is explained by its inputs' error and its rounding\n"),
    }
    o.push_str("error by layer (largest relative error of its ops):\n");
    for (l, e) in &r.layers {
        let _ = writeln!(o, "  {:<16} {}", l.text(), g(*e));
    }
    o.push_str("ops that amplify most:\n");
    for x in &r.amplifying {
        let _ = writeln!(o, "  {} (step {}): x{} ({} from {})", x.path.text(), x.step, g(x.judged.amplification), g(x.judged.error), g(x.judged.input_error));
    }
    o
}
