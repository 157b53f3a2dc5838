//! Frame summaries (format 2.5): what bisect reads of an items frame, so that a frame two runs
//! hold identically is compared without decompressing or decoding it.
//!
//! The writer follows each items frame that holds op records, and no site, embeddings or
//! value, with an optional summary frame (kind 131) holding its [`FrameSummary`]:
//! each record's site, the runs of token positions each record covers per batch row, the
//! steps, whether a record holds a non-finite value that counts, and, whole, the items every
//! bisect report keeps (forward passes, generated tokens, and the records [`kept_whole`]
//! names). Readers that do not use it skip it, as every optional frame; format-2.4 readers too.
//! A summary is untrusted like the rest of the file: [`crate::validate::Checker::summary`]
//! checks it against the trace's structure before anything indexes with it.

use crate::record::{Item, Kernel, OpRecord, Stats};
use crate::site::Op;
use serde::{Deserialize, Serialize};

/// Whether `path` is where a model's final logits are recorded (`logits` in the decoders here,
/// `lm_head` in imported traces): bisect keeps those records whole.
pub fn is_logits_path(path: &str) -> bool {
    path == "logits" || path == "lm_head"
}

/// Whether bisect keeps op record `r` whole in its first pass (every report reads it): it has no
/// per-token entry, it is the model's input (token ids), or it is at the logits' path
/// (`logits_site`: its site's path passes [`is_logits_path`]).
pub fn kept_whole(r: &OpRecord, logits_site: bool) -> bool {
    r.tokens.is_empty() || r.kernel == Some(Kernel::Input) || logits_site
}

/// Whether `op` applies an attention mask (`where_cond` with a fill, or an additive mask): its
/// output holds the mask's fill value (-inf, or the dtype's lowest finite value standing for it).
pub fn is_mask(op: Option<Op>) -> bool {
    matches!(op, Some(Op::WhereCond | Op::MaskAdd))
}

/// Non-finite values of a record of op `op` (`None`: an op name this build does not know) that
/// count: for mask ops only NaN and +Inf (their -inf is intended), for every other op NaN and
/// ±Inf.
pub fn counted(op: Option<Op>, s: &Stats) -> u64 {
    if is_mask(op) {
        s.nan.saturating_add(s.pos_inf)
    } else {
        s.nonfinite()
    }
}

/// The most runs a summary holds (the writer writes none for a frame that needs more, and the
/// reader refuses more): a bound on what decoding one allocates.
pub const MAX_RUNS: usize = 1 << 16;

/// The fewest payload bytes one per-token entry takes in an items frame (a format-2
/// `Tokens::WholeLow`: row, position and four samples): a summary of a frame of `U` bytes
/// stands for at most `U / 18` per-token entries.
pub const MIN_TOKEN_BYTES: u64 = 18;

/// One run of token positions of each of a few consecutive records: `len` positions from
/// `pos` of batch row `row`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyRun {
    /// Index of the first record among the frame's op records.
    pub record: u32,
    /// Records from `record` on that each hold the run (at least 1).
    pub records: u32,
    /// Batch row.
    pub row: u32,
    /// First position.
    pub pos: u32,
    /// Positions in the run (at least 1; `pos + len - 1` fits a u32, checked by
    /// [`crate::validate::Checker::summary`]).
    pub len: u32,
}

/// What bisect reads of one items frame (see the module docs). Stored as a postcard value in a
/// summary frame (kind 131), run-length coded: a decode step's records (sites 0,
/// 1, 2, … each at one position) take two site entries and one run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FrameSummary {
    /// Items in the frame (what the footer counts).
    pub items: u32,
    /// The op records' site ids as (step, count): `count` records, each at the previous
    /// record's site plus `step` (wrapping; the first record's previous site is 0).
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_ITEMS_PER_FRAME as usize }>")]
    pub(crate) sites: Vec<(u32, u32)>,
    /// (first record minus the previous entry's first record, records, row, first position,
    /// positions): see [`KeyRun`].
    #[serde(deserialize_with = "crate::limits::vec::<_, _, MAX_RUNS>")]
    pub(crate) runs: Vec<(u32, u32, u32, u32, u32)>,
    /// Smallest and largest forward-pass index of its records.
    pub steps: (u32, u32),
    /// A record holds a NaN or ±Inf that counts ([`counted`]).
    pub nonfinite: bool,
    /// The frame's forward passes, generated tokens and the records [`kept_whole`] names, in
    /// order.
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_ITEMS_PER_FRAME as usize }>")]
    pub kept: Vec<Item>,
}

