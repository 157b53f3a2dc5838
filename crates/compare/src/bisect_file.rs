//! [`bisect`](crate::bisect::bisect) of two trace files without reading either whole.
//!
//! Pass 1 reads both files a frame at a time in lockstep ([`Alignment`]), and keeps the small
//! items a report always reads (sites, forward passes, generated tokens, embeddings, the token-id
//! and logits records, records without a token axis), plus a note per items frame: its checksum,
//! the records and positions it holds, whether it holds dumped values. Pass 2 decompresses only
//! the frames holding a record the report names (the root causes, the ops at the reported root's
//! position) or a dumped value; the others are read past. Memory stays near the largest frame,
//! the kept items and the report, whatever the traces' length.

use crate::align::{Alignment, Items};
use candle_trace_format::error::Result;
use candle_trace_format::format::{Skip, Trace, TraceReader};
use candle_trace_format::record::{Item, Kernel};
use std::collections::HashSet;
use std::path::Path;

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
/// before it, its checksum.
type Frame = (Vec<Item>, (u64, u32), u64);

/// One file in pass 1: a thread decodes its frames (the two files decode on two cores) while
/// this side notes them, keeps what every report reads, and hands the items out one at a time.
struct Pass1 {
    frames: std::sync::mpsc::Receiver<Result<Option<Frame>>>,
    thread: Option<std::thread::JoinHandle<TraceReader<std::io::BufReader<std::fs::File>>>>,
    /// The frame being handed out, and the index of its next item.
    frame: Vec<Item>,
    next: usize,
    /// Frames handed out go back to the reading thread to be freed there: memory freed by the
    /// thread that allocated it is reused at once, where freeing it here took glibc's arena lock
    /// for every record.
    spent: std::sync::mpsc::SyncSender<Vec<Item>>,
    notes: Vec<FrameNote>,
    kept: Vec<Item>,
    /// Site ids of the final logits.
    logits: HashSet<u32>,
    /// The file, for errors.
    path: std::path::PathBuf,
}

impl Pass1 {
    fn new(mut reader: TraceReader<std::io::BufReader<std::fs::File>>) -> Self {
        let path = reader.path().to_path_buf();
        let (tx, frames) = std::sync::mpsc::sync_channel::<Result<Option<Frame>>>(4);
        let (spent, back) = std::sync::mpsc::sync_channel::<Vec<Item>>(8);
        let thread = std::thread::spawn(move || loop {
            back.try_iter().for_each(drop);
            let (ops, sites, _) = reader.position();
            let next = reader.next_items().map(|f| f.map(|items| (items, (ops, sites), reader.position().2)));
            let stop = !matches!(next, Ok(Some(_)));
            // A closed channel: the other side stopped on an error.
            if tx.send(next).is_err() || stop {
                return reader;
            }
        });
        Pass1 { frames, thread: Some(thread), frame: Vec::new(), next: 0, spent, notes: Vec::new(), kept: Vec::new(), logits: HashSet::new(), path }
    }

    /// The reader, once every frame was read (call once).
    fn reader(&mut self) -> Result<TraceReader<std::io::BufReader<std::fs::File>>> {
        // Neither can happen without a bug here: said as such, naming the file.
        let bug = |what: &str| candle_trace_format::error::Error::trace(&self.path, format!("{what} (a bug in candle-trace: please report it)"));
        let t = self.thread.take().ok_or_else(|| bug("its reader was taken twice"))?;
        t.join().map_err(|_| bug("its reading thread panicked"))
    }

