//! Where a [`super::TraceWriter`]'s frames go: encoded, compressed and written on a thread of
//! their own (the default), so that a forward pass runs on while the last one's frame is
//! compressed, or on the caller's thread ([`super::TraceWriter::create_here`]).
//!
//! The writer cuts frames exactly as before and hands each over whole, in order, through a
//! queue of one ([`QUEUE`]); the thread makes the same bytes the caller's thread would (one zstd
//! context, frames in the order handed over), so the file is the same byte for byte
//! (`tests::both_ways_write_the_same_bytes`). A full queue makes the writer wait: at most three
//! hand-overs are in memory, cut and not yet written (the one being written, the one queued and
//! the one the writer waits with, or else the one it is filling), with `--dump` up to
//! [`super::VALUE_BYTES_PER_FRAME`] of values each. A killed run loses those: an items frame and
//! its summary frame, or a sampling frame, each.
//!
//! An error on the thread (I/O, a frame over the cap) ends it: the frames handed over after the
//! one that failed are dropped, and the writer returns the error at its next hand-over or at
//! [`super::TraceWriter::finish`] or [`super::TraceWriter::close`] (dropping the writer waits
//! for the thread and drops the error); every later call returns it again, in words.
//!
//! Once an items frame is written, its items go back to the writer ([`reusable`], through a
//! queue of [`BACK`] frames), which fills the op records of a later frame into them in place
//! ([`super::TraceWriter::push_op`]): a record's lists and strings keep their memory and the
//! record is not moved, so filling a record allocates nothing once the frame it lands in has
//! come back with room enough (a kernel holding a string, `to_dtype`'s, is still cloned; a
//! dumped op's values are new), and most memory allocated on the recording thread is reused
//! there rather than freed on the writing one, where glibc's allocator takes the allocating
//! arena's lock for each such free (records past the room a frame keeps, and frames that find
//! the queue back full, are still freed there).

use super::*;
use crate::crash::KillPoint;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::thread::JoinHandle;

/// Frames handed over and not yet taken by the thread, at most.
pub(super) const QUEUE: usize = 1;

/// Written items frames handed back for reuse and not yet taken, at most (a frame handed back
/// when the queue is full is freed on the writing thread instead).
pub(super) const BACK: usize = 2;

/// Token entries, over all the records of one frame, whose memory a frame handed back keeps at
/// most: about 3.6 MB (a prefill frame's records past it are freed).
pub(super) const BACK_TOKEN_ENTRIES: usize = 1 << 16;

/// A written items frame made ready for reuse: each op record stays where it was, to be
/// overwritten by the item at the same place in a later frame (frames of one run hold their
/// items in much the same order, so an op record is mostly overwritten by an op record); every
/// other item (a dumped value can be hundreds of MB), and every record with room for more than
/// [`crate::limits::MAX_INPUTS`] inputs or operands, [`crate::limits::MAX_RANK`] dims or, past
/// [`BACK_TOKEN_ENTRIES`] in all, token entries, is freed here and left as an empty record.
pub(super) fn reusable(mut items: Vec<Item>) -> Vec<Item> {
    let mut room = BACK_TOKEN_ENTRIES;
    for i in &mut items {
        match i {
            Item::Op(r)
                if r.tokens.capacity() <= room
                    && r.inputs.capacity() <= crate::limits::MAX_INPUTS
                    && r.operands.capacity() <= crate::limits::MAX_INPUTS
                    && r.shape.capacity() <= crate::limits::MAX_RANK =>
            {
                room -= r.tokens.capacity();
            }
            _ => *i = Item::Op(crate::record::OpRecord::default()),
        }
    }
    items
}

/// One frame to write.
pub(super) enum Job {
    /// An items frame, followed by its summary frame when it has one.
    Items(Vec<Item>),
    /// A frame of kind `.0` holding the postcard bytes `.1`.
    Frame(u8, Vec<u8>),
    /// The footer frame's postcard bytes: written, then the file is synced.
    Footer(Vec<u8>),
}

