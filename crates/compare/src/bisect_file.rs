//! [`bisect`](crate::bisect::bisect) of two trace files without reading either whole.
//!
//! Pass 1 reads both files a frame at a time in lockstep ([`Alignment`]), and keeps the small
//! items a report always reads (sites, forward passes, generated tokens, embeddings, the token-id
//! and logits records, records without a token axis), plus a note per items frame: its checksum,
//! the records and positions it holds, whether it holds dumped values. Each file has a reading
//! thread, which checks its frames in order, and a scanning thread ([`Scan`]) decoding every
//! other frame ahead of it; a frame both files store the same is decoded once and compared
//! whole, one both hold identically is read as its summary, and two that differ but hold the
//! same records are compared record against record. Pass 1 keeps each root cause's record as
//! it finds it. Pass 2, for both files at once, decompresses only the frames holding a record
//! the report names and pass 1 did not keep (the ops at the reported root's position, root
//! causes past pass 1's budget) or a dumped value, going straight to them by where the frame
//! comparison found each frame ([`Skip::index`]: no header between them is read, and each
//! frame read must still have the checksum pass 1 noted); a frame wanted for root causes only
//! is read for those records alone ([`Skip::records_only`]). Memory stays near a few frames
//! per file (the channels between the threads are bounded), the kept items, the report, and
//! per file 8 bytes an items frame (the index) and a record id → site map that takes 16 bytes
//! a frame read as its summary and 4 a record read one by one (`seq_sites.rs`).

use crate::align::{Alignment, Items, Whole};
use candle_trace_format::error::Result;
use candle_trace_format::format::{Decoded, Next, Scan, Skip, Stored, Trace, TraceReader};
use candle_trace_format::record::Item;
use candle_trace_format::summary::FrameSummary;
use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TryRecvError};
use std::sync::Arc;

/// What pass 1 notes of one items frame.
#[derive(Debug)]
struct FrameNote {
    sum: u64,
    /// (op records, sites) before the frame.
    before: (u64, u32),
    /// Record ids in the frame: `first..end`.
    seqs: (u64, u64),
    /// Smallest and largest token position of its records (`None`: no per-token entry).
    positions: Option<(u32, u32)>,
    /// It holds dumped values or operands (read in pass 2: values may span frames).
    values: bool,
}

/// An items frame as pass 1's reading thread hands it over: its items, the (op records, sites)
/// before it, its checksum, and where to free it when it was decoded on a scanning thread.
struct Frame {
    items: Arc<Vec<Item>>,
    /// The frame's summary and offset, read in place of its items (`items` is then empty).
    summary: Option<(Arc<FrameSummary>, u64)>,
    before: (u64, u32),
    sum: u64,
    /// It held value parts (joined into a value in a later frame and dropped from `items`).
    parts: bool,
    home: Option<SpentTo>,
}

/// A frame handed out: back to the thread that decoded it, whose next frame is read into its
/// op records (no allocation a record), or freed there when another holds it too (memory freed
/// by the thread that allocated it is reused at once, where freeing it on another took glibc's
/// arena lock for every record). A full channel (the thread is behind): freed here.
type SpentTo = SyncSender<Arc<Vec<Item>>>;

/// Frames decoded ahead of a reading thread ([`Scan`]): its own file's even (run a) or odd
/// (run b) frames, and the other file's other frames, taken when its own are stored the same.
/// Two runs' frames decode on two threads ahead of their checks, and the frames both runs hold
/// decode once.
struct Ahead {
    parity: usize,
    own: Receiver<Decoded>,
    other: Receiver<Decoded>,
    /// Set while pass 1 waits for this file's next frame: the thread then decodes rather than
    /// wait for the other file's.
    hungry: Arc<AtomicBool>,
    /// Items frames the other file's scan has passed (a frame it passed and that is not in
    /// `other` was not decoded there, or was dropped as this thread was behind).
    other_passed: Arc<AtomicUsize>,
    /// The scanning threads, to free their frames there: this file's, the other's.
    homes: [SpentTo; 2],
}

/// How long [`find`] waits for a frame decoded ahead.
enum Wait<'a> {
    /// Until it comes or the scan ends: this file's own scan, which sends every frame it
    /// decodes and waits for nothing else.
    Always,
    /// While pass 1 is not waiting for this file (the flag), and the scan has not passed the
    /// frame (the count of frames it passed).
    Unless(&'a AtomicBool, &'a AtomicUsize),
    /// Not at all: only one already there.
    Never,
}