impl FrameSummary {
    /// The summary of the items frame `items`; `None` when it holds no op record, or an item a
    /// summary does not stand for (a site, embeddings, a value). `site(id)`: whether the site's
    /// path is the logits' ([`is_logits_path`]) and its op, as declared earlier in the trace.
    pub fn of(items: &[Item], site: impl Fn(u32) -> (bool, Option<Op>)) -> Option<FrameSummary> {
        let mut s = FrameSummary { items: u32::try_from(items.len()).ok()?, steps: (u32::MAX, 0), ..FrameSummary::default() };
        let (mut prev_site, mut records) = (0u32, 0u32);
        // Each run of the record before (row, position, length) → its entry: a record holding
        // the same run extends it.
        let (mut open, mut now) = (std::collections::HashMap::<(u32, u32, u32), usize>::new(), Vec::new());
        // This record's runs: (row, first position, length); one list for every record.
        let mut mine: Vec<(u32, u32, u32)> = Vec::new();
        // Runs as (first record, records, row, position, length).
        let mut runs: Vec<(u32, u32, u32, u32, u32)> = Vec::new();
        for item in items {
            let r = match item {
                Item::Op(r) => r,
                Item::Forward(_) | Item::Token(_) => {
                    s.kept.push(item.clone());
                    continue;
                }
                _ => return None,
            };
            let (logits, op) = site(r.site);
            let step = r.site.wrapping_sub(prev_site);
            match s.sites.last_mut() {
                Some(last) if last.0 == step && records > 0 => last.1 += 1,
                _ => s.sites.push((step, 1)),
            }
            prev_site = r.site;
            s.steps = (s.steps.0.min(r.step), s.steps.1.max(r.step));
            s.nonfinite |= counted(op, &r.stats) > 0;
            mine.clear();
            for t in &r.tokens {
                match mine.last_mut() {
                    Some(last) if last.0 == t.row && last.1.checked_add(last.2) == Some(t.pos) && last.2 < u32::MAX => last.2 += 1,
                    _ => mine.push((t.row, t.pos, 1)),
                }
            }
            now.clear();
            for &key in &mine {
                match open.get(&key) {
                    Some(&e) if runs[e].0 + runs[e].1 == records => {
                        runs[e].1 += 1;
                        now.push((key, e));
                    }
                    _ => {
                        now.push((key, runs.len()));
                        runs.push((records, 1, key.0, key.1, key.2));
                    }
                }
            }
            open.clear();
            open.extend(now.iter().copied());
            if kept_whole(r, logits) {
                s.kept.push(item.clone());
            }
            records += 1;
        }
        let mut first = 0;
        s.runs = runs
            .into_iter()
            .map(|(r, n, row, pos, len)| {
                let d = r - first;
                first = r;
                (d, n, row, pos, len)
            })
            .collect();
        (records > 0 && s.runs.len() <= MAX_RUNS).then_some(s)
    }

    /// Op records in the frame (a count read from the file: check it before allocating by it).
    pub fn records(&self) -> u64 {
        self.sites.iter().map(|s| s.1 as u64).sum()
    }

