//! Traces recorded at different levels (`trace record --level`, [`Level`]) compared on what both
//! hold: the finer trace is projected onto the coarser level, as if it had been recorded there.
//! A record the level skips is dropped, and the records that read it read its own recorded
//! inputs instead, the wider way ([`candle_trace_format::record::Reads::wider`]): the projection of an `ops` trace onto `layers`
//! holds the records, inputs and reads a `layers` run of the same model records.

use candle_trace_format::format::Trace;
use candle_trace_format::record::{InputRef, Item};
use candle_trace_format::site::{Level, Op};
use std::collections::HashMap;

/// How coarse a level is: ops 0, layers 1, logits 2.
fn rank(l: Level) -> u8 {
    match l {
        Level::Ops => 0,
        Level::Layers => 1,
        Level::Logits => 2,
    }
}

/// The coarser of two levels: what both traces hold.
pub fn coarser(a: Level, b: Level) -> Level {
    if rank(a) >= rank(b) {
        a
    } else {
        b
    }
}

/// `items` as a run recorded at `level` holds them (see the module docs). Sites stay (ids are
/// positions in the site table); dumps of dropped records go with them; the kept records are
/// numbered again from 0, as a run's are.
pub fn project_items(items: Vec<Item>, level: Level) -> Vec<Item> {
    if level == Level::Ops {
        return items;
    }
    let mut keep: Vec<bool> = Vec::new();
    // Dropped records of the current forward pass -> the kept records they stand for.
    let mut dropped: HashMap<u64, Vec<InputRef>> = HashMap::new();
    // Kept records: old id -> new id.
    let mut renumbered: HashMap<u64, u64> = HashMap::new();
    let mut out = Vec::with_capacity(items.len() / 8);
    for item in items {
        match item {
            Item::Site { id, ref path, ref op } => {
                if keep.len() <= id as usize {
                    keep.resize(id as usize + 1, true);
                }
                keep[id as usize] = level.keeps(path, Op::parse(op).unwrap_or(Op::Probe));
                out.push(item);
            }
            Item::Forward(_) => {
                dropped.clear();
                out.push(item);
            }
            Item::Op(mut r) => {
                let inputs = InputRef::through_skipped(r.inputs.iter().copied(), |seq| dropped.get(&seq).map(Vec::as_slice));
                if keep.get(r.site as usize).copied().unwrap_or(true) {
                    r.inputs = inputs.into_iter().filter_map(|i| renumbered.get(&i.seq).map(|&seq| InputRef { seq, reads: i.reads })).collect();
                    let seq = renumbered.len() as u64;
                    renumbered.insert(r.seq, seq);
                    r.seq = seq;
                    out.push(Item::Op(r));
                } else {
                    dropped.insert(r.seq, inputs);
                }
            }
            Item::Dump(mut d) => {
                if let Some(&seq) = renumbered.get(&d.seq) {
                    d.seq = seq;
                    out.push(Item::Dump(d));
                }
            }
            other => out.push(other),
        }
    }
    out
}

/// [`project_items`] of a whole trace recorded at a finer level than `level`; `t.level` stays
/// the level it was recorded at (the report says both).
pub fn project(mut t: Trace, level: Level) -> Trace {
    if rank(level) > rank(t.level) {
        t.items = project_items(std::mem::take(&mut t.items), level);
    }
    t
}

/// Op records `t` holds (before any [`project`]).
pub fn op_records(t: &Trace) -> usize {
    t.items.iter().filter(|i| matches!(i, Item::Op(_))).count()
}

/// What a bisect report says of the levels: nothing when both recorded every op.
pub fn note(a: Level, b: Level) -> Option<String> {
    let what = |l: Level| match l {
        Level::Ops => "every op",
        Level::Layers => "each layer's output and the logits",
        Level::Logits => "the logits",
    };
    match (a, b) {
        (Level::Ops, Level::Ops) => None,
        (x, y) if x == y => Some(format!("both runs recorded {} (--level {}): a root is the first of those whose output differs while the one before it matched", what(x), x.as_str())),
        (x, y) => {
            let c = coarser(x, y);
            Some(format!("a recorded {} (--level {}), b {} (--level {}): compared what both hold, {}", what(x), x.as_str(), what(y), y.as_str(), what(c)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_trace_format::record::OpRecord;
    use candle_trace_format::record::Reads;

    fn site(id: u32, path: &str, op: &str) -> Item {
        Item::Site { id, path: path.into(), op: op.into() }
    }
    fn op(seq: u64, site: u32, inputs: &[(u64, Reads)]) -> Item {
        Item::Op(OpRecord { seq, site, inputs: inputs.iter().map(|&(seq, reads)| InputRef { seq, reads }).collect(), ..OpRecord::default() })
    }

    /// A layer whose attention reads the previous layer's output over the prefix: projected onto
    /// `layers`, its output reads the previous layer's output at `0..=p`, once.
    #[test]
    fn a_layer_output_reads_the_previous_layer_output_through_attention() {
        let items = vec![
            site(0, "layers.0.mlp_residual", "add"),
            site(1, "layers.1.input_layernorm", "rms_norm"),
            site(2, "layers.1.self_attn.softmax", "softmax"),
            site(3, "layers.1.attn_residual", "add"),
            site(4, "layers.1.mlp_residual", "add"),
            op(0, 0, &[]),
            op(1, 1, &[(0, Reads::Same)]),
            op(2, 2, &[(1, Reads::Same), (1, Reads::Prefix)]),
            op(3, 3, &[(0, Reads::Same), (2, Reads::Same)]),
            op(4, 4, &[(3, Reads::Same)]),
        ];
        let out = project_items(items, Level::Layers);
        let ops: Vec<&OpRecord> = out.iter().filter_map(|i| if let Item::Op(r) = i { Some(r) } else { None }).collect();
        assert_eq!(ops.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![0, 1], "renumbered");
        assert_eq!(ops[1].inputs, vec![InputRef { seq: 0, reads: Reads::Prefix }]);
        assert_eq!(out.iter().filter(|i| matches!(i, Item::Site { .. })).count(), 5);
        assert_eq!(coarser(Level::Ops, Level::Layers), Level::Layers);
        assert!(note(Level::Ops, Level::Ops).is_none() && note(Level::Ops, Level::Layers).unwrap().contains("compared what both hold"));
    }
}