/// The frame decoded ahead with ordinal `s.ordinal` (from `from`), if it is there or comes
/// while `wait` allows; `held`: one received ahead of this one.
fn find(s: &Stored<'_>, from: &Receiver<Decoded>, wait: Wait<'_>, held: &mut Option<Decoded>) -> Option<Decoded> {
    loop {
        match held.take() {
            Some(d) if d.ordinal > s.ordinal => {
                *held = Some(d);
                return None;
            }
            Some(d) if d.ordinal == s.ordinal => return Some(d),
            _ => {}
        }
        let got = match wait {
            Wait::Always => from.recv().ok(),
            Wait::Never => from.try_recv().ok(),
            Wait::Unless(hungry, passed) => match from.try_recv() {
                Ok(d) => Some(d),
                Err(TryRecvError::Disconnected) => None,
                // The scan has passed the frame (dropped as this thread was behind, or not
                // decoded there): one last look, then decode.
                Err(TryRecvError::Empty) if passed.load(Ordering::Acquire) > s.ordinal => from.try_recv().ok(),
                // Else wait a millisecond at a time, and no longer once pass 1 waits for this
                // file (the other file's scan may wait for pass 1).
                Err(TryRecvError::Empty) => match from.recv_timeout(std::time::Duration::from_millis(1)) {
                    Ok(d) => Some(d),
                    Err(RecvTimeoutError::Timeout) if !hungry.load(Ordering::Relaxed) => continue,
                    Err(RecvTimeoutError::Timeout) => from.try_recv().ok(),
                    Err(RecvTimeoutError::Disconnected) => None,
                },
            },
        };
        *held = Some(got?);
    }
}

/// A thread decoding `scan`'s frames ahead: each to its file's reading thread (`own`, which
/// waits for it) and offered to the other file's (`other`, dropped when that one is behind),
/// counting in `passed` the frames the scan has passed; frames handed back on `back` are read
/// into again (or freed) here. It ends with the scan (at the file's end, a frame that does not decode, dumped values)
/// or when its reading thread is gone.
fn scanning(scan: Option<Scan>, own: SyncSender<Decoded>, other: SyncSender<Decoded>, passed: Arc<AtomicUsize>, back: Receiver<Arc<Vec<Item>>>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let Some(mut scan) = scan else { return };
        while let Some(d) = scan.next_frame() {
            // A frame only this side held is read into again; one still shared is freed.
            back.try_iter().filter_map(|f| Arc::try_unwrap(f).ok()).for_each(|f| scan.recycle(f));
            let _ = other.try_send(d.clone());
            passed.store(scan.passed(), Ordering::Release);
            if own.send(d).is_err() {
                return;
            }
        }
        // The rest is decoded by the reading threads: neither waits for this scan.
        passed.store(usize::MAX, Ordering::Release);
    })
}