/// The file and what writing frames into it needs.
pub(super) struct Frames {
    path: PathBuf,
    file: File,
    /// The zstd context every frame is compressed with, and the level it is set to.
    zstd: zstd::bulk::Compressor<'static>,
    level: i32,
    /// Frames written so far (header included).
    frames: u64,
    /// Crash tests only ([`crate::crash`]): where to SIGKILL this process.
    kill_at: Option<KillPoint>,
    /// Per site id declared so far: whether its path is the logits' and its op (for the frame
    /// summaries, [`crate::summary::FrameSummary::of`]).
    sites: Vec<(bool, Option<crate::site::Op>)>,
    /// The postcard bytes of the frame being written, its compressed payload and the frame
    /// itself ([`pack_into`]): kept from frame to frame, so that a frame's bytes are not
    /// allocated anew each time (up to [`KEEP_BYTES`] each: a frame of dumped values can be tens
    /// of MB).
    raw: Vec<u8>,
    packed: Vec<u8>,
    frame: Vec<u8>,
}

/// Bytes of room the buffers of [`Frames`] keep at most from one frame to the next.
const KEEP_BYTES: usize = 4 << 20;

/// `buf` to keep for the next frame: itself, or nothing when it holds more than [`KEEP_BYTES`].
fn kept(buf: Vec<u8>) -> Vec<u8> {
    if buf.capacity() > KEEP_BYTES {
        Vec::new()
    } else {
        buf
    }
}

/// A postcard output that appends to a list of bytes kept by the caller.
struct Append<'a>(&'a mut Vec<u8>);

impl postcard::ser_flavors::Flavor for Append<'_> {
    type Output = ();
    #[inline(always)]
    fn try_push(&mut self, b: u8) -> postcard::Result<()> {
        self.0.push(b);
        Ok(())
    }
    #[inline(always)]
    fn try_extend(&mut self, b: &[u8]) -> postcard::Result<()> {
        self.0.extend_from_slice(b);
        Ok(())
    }
    fn finalize(self) -> postcard::Result<()> {
        Ok(())
    }
}

impl Frames {
    /// Writes into `file` (already holding the preamble), whose name is `path`.
    ///
    /// # Errors
    /// [`Error::Io`] when no zstd context can be made.
    pub(super) fn new(path: &Path, file: File) -> Result<Frames> {
        let zstd = zstd::bulk::Compressor::new(ZSTD_LEVEL).map_err(|e| Error::io(path, std::io::Error::other(e)))?;
        Ok(Frames {
            path: path.to_path_buf(),
            file,
            zstd,
            level: ZSTD_LEVEL,
            frames: 0,
            kill_at: crate::crash::kill_point(),
            sites: Vec::new(),
            raw: Vec::new(),
            packed: Vec::new(),
            frame: Vec::new(),
        })
    }

    /// Writes what `job` holds; an items frame's items come back, to be reused.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be written or synced; [`Error::Trace`] when a frame
    /// passes [`MAX_FRAME_LEN`] or cannot be encoded.
    pub(super) fn run(&mut self, job: Job) -> Result<Option<Vec<Item>>> {
        match job {
            Job::Items(items) => self.items(&items).map(|()| Some(items)),
            Job::Frame(kind, raw) => self.frame(kind, &raw).map(|()| None),
            Job::Footer(raw) => {
                self.frame(KIND_FOOTER, &raw)?;
                // Durable on disk; special files (/dev/null, pipes) cannot be synced and need not be.
                if self.file.metadata().map(|m| m.is_file()).unwrap_or(false) {
                    self.file.sync_all().map_err(|e| Error::io(&self.path, e))?;
                }
                Ok(None)
            }
        }
    }

    /// Writes `items` as one items frame, then its summary frame when it has one.
    fn items(&mut self, items: &[Item]) -> Result<()> {
        for i in items {
            if let Item::Site { path, op, .. } = i {
                self.sites.push((crate::summary::is_logits_path(path), crate::site::Op::parse(op)));
            }
        }
        let mut raw = std::mem::take(&mut self.raw);
        raw.clear();
        let encoded = postcard::serialize_with_flavor(&crate::compact::encode_items(items), Append(&mut raw)).map_err(|e| Error::trace(&self.path, format!("cannot encode frame: {e}")));
        let written = encoded.and_then(|()| {
            self.set_level(super::items_zstd_level(items))?;
            let written = self.frame(KIND_ITEMS, &raw);
            self.set_level(ZSTD_LEVEL)?;
            written
        });
        if written.is_ok() {
            let sites = &self.sites;
            // Optional: one that cannot be encoded within the caps is left out (bisect decodes
            // the frame instead).
            raw.clear();
            let summary = crate::summary::FrameSummary::of(items, |id| sites.get(id as usize).copied().unwrap_or((false, None)));
            if summary.is_some_and(|s| postcard::serialize_with_flavor(&s, Append(&mut raw)).is_ok()) {
                let packed = pack_into(&mut self.zstd, KIND_SUMMARY, &raw, &mut self.packed, &mut self.frame);
                let w = match packed {
                    Ok(()) => self.write_frame(),
                    Err(_) => {
                        self.trim();
                        Ok(())
                    }
                };
                self.raw = kept(raw);
                return w;
            }
        }
        self.raw = kept(raw);
        written
    }

