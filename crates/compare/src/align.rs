//! Bisect's first pass: the two traces read in lockstep, item by item, each per-token op output
//! compared with the other run's at the same (module path, batch row, position) as soon as both
//! are read, and each differing one tested for matched inputs there and then.
//!
//! What it keeps does not grow with the records compared: an entry per (path, row, position)
//! read on one side and not yet on the other (a forward pass's worth when the runs schedule
//! their passes differently, whole against chunked prefill), and per (path, row) the runs of
//! positions compared and of positions that differ (a few runs each: positions arrive in order).
//! It grows with the trace by 4 bytes a record (the site of each record id, which inputs name)
//! and keeps at most [`MAX_ROOTS`] root causes, the earliest.
//!
//! Semantics are those of the report ([`crate::bisect`]): the first occurrence of a key in each
//! trace is the one compared; a root is a differing output whose inputs matched at the positions
//! it reads ([`Reads`]): its own position, the KV cache's `0..=p`, or every position of its row.
//! Where the two runs' non-finite counts differ, a `0..=p` read must also hold no non-finite
//! difference at the later positions of the pass, and such a root is judged again once every
//! position is compared: attention weighs a later key of its pass by 0, and 0 × NaN is NaN.

use crate::bound::{diff_bound, slice_len};
use crate::lanes::Lanes;
use crate::seq_sites::SeqSites;
use candle_trace_format::error::{Error, Result};
use candle_trace_format::record::{Item, OpRecord, Reads, TokenStat};
use candle_trace_format::summary::FrameSummary;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::rc::Rc;

/// Root causes kept (the earliest by position, then execution order); more are counted.
pub const MAX_ROOTS: usize = 10_000;

/// (site, compared row, position); the site is an index into [`Alignment::paths`].
type Key = (u32, u32, u32);

/// What a differing output needs of its record to be judged: its id and inputs.
#[derive(Clone, Debug, Default)]
struct RecInfo {
    seq: u64,
    /// (site of the input record, how it is read); `u32::MAX` for an input id naming no record.
    inputs: Vec<(u32, Reads)>,
    /// Index into [`Alignment::dtypes`].
    dtype: u32,
    /// The op is the model's input (token ids) and reads nothing.
    input_op: bool,
    /// One past the last position of the record's forward pass (its last key, for attention);
    /// `u32::MAX` without a sequence dim.
    pass_end: u32,
}

/// [`RecInfo`] of record `r` (its `dtype` interned, whether it is the model's input), its
/// inputs' sites looked up in `seq_site` (own record id → site); an input id at or past `r`'s own
/// names no record.
fn rec_info(seq_site: &SeqSites, r: &OpRecord, dtype: u32, input_op: bool) -> Rc<RecInfo> {
    let mut info = RecInfo::default();
    rec_info_into(&mut info, seq_site, r, dtype, input_op);
    Rc::new(info)
}

/// [`rec_info`] into `info`, whose input list is reused (no allocation once it has grown).
fn rec_info_into(info: &mut RecInfo, seq_site: &SeqSites, r: &OpRecord, dtype: u32, input_op: bool) {
    info.inputs.clear();
    for i in &r.inputs {
        let site = if i.seq < r.seq { seq_site.get(i.seq) } else { None };
        info.inputs.push((site.unwrap_or(u32::MAX), i.reads));
    }
    info.pass_end = r.axis.as_ref().and_then(|a| Some(a.first_pos.saturating_add(*r.shape.get(a.seq_dim? as usize)?))).unwrap_or(u32::MAX);
    (info.seq, info.dtype, info.input_op) = (r.seq, dtype, input_op);
}

/// One side's entry for a key the other side has not reached yet.
#[derive(Debug)]
struct Pending {
    side: usize,
    stat: TokenStat,
    rec: Rc<RecInfo>,
}

/// A differing (op, row, position) of run a, by the report's order: position, then record id in
/// a (execution order), then row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Found {
    /// Token position.
    pub pos: u32,
    /// Record id in trace a.
    pub seq_a: u64,
    /// Batch row (run a's; run b's row holding the same request is compared as it).
    pub row: u32,
    /// Record id in trace b.
    pub seq_b: u64,
}

/// One trace's part of the pass.
#[derive(Debug, Default)]
struct SideState {
    /// Own site id → index into `paths`.
    sites: Vec<u32>,
    /// Own site id → the op is `input`.
    input_op: Vec<bool>,
    /// Own site id → the layer its module path belongs to.
    layer: Vec<Option<u32>>,
    /// Own record id → its site (index into `paths`).
    seq_site: SeqSites,
    /// Own row → compared row; `None`: every row as itself.
    rows: Option<HashMap<u32, u32>>,
    /// Rows compared (run a, when b's rows are paired with some of a's): other rows are skipped.
    only: Option<HashSet<u32>>,
    exhausted: bool,
    nonfinite: crate::nonfinite::Scan,
}