/// A file's reading thread in pass 1 ([`Pass1`]): reads and checks its frames in order
/// (taking those decoded ahead, `ahead`, as [`find`] allows; reading those `summarised` marks
/// as their summaries) and hands them to `tx`, those read as summaries in runs; frames handed
/// back on `back` are read into again. Returns the reader at the file's end, at an error (sent
/// first) or when pass 1 has stopped.
fn reading(mut reader: Reader, ahead: Option<Ahead>, summarised: Arc<[bool]>, tx: SyncSender<Vec<Result<Option<Frame>>>>, back: Receiver<Arc<Vec<Item>>>) -> Reader {
    // `in_step`: the last of the other file's frames offered here was this file's (else
    // this thread stops waiting for them, and takes one only when it is there, until
    // one is this file's again).
    let (mut held, mut in_step) = ([None, None], true);
    let mut run = Vec::new();
    loop {
        back.try_iter().filter_map(|f| Arc::try_unwrap(f).ok()).for_each(|f| reader.recycle(f));
        let (ops, sites, _) = reader.position();
        // The frame offered (a clone: its address stays its own until compared).
        let mut offered: Option<(Arc<Vec<Item>>, usize)> = None;
        let next = reader.next_or_summary(
            &mut |s| {
                let ah = ahead.as_ref()?;
                let k = usize::from(s.ordinal % 2 != ah.parity);
                let d = match k {
                    0 => find(s, &ah.own, Wait::Always, &mut held[0]),
                    _ => find(s, &ah.other, if in_step { Wait::Unless(&ah.hungry, &ah.other_passed) } else { Wait::Never }, &mut held[1]),
                };
                offered = d.as_ref().map(|d| (d.items.clone(), k));
                d
            },
            &|k| summarised.get(k) == Some(&true),
        );
        let (sum, parts) = (reader.position().2, reader.held_value_parts());
        let next = next.map(|f| {
            f.map(|f| match f {
                Next::Summary(s, at) => Frame { items: Arc::default(), summary: Some((s, at)), before: (ops, sites), sum, parts, home: None },
                Next::Items(items) => {
                    let taken = offered.as_ref().filter(|o| Arc::ptr_eq(&o.0, &items)).map(|o| o.1);
                    if offered.as_ref().is_some_and(|o| o.1 == 1) {
                        in_step = taken.is_some();
                    }
                    // A frame offered and not taken (the other file's, stored otherwise)
                    // goes back to the thread that decoded it, to be read into again
                    // there: freed here, its records were lost to that thread's reuse
                    // (and freed across threads) whenever this was the last holder.
                    if let (None, Some((o, k)), Some(ah)) = (taken, offered.take(), &ahead) {
                        let _ = ah.homes[k].try_send(o);
                    }
                    Frame { home: taken.and_then(|k| ahead.as_ref().map(|ah| ah.homes[k].clone())), items, summary: None, before: (ops, sites), sum, parts }
                }
            })
        });
        let stop = !matches!(next, Ok(Some(_)));
        let summary = matches!(&next, Ok(Some(f)) if f.summary.is_some());
        run.push(next);
        // Frames read as summaries go over in runs of up to SUMMARY_RUN; anything else
        // at once, after the run before it. A closed channel: the other side stopped
        // on an error.
        if (stop || !summary || run.len() >= SUMMARY_RUN) && (tx.send(std::mem::take(&mut run)).is_err() || stop) {
            return reader;
        }
    }
}

/// One file in pass 1: a thread reads and checks its frames (decoded ahead by scanning threads,
/// or by itself) while this side notes them, keeps what every report reads, and hands the
/// items out one at a time, or a frame at a time when both files hold it
/// ([`Items::whole_frame`]).
struct Pass1 {
    /// Frames from the reading thread: one at a time, or a run of frames read as their
    /// summaries (cheap to read, and one hand-over a run rather than one a frame).
    frames: Receiver<Vec<Result<Option<Frame>>>>,
    /// Frames received and not loaded yet, in file order.
    queued: std::collections::VecDeque<Result<Option<Frame>>>,
    thread: Option<std::thread::JoinHandle<Reader>>,
    /// The thread decoding this file's frames ahead, when there is one.
    scan: Option<std::thread::JoinHandle<()>>,
    /// The frame being handed out, and the index of its next item.
    frame: Arc<Vec<Item>>,
    next: usize,
    /// The frame loaded is a summary (its offset and the records and sites before it), not
    /// handed out yet: decoded here if its items are asked for.
    summary: Option<(Arc<FrameSummary>, u64, (u64, u32))>,
    /// Frames compared from their summaries (tests check that it happens).
    #[cfg_attr(not(test), allow(dead_code))]
    summarised_frames: u64,
    /// Where the frame goes once handed out: the scanning thread that decoded it, else `spent`.
    home: Option<SpentTo>,
    spent: SpentTo,
    /// The file has no more frames.
    done: bool,
    /// Frames compared whole, both files holding them (tests check that it happens).
    #[cfg_attr(not(test), allow(dead_code))]
    shared_frames: u64,
    /// Set while waiting for this file's next frame ([`Ahead::hungry`]).
    hungry: Option<Arc<AtomicBool>>,
    notes: Vec<FrameNote>,
    kept: Vec<Item>,
    /// Op records kept because pass 1 found them root causes ([`Items::keep`]), and their
    /// size in bytes (at most [`Pass1::KEEP_BYTES`]): pass 2 does not read their frames again.
    found: HashSet<u64>,
    found_bytes: usize,
    /// By own site id: the site is the final logits' (looked up for every record: a list,
    /// not a hashed set).
    logits: Vec<bool>,
    /// The file, for errors.
    path: std::path::PathBuf,
    /// Where its items frames start ([`Frames::index`]; empty when not known): pass 2 goes
    /// straight to those it reads.
    index: Arc<[u64]>,
}