    /// Sets the zstd level of the frames compressed next (nothing to do when it is `level`).
    ///
    /// # Errors
    /// [`Error::Io`] when zstd refuses the level.
    fn set_level(&mut self, level: i32) -> Result<()> {
        if level != self.level {
            self.zstd.set_compression_level(level).map_err(|e| Error::io(&self.path, e))?;
            self.level = level;
        }
        Ok(())
    }

    /// Compresses and writes one frame of kind `kind` holding `raw`.
    fn frame(&mut self, kind: u8, raw: &[u8]) -> Result<()> {
        match pack_into(&mut self.zstd, kind, raw, &mut self.packed, &mut self.frame) {
            Ok(()) => self.write_frame(),
            Err(e) => {
                self.trim();
                Err(Error::trace(&self.path, e))
            }
        }
    }

    /// Writes the frame [`pack_into`] made in `self.frame`; the buffers are kept for the next
    /// frame, or freed when they grew past [`KEEP_BYTES`].
    fn write_frame(&mut self) -> Result<()> {
        let frame = std::mem::take(&mut self.frame);
        let written = self.write_bytes(&frame);
        self.frame = frame;
        self.trim();
        written
    }

    /// Frees the frame buffers that grew past [`KEEP_BYTES`].
    fn trim(&mut self) {
        self.frame = kept(std::mem::take(&mut self.frame));
        self.packed = kept(std::mem::take(&mut self.packed));
    }

    /// Writes one whole frame with one `write_all` (and kills the process there in crash tests).
    fn write_bytes(&mut self, frame: &[u8]) -> Result<()> {
        let index = self.frames;
        if let Some(k) = self.kill_at.filter(|k| k.frame == index && k.mid_frame) {
            // Half the frame reaches the file, then the process dies.
            let _ = self.file.write_all(&frame[..frame.len() / 2]);
            k.kill();
        }
        self.file.write_all(frame).map_err(|e| Error::io(&self.path, e))?;
        self.frames += 1;
        if let Some(k) = self.kill_at.filter(|k| k.frame == index && !k.mid_frame) {
            k.kill();
        }
        Ok(())
    }
}

/// `value`'s postcard bytes.
///
/// # Errors
/// [`Error::Trace`] on `path` when it cannot be encoded.
pub(super) fn encode<T: serde::Serialize>(path: &Path, value: &T) -> Result<Vec<u8>> {
    postcard::to_stdvec(value).map_err(|e| Error::trace(path, format!("cannot encode frame: {e}")))
}

/// Where frames are written: here, or on the writing thread. See the module docs.
pub(super) enum Output {
    /// On the caller's thread, with the last items frame written, kept for reuse.
    Here(Box<Frames>, Option<Vec<Item>>),
    /// On the writing thread, through the queue; written items frames come back through `back`.
    Thread { tx: SyncSender<Job>, thread: JoinHandle<Result<()>>, back: Receiver<Vec<Item>> },
    /// The thread ended (on the error, in words) or the footer was written.
    Ended(String),
}