/// The first pass's result: what was compared, what differs, and the root causes.
#[derive(Debug)]
pub struct Alignment {
    /// Module paths of both traces (a site of either trace is an index here).
    paths: Vec<String>,
    path_id: HashMap<String, u32>,
    dtypes: Vec<String>,
    sides: [SideState; 2],
    /// (foldhash: these maps are looked up once or twice a per-token entry; SipHash was a few
    /// percent of a bisect.)
    pending: foldhash::HashMap<Key, Pending>,
    lanes: Lanes,
    /// The paths and lane keys of the frame summary being taken (kept for their capacity).
    summary_sites: Vec<u32>,
    summary_keys: Vec<u64>,
    /// Per-token outputs compared (both traces hold the key).
    pub compared: u64,
    /// Of those, outputs whose digest or dtype differ.
    pub differing: u64,
    roots: BinaryHeap<Found>,
    /// Root causes found, kept or not.
    pub roots_total: u64,
    /// Kept roots whose difference is in non-finite values and that read an input `0..=p`,
    /// with what they read: judged again once every position is compared ([`Alignment::settle`]).
    poisoned_roots: Vec<(Found, RecInfo, u32)>,
    /// Each side's record being judged by [`Alignment::pairs`] (kept for its input list's
    /// capacity).
    judged: [RecInfo; 2],
    /// The earliest differing output of an `input` op (the token ids).
    pub input_differs: Option<Found>,
    /// The earliest differing output read from ops at different module paths in the two runs
    /// (the op graphs differ before it), whose inputs at paths both read matched: (where, a's
    /// input sites, b's).
    fork: Option<(Found, Vec<u32>, Vec<u32>)>,
    /// Trace a's first forward pass (the step of its first op record).
    first_step: Option<u32>,
    /// Layer → the site of its output: the last op the layer records in trace a's first forward
    /// pass (the residual stream after the layer), whatever the model names it.
    layer_out: HashMap<u32, u32>,
    /// Path ids of `input` ops (token ids, not activations).
    input_paths: HashSet<u32>,
    /// A site id names different paths in the two traces (each pair compared when the second
    /// of the two is declared): with equal site counts, the two site tables are the same.
    sites_differ: bool,
    /// Root causes and token-id differences found since the sources were last asked to keep
    /// their records ([`Items::keep`]).
    found_now: Vec<Found>,
    /// The traces hold a coarser level than every op (`--level layers`, `logits`): a record
    /// stands for ops that include attention over its own earlier positions (the KV cache the
    /// same layers wrote from them), which no recorded input shows.
    coarse: bool,
}

/// A source of items in file order, one at a time.
pub trait Items {
    /// Passes the next item to `f`; false when there is none.
    ///
    /// # Errors
    /// The source's read errors and `f`'s.
    fn next_into(&mut self, f: &mut dyn FnMut(&Item) -> Result<()>) -> Result<bool>;

    /// When the source stands between two frames (every item of one handed out): the next
    /// frame's items, or its summary, loaded but not handed out. Sources that are not read by
    /// frames, and sources in the middle of one, say `None` (the default).
    ///
    /// # Errors
    /// The source's read errors.
    fn whole_frame(&mut self) -> Result<Option<Whole>> {
        Ok(None)
    }

    /// Hands out every item of the frame [`Items::whole_frame`] returned, without passing them.
    fn skip_frame(&mut self) {}

    /// Keeps a copy of op record `seq`, one of the items handed out, if it is still at hand
    /// (in the frame being handed out): pass 1 found it a root cause, and a report reads it.
    /// Sources that keep nothing (the default) say false.
    fn keep(&mut self, _seq: u64) -> bool {
        false
    }
}

/// A frame as [`Items::whole_frame`] gives it.
pub enum Whole {
    /// Its items (the same `Arc` on both sides when both files hold the frame and it was
    /// decoded once).
    Items(std::sync::Arc<Vec<Item>>),
    /// Its summary, in place of the items (a frame both files hold identically, not decoded),
    /// and the frame's ordinal among its file's items frames.
    Summary(std::sync::Arc<FrameSummary>, usize),
}

impl Items for std::slice::Iter<'_, Item> {
    fn next_into(&mut self, f: &mut dyn FnMut(&Item) -> Result<()>) -> Result<bool> {
        match self.next() {
            Some(item) => f(item).map(|_| true),
            None => Ok(false),
        }
    }
}

