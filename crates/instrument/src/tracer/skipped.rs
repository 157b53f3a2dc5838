//! The ops a record level skips in a forward pass (`--level`), each standing for its nearest
//! recorded ancestors: what a record reading a skipped op's output lists as its inputs.

use super::{Node, SKIPPED};
use candle_trace_format::record::{InputRef, Reads};

/// For each op skipped in this forward pass (by id from [`SKIPPED`], in the order skipped), the
/// recorded ops it stands for with how it reads them ([`InputRef::through_skipped_into`]). One
/// flat list and each op's span of it, kept from pass to pass: once grown, a skipped op
/// allocates nothing.
#[derive(Default)]
pub(super) struct Skipped {
    refs: Vec<InputRef>,
    /// Per skipped op, its span of `refs`.
    spans: Vec<(u32, u32)>,
    /// Where [`Skipped::push`] resolves an op's ancestors before appending them.
    scratch: Vec<InputRef>,
}

impl Skipped {
    /// Forgets the ops of the forward pass before (their lists' memory is kept).
    pub(super) fn clear(&mut self) {
        self.refs.clear();
        self.spans.clear();
    }

    /// Notes a skipped op that read `inputs`; returns its id (at or above [`SKIPPED`]).
    pub(super) fn push(&mut self, inputs: &[(&Node, Reads)]) -> u64 {
        let mut scratch = std::mem::take(&mut self.scratch);
        self.ancestors_into(inputs, &mut scratch);
        let start = self.refs.len() as u32;
        self.refs.extend_from_slice(&scratch);
        self.spans.push((start, self.refs.len() as u32));
        self.scratch = scratch;
        SKIPPED + self.spans.len() as u64 - 1
    }

    /// The recorded inputs of an op that read `inputs`, into `out` (cleared first): each
    /// recorded node itself, each skipped one replaced by the recorded ops it stands for (read
    /// the wider way of the two), once each. A skipped id this pass did not give stands for
    /// nothing.
    pub(super) fn ancestors_into(&self, inputs: &[(&Node, Reads)], out: &mut Vec<InputRef>) {
        let refs = inputs.iter().filter_map(|(n, reads)| n.seq.map(|seq| InputRef { seq, reads: *reads }));
        let of = |seq: u64| -> &[InputRef] {
            let i = usize::try_from(seq - SKIPPED).unwrap_or(usize::MAX);
            self.spans.get(i).map_or(&[], |&(a, b)| &self.refs[a as usize..b as usize])
        };
        InputRef::through_skipped_into(refs, |seq| (seq >= SKIPPED).then(|| of(seq)), out)
    }
}
