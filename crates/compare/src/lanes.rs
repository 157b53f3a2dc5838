//! The alignment's lanes: per (module path, compared row), the positions compared, those that
//! differ and by how much. Lanes are kept in a list in the order they were first named and
//! found through a map of their keys; a frame both traces hold identically names the same
//! lanes as the frame before it (a decode step's keys are the last step's, one position on), so
//! the lanes of a frame summary's keys are looked up once and reused while its keys repeat
//! ([`Lanes::compare_runs`]): a summarised frame then costs a comparison of its keys and an
//! append to each lane's runs, not a map lookup a record.

use crate::runs::Runs;

/// (site, compared row): the site is an index into the alignment's module paths.
pub(crate) type LaneKey = (u32, u32);

/// A lane key as one word (site high, row low), for [`Lanes::compare_runs`]: a list of them
/// compares as bytes.
pub(crate) fn packed((site, row): LaneKey) -> u64 {
    (u64::from(site) << 32) | u64::from(row)
}

/// One (path, row): the positions compared and those that differ.
#[derive(Debug, Default)]
pub(crate) struct Lane {
    pub(crate) compared: Runs,
    pub(crate) differing: Runs,
    /// Keys of this lane read on one side only so far.
    pub(crate) pending: u32,
    /// (position, lower bound of max |a - b|) of each position that differs, in arrival order.
    pub(crate) diffs: Vec<(u32, f32)>,
    /// The positions whose two runs' non-finite counts differ.
    pub(crate) nonfinite: Runs,
}

/// Every lane, by key.
#[derive(Debug, Default)]
pub(crate) struct Lanes {
    /// The lanes, in the order their keys were first named.
    all: Vec<(LaneKey, Lane)>,
    /// Key → index into `all`. (foldhash: looked up once or twice a per-token entry.)
    ids: foldhash::HashMap<LaneKey, u32>,
    /// The keys [`Lanes::compare_runs`] last resolved ([`packed`]), and their lanes' indices.
    last_keys: Vec<u64>,
    last_ids: Vec<u32>,
}

impl Lanes {
    /// The lane of `key`, if one was named.
    pub(crate) fn get(&self, key: LaneKey) -> Option<&Lane> {
        self.ids.get(&key).map(|&i| &self.all[i as usize].1)
    }

    /// The lane of `key`, made empty when none was named yet.
    pub(crate) fn entry(&mut self, key: LaneKey) -> &mut Lane {
        let i = self.index(key);
        &mut self.all[i as usize].1
    }

    /// The lane of `key` when one was named.
    pub(crate) fn get_mut(&mut self, key: LaneKey) -> Option<&mut Lane> {
        let i = *self.ids.get(&key)?;
        Some(&mut self.all[i as usize].1)
    }

    /// Every lane with its key, in the order the keys were first named.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&LaneKey, &Lane)> {
        self.all.iter().map(|(k, l)| (k, l))
    }

    fn index(&mut self, key: LaneKey) -> u32 {
        if let Some(&i) = self.ids.get(&key) {
            return i;
        }
        let i = self.all.len() as u32;
        self.all.push((key, Lane::default()));
        self.ids.insert(key, i);
        i
    }

    /// Notes positions `pos..pos + len` compared (and equal) in lane `keys[k]` ([`packed`]) for
    /// each `k`, a run `(records, pos, len)` standing for that many keys in turn; returns how
    /// many were not compared before. The lanes are looked up only when `keys` differ from the
    /// last call's.
    pub(crate) fn compare_runs(&mut self, keys: &[u64], runs: impl Iterator<Item = (usize, u32, u32)>) -> u64 {
        if self.last_keys != keys {
            let ids: Vec<u32> = keys.iter().map(|&k| self.index(((k >> 32) as u32, k as u32))).collect();
            self.last_ids = ids;
            self.last_keys.clear();
            self.last_keys.extend_from_slice(keys);
        }
        let mut new = 0;
        let mut ids = self.last_ids.iter();
        for (records, pos, len) in runs {
            for &i in ids.by_ref().take(records) {
                new += self.all[i as usize].1.compared.insert_run(pos, len);
            }
        }
        new
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs noted through the cached lanes land where single lookups put them, whether the keys
    /// repeat, change order, or name new lanes.
    #[test]
    fn compare_runs_notes_what_entry_would() {
        let (mut cached, mut plain) = (Lanes::default(), Lanes::default());
        // Per frame: its keys, then its runs of (records, pos, len).
        type Frame<'a> = (&'a [LaneKey], &'a [(usize, u32, u32)]);
        let frames: [Frame; 4] =
            [(&[(0, 0), (1, 0), (2, 0)], &[(3, 5, 1)]), (&[(0, 0), (1, 0), (2, 0)], &[(2, 6, 1), (1, 6, 2)]), (&[(2, 0), (0, 0), (3, 1)], &[(3, 9, 4)]), (&[(0, 0), (1, 0), (2, 0)], &[(3, 6, 1)])];
        for (keys, runs) in frames {
            let packed_keys: Vec<u64> = keys.iter().map(|&k| packed(k)).collect();
            let new = cached.compare_runs(&packed_keys, runs.iter().copied());
            let mut want = 0;
            let mut k = keys.iter();
            for &(records, pos, len) in runs {
                for &key in k.by_ref().take(records) {
                    want += plain.entry(key).compared.insert_run(pos, len);
                }
            }
            assert_eq!(new, want, "{keys:?} {runs:?}");
        }
        let dump = |l: &Lanes| l.iter().map(|(k, lane)| (*k, lane.compared.0.clone())).collect::<Vec<_>>();
        assert_eq!(dump(&cached), dump(&plain));
        assert_eq!(cached.get((2, 0)).map(|l| l.compared.0.clone()), Some(vec![(5, 8), (9, 13)]));
        assert_eq!(cached.get((3, 1)).map(|l| l.compared.0.clone()), Some(vec![(9, 13)]));
    }
}