impl Alignment {
    /// Runs the pass over a's and b's items, both holding `level`'s records. `b_rows`: b's own
    /// row → the row of a it is compared as (rows absent are not compared; a's rows outside its
    /// values are skipped); `None`: every row as itself. Below `ops`, an output that differs
    /// while its inputs matched is no root where an earlier position of the same record's site
    /// (and row) already differs: it may have inherited that difference through the KV cache
    /// its unrecorded attention reads, as the `k_cache` and `v_cache` records of an `ops` trace
    /// show (a chunked prefill's decode steps are then not roots of their own).
    ///
    /// # Errors
    /// The sources' errors; a site declared out of order, a record naming an undeclared site or
    /// numbered out of order ([`Error::Refused`]-like, naming `names`' file).
    pub fn run(level: candle_trace_format::site::Level, a: &mut dyn Items, b: &mut dyn Items, b_rows: Option<HashMap<u32, u32>>, names: [&std::path::Path; 2]) -> Result<Self> {
        let only = b_rows.as_ref().map(|m| m.values().copied().collect());
        let mut al = Alignment {
            paths: Vec::new(),
            path_id: HashMap::new(),
            dtypes: Vec::new(),
            sides: [SideState { only, ..SideState::default() }, SideState { rows: b_rows, ..SideState::default() }],
            pending: foldhash::HashMap::default(),
            lanes: Lanes::default(),
            summary_sites: Vec::new(),
            summary_keys: Vec::new(),
            compared: 0,
            differing: 0,
            roots: BinaryHeap::new(),
            roots_total: 0,
            poisoned_roots: Vec::new(),
            judged: Default::default(),
            input_differs: None,
            fork: None,
            input_paths: HashSet::new(),
            first_step: None,
            layer_out: HashMap::new(),
            sites_differ: false,
            found_now: Vec::new(),
            coarse: level != candle_trace_format::site::Level::Ops,
        };
        let sources: [&mut dyn Items; 2] = [a, b];
        loop {
            // The records of what was just found, while both sides still hold them.
            for f in al.found_now.drain(..) {
                sources[0].keep(f.seq_a);
                sources[1].keep(f.seq_b);
            }
            let (ea, eb) = (al.sides[0].exhausted, al.sides[1].exhausted);
            let side = match (ea, eb) {
                (true, true) => break,
                (true, false) => 1,
                (false, true) => 0,
                // The side that has read fewer records: both list one model's ops in order.
                _ => usize::from(al.sides[1].seq_site.len() < al.sides[0].seq_site.len()),
            };
            if !ea && !eb && al.in_step() {
                // Both files stand between frames after the same records: a frame both hold
                // (decoded once) is compared whole.
                let same = match (sources[0].whole_frame()?, sources[1].whole_frame()?) {
                    (Some(Whole::Items(fa)), Some(Whole::Items(fb))) if std::sync::Arc::ptr_eq(&fa, &fb) => al.both(&fa).map(|_| true),
                    // Frames that differ, holding the same records: compared record by record.
                    (Some(Whole::Items(fa)), Some(Whole::Items(fb))) if paired(&fa, &fb) => al.pairs(&fa, &fb).map(|_| true),
                    // Summaries stand for the frames only past trace a's first forward pass
                    // and while no non-finite value is still to be found.
                    (Some(Whole::Summary(sa, ka)), Some(Whole::Summary(sb, kb))) if ka == kb && sa == sb && al.summary_fits(&sa) => al.both_summary(&sa).map(|_| true),
                    _ => Ok(false),
                };
                if same.map_err(|(side, msg)| Error::trace(names[side], msg))? {
                    sources[0].skip_frame();
                    sources[1].skip_frame();
                    continue;
                }
            }
            let more = sources[side].next_into(&mut |item| al.feed(side, item).map_err(|msg| Error::trace(names[side], msg)))?;
            if !more {
                al.sides[side].exhausted = true;
            }
        }
        al.settle();
        Ok(al)
    }

    /// Drops the roots whose difference is in non-finite values when one of their `0..=p`
    /// inputs holds a non-finite difference at a later position of their pass compared after
    /// them: the pass that held that later key brought its NaN to the earlier query through
    /// attention's zero weight, and the other run, chunked otherwise, computed that key in a
    /// later pass.
    fn settle(&mut self) {
        let late = |(f, rec, end): &(Found, RecInfo, u32)| rec.inputs.iter().any(|&(site, reads)| reads == Reads::Prefix && self.later_nonfinite(site, f.row, f.pos, *end));
        let dropped: HashSet<Found> = self.poisoned_roots.iter().filter(|x| late(x)).map(|x| x.0).collect();
        if !dropped.is_empty() {
            let kept = self.roots.len();
            self.roots.retain(|f| !dropped.contains(f));
            self.roots_total -= (kept - self.roots.len()) as u64;
        }
    }

    fn intern_path(&mut self, path: &str) -> u32 {
        if let Some(&id) = self.path_id.get(path) {
            return id;
        }
        let id = self.paths.len() as u32;
        self.paths.push(path.to_string());
        self.path_id.insert(path.to_string(), id);
        id
    }