    /// Notes a frame and keeps what every report reads of it.
    fn take(&mut self, items: &[Item], before: (u64, u32), sum: u64) {
        let (mut seqs, mut positions, mut values) = ((u64::MAX, 0), None::<(u32, u32)>, false);
        for item in items {
            match item {
                Item::Op(r) => {
                    seqs = (seqs.0.min(r.seq), r.seq + 1);
                    for t in &r.tokens {
                        positions = Some(positions.map_or((t.pos, t.pos), |(lo, hi)| (lo.min(t.pos), hi.max(t.pos))));
                    }
                    if r.tokens.is_empty() || r.kernel == Some(Kernel::Input) || self.logits.contains(&r.site) {
                        self.kept.push(item.clone());
                    }
                }
                Item::Dump(_) | Item::Operand(_) | Item::Counterpart(_) | Item::ValuePart(_) => values = true,
                Item::Site { id, path, .. } => {
                    if path == "logits" || path == "lm_head" {
                        self.logits.insert(*id);
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
    /// Stops the decoding thread when pass 1 ends early (an error on either side): its next send
    /// fails once the channel is closed; then waits for it, so no thread outlives the bisect.
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            drop(std::mem::replace(&mut self.frames, std::sync::mpsc::sync_channel(0).1));
            let _ = t.join();
        }
    }
}

impl Items for Pass1 {
    fn next_into(&mut self, f: &mut dyn FnMut(&Item) -> Result<()>) -> Result<bool> {
        loop {
            if let Some(item) = self.frame.get(self.next) {
                self.next += 1;
                return f(item).map(|_| true);
            }
            match self.frames.recv() {
                Ok(Ok(Some((items, before, sum)))) => {
                    self.take(&items, before, sum);
                    // A full channel (the thread is behind): freed here instead.
                    let _ = self.spent.try_send(std::mem::replace(&mut self.frame, items));
                    self.next = 0;
                }
                Ok(Ok(None)) | Err(_) => {
                    // The file's end: the last frame's items are not needed in pass 2.
                    self.frame = Vec::new();
                    return Ok(false);
                }
                Ok(Err(e)) => return Err(e),
            }
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
    bisect_files_profiled(pa, pb).map(|(r, _, ta, tb)| (r, ta, tb))
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
    let (la, lb) = (level_of(pa)?, level_of(pb)?);
    if la != lb {
        // Recorded at different levels: both read whole, the finer one projected onto the
        // coarser level (crate::level); the coarser trace is the small one.
        let level = crate::level::coarser(la, lb);
        let ta = crate::level::project(candle_trace_format::format::read_trace(pa)?, level);
        let tb = crate::level::project(candle_trace_format::format::read_trace(pb)?, level);
        let pairs = crate::bisect::pairing(&ta.header, &tb.header);
        crate::bisect::same_model(&ta.header, &tb.header, pa, pb)?;
        let al = Alignment::run(&mut ta.items.iter(), &mut tb.items.iter(), crate::bisect::b_rows(&pairs), [pa, pb])?;
        let (report, _) = crate::bisect::report(&ta, &tb, &pairs, &al)?;
        let profile = Profile::of(&report, &al);
        return Ok((report, profile, ta, tb));
    }
    let (ra, rb) = (TraceReader::open(pa)?, TraceReader::open(pb)?);
    let (ha, hb) = (ra.header().clone(), rb.header().clone());
    crate::bisect::same_model(&ha, &hb, pa, pb)?;
    let pairs = crate::bisect::pairing(&ha, &hb);
    let (mut xa, mut xb) = (Pass1::new(ra), Pass1::new(rb));
    let al = Alignment::run(&mut xa, &mut xb, crate::bisect::b_rows(&pairs), [pa, pb])?;
    let roots = al.roots();
    let at = crate::bisect::reported(&al, &roots).map(|f| (f.row, f.pos));
    let seqs = |side: usize| -> HashSet<u64> { roots.iter().chain(al.input_differs.iter()).map(|f| if side == 0 { f.seq_a } else { f.seq_b }).collect() };
    // Run b's own row holding the reported root's request.
    let at_b = at.map(|(row, pos)| (pairs.iter().find(|p| p.0 == row).map_or(if pairs.is_empty() { row } else { u32::MAX }, |p| p.1), pos));
    let ta = pass2(pa, xa, &seqs(0), at)?;
    let tb = pass2(pb, xb, &seqs(1), at_b)?;
    let (report, _) = crate::bisect::report(&ta, &tb, &pairs, &al)?;
    let profile = Profile::of(&report, &al);
    Ok((report, profile, ta, tb))
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
    let wanted = |n: &FrameNote| n.values || seqs.iter().any(|&s| (n.seqs.0..n.seqs.1).contains(&s)) || at.zip(n.positions).is_some_and(|((_, p), (lo, hi))| (lo..=hi).contains(&p));
    let skip = Skip { want: notes.iter().map(wanted).collect(), sums: notes.iter().map(|n| n.sum).collect(), before: notes.iter().map(|n| n.before).collect() };
    let mut reader = TraceReader::open(path)?.skipping(skip);
    let have: HashSet<u64> = kept.iter().filter_map(|i| if let Item::Op(r) = i { Some(r.seq) } else { None }).collect();
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
    Ok(Trace { path: path.to_path_buf(), header, items: others, footer: tail.footer, truncated: tail.truncated, sampling: tail.sampling, build: tail.build, level: tail.level })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_trace_format::record::{Header, OpRecord};

    fn threads() -> usize {
        std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
    }

    /// Regression (found by fuzzing the streaming bisect): pass 1 dropped before its file ended
    /// (an error on the other side) left the decoding thread running, with its reader's buffers,
    /// after the bisect returned. Dropping it now stops and joins the thread. Counts the threads
    /// of this process (Linux's /proc; one test at a time, as `.cargo/config.toml` runs them).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_pass_dropped_early_leaves_no_thread() {
        let op = |seq: u64| OpRecord { seq, dtype: "f32".into(), shape: vec![1], digest: seq as u128, ..OpRecord::default() };
        let items: Vec<Item> = std::iter::once(Item::Site { id: 0, path: "x".into(), op: "add".into() }).chain((0..20_000).map(|s| Item::Op(op(s)))).collect();
        let path = std::env::temp_dir().join(format!("candle-trace-pass1-{}.trace", std::process::id()));
        std::fs::write(&path, candle_trace_format::format::encode_trace(&Header::default(), &items, None).unwrap()).unwrap();
        let before = threads();
        let mut p = Pass1::new(TraceReader::open(&path).unwrap());
        assert!(p.next_into(&mut |_| Ok(())).unwrap(), "read one item");
        assert_eq!(threads(), before + 1, "pass 1 decodes on its own thread");
        drop(p);
        assert_eq!(threads(), before, "the decoding thread outlived its pass");
        let _ = std::fs::remove_file(&path);
    }
}
