//! Own record id → site, for one trace in bisect's first pass ([`crate::align::Alignment`]),
//! kept small: the records of a frame read as its summary come as one list of sites, and a
//! decoder's forward passes all list the same sites, so such a list is stored once and each
//! frame of it costs one run (16 bytes) rather than 4 bytes a record. Records fed one at a
//! time take 4 bytes each, as in a plain list. Memory written once, not grown record by record
//! through the whole run, is also memory not faulted in page by page.

use std::hash::BuildHasher;

/// Record id → site (see the module documentation).
#[derive(Debug, Default)]
pub(crate) struct SeqSites {
    /// Interned lists and records fed one at a time, end to end.
    store: Vec<u32>,
    /// Runs of consecutive record ids, by first id: (first record id, offset into `store`). A
    /// run ends where the next begins; the last one at `len`.
    runs: Vec<(u64, usize)>,
    /// The last run takes the records [`SeqSites::push`] feeds (its sites end `store`).
    open: bool,
    /// Interned lists by hash: (offset into `store`, length).
    lists: foldhash::HashMap<u64, Vec<(usize, usize)>>,
    hasher: foldhash::fast::RandomState,
    len: u64,
}

impl SeqSites {
    /// Records noted: the next record's id.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// The site of record `seq`; `None` past the last record noted.
    pub(crate) fn get(&self, seq: u64) -> Option<u32> {
        if seq >= self.len {
            return None;
        }
        // Most lookups are of the records just noted (an op's inputs): the last run first.
        let k = match self.runs.last() {
            Some(&(start, _)) if start <= seq => self.runs.len() - 1,
            _ => self.runs.partition_point(|&(start, _)| start <= seq) - 1,
        };
        let (start, at) = self.runs[k];
        self.store.get(at + (seq - start) as usize).copied()
    }

    /// Notes the next record's site.
    pub(crate) fn push(&mut self, site: u32) {
        if !self.open {
            self.runs.push((self.len, self.store.len()));
            self.open = true;
        }
        self.store.push(site);
        self.len += 1;
    }

    /// Notes the next `sites.len()` records' sites, the list stored once however often it
    /// comes.
    pub(crate) fn extend(&mut self, sites: &[u32]) {
        if sites.is_empty() {
            return;
        }
        let hash = self.hasher.hash_one(sites);
        let store = &self.store;
        let known = self.lists.get(&hash).and_then(|c| c.iter().find(|&&(at, n)| store.get(at..at + n) == Some(sites)));
        let at = match known {
            Some(&(at, _)) => at,
            None => {
                let at = self.store.len();
                self.store.extend_from_slice(sites);
                self.lists.entry(hash).or_default().push((at, sites.len()));
                at
            }
        };
        self.runs.push((self.len, at));
        self.open = false;
        self.len += sites.len() as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every record's site is the one noted, whether pushed, extended from a repeated list or
    /// from a new one, and a repeated list is stored once.
    #[test]
    fn gives_back_each_records_site() {
        let (mut s, mut want) = (SeqSites::default(), Vec::new());
        let pass: Vec<u32> = (0..600).map(|k| k * 7 % 601).collect();
        for step in 0..50u32 {
            match step % 5 {
                0 | 1 | 3 => s.extend(&pass),
                2 => (0..10).for_each(|k| s.push(step * 100 + k)),
                _ => s.extend(&[step, step + 1]),
            }
            match step % 5 {
                0 | 1 | 3 => want.extend_from_slice(&pass),
                2 => want.extend((0..10).map(|k| step * 100 + k)),
                _ => want.extend_from_slice(&[step, step + 1]),
            }
            s.extend(&[]);
        }
        assert_eq!(s.len(), want.len() as u64);
        for (seq, &site) in want.iter().enumerate() {
            assert_eq!(s.get(seq as u64), Some(site), "record {seq}");
        }
        assert_eq!(s.get(want.len() as u64), None);
        // 600 sites once, 10 pushed each of 10 steps, two each of 10 steps (all different).
        assert_eq!(s.store.len(), 600 + 100 + 20);
    }
}