    fn intern_dtype(&mut self, dtype: &str) -> u32 {
        match self.dtypes.iter().position(|d| d == dtype) {
            Some(i) => i as u32,
            None => {
                self.dtypes.push(dtype.to_string());
                self.dtypes.len() as u32 - 1
            }
        }
    }

    fn feed(&mut self, side: usize, item: &Item) -> std::result::Result<(), String> {
        self.sides[side].nonfinite.feed(item);
        match item {
            Item::Site { id, path, op } => {
                if *id as usize != self.sides[side].sites.len() {
                    return Err(format!("site ids out of order at site {id}"));
                }
                let pid = self.intern_path(path);
                let input = candle_trace_format::site::Op::parse(op) == Some(candle_trace_format::site::Op::Input);
                if input {
                    self.input_paths.insert(pid);
                }
                self.sites_differ |= self.sides[1 - side].sites.get(*id as usize).is_some_and(|&other| other != pid);
                let s = &mut self.sides[side];
                s.sites.push(pid);
                s.input_op.push(input);
                s.layer.push(candle_trace_format::site::layer_of(path));
            }
            Item::Op(r) => self.op(side, r)?,
            _ => {}
        }
        Ok(())
    }

    /// Whether both sides have read the same sites and records, compare every row as itself and
    /// have no key waiting: then a stretch of items both hold compares equal key by key
    /// ([`Alignment::both`]).
    fn in_step(&self) -> bool {
        let [a, b] = &self.sides;
        self.pending.is_empty() && a.rows.is_none() && a.only.is_none() && b.rows.is_none() && a.seq_site.len() == b.seq_site.len() && a.sites.len() == b.sites.len() && !self.sites_differ
    }

    /// Feeds `items`, which both sides read next, [`Alignment::in_step`]: what feeding them to
    /// each side would do, without the per-key waiting (every key compares equal). Errors name
    /// the side.
    fn both(&mut self, items: &[Item]) -> std::result::Result<(), (usize, String)> {
        for item in items {
            let Item::Op(r) = item else {
                for side in 0..2 {
                    self.feed(side, item).map_err(|m| (side, m))?;
                }
                continue;
            };
            for side in 0..2 {
                self.sides[side].nonfinite.feed(item);
            }
            let site = self.record(0, r).map_err(|m| (0, m))?;
            self.sides[1].seq_site.push(site);
            for t in &r.tokens {
                let lane = self.lanes.entry((site, t.row));
                if !lane.compared.contains(t.pos) {
                    lane.compared.insert(t.pos);
                    self.compared += 1;
                }
            }
        }
        Ok(())
    }

    /// Feeds frames `a` and `b`, which the two sides read next, [`Alignment::in_step`] and
    /// [`paired`]: what feeding them item by item does (a's record, then b's, whose keys meet
    /// a's), without the per-key waiting: each pair of records compared key by key and a key
    /// that differs judged at once. A record reading an earlier output of its own op (whose
    /// waiting keys its judgement could see) is fed item by item. Errors name the side.
    fn pairs(&mut self, a: &[Item], b: &[Item]) -> std::result::Result<(), (usize, String)> {
        for (ia, ib) in a.iter().zip(b) {
            let (ra, rb) = match (ia, ib) {
                (Item::Op(ra), Item::Op(rb)) if !ra.tokens.is_empty() && !self.reads_own_op(0, ra) && !self.reads_own_op(1, rb) => (ra, rb),
                _ => {
                    self.feed(0, ia).map_err(|m| (0, m))?;
                    self.feed(1, ib).map_err(|m| (1, m))?;
                    continue;
                }
            };
            self.sides[0].nonfinite.feed(ia);
            let site = self.record(0, ra).map_err(|m| (0, m))?;
            self.sides[1].nonfinite.feed(ib);
            self.record(1, rb).map_err(|m| (1, m))?;
            let same_dtype = ra.dtype == rb.dtype;
            // The two records as judged, made when a key first differs.
            let (mut judged, mut made) = (std::mem::take(&mut self.judged), false);
            for (ta, tb) in ra.tokens.iter().zip(&rb.tokens) {
                let lane = self.lanes.entry((site, ta.row));
                if lane.compared.contains(ta.pos) {
                    continue; // a later occurrence: the first is the one compared
                }
                if ta.digest == tb.digest && same_dtype {
                    lane.compared.insert(ta.pos);
                    self.compared += 1;
                    continue;
                }
                if !made {
                    let da = self.intern_dtype(&ra.dtype);
                    let db = if same_dtype { da } else { self.intern_dtype(&rb.dtype) };
                    // Each side's own site, as the item-by-item path reads it.
                    let [sa, sb] = &self.sides;
                    rec_info_into(&mut judged[0], &sa.seq_site, ra, da, sa.input_op[ra.site as usize]);
                    rec_info_into(&mut judged[1], &sb.seq_site, rb, db, sb.input_op[rb.site as usize]);
                    made = true;
                }
                self.resolve((site, ta.row, ta.pos), (ta, &judged[0]), (tb, &judged[1]), || slice_len(rb, tb.row, tb.pos));
            }
            self.judged = judged;
        }
        Ok(())
    }