impl Output {
    /// Writes on a thread of its own, or here when no thread can be started.
    pub(super) fn thread(frames: Frames) -> Output {
        let (tx, rx) = sync_channel::<Job>(QUEUE);
        let (back_tx, back) = sync_channel::<Vec<Item>>(BACK);
        // The frames come back when the thread cannot be started (the closure is dropped
        // unrun, and with it what it owns): keep them here instead.
        let slot = std::sync::Arc::new(std::sync::Mutex::new(Some(frames)));
        let mine = slot.clone();
        let spawned = std::thread::Builder::new().name("candle-trace-writer".into()).spawn(move || {
            let Some(mut frames) = mine.lock().ok().and_then(|mut g| g.take()) else { return Ok(()) };
            drop(mine);
            for job in rx {
                if let Some(items) = frames.run(job)? {
                    // A full queue (the writer is not taking them) or a writer gone: freed here.
                    let _ = back_tx.try_send(reusable(items));
                }
            }
            Ok(())
        });
        match spawned {
            Ok(thread) => Output::Thread { tx, thread, back },
            Err(_) => match slot.lock().ok().and_then(|mut g| g.take()) {
                Some(frames) => Output::Here(Box::new(frames), None),
                None => Output::Ended("the writing thread could not be started".into()),
            },
        }
    }

    /// Writes (or hands over) one frame.
    ///
    /// # Errors
    /// The error the thread ended on (first time in full, then in words), or this frame's.
    pub(super) fn send(&mut self, path: &Path, job: Job) -> Result<()> {
        match self {
            Output::Here(f, kept) => {
                if let Some(items) = f.run(job)? {
                    *kept = Some(reusable(items));
                }
                Ok(())
            }
            Output::Thread { tx, .. } => match tx.send(job) {
                Ok(()) => Ok(()),
                // The thread has ended, on an error: collect it.
                Err(_) => self.end(path),
            },
            Output::Ended(why) => Err(Error::trace(path, format!("not written: the trace writer stopped earlier ({why})"))),
        }
    }

    /// The items of an items frame written since the last call, made ready for reuse (see
    /// [`reusable`]), if one has come back: never waits.
    pub(super) fn written_back(&mut self) -> Option<Vec<Item>> {
        match self {
            Output::Here(_, kept) => kept.take(),
            Output::Thread { back, .. } => back.try_recv().ok(),
            Output::Ended(_) => None,
        }
    }

    /// Waits for every frame handed over to be written, and ends the thread.
    ///
    /// # Errors
    /// As [`Output::send`].
    pub(super) fn end(&mut self, path: &Path) -> Result<()> {
        let ended = match std::mem::replace(self, Output::Ended("the trace was finished".into())) {
            Output::Here(..) => Ok(()),
            Output::Thread { tx, thread, .. } => {
                drop(tx);
                thread.join().unwrap_or_else(|_| Err(Error::trace(path, "the writing thread panicked")))
            }
            Output::Ended(why) => Err(Error::trace(path, format!("not written: the trace writer stopped earlier ({why})"))),
        };
        if let Err(e) = &ended {
            *self = Output::Ended(e.to_string());
        }
        ended
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example traces' items, written through the writing thread and on the caller's
    /// thread, with a level frame, sampling frames and frames cut by size: the same bytes.
    #[test]
    fn both_ways_write_the_same_bytes() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["builtin-whole", "builtin-chunk1", "gemma3-270m-fixed"] {
            let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces").join(format!("{name}.trace"));
            let t = read_trace(&src).unwrap();
            let write = |path: &Path, here: bool| {
                let mut w = if here { TraceWriter::create_here(path, &t.header, t.build.as_ref()) } else { TraceWriter::create(path, &t.header, t.build.as_ref()) }.unwrap();
                w.level(crate::site::Level::Layers).unwrap();
                for (i, item) in t.items.iter().enumerate() {
                    w.push(item.clone()).unwrap();
                    if i % 97 == 0 {
                        w.flush().unwrap();
                    }
                    if i % 301 == 0 {
                        w.sampling(&t.sampling).unwrap();
                    }
                }
                w.finish(t.footer.as_ref().unwrap()).unwrap();
                std::fs::read(path).unwrap()
            };
            let (a, b) = (write(&dir.path().join("thread.trace"), false), write(&dir.path().join("here.trace"), true));
            assert!(a.len() > 10_000, "{name}: {} bytes", a.len());
            assert!(a == b, "{name}: the files differ");
        }
    }