type Reader = TraceReader<candle_trace_format::format::FileAt>;

/// Frames read as their summaries that a reading thread hands over at once, at most: a
/// thread waking for each of them cost more than reading them.
const SUMMARY_RUN: usize = 32;

impl Pass1 {
    /// Bytes of root-cause records kept from pass 1 at most, a file; past it, pass 2 reads
    /// the rest from their frames.
    const KEEP_BYTES: usize = 32 << 20;

    fn new(reader: Reader, ahead: Option<Ahead>, summarised: Arc<[bool]>, index: Arc<[u64]>) -> Self {
        let path = reader.path().to_path_buf();
        let (tx, frames) = sync_channel::<Vec<Result<Option<Frame>>>>(4);
        let (spent, back) = sync_channel::<Arc<Vec<Item>>>(8);
        let hungry = ahead.as_ref().map(|a| a.hungry.clone());
        let thread = std::thread::spawn(move || reading(reader, ahead, summarised, tx, back));
        Pass1 {
            frames,
            queued: Default::default(),
            thread: Some(thread),
            scan: None,
            frame: Arc::default(),
            next: 0,
            summary: None,
            summarised_frames: 0,
            home: None,
            spent,
            done: false,
            shared_frames: 0,
            hungry,
            notes: Vec::new(),
            kept: Vec::new(),
            found: HashSet::new(),
            found_bytes: 0,
            logits: Vec::new(),
            path,
            index,
        }
    }

    /// Pass 1 of files a and b, with a thread decoding ahead a's even frames and one b's odd
    /// frames; each reading thread takes the other's frames when its own are stored the same.
    fn pair(ra: Reader, rb: Reader, frames: Frames) -> (Self, Self) {
        let Frames { summarised, index: [index_a, index_b] } = frames;
        let (own_a, own_a_rx) = sync_channel(4);
        let (own_b, own_b_rx) = sync_channel(4);
        let (a_to_b, b_other) = sync_channel(4);
        let (b_to_a, a_other) = sync_channel(4);
        let (home_a, back_a) = sync_channel(16);
        let (home_b, back_b) = sync_channel(16);
        let (passed_a, passed_b) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let scan = |r: &Reader, parity, index: &Arc<[u64]>| Scan::open(r.path(), parity).map(|s| s.skipping(summarised.clone()).indexed(index.clone()));
        let scan_a = scanning(scan(&ra, 0, &index_a), own_a, a_to_b, passed_a.clone(), back_a);
        let scan_b = scanning(scan(&rb, 1, &index_b), own_b, b_to_a, passed_b.clone(), back_b);
        let ahead = |parity, own, other, other_passed, homes| Some(Ahead { parity, own, other, hungry: Arc::new(AtomicBool::new(false)), other_passed, homes });
        let mut a = Pass1::new(ra, ahead(0, own_a_rx, a_other, passed_b, [home_a.clone(), home_b.clone()]), summarised.clone(), index_a);
        let mut b = Pass1::new(rb, ahead(1, own_b_rx, b_other, passed_a, [home_b, home_a]), summarised, index_b);
        (a.scan, b.scan) = (Some(scan_a), Some(scan_b));
        (a, b)
    }

    /// Says whether pass 1 waits for this file's next frame (its thread then stops waiting for
    /// the other file's).
    fn set_hungry(&self, waits: bool) {
        if let Some(h) = &self.hungry {
            h.store(waits, Ordering::Relaxed);
        }
    }

