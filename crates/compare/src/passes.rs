//! Forward passes of two runs lined up by the positions they hold, for `bisect --tolerance`
//! ([`crate::across`]): a record is paired with the other run's record of the same module path
//! in the pass over the same positions (`index_pos`, `seq_len`), so runs whose prompts were
//! split otherwise (`--prefill-chunk`) still pair their decode steps, and a run that recorded
//! some passes only (a reference that recorded its decode steps) pairs those.

use candle_trace_format::record::Forward;
use std::collections::{BTreeMap, HashMap};

/// What a run's forward passes held: by step, the positions `index_pos .. index_pos + seq_len`
/// and the ids fed (`[batch, seq_len]`, row-major).
#[derive(Default)]
pub(crate) struct Passes<'t> {
    by_step: HashMap<u32, &'t Forward>,
}

/// A pass by the positions it holds: `(index_pos, seq_len)`; `(u32::MAX, step)` for a step the
/// trace holds no pass item for.
pub(crate) type PassKey = (u32, u32);

impl<'t> Passes<'t> {
    /// Notes forward pass `f`.
    pub(crate) fn add(&mut self, f: &'t Forward) {
        self.by_step.insert(f.step, f);
    }

    /// The key of step `step`'s pass.
    pub(crate) fn key(&self, step: u32) -> PassKey {
        self.by_step.get(&step).map_or((u32::MAX, step), |f| (f.index_pos, f.seq_len))
    }

    /// The end (one past the last position) of step `step`'s pass; `u32::MAX` when unknown.
    pub(crate) fn end(&self, step: u32) -> u32 {
        self.by_step.get(&step).map_or(u32::MAX, |f| f.index_pos.saturating_add(f.seq_len))
    }

    /// Every position held, with the ids fed there (one per batch row) and the step holding it.
    fn columns(&self) -> BTreeMap<u32, (Vec<u32>, u32)> {
        let mut out = BTreeMap::new();
        for f in self.by_step.values() {
            let n = f.seq_len as usize;
            if n == 0 || f.ids.len() % n != 0 {
                continue;
            }
            for i in 0..n {
                let col: Vec<u32> = f.ids.chunks(n).map(|row| row[i]).collect();
                out.insert(f.index_pos.saturating_add(i as u32), (col, f.step));
            }
        }
        out
    }
}

/// The first position both runs hold whose fed ids differ (in any batch row, or in the number of
/// rows), with a's step that holds it: passes from there on (by their end) are not compared.
/// `None` when every position both hold was fed the same ids.
pub(crate) fn fed_differ_at(a: &Passes, b: &Passes) -> Option<(u32, u32)> {
    let cb = b.columns();
    a.columns().into_iter().find(|(p, (ids, _))| cb.get(p).is_some_and(|(other, _)| other != ids)).map(|(p, (_, step))| (step, p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_trace_format::record::Phase;

    fn pass(step: u32, index_pos: u32, ids: Vec<u32>) -> Forward {
        Forward { step, phase: if step == 0 { Phase::Prefill } else { Phase::Decode }, index_pos, seq_len: ids.len() as u32, batch: 1, ids }
    }

    #[test]
    fn whole_and_chunked_prefills_line_up_by_position() {
        let whole = [pass(0, 0, vec![1, 2, 3, 4]), pass(1, 4, vec![9]), pass(2, 5, vec![7])];
        let chunked = [pass(0, 0, vec![1, 2]), pass(1, 2, vec![3, 4]), pass(2, 4, vec![9]), pass(3, 5, vec![8])];
        let (mut a, mut b) = (Passes::default(), Passes::default());
        whole.iter().for_each(|f| a.add(f));
        chunked.iter().for_each(|f| b.add(f));
        // The decode steps over position 4 pair (a's step 1, b's step 2); position 5 was fed
        // another token: a's step 2 and b's step 3 end past it.
        assert_eq!((a.key(1), b.key(2)), ((4, 1), (4, 1)));
        assert_eq!(fed_differ_at(&a, &b), Some((2, 5)));
        assert_eq!((a.end(2), b.end(3), a.end(7)), (6, 6, u32::MAX));
        let same = [pass(0, 0, vec![1, 2, 3, 4])];
        let mut c = Passes::default();
        same.iter().for_each(|f| c.add(f));
        assert_eq!(fed_differ_at(&a, &c), None);
    }
}