    /// Each op record's site id, in order.
    pub fn sites(&self) -> impl Iterator<Item = u32> + '_ {
        let mut site = 0u32;
        self.sites.iter().flat_map(|&(step, n)| std::iter::repeat_n(step, n as usize)).map(move |step| {
            site = site.wrapping_add(step);
            site
        })
    }

    /// [`FrameSummary::sites`] into `out` (cleared first): a loop a run of sites, for the
    /// frames bisect takes from their summaries. Check [`FrameSummary::records`] first: `out`
    /// grows by that many.
    pub fn sites_into(&self, out: &mut Vec<u32>) {
        out.clear();
        let mut site = 0u32;
        for &(step, n) in &self.sites {
            out.extend((0..n).map(|_| {
                site = site.wrapping_add(step);
                site
            }));
        }
    }

    /// The per-token entries the runs stand for: records × positions, summed (saturating).
    pub fn entries(&self) -> u64 {
        self.runs().map(|k| k.records as u64 * k.len as u64).fold(0, u64::saturating_add)
    }

    /// The runs of token positions, by first record (see [`KeyRun`]).
    pub fn runs(&self) -> impl Iterator<Item = KeyRun> + '_ {
        self.runs.iter().scan(0u32, |record, &(d, records, row, pos, len)| {
            *record = record.wrapping_add(d);
            Some(KeyRun { record: *record, records, row, pos, len })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{Forward, TokenStat};

    fn op(seq: u64, site: u32, tokens: &[(u32, u32)]) -> Item {
        let tokens = tokens.iter().map(|&(row, pos)| TokenStat { row, pos, digest: 0, sum: 0.0, abs_max: 0.0, nonfinite: 0, samples: [0.0; 4] }).collect();
        Item::Op(OpRecord { seq, site, step: 2, dtype: "f32".into(), shape: vec![1], tokens, ..OpRecord::default() })
    }

    #[test]
    fn a_summary_holds_each_records_site_and_runs_of_positions() {
        let fwd = Item::Forward(Forward { step: 2, phase: crate::record::Phase::Decode, index_pos: 5, seq_len: 1, batch: 2, ids: Vec::new() });
        let items = vec![fwd.clone(), op(10, 3, &[(0, 5), (0, 6), (0, 7), (1, 5)]), op(11, 4, &[(0, 8)]), op(12, 9, &[]), op(13, 1, &[(0, 8), (0, 9)])];
        let s = FrameSummary::of(&items, |site| (site == 1, None)).expect("a summary");
        assert_eq!(s.items, 5);
        assert_eq!(s.sites().collect::<Vec<_>>(), vec![3, 4, 9, 1]);
        let runs: Vec<_> = s.runs().map(|k| (k.record, k.records, k.row, k.pos, k.len)).collect();
        // Record 1's position 8 does not join record 0's run of row 0 (another record).
        assert_eq!(runs, vec![(0, 1, 0, 5, 3), (0, 1, 1, 5, 1), (1, 1, 0, 8, 1), (3, 1, 0, 8, 2)]);
        // A decode step: sites 0, 1, 2, … each at one position, one site entry after the
        // first and one run.
        let step: Vec<Item> = (0..50).map(|k| op(100 + k, k as u32, &[(0, 7)])).collect();
        let d = FrameSummary::of(&step, |_| (false, None)).expect("a summary");
        assert_eq!((d.sites.len(), d.runs.len(), d.records()), (2, 1, 50));
        assert_eq!(d.sites().collect::<Vec<_>>(), (0..50).collect::<Vec<u32>>());
        assert_eq!(d.runs().map(|k| (k.record, k.records, k.row, k.pos, k.len)).collect::<Vec<_>>(), vec![(0, 50, 0, 7, 1)]);
        // A batch of two, rows alternating within each record: one run a row.
        let batch: Vec<Item> = (0..4).map(|k| op(k, 3, &[(0, 0), (0, 1), (1, 0), (1, 1)])).collect();
        let b = FrameSummary::of(&batch, |_| (false, None)).expect("a summary");
        assert_eq!(b.runs().map(|k| (k.record, k.records, k.row, k.pos, k.len)).collect::<Vec<_>>(), vec![(0, 4, 0, 0, 2), (0, 4, 1, 0, 2)]);
        assert_eq!(b.sites().collect::<Vec<_>>(), vec![3; 4]);
        assert_eq!(s.steps, (2, 2));
        // The forward pass, the record without tokens, the one at the logits' site.
        assert_eq!(s.kept, vec![fwd.clone(), items[3].clone(), items[4].clone()]);
        let bytes = postcard::to_stdvec(&s).expect("encode");
        assert_eq!(postcard::from_bytes::<FrameSummary>(&bytes).expect("decode"), s);
        assert!(FrameSummary::of(&[Item::Site { id: 0, path: "x".into(), op: "add".into() }, op(0, 0, &[(0, 0)])], |_| (false, None)).is_none());
        assert!(FrameSummary::of(&[fwd], |_| (false, None)).is_none(), "no op record");
    }
}