    /// Takes the next frame from the reading thread, notes it and hands the last one back;
    /// false at the file's end.
    fn load(&mut self) -> Result<bool> {
        if self.done {
            return Ok(false);
        }
        if self.queued.is_empty() {
            self.set_hungry(true);
            let got = self.frames.recv();
            self.set_hungry(false);
            self.queued.extend(got.unwrap_or_default());
        }
        match self.queued.pop_front().ok_or(()) {
            Ok(Ok(Some(f))) => {
                match &f.summary {
                    Some((s, _)) => self.take_summary(s, f.before, f.sum),
                    None => self.take(&f.items, f.before, f.sum, f.parts),
                }
                self.summary = f.summary.map(|(s, at)| (s, at, f.before));
                let old = std::mem::replace(&mut self.frame, f.items);
                let _ = std::mem::replace(&mut self.home, f.home).as_ref().unwrap_or(&self.spent).try_send(old);
                self.next = 0;
                Ok(true)
            }
            Ok(Ok(None)) | Err(_) => {
                // The file's end: the last frame's items are not needed in pass 2.
                self.frame = Arc::default();
                self.done = true;
                Ok(false)
            }
            Ok(Err(e)) => Err(e),
        }
    }

    /// The reader, once every frame was read (call once).
    fn reader(&mut self) -> Result<Reader> {
        // Neither can happen without a bug here: said as such, naming the file.
        let bug = |what: &str| candle_trace_format::error::Error::trace(&self.path, format!("{what} (a bug in candle-trace: please report it)"));
        let t = self.thread.take().ok_or_else(|| bug("its reader was taken twice"))?;
        let reader = t.join().map_err(|_| bug("its reading thread panicked"))?;
        // Its reading thread gone, the scan's next send fails and it ends.
        self.scan.take().map(|t| t.join()).transpose().map_err(|_| bug("its scanning thread panicked"))?;
        Ok(reader)
    }

    /// Whether own site `site` is the final logits'.
    fn is_logits(&self, site: u32) -> bool {
        self.logits.get(site as usize) == Some(&true)
    }

    /// Notes a frame read as its summary and keeps what every report reads of it, as
    /// [`Pass1::take`] does of its items.
    fn take_summary(&mut self, s: &FrameSummary, before: (u64, u32), sum: u64) {
        let positions = s.runs().fold(None::<(u32, u32)>, |acc, k| {
            let hi = k.pos.saturating_add(k.len.saturating_sub(1));
            Some(acc.map_or((k.pos, hi), |(lo, h)| (lo.min(k.pos), h.max(hi))))
        });
        self.kept.extend(s.kept.iter().cloned());
        self.notes.push(FrameNote { sum, before, seqs: (before.0, before.0 + s.records()), positions, values: false });
    }

    /// The loaded frame's items when it was read as its summary: decoded here, from its offset
    /// in the file, and checked there as the reading thread would have.
    fn decode_summarised(&mut self) -> Result<()> {
        if let Some((s, at, before)) = self.summary.take() {
            let items = TraceReader::items_frame_at(&self.path, at, before)?;
            // Pass 1 noted the frame from its summary: the frame must be what it says.
            let sites = items.iter().filter_map(|i| if let Item::Op(r) = i { Some(r.site) } else { None });
            if items.len() != s.items as usize || !sites.eq(s.sites()) {
                return Err(candle_trace_format::error::Error::trace(&self.path, format!("the items frame at byte {at} is not what its summary says")));
            }
            self.frame = Arc::new(items);
            self.next = 0;
        }
        Ok(())
    }

    /// Notes a frame and keeps what every report reads of it; `parts`: it held value parts (the
    /// start of a value that a later frame ends: pass 2 reads the frame for it).
    fn take(&mut self, items: &[Item], before: (u64, u32), sum: u64, parts: bool) {
        let (mut seqs, mut positions, mut values) = ((u64::MAX, 0), None::<(u32, u32)>, parts);
        for item in items {
            match item {
                Item::Op(r) => {
                    seqs = (seqs.0.min(r.seq), r.seq + 1);
                    for t in &r.tokens {
                        positions = Some(positions.map_or((t.pos, t.pos), |(lo, hi)| (lo.min(t.pos), hi.max(t.pos))));
                    }
                    if candle_trace_format::summary::kept_whole(r, self.is_logits(r.site)) {
                        self.kept.push(item.clone());
                    }
                }
                Item::Dump(_) | Item::Operand(_) | Item::Counterpart(_) | Item::ValuePart(_) | Item::WeightNorm(_) => values = true,
                Item::Site { id, path, .. } => {
                    if candle_trace_format::summary::is_logits_path(path) {
                        // Site ids come in order (the reader checked): at most one past the last.
                        let id = *id as usize;
                        if self.logits.len() <= id {
                            self.logits.resize(id + 1, false);
                        }
                        self.logits[id] = true;
                    }
                    self.kept.push(item.clone());
                }
                Item::Forward(_) | Item::Token(_) | Item::Embeddings(_) => self.kept.push(item.clone()),
            }
        }
        if seqs.0 == u64::MAX {
            seqs = (before.0, before.0);
        }
        self.notes.push(FrameNote { sum, before, seqs, positions, values });
    }
}