    /// Whether record `r` of side `side` reads an earlier output of its own op (its site's).
    fn reads_own_op(&self, side: usize, r: &OpRecord) -> bool {
        let s = &self.sides[side];
        r.inputs.iter().any(|i| s.seq_site.get(i.seq) == s.sites.get(r.site as usize).copied())
    }

    /// Whether [`Alignment::both_summary`] stands for feeding the frame summarised by `s` to
    /// [`Alignment::both`]: trace a's first forward pass is known and the frame's records are
    /// all in it or all past it (its layer outputs are noted from the summary's sites), and
    /// the frame holds no non-finite value that counts, or both traces' first one is found.
    fn summary_fits(&self, s: &FrameSummary) -> bool {
        let steps = self.first_step.is_some_and(|f| s.steps.0 > f || s.steps == (f, f));
        let finite = !s.nonfinite || self.sides.iter().all(|x| x.nonfinite.found.is_some());
        steps && finite
    }

    /// [`Alignment::both`] of a frame both sides hold identically, from its summary: each
    /// record's site, the runs of positions compared (all equal).
    fn both_summary(&mut self, s: &FrameSummary) -> std::result::Result<(), (usize, String)> {
        let first = self.first_step.is_some_and(|f| s.steps == (f, f));
        // The records' own sites, then their paths, in place (the reader checked the count).
        let mut paths = std::mem::take(&mut self.summary_sites);
        s.sites_into(&mut paths);
        for own in paths.iter_mut() {
            let Some(&site) = self.sides[0].sites.get(*own as usize) else {
                return Err((0, format!("a frame summary names unknown site {own}")));
            };
            if first {
                if let Some(l) = self.sides[0].layer[*own as usize] {
                    self.layer_out.insert(l, site);
                }
            }
            *own = site;
        }
        for side in &mut self.sides {
            side.seq_site.extend(&paths);
        }
        // Each run's records' lanes, in order; a frame like the last one (a decode step's) names
        // the same lanes, found once.
        let mut keys = std::mem::take(&mut self.summary_keys);
        keys.clear();
        for k in s.runs() {
            let Some(sites) = paths.get(k.record as usize..(k.record as usize).saturating_add(k.records as usize)) else {
                return Err((0, format!("a frame summary names records {}..{} of {}", k.record, k.record as u64 + k.records as u64, paths.len())));
            };
            keys.extend(sites.iter().map(|&site| crate::lanes::packed((site, k.row))));
        }
        self.compared += self.lanes.compare_runs(&keys, s.runs().map(|k| (k.records as usize, k.pos, k.len)));
        self.summary_keys = keys;
        self.summary_sites = paths;
        Ok(())
    }

    /// Checks record `r` of `side` (its site declared, its id the next) and notes it: its site
    /// (returned, an index into `paths`), the layer it ends in trace a's first forward pass.
    fn record(&mut self, side: usize, r: &OpRecord) -> std::result::Result<u32, String> {
        let s = &self.sides[side];
        let Some(&site) = s.sites.get(r.site as usize) else {
            return Err(format!("record {} names unknown site {}", r.seq, r.site));
        };
        if r.seq != s.seq_site.len() {
            return Err(format!("record {} where {} was expected", r.seq, s.seq_site.len()));
        }
        if side == 0 && *self.first_step.get_or_insert(r.step) == r.step {
            if let Some(l) = s.layer[r.site as usize] {
                self.layer_out.insert(l, site);
            }
        }
        self.sides[side].seq_site.push(site);
        Ok(site)
    }

