//! The first non-finite value of a run: the first op (in execution order) whose output holds a
//! NaN or ±Inf, where in the sequence it appeared, and whether all of the op's inputs were finite
//! (then this op made it, rather than passing it on).
//!
//! Masks write -inf on purpose (causal and sliding-window masks; padding in f16 encoders, where
//! the mask value plus a score overflows): for mask ops (`where_cond`, `mask_add`) only NaN and
//! +Inf count.

use candle_trace_format::format::Trace;
use candle_trace_format::record::{Item, OpRecord};
use candle_trace_format::site::{layer_of, Op};
use serde::Serialize;

/// Where the first non-finite value appeared.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct NonFinite {
    /// Record id (`seq`) of the op record.
    pub seq: u64,
    /// Forward-pass index.
    pub step: u32,
    /// Layer index from the module path; `None` outside layers.
    pub layer: Option<u32>,
    /// Module path of the op.
    pub path: crate::untrusted::Untrusted,
    /// Op name.
    pub op: crate::untrusted::Untrusted,
    /// First (row, token position) holding a non-finite value, when the output has a token axis.
    pub row: Option<u32>,
    /// Token position of that entry (the row's own in a padded batch); `None` without a token axis.
    pub position: Option<u32>,
    /// NaN values in the whole output.
    pub nan: u64,
    /// +Inf values in the whole output.
    pub pos_inf: u64,
    /// -Inf values in the whole output (a mask's intended -inf included).
    pub neg_inf: u64,
    /// True when every recorded input of the op was finite: this op produced the value.
    pub inputs_finite: bool,
}

/// The rule is the format crate's, which the writer's frame summaries use too.
pub use candle_trace_format::summary::{counted, is_mask};

/// True when a record of op `op` holds a non-finite value that is not a mask's intended -inf.
pub fn is_nonfinite(op: Option<Op>, r: &OpRecord) -> bool {
    counted(op, &r.stats) > 0
}

/// Finds the first non-finite op output of a trace (`None` when every output is finite).
pub fn first_nonfinite(t: &Trace) -> Option<NonFinite> {
    let mut scan = Scan::default();
    for item in &t.items {
        if scan.feed(item) {
            break;
        }
    }
    scan.found
}

/// [`first_nonfinite`] over items fed one at a time (a trace read frame by frame): it holds the
/// site table and, once found, the answer.
#[derive(Debug, Default)]
pub struct Scan {
    sites: Vec<(String, String)>,
    /// The first non-finite op output, once fed.
    pub found: Option<NonFinite>,
}

impl Scan {
    /// Feeds the next item in file order; true once the answer is found (later items change
    /// nothing).
    pub fn feed(&mut self, item: &Item) -> bool {
        if self.found.is_some() {
            return true;
        }
        match item {
            Item::Site { path, op, .. } => self.sites.push((path.clone(), op.clone())),
            Item::Op(r) => {
                let Some((path, op)) = self.sites.get(r.site as usize) else { return false };
                // Most records hold no non-finite value: the op is parsed only for those that do.
                if r.stats.nonfinite() > 0 && is_nonfinite(Op::parse(op), r) {
                    let first = r.tokens.iter().find(|t| t.nonfinite > 0);
                    self.found = Some(NonFinite {
                        seq: r.seq,
                        step: r.step,
                        layer: layer_of(path),
                        path: path.as_str().into(),
                        op: op.as_str().into(),
                        row: first.map(|t| t.row),
                        position: first.map(|t| t.pos),
                        nan: r.stats.nan,
                        pos_inf: r.stats.pos_inf,
                        neg_inf: r.stats.neg_inf,
                        // Every earlier output was finite (this is the first that is not), so
                        // every input was: this op made the value.
                        inputs_finite: true,
                    });
                }
            }
            _ => {}
        }
        self.found.is_some()
    }
}

/// One line describing a [`NonFinite`] (or its absence).
pub fn describe(n: Option<&NonFinite>) -> crate::untrusted::Untrusted {
    match n {
        None => "none: every recorded op output is finite".into(),
        Some(n) => {
            let at = match (n.position, n.row) {
                (Some(p), Some(r)) => format!(" at token position {p} (row {r})"),
                _ => String::new(),
            };
            let layer = n.layer.map(|l| format!("layer {l}, ")).unwrap_or_default();
            let cause = if n.inputs_finite { "its inputs were all finite: this op made it" } else { "an input was already non-finite" };
            format!("{} ({}), {layer}step {}{at}; in the whole output {} NaN, {} +Inf, {} -Inf; {cause}", &*n.path, &*n.op, n.step, n.nan, n.pos_inf, n.neg_inf).into()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_trace_format::record::Stats;

    /// A mask's NaN is found whatever its -Inf count: counts read from a file may be any u64,
    /// and a sum that wrapped to 0 once hid it.
    #[test]
    fn a_mask_nan_is_found_beside_any_neg_inf_count() {
        let site = Item::Site { id: 0, path: "layers.0.self_attn.mask".into(), op: "where_cond".into() };
        for (nan, neg_inf, found) in [(1, u64::MAX, true), (0, u64::MAX, false), (1, 0, true), (0, 5, false)] {
            let r = OpRecord { stats: Stats { nan, neg_inf, ..Stats::default() }, ..OpRecord::default() };
            let mut scan = Scan::default();
            scan.feed(&site);
            assert_eq!(scan.feed(&Item::Op(r)), found, "nan {nan}, -inf {neg_inf}");
        }
    }
}