    /// An items frame holding dumped values is compressed at [`VALUES_ZSTD_LEVEL`], the frames
    /// before and after it (an items frame, a sampling frame) at [`ZSTD_LEVEL`]: each stored
    /// payload is what a fresh context at that level makes of it. (A frame holding values has
    /// no summary frame.)
    #[test]
    fn frames_holding_dumped_values_are_compressed_at_their_level() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.trace");
        let mut frames = Frames::new(&path, File::create(&path).unwrap()).unwrap();
        // Values that level 1 and level 3 compress differently.
        let values: Vec<u8> = (0..40_000u32).flat_map(|i| (((i as f32 * 0.001).sin() * 1000.0).round() / 10.0).to_le_bytes()).collect();
        let site = Item::Site { id: 0, path: "layers.0.mlp".into(), op: "add".into() };
        let dump = Item::Dump(crate::record::Dump { seq: 0, dtype: "f32".into(), shape: vec![values.len() as u32 / 4], shuffled: true, data: values.clone() });
        for job in [Job::Items(vec![site.clone()]), Job::Items(vec![site, dump]), Job::Frame(KIND_SAMPLING, values)] {
            frames.run(job).unwrap();
        }
        drop(frames);
        let bytes = std::fs::read(&path).unwrap();
        let (mut src, mut levels) = (&bytes[..], Vec::new());
        while let Some(h) = FrameHeader::read(&mut src).unwrap() {
            let (payload, rest) = src.split_at(h.clen as usize);
            src = rest;
            let raw = zstd::bulk::decompress(payload, h.ulen as usize).unwrap();
            let matching: Vec<i32> = [ZSTD_LEVEL, VALUES_ZSTD_LEVEL].into_iter().filter(|&l| zstd::bulk::Compressor::new(l).unwrap().compress(&raw).unwrap() == payload).collect();
            levels.push((h.kind, matching));
        }
        // A repro's counterpart counts as values only with operand values.
        let other = |operands| Item::Counterpart(Box::new(crate::record::Counterpart { header: Default::default(), record: Default::default(), operands }));
        let value = crate::record::OperandValue::Tensor(crate::record::Dump { seq: 1, dtype: "f32".into(), shape: vec![1], shuffled: true, data: vec![0; 4] });
        assert_eq!([super::items_zstd_level(&[other(vec![])]), super::items_zstd_level(&[other(vec![value])])], [ZSTD_LEVEL, VALUES_ZSTD_LEVEL]);
        // The first frame (one site) may be too small for the levels to differ.
        assert!(levels[0].0 == KIND_ITEMS && levels[0].1.contains(&ZSTD_LEVEL), "{levels:?}");
        assert_eq!(levels[1..], [(KIND_ITEMS, vec![VALUES_ZSTD_LEVEL]), (KIND_SAMPLING, vec![ZSTD_LEVEL])]);
    }

    /// A frame the thread cannot write (over the cap) ends it: the error comes back at the end
    /// in full, and every call after it names it; the frames before it are in the file.
    #[test]
    fn an_error_on_the_thread_comes_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.trace");
        let file = File::create(&path).unwrap();
        let mut out = Output::thread(Frames::new(&path, file).unwrap());
        assert!(matches!(out, Output::Thread { .. }));
        out.send(&path, Job::Frame(KIND_SAMPLING, vec![0; 100])).unwrap();
        let written = FRAME_HEADER_LEN as u64;
        out.send(&path, Job::Frame(KIND_SAMPLING, vec![0; MAX_FRAME_LEN as usize + 1])).unwrap();
        let first = out.end(&path).unwrap_err().to_string();
        assert!(first.contains("64 MiB cap") && first.contains("t.trace"), "{first}");
        let later = out.send(&path, Job::Frame(KIND_SAMPLING, vec![0; 100])).unwrap_err().to_string();
        assert!(later.contains("stopped earlier") && later.contains("64 MiB cap"), "{later}");
        assert!(std::fs::metadata(&path).unwrap().len() > written, "the first frame is in the file");
    }

    /// A writer closed without a footer (a copy of a truncated trace) returns the error met
    /// writing its last frame, as finishing does; dropping it would not.
    #[test]
    fn closing_returns_the_last_frames_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.trace");
        let mut w = TraceWriter::create(&path, &Header::default(), None).unwrap();
        // One item whose frame passes the 64 MiB cap: refused on the writing thread.
        w.push(Item::Embeddings(vec![vec![0.0; (MAX_FRAME_LEN as usize / 4) + 1024]])).unwrap();
        w.flush().unwrap();
        let e = w.close().unwrap_err().to_string();
        assert!(e.contains("64 MiB cap") && e.contains("c.trace"), "{e}");
    }
}