impl Drop for Pass1 {
    /// Stops the reading thread when pass 1 ends early (an error on either side): its next send
    /// fails once the channel is closed (and it no longer waits for the other file's frames);
    /// then waits for it and for the scanning thread (whose sends fail once the reading thread
    /// is gone), so no thread outlives the bisect.
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.set_hungry(true);
            drop(std::mem::replace(&mut self.frames, sync_channel(0).1));
            let _ = t.join();
        }
        if let Some(t) = self.scan.take() {
            let _ = t.join();
        }
    }
}

impl Items for Pass1 {
    fn next_into(&mut self, f: &mut dyn FnMut(&Item) -> Result<()>) -> Result<bool> {
        self.decode_summarised()?;
        loop {
            if let Some(item) = self.frame.get(self.next) {
                self.next += 1;
                return f(item).map(|_| true);
            }
            if !self.load()? {
                return Ok(false);
            }
        }
    }

    fn whole_frame(&mut self) -> Result<Option<Whole>> {
        if self.next < self.frame.len() || self.summary.is_some() || !self.load()? {
            return Ok(None);
        }
        Ok(Some(match &self.summary {
            Some((s, ..)) => Whole::Summary(s.clone(), self.notes.len() - 1),
            None => Whole::Items(self.frame.clone()),
        }))
    }

    fn keep(&mut self, seq: u64) -> bool {
        if self.found.contains(&seq) {
            return true;
        }
        // Records are handed out in id order: the record is at or before the last one.
        let handed = &self.frame[..self.next.min(self.frame.len())];
        let at = handed.iter().rev().filter_map(|i| if let Item::Op(r) = i { Some(r) } else { None }).take_while(|r| r.seq >= seq).find(|r| r.seq == seq);
        let Some(r) = at else { return false };
        if candle_trace_format::summary::kept_whole(r, self.is_logits(r.site)) {
            return true; // kept when its frame was loaded
        }
        let bytes = std::mem::size_of::<candle_trace_format::record::OpRecord>()
            + r.tokens.len() * std::mem::size_of::<candle_trace_format::record::TokenStat>()
            + r.inputs.len() * 16
            + (r.shape.len() + r.samples.len()) * 4
            + r.operands.len() * 8
            + r.dtype.len();
        if self.found_bytes + bytes > Self::KEEP_BYTES {
            return false;
        }
        self.found_bytes += bytes;
        self.found.insert(seq);
        self.kept.push(Item::Op(r.clone()));
        true
    }

    fn skip_frame(&mut self) {
        self.next = self.frame.len();
        match self.summary.take() {
            Some(_) => self.summarised_frames += 1,
            None => self.shared_frames += 1,
        }
    }
}

/// [`crate::bisect::bisect`] of two trace files, read a frame at a time (see the module
/// documentation). Returns the report and the two traces as far as the report read them:
/// headers, tokens and the records it names.
///
/// # Errors
/// As [`crate::bisect::bisect`], and [`candle_trace_format::format::read_trace`]'s for either file; a file
/// that changes between the two passes is refused.
pub fn bisect_files(pa: &Path, pb: &Path) -> Result<(crate::bisect::Report, Trace, Trace)> {
    bisect_files_with(pa, pb, false).map(|(r, _, ta, tb)| (r, ta, tb))
}

/// What the HTML report draws beside the report: the per-layer profile of the whole run
/// ([`crate::bisect::profile`]) and the report's row by layer and position
/// ([`crate::bisect::heat`]).
#[derive(Clone, Debug, Default)]
pub struct Profile {
    /// The largest difference per layer, every row and position.
    pub points: Vec<crate::bisect::LayerPoint>,
    /// The flip's row (else the root's, else 0) by layer and position.
    pub heat: crate::bisect::Heat,
}