    fn op(&mut self, side: usize, r: &OpRecord) -> std::result::Result<(), String> {
        let site = self.record(side, r)?;
        let input_op = self.sides[side].input_op[r.site as usize];
        if r.tokens.is_empty() || (self.sides[1 - side].exhausted && self.pending.is_empty()) {
            return Ok(()); // nothing of it can be compared per token
        }
        // Once the other trace has ended, only keys it read can still be compared.
        let other_ended = self.sides[1 - side].exhausted;
        let dtype = self.intern_dtype(&r.dtype);
        // What judging the record needs, made only when a key of it waits for the other side or
        // differs: most keys arrive second and match.
        let mut rec: Option<Rc<RecInfo>> = None;
        for t in &r.tokens {
            let s = &self.sides[side];
            let row = match &s.rows {
                None => t.row,
                Some(m) => match m.get(&t.row) {
                    Some(&c) => c,
                    None => continue,
                },
            };
            if s.only.as_ref().is_some_and(|o| !o.contains(&row)) {
                continue;
            }
            let key = (site, row, t.pos);
            let lane = self.lanes.entry((site, row));
            if lane.compared.contains(t.pos) {
                continue; // a later occurrence: the first is the one compared
            }
            match self.pending.get(&key) {
                Some(p) if p.side == side => continue,
                Some(p) if p.stat.digest == t.digest && p.rec.dtype == dtype => {
                    // Both sides read and identical: what `resolve` does with a match.
                    self.pending.remove(&key);
                    lane.pending -= 1;
                    lane.compared.insert(t.pos);
                    self.compared += 1;
                }
                Some(_) => {
                    let other = self.pending.remove(&key).expect("just seen");
                    lane.pending -= 1;
                    let rec = rec.get_or_insert_with(|| rec_info(&self.sides[side].seq_site, r, dtype, input_op)).clone();
                    let (mine, theirs) = ((t, &*rec), (&other.stat, &*other.rec));
                    let (pa, pb) = if side == 0 { (mine, theirs) } else { (theirs, mine) };
                    self.resolve(key, pa, pb, || slice_len(r, t.row, t.pos));
                }
                None if other_ended => {}
                None => {
                    lane.pending += 1;
                    let rec = rec.get_or_insert_with(|| rec_info(&self.sides[side].seq_site, r, dtype, input_op)).clone();
                    self.pending.insert(key, Pending { side, stat: t.clone(), rec });
                }
            }
        }
        Ok(())
    }

    /// Both sides of `key` are read: compare them, and judge a differing one (`n`: the slice's
    /// element count, for the bound on the difference).
    fn resolve(&mut self, (site, row, pos): Key, (sa, ra): (&TokenStat, &RecInfo), (sb, rb): (&TokenStat, &RecInfo), n: impl FnOnce() -> Option<usize>) {
        self.compared += 1;
        let lane = self.lanes.get_mut((site, row)).expect("lane of a pending key");
        lane.compared.insert(pos);
        if sa.digest == sb.digest && ra.dtype == rb.dtype {
            return;
        }
        self.differing += 1;
        lane.differing.insert(pos);
        // A difference in non-finite values can come from positions past `pos` that the pass
        // held: 0 × NaN is NaN where attention weighs a later key by 0.
        let poisoned = sa.nonfinite != sb.nonfinite;
        if poisoned {
            lane.nonfinite.insert(pos);
        }
        // Where such a difference may have come from: up to the end of the longer of the two
        // passes that computed this output.
        let poisoned = poisoned.then(|| ra.pass_end.max(rb.pass_end));
        lane.diffs.push((pos, diff_bound(sa, sb, n()).0 as f32));
        let found = Found { pos, seq_a: ra.seq, row, seq_b: rb.seq };
        if ra.inputs.is_empty() && ra.input_op {
            if self.input_differs.is_none_or(|f| found < f) {
                self.input_differs = Some(found);
                self.found_now.push(found);
            }
            return;
        }
        if self.inputs_match(ra, rb, row, pos, poisoned) && !self.earlier_own_difference(site, row, pos) {
            self.roots_total += 1;
            // Kept (below): one of the MAX_ROOTS earliest so far.
            if self.roots.len() < MAX_ROOTS || self.roots.peek().is_some_and(|last| found < *last) {
                self.found_now.push(found);
            }
            self.roots.push(found);
            if let Some(end) = poisoned.filter(|_| self.poisoned_roots.len() < MAX_ROOTS && ra.inputs.iter().any(|i| i.1 == Reads::Prefix)) {
                self.poisoned_roots.push((found, ra.clone(), end));
            }
            if self.roots.len() > MAX_ROOTS {
                self.roots.pop();
            }
        } else if self.fork.as_ref().is_none_or(|f| found < f.0) && self.forks(ra, rb, row, pos, poisoned) {
            let sites = |r: &RecInfo| r.inputs.iter().map(|i| i.0).collect();
            self.fork = Some((found, sites(ra), sites(rb)));
        }
    }

    /// At a coarse level ([`Alignment::run`]): whether the output of `site` for `row` already
    /// differs at a position before `pos`.
    fn earlier_own_difference(&self, site: u32, row: u32, pos: u32) -> bool {
        self.coarse && self.lanes.get((site, row)).is_some_and(|l| l.differing.first().is_some_and(|d| d < pos as u64))
    }

