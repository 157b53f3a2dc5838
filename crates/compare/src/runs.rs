//! Sets of token positions as sorted runs: what bisect's alignment keeps per (module path, row)
//! of the positions compared, differing, and differing in non-finite values
//! ([`crate::align`]). Positions mostly arrive in order, so a set is a few runs.

/// Sorted, disjoint, half-open runs of positions (ends in u64: position `u32::MAX` is one).
#[derive(Debug, Default)]
pub(crate) struct Runs(pub(crate) Vec<(u64, u64)>);

impl Runs {
    pub(crate) fn insert(&mut self, p: u32) {
        let (p, end) = (p as u64, p as u64 + 1);
        if let Some(last) = self.0.last_mut() {
            if p == last.1 {
                last.1 = end;
                return;
            }
            if p > last.1 {
                self.0.push((p, end));
                return;
            }
        } else {
            self.0.push((p, end));
            return;
        }
        // Out of order: the first run starting after p.
        let i = self.0.partition_point(|r| r.0 <= p);
        if i > 0 && self.0[i - 1].1 > p {
            return; // already in
        }
        let joins_left = i > 0 && self.0[i - 1].1 == p;
        let joins_right = i < self.0.len() && self.0[i].0 == end;
        match (joins_left, joins_right) {
            (true, true) => {
                self.0[i - 1].1 = self.0[i].1;
                self.0.remove(i);
            }
            (true, false) => self.0[i - 1].1 = end,
            (false, true) => self.0[i].0 = p,
            (false, false) => self.0.insert(i, (p, end)),
        }
    }

    pub(crate) fn contains(&self, p: u32) -> bool {
        let p = p as u64;
        let i = self.0.partition_point(|r| r.0 <= p);
        i > 0 && self.0[i - 1].1 > p
    }

    /// Every position `0..=p` is in.
    pub(crate) fn covers_prefix(&self, p: u32) -> bool {
        self.0.first().is_some_and(|r| r.0 == 0 && r.1 > p as u64)
    }

    /// Whether a position in `lo..hi` is in.
    pub(crate) fn intersects(&self, lo: u64, hi: u64) -> bool {
        let i = self.0.partition_point(|r| r.1 <= lo);
        self.0.get(i).is_some_and(|r| r.0 < hi && lo < hi)
    }

    pub(crate) fn first(&self) -> Option<u64> {
        self.0.first().map(|r| r.0)
    }

    /// Inserts the `len` positions from `pos`: how many were not in. The runs it overlaps or
    /// touches merge into one; O(log n) besides the merge.
    #[inline]
    pub(crate) fn insert_run(&mut self, pos: u32, len: u32) -> u64 {
        let (lo, hi) = (pos as u64, pos as u64 + len as u64);
        // Positions mostly arrive in order, right after the last run (a summarised frame's
        // positions after the last frame's): that run grows. Inlined; the rest is not.
        if let Some(last) = self.0.last_mut() {
            if lo == last.1 && len > 0 {
                last.1 = hi;
                return len as u64;
            }
        }
        self.insert_run_slow(lo, hi)
    }

    #[inline(never)]
    fn insert_run_slow(&mut self, lo: u64, hi: u64) -> u64 {
        if hi == lo {
            return 0;
        }
        // Positions mostly arrive in order: at or past the last run's start.
        if let Some(last) = self.0.last_mut() {
            if lo > last.1 {
                self.0.push((lo, hi));
                return hi - lo;
            }
            if lo >= last.0 {
                let new = hi.saturating_sub(last.1);
                last.1 = last.1.max(hi);
                return new;
            }
        }
        // Runs i..j end at or after `lo` and start at or before `hi`.
        let i = self.0.partition_point(|r| r.1 < lo);
        let j = self.0.partition_point(|r| r.0 <= hi);
        let covered: u64 = self.0[i..j].iter().map(|r| r.1.min(hi).saturating_sub(r.0.max(lo))).sum();
        let merged = match self.0.get(i..j) {
            Some([first, .., last]) | Some([first @ last]) => (lo.min(first.0), hi.max(last.1)),
            _ => (lo, hi),
        };
        self.0.splice(i..j, [merged]);
        hi - lo - covered
    }
}

#[cfg(test)]
mod tests {
    use super::Runs;

    #[test]
    fn runs_merge_in_any_order() {
        let mut r = Runs::default();
        for p in [0, 1, 2, 5, 7, 6, 3, 9, 4, 0, 8] {
            r.insert(p);
        }
        assert_eq!(r.0, vec![(0, 10)]);
        let mut r = Runs::default();
        for p in [10, 4, 2, 3, 20] {
            r.insert(p);
        }
        assert_eq!(r.0, vec![(2, 5), (10, 11), (20, 21)]);
        assert!(r.contains(3) && !r.contains(5) && r.contains(10) && !r.contains(0));
        assert!(!r.covers_prefix(0));
        r.insert(0);
        r.insert(1);
        assert!(r.covers_prefix(4) && !r.covers_prefix(5));
        r.insert(u32::MAX);
        assert!(!r.contains(u32::MAX - 1) && r.contains(u32::MAX));
    }

    #[test]
    fn runs_intersect_a_range() {
        let mut r = Runs::default();
        for p in [3, 4, 9] {
            r.insert(p);
        }
        let hits: Vec<(u64, u64)> = [(0, 3), (0, 4), (5, 9), (5, 10), (4, 5), (10, 20), (2, 2), (9, 9)].into_iter().filter(|&(lo, hi)| r.intersects(lo, hi)).collect();
        assert_eq!(hits, [(0, 4), (5, 10), (4, 5)]);
    }

    /// A run inserted at once is the same as its positions one by one, and counts the new ones.
    #[test]
    fn runs_insert_a_range_as_its_positions() {
        let start = [(2u64, 5u64), (10, 11), (20, 21), (30, 40)];
        for (pos, len) in [(0u32, 1u32), (0, 2), (3, 2), (5, 5), (4, 20), (11, 9), (21, 9), (50, 3), (0, 100), (40, 1), (35, 10), (30, 5), (39, 1), (u32::MAX, 1), (u32::MAX - 2, 3)] {
            let (mut one, mut each) = (Runs(start.to_vec()), Runs(start.to_vec()));
            let new = one.insert_run(pos, len);
            let mut count = 0;
            for p in (pos as u64..pos as u64 + len as u64).map(|p| p as u32) {
                count += u64::from(!each.contains(p));
                each.insert(p);
            }
            assert_eq!((one.0, new), (each.0, count), "{pos} + {len}");
        }
    }
}