impl Profile {
    /// The profile of alignment `al`, the heat map drawn for the row `report` names (the flip's,
    /// else the root's, else 0).
    fn of(report: &crate::bisect::Report, al: &Alignment) -> Self {
        let row = report.first_token_divergence.as_ref().map(|t| t.row).or(report.first_divergence.as_ref().map(|d| d.row)).unwrap_or(0);
        Profile { points: crate::bisect::profile(al), heat: crate::bisect::heat(al, row) }
    }
}

/// [`bisect_files`], with the [`Profile`] the HTML report draws.
///
/// # Errors
/// As [`bisect_files`].
pub fn bisect_files_profiled(pa: &Path, pb: &Path) -> Result<(crate::bisect::Report, Profile, Trace, Trace)> {
    bisect_files_with(pa, pb, true).map(|(r, p, ta, tb)| (r, p.unwrap_or_default(), ta, tb))
}

/// [`bisect_files`], with the [`Profile`] when `profiled` (drawing it walks every position
/// compared: only the HTML report needs it).
fn bisect_files_with(pa: &Path, pb: &Path, profiled: bool) -> Result<(crate::bisect::Report, Option<Profile>, Trace, Trace)> {
    let (la, lb) = (level_of(pa)?, level_of(pb)?);
    if la != lb {
        // Recorded at different levels: both read whole, the finer one projected onto the
        // coarser level (crate::level); the coarser trace is the small one.
        let level = crate::level::coarser(la, lb);
        let (ta, tb) = (candle_trace_format::format::read_trace(pa)?, candle_trace_format::format::read_trace(pb)?);
        let recorded = (crate::level::op_records(&ta), crate::level::op_records(&tb));
        let (ta, tb) = (crate::level::project(ta, level), crate::level::project(tb, level));
        let pairs = crate::bisect::pairing(&ta.header, &tb.header);
        crate::bisect::same_model(&ta.header, &tb.header, pa, pb)?;
        let al = Alignment::run(level, &mut ta.items.iter(), &mut tb.items.iter(), crate::bisect::b_rows(&pairs), [pa, pb])?;
        let (mut report, _) = crate::bisect::report(&ta, &tb, &pairs, &al)?;
        // The report gives each file's own record count; the note says what was compared.
        (report.a.op_records, report.b.op_records) = recorded;
        let profile = profiled.then(|| Profile::of(&report, &al));
        return Ok((report, profile, ta, tb));
    }
    let (ra, rb) = (TraceReader::open(pa)?, TraceReader::open(pb)?);
    let (ha, hb) = (ra.header().clone(), rb.header().clone());
    crate::bisect::same_model(&ha, &hb, pa, pb)?;
    let pairs = crate::bisect::pairing(&ha, &hb);
    let (mut xa, mut xb) = Pass1::pair(ra, rb, frames(pa, pb, pairs.is_empty()));
    let al = Alignment::run(la, &mut xa, &mut xb, crate::bisect::b_rows(&pairs), [pa, pb])?;
    let roots = al.roots();
    let at = crate::bisect::reported(&al, &roots).map(|f| (f.row, f.pos));
    let seqs = |side: usize| -> HashSet<u64> { roots.iter().chain(al.input_differs.iter()).map(|f| if side == 0 { f.seq_a } else { f.seq_b }).collect() };
    // Run b's own row holding the reported root's request.
    let at_b = at.map(|(row, pos)| (pairs.iter().find(|p| p.0 == row).map_or(if pairs.is_empty() { row } else { u32::MAX }, |p| p.1), pos));
    // The two files' second passes are independent: one on its own thread. Run a's error is
    // the one reported when both fail.
    let (sa, sb) = (seqs(0), seqs(1));
    let (ta, tb) = std::thread::scope(|s| {
        let b = s.spawn(|| pass2(pb, xb, &sb, at_b));
        let ta = pass2(pa, xa, &sa, at);
        (ta, b.join())
    });
    let tb = tb.map_err(|_| candle_trace_format::error::Error::trace(pb, "its second pass panicked (a bug in candle-trace: please report it)"))?;
    let (ta, tb) = (ta?, tb?);
    let (report, _) = crate::bisect::report(&ta, &tb, &pairs, &al)?;
    let profile = profiled.then(|| Profile::of(&report, &al));
    Ok((report, profile, ta, tb))
}