    /// Whether `a` and `b` read ops at different module paths (the graphs differ, as when a
    /// kernel is chosen by batch size) with nothing upstream to blame: every input both runs
    /// computed at (row, pos) matched, and so did the compared inputs of each input only one run
    /// computed there (a skipped mask, whose input differs, is no fork).
    fn forks(&self, a: &RecInfo, b: &RecInfo, row: u32, pos: u32, poisoned: Option<u32>) -> bool {
        // Called for most differing outputs of a diverged pair: no allocation.
        fn sites(r: &RecInfo) -> impl Iterator<Item = u32> + '_ {
            r.inputs.iter().map(|i| i.0)
        }
        if sites(a).eq(sites(b)) || sites(a).chain(sites(b)).any(|x| x == u32::MAX) {
            return false;
        }
        let compared = |site: u32| self.lanes.get((site, row)).is_some_and(|l| l.compared.contains(pos));
        let upstream_matched = |&(site, reads): &(u32, Reads)| {
            if compared(site) {
                return self.input_matches((site, reads), row, pos, poisoned);
            }
            // One run's own op here: judge what it read.
            self.pending.get(&(site, row, pos)).is_none_or(|p| p.rec.inputs.iter().filter(|i| compared(i.0)).all(|&i| self.input_matches(i, row, pos, poisoned)))
        };
        a.inputs.iter().chain(&b.inputs).all(upstream_matched)
    }

    /// Whether records `a` and `b` read identical inputs at (row, pos) (`poisoned`: for an output
    /// whose non-finite counts differ, see [`Alignment::input_matches`]). Inputs from different
    /// module paths do not match (the graphs differ there).
    fn inputs_match(&self, a: &RecInfo, b: &RecInfo, row: u32, pos: u32, poisoned: Option<u32>) -> bool {
        a.inputs.len() == b.inputs.len() && a.inputs.iter().zip(&b.inputs).all(|(&(sa, reads), &(sb, _))| sa == sb && self.input_matches((sa, reads), row, pos, poisoned))
    }

    /// Whether the input at site `site`, read as `reads` by the output at (row, pos), was
    /// compared and identical. For a `poisoned` output (its two runs' non-finite counts differ;
    /// `Some(end)`, one past the last position of the longer of their passes), a `Prefix` input
    /// must also hold no difference in non-finite values at the positions `pos + 1 .. end`
    /// compared so far: a NaN at a later key of the same pass reaches `pos` through the zero
    /// weight attention gives it (0 × NaN = NaN), which the exact dependence `0..=pos` leaves
    /// out.
    fn input_matches(&self, (site, reads): (u32, Reads), row: u32, pos: u32, poisoned: Option<u32>) -> bool {
        if site == u32::MAX {
            return false;
        }
        let Some(lane) = self.lanes.get((site, row)) else { return false };
        match reads {
            Reads::Same => lane.compared.contains(pos) && !lane.differing.contains(pos),
            Reads::Prefix => lane.compared.covers_prefix(pos) && lane.differing.first().is_none_or(|d| d > pos as u64) && !poisoned.is_some_and(|end| self.later_nonfinite(site, row, pos, end)),
            Reads::All => lane.compared.first().is_some() && lane.differing.first().is_none() && lane.pending == 0,
        }
    }

    /// Whether the input at `site` holds, for row `row`, a difference in non-finite values at a
    /// position after `pos` and before `end` (the pass of the output that read it).
    fn later_nonfinite(&self, site: u32, row: u32, pos: u32, end: u32) -> bool {
        self.lanes.get((site, row)).is_some_and(|l| l.nonfinite.intersects(pos as u64 + 1, end as u64))
    }

    /// The earliest differing output whose two runs read ops at different module paths, all
    /// inputs at shared paths matching: where, and the module paths it read in a and in b.
    pub fn fork(&self) -> Option<(Found, Vec<&str>, Vec<&str>)> {
        let (f, a, b) = self.fork.as_ref()?;
        let names = |v: &[u32]| v.iter().filter_map(|&s| self.paths.get(s as usize).map(String::as_str)).collect();
        Some((*f, names(a), names(b)))
    }

    /// The root causes kept, in (position, execution, row) order.
    pub fn roots(&self) -> Vec<Found> {
        let mut v = self.roots.clone().into_vec();
        v.sort_unstable();
        v
    }

    /// Whether `path` is an `input` op's (its values are token ids, not activations).
    pub fn is_input(&self, path: &str) -> bool {
        self.path_id.get(path).is_some_and(|i| self.input_paths.contains(i))
    }

    /// Whether the outputs of `path` at (compared row, pos) were compared and are identical.
    pub fn matched(&self, path: &str, row: u32, pos: u32) -> bool {
        let Some(&site) = self.path_id.get(path) else { return false };
        self.lanes.get((site, row)).is_some_and(|l| l.compared.contains(pos) && !l.differing.contains(pos))
    }

    /// Batch row `row`'s (a's row) numeric op outputs by module path and position: per path
    /// (in [`Alignment::per_path`]'s order; `None` for an `input` op, whose values are token
    /// ids), each compared position with its lower bound of max |a - b| (0: identical;
    /// `f64::MIN_POSITIVE`: differs below the statistics' resolution; NaN: a NaN or ±Inf on one
    /// side).
    pub fn per_position(&self, row: u32) -> Vec<Option<Vec<(u32, f64)>>> {
        let mut out: Vec<Option<Vec<(u32, f64)>>> = self.paths.iter().enumerate().map(|(i, _)| (!self.input_paths.contains(&(i as u32))).then(Vec::new)).collect();
        for (&(site, r), lane) in self.lanes.iter() {
            let Some(Some(cells)) = out.get_mut(site as usize).filter(|_| r == row) else { continue };
            let diffs: HashMap<u32, f64> = lane.diffs.iter().map(|&(p, d)| (p, d as f64)).collect();
            for &(start, end) in &lane.compared.0 {
                // Positions are u32; a run past that is a corrupt lane, cut.
                for p in (start..end.min(u32::MAX as u64 + 1)).map(|p| p as u32) {
                    let d = if lane.differing.contains(p) { diffs.get(&p).copied().filter(|d| *d > 0.0 || d.is_nan()).unwrap_or(f64::MIN_POSITIVE) } else { 0.0 };
                    cells.push((p, d));
                }
            }
        }
        out
    }

    /// Per module path (in the order paths were first seen), what was compared over every row
    /// and position: (path, entries compared, entries that differ, lower bound of max |a - b|,
    /// NaN when a NaN or ±Inf appears on one side only).
    pub fn per_path(&self) -> Vec<(&str, u64, u64, f64)> {
        let mut out: Vec<(&str, u64, u64, f64)> = self.paths.iter().map(|p| (p.as_str(), 0, 0, 0.0)).collect();
        for (&(site, _), lane) in self.lanes.iter() {
            let Some(x) = out.get_mut(site as usize) else { continue };
            x.1 += lane.compared.0.iter().map(|r| r.1 - r.0).sum::<u64>();
            x.2 += lane.differing.0.iter().map(|r| r.1 - r.0).sum::<u64>();
            for &(_, d) in &lane.diffs {
                x.3 = if d.is_nan() || x.3.is_nan() { f64::NAN } else { x.3.max(d as f64) };
            }
        }
        out
    }

    /// The module path of layer `layer`'s output: the last op that layer records in trace a's
    /// first forward pass (`layers.3.mlp_residual` in the decoders here,
    /// `encoder.layer.3.output.LayerNorm` in BERT, the last probe of a layer in a model traced
    /// with `Tracer::probe`). `None` for a layer trace a never recorded.
    pub fn layer_output(&self, layer: u32) -> Option<&str> {
        self.layer_out.get(&layer).and_then(|&s| self.paths.get(s as usize)).map(String::as_str)
    }

    /// The module path of record `seq` of trace a (0) or b (1).
    pub fn path_of(&self, side: usize, seq: u64) -> Option<&str> {
        let site = self.sides[side].seq_site.get(seq)?;
        self.paths.get(site as usize).map(String::as_str)
    }

    /// The outputs of `path` at compared row `row`, position by position: (position, lower bound
    /// of max |a - b|, 0 where identical), in position order, for every position compared.
    pub fn drift(&self, path: &str, row: u32) -> Vec<(u32, f64)> {
        let Some(lane) = self.path_id.get(path).and_then(|&s| self.lanes.get((s, row))) else { return Vec::new() };
        let diffs: HashMap<u32, f32> = lane.diffs.iter().copied().collect();
        lane.compared.0.iter().flat_map(|&(lo, hi)| lo..hi).map(|p| (p as u32, diffs.get(&(p as u32)).map_or(0.0, |&d| d as f64))).collect()
    }

    /// Op records read from trace a (0) or b (1).
    pub fn records(&self, side: usize) -> usize {
        self.sides[side].seq_site.len() as usize
    }

    /// Each trace's first non-finite op output.
    pub fn nonfinite(&self) -> [Option<crate::nonfinite::NonFinite>; 2] {
        [self.sides[0].nonfinite.found.clone(), self.sides[1].nonfinite.found.clone()]
    }
}

/// Whether frames `a` and `b` hold the same records in the same order ([`Alignment::pairs`]):
/// the same kind of item at each index, and op records with the same id, own site and token
/// keys (row, position), key for key.
fn paired(a: &[Item], b: &[Item]) -> bool {
    let same_keys = |p: &OpRecord, q: &OpRecord| p.tokens.len() == q.tokens.len() && p.tokens.iter().zip(&q.tokens).all(|(s, t)| s.row == t.row && s.pos == t.pos);
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| match (x, y) {
            (Item::Op(p), Item::Op(q)) => p.seq == q.seq && p.site == q.site && same_keys(p, q),
            (Item::Op(_), _) | (_, Item::Op(_)) => false,
            _ => true,
        })
}