/// What pass 1 knows of both files' items frames before it reads them.
#[derive(Clone, Default)]
struct Frames {
    /// By ordinal, the items frames both files hold identically with a summary (the same items
    /// and summary payloads at the same ordinal, however compressed:
    /// [`candle_trace_format::format::same_frames`]), which pass 1 reads as their summaries.
    summarised: Arc<[bool]>,
    /// Where each file's items frames start, by ordinal: its scanning thread goes straight to
    /// the frames it decodes ([`Scan::indexed`]).
    index: [Arc<[u64]>; 2],
}

/// [`Frames`] of files `pa` and `pb` (their frame headers read); none summarised when
/// `rows_as_themselves` is false (run b's rows are paired with other rows of a, so no frame
/// compares whole).
fn frames(pa: &Path, pb: &Path, rows_as_themselves: bool) -> Frames {
    let (same, [ia, ib]) = candle_trace_format::format::frames_compared(pa, pb);
    Frames { summarised: if rows_as_themselves { same.into() } else { Arc::new([]) }, index: [ia.into(), ib.into()] }
}

/// The level `path` was recorded at: its level frame, read before its first items frame.
///
/// # Errors
/// The file cannot be opened, or its header or first items frame is malformed.
pub fn level_of(path: &Path) -> Result<candle_trace_format::site::Level> {
    let mut r = TraceReader::open(path)?;
    r.next_items()?;
    Ok(r.level())
}

/// Reads back the records of `path` that the report names (`seqs`, and every record with an
/// entry at `at` = (own row, position)) with their dumps, and joins them to pass 1's kept items.
fn pass2(path: &Path, mut p1: Pass1, seqs: &HashSet<u64>, at: Option<(u32, u32)>) -> Result<Trace> {
    let reader = p1.reader()?;
    let (notes, kept) = (std::mem::take(&mut p1.notes), std::mem::take(&mut p1.kept));
    let header = reader.header().clone();
    // The end of the file is checked here (footer counts, value parts left over).
    let tail = reader.finish()?;
    // A frame is read whole for its values or for the records at the reported position, and
    // for the records `seqs` names only otherwise (its other records are read past).
    let whole = |n: &FrameNote| n.values || at.zip(n.positions).is_some_and(|((_, p), (lo, hi))| (lo..=hi).contains(&p));
    let have: HashSet<u64> = kept.iter().filter_map(|i| if let Item::Op(r) = i { Some(r.seq) } else { None }).collect();
    // Records pass 1 kept (root causes it found, records every report reads) are not read again.
    let records: std::collections::BTreeSet<u64> = seqs.iter().copied().filter(|s| !have.contains(s)).collect();
    let named = |n: &FrameNote| records.range(n.seqs.0..n.seqs.1.max(n.seqs.0)).next().is_some();
    let want = notes.iter().map(|n| whole(n) || named(n)).collect();
    let skip = Skip {
        want,
        sums: notes.iter().map(|n| n.sum).collect(),
        before: notes.iter().map(|n| n.before).collect(),
        records_only: notes.iter().map(|n| !whole(n)).collect(),
        records,
        index: Some(p1.index.clone()),
    };
    let mut reader = TraceReader::open(path)?.skipping(skip);
    let (mut others, mut ops, mut dumps) = (Vec::new(), Vec::new(), Vec::new());
    for item in kept {
        match item {
            Item::Op(_) => ops.push(item),
            _ => others.push(item),
        }
    }
    let mut read: HashSet<u64> = HashSet::new();
    while let Some(items) = reader.next_items()? {
        for item in items {
            match &item {
                Item::Op(r) if !have.contains(&r.seq) && (seqs.contains(&r.seq) || at.is_some_and(|(row, pos)| r.tokens.iter().any(|t| t.row == row && t.pos == pos))) => {
                    read.insert(r.seq);
                    ops.push(item);
                }
                Item::Dump(d) if have.contains(&d.seq) || read.contains(&d.seq) => dumps.push(item),
                _ => {}
            }
        }
    }
    let seq = |i: &Item| if let Item::Op(r) = i { r.seq } else { 0 };
    ops.sort_by_key(seq);
    others.extend(ops);
    others.extend(dumps);
    Ok(Trace { path: path.to_path_buf(), header, items: others, footer: tail.footer, truncated: tail.truncated, sampling: tail.sampling, build: tail.build, level: tail.level, extras: tail.extras })
}

#[cfg(test)]
mod tests;
