//! The reader: preamble, then one frame at a time (lengths and checksum checked, decompressed
//! within the budget, decoded, validated), recovering every complete frame of a truncated file.

use super::*;
use std::sync::Arc;

/// Reads every frame of `r` into a [`Trace`], keeping the items `keep` accepts.
pub(super) fn collect<R: Read + std::io::Seek>(mut r: TraceReader<R>, mut keep: impl FnMut(&Item) -> bool) -> Result<Trace> {
    let mut memory = crate::validate::header_weight(&r.header);
    let mut items = Vec::new();
    while let Some(frame) = r.next_items()? {
        for item in frame {
            if !keep(&item) {
                continue;
            }
            memory += crate::validate::weight(&item);
            if memory > r.budget {
                return Err(r.refuse(Refusal::MemoryBudget { at: r.frame_at, budget: r.budget }));
            }
            items.push(item);
        }
    }
    let (path, header) = (r.path.clone(), r.header.clone());
    let tail = r.finish()?;
    Ok(Trace { path, header, items, footer: tail.footer, truncated: tail.truncated, sampling: tail.sampling, build: tail.build, level: tail.level, extras: tail.extras })
}

/// What a [`TraceReader`] holds once its items are read: the footer, the sampling and build
/// frames.
#[derive(Debug)]
pub struct Tail {
    /// The footer frame's value; `None` when the file is truncated.
    pub footer: Option<Footer>,
    /// True when the file ended before its footer.
    pub truncated: bool,
    /// Every sampling frame's steps, in file order.
    pub sampling: Vec<crate::record::SamplingStep>,
    /// The build frame's value, when the file has one.
    pub build: Option<crate::record::BuildInfo>,
    /// The level frame's value ([`crate::site::Level::Ops`] without one).
    pub level: crate::site::Level,
    /// The settings frame's pairs and every penalty frame's steps (format 2.7).
    pub extras: crate::record::Extras,
}

/// A trace read frame by frame, from a file or from memory: one items frame's items at a time,
/// so a consumer that keeps little (bisect's index, `show`) holds little whatever the trace's
/// length. It makes every check [`decode_trace`] documents, in file order.
pub struct TraceReader<R> {
    src: R,
    path: PathBuf,
    /// Bytes in the source.
    len: u64,
    /// Offset of the next frame.
    at: u64,
    /// Offset of the frame whose items were returned last.
    frame_at: usize,
    version: u16,
    /// The minor version in the preamble (0 in format 1 and in format-2 files that predate it).
    minor: u8,
    header: Header,
    budget: u64,
    decompressed: u64,
    /// Bytes the sampling steps take.
    sampling_memory: u64,
    check: crate::validate::Checker,
    /// Items read, value parts included (what the footer counts).
    raw_items: u64,
    /// Value parts waiting for their value.
    parts: Vec<u8>,
    pending_parts: bool,
    /// The last items frame read held value parts (dropped from its items once joined).
    frame_parts: bool,
    footer: Option<Footer>,
    truncated: bool,
    sampling: Vec<crate::record::SamplingStep>,
    build: Option<crate::record::BuildInfo>,
    level: Option<crate::site::Level>,
    /// The settings frame's pairs, once read, and the penalty frames' steps.
    settings: Option<crate::record::Settings>,
    penalty: Vec<crate::record::PenaltyStep>,
    /// The compressed payload of the last frame: its first `stored` bytes (the rest is room
    /// kept written, so a larger frame later zeroes only what it adds).
    buf: Vec<u8>,
    stored: usize,
    /// One zstd decompression context for every frame (making one a frame cost a few percent of
    /// a bisect).
    dctx: zstd::bulk::Decompressor<'static>,
    /// Items frames read so far (skipped ones included).
    items_frames: usize,
    /// The checksum of the last items frame read.
    last_sum: u64,
    /// Items frames to skip, from an earlier pass over the same file.
    skip: Option<Skip>,
    /// Op records of frames handed back ([`TraceReader::recycle`]), read into again.
    spare: Spare,
}

/// What an earlier pass over a file noted of each items frame, by ordinal, so a later pass reads
/// only some of them: a skipped frame is neither decompressed nor decoded, and every frame's
/// checksum must be the one noted (the file did not change between the passes).
#[derive(Debug, Default)]
pub struct Skip {
    /// Read this frame.
    pub want: Vec<bool>,
    /// The frame header's checksum.
    pub sums: Vec<u64>,
    /// (op records, sites) declared before the frame.
    pub before: Vec<(u64, u32)>,
    /// Of the wanted frames, those read for some of their op records only: those of `records`.
    /// Their other op records are read past, not built (the earlier pass checked them, and the
    /// frame's checksum is still the one it noted), and nothing after the last one named is
    /// read; the other items before it are decoded. Format 2 and later (a format-1 frame is
    /// decoded whole). Absent: the frame is decoded whole.
    pub records_only: Vec<bool>,
    /// The op records (ids) the frames in `records_only` are read for.
    pub records: std::collections::BTreeSet<u64>,
    /// Where each items frame's header starts, by ordinal (bytes from the file's start, as
    /// [`super::frames_compared`] lists them for the same file): the reader then goes straight
    /// from one wanted frame to the next and stops after the last, reading no header between
    /// (the frames it reads must still have the noted checksums, so a file changed where it
    /// reads is refused; a change in a frame it does not read cannot reach what it returns,
    /// nor can the footer, sampling and build frames it then never reaches). Ignored unless it
    /// lists as many frames as `sums`.
    pub index: Option<std::sync::Arc<[u64]>>,
}

impl Skip {
    /// The records (ids, ascending) items frame `ordinal` is read for, when it is read for some
    /// records only ([`Skip::records_only`]): those of `records` between the records before it
    /// and those before the next.
    fn records_in(&self, ordinal: usize) -> Option<Vec<u64>> {
        if self.records_only.get(ordinal) != Some(&true) {
            return None;
        }
        let lo = self.before.get(ordinal)?.0;
        let hi = self.before.get(ordinal + 1).map_or(u64::MAX, |b| b.0);
        Some(self.records.range(lo..hi.max(lo)).copied().collect())
    }
}

/// An items frame as stored, offered to [`TraceReader::next_items_reusing`]'s `reuse`.
#[derive(Debug)]
pub struct Stored<'a> {
    /// Items frames before it in its file.
    pub ordinal: usize,
    /// Its file's major format version.
    pub version: u16,
    /// Its frame header's checksum (xxh3-64 of the payload).
    pub sum: u64,
    /// Its payload's uncompressed length, in bytes.
    pub ulen: u32,
    /// Its payload as stored (zstd-compressed).
    pub bytes: &'a [u8],
}

/// An items frame decoded ahead of its reader, out of the order of checks
/// ([`super::scan::Scan`]), for a [`TraceReader`] of the same file, or of another file holding
/// the same frame, to take in place of decoding it ([`TraceReader::next_items_reusing`]).
#[derive(Clone, Debug)]
pub struct Decoded {
    /// Items frames before it in its file.
    pub ordinal: usize,
    /// Its file's major format version (the same bytes decode differently in format 1).
    pub version: u16,
    /// Its frame header's checksum.
    pub sum: u64,
    /// Its payload's uncompressed length, in bytes.
    pub ulen: u32,
    /// Its payload as stored.
    pub stored: Arc<Vec<u8>>,
    /// Its items, decoded but not checked against the trace's structure (the taking reader
    /// checks them in its order). None is a value or a value part.
    pub items: Arc<Vec<Item>>,
}

impl Decoded {
    /// Whether `s` is this frame: the same stored bytes at the same ordinal, in a file of the
    /// same major version. Equal compressed bytes decompress to equal payloads, so no hash is
    /// trusted here.
    fn is(&self, s: &Stored<'_>) -> bool {
        self.ordinal == s.ordinal && self.version == s.version && self.sum == s.sum && self.ulen == s.ulen && self.stored.as_slice() == s.bytes
    }
}

/// An items frame's items: decoded by this reader, or taken from another; or its summary.
enum Frame {
    Own(Vec<Item>),
    Reused(Arc<Vec<Item>>),
    /// The summary, and the items frame's offset in the file.
    Summary(Arc<crate::summary::FrameSummary>, u64),
}

/// An items frame as [`TraceReader::next_or_summary`] gives it: its items, checked, or its
/// summary, checked ([`crate::validate::Checker::summary`]), in place of them.
#[derive(Debug)]
pub enum Next {
    /// The frame's items.
    Items(Arc<Vec<Item>>),
    /// The frame's summary, and the frame's offset in the file (for
    /// [`TraceReader::items_frame_at`]); the frame itself was neither decompressed nor decoded.
    Summary(Arc<crate::summary::FrameSummary>, u64),
}

impl TraceReader<FileAt> {
    /// The items of the items frame at byte offset `at` of `path` (a [`Next::Summary`]'s), with
    /// `before` = (op records, sites) declared before it: decompressed, decoded and checked as
    /// a reader of the whole file checks it there.
    ///
    /// # Errors
    /// As [`TraceReader::next_items`]; no items frame at `at` (the file changed) is refused.
    pub fn items_frame_at(path: &Path, at: u64, before: (u64, u32)) -> Result<Vec<Item>> {
        use std::io::Seek;
        let mut r = TraceReader::open(path)?;
        r.src.seek(std::io::SeekFrom::Start(at)).map_err(|e| Error::io(path, e))?;
        r.at = at;
        r.check.resume(before.0, before.1);
        let Some((KIND_ITEMS, ulen, sum, at)) = r.stored(&|_| false)? else {
            return Err(r.refuse(Refusal::Sequence("the file changed between two reads of it: no items frame where one was read".into())));
        };
        let raw = r.unpack(ulen, sum, at)?;
        r.frame_at = at;
        let items = decode_items(&raw, at, r.version).map_err(|why| r.refuse(why))?;
        r.joined(items, at, false)
    }

    /// Opens `path` and reads its preamble and header frame.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be read (a directory, a device, a missing file);
    /// [`Error::Refused`] when a check of the preamble or header fails.
    pub fn open(path: &Path) -> Result<Self> {
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        if meta.is_dir() {
            return Err(Error::trace(path, "is a directory, not a trace file"));
        }
        if !meta.is_file() {
            // A device or a pipe could be read without end.
            return Err(Error::trace(path, "is not a regular file (a device or a pipe?), not a trace file"));
        }
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // Payloads are read into the reader's own buffer, and one passed over (read as its
        // summary) costs nothing ([`FileAt`]).
        Self::start(FileAt::new(file), meta.len(), path)
    }
}

impl<'a> TraceReader<std::io::Cursor<&'a [u8]>> {
    /// Reads the preamble and header frame of a trace held in memory (`path` names it in errors).
    ///
    /// # Errors
    /// [`Error::Refused`] when a check of the preamble or header fails.
    pub fn from_bytes(bytes: &'a [u8], path: &Path) -> Result<Self> {
        Self::start(std::io::Cursor::new(bytes), bytes.len() as u64, path)
    }
}

impl<R: Read + std::io::Seek> TraceReader<R> {
    fn start(mut src: R, len: u64, path: &Path) -> Result<Self> {
        let refuse = |why: Refusal| Error::refused(path, why);
        if len == 0 {
            return Err(refuse(Refusal::Empty));
        }
        let mut pre = [0u8; PREAMBLE_LEN];
        let got = read_up_to(&mut src, &mut pre).map_err(|e| Error::io(path, e))?;
        if got < MAGIC.len() || pre[..MAGIC.len()] != MAGIC {
            return Err(refuse(Refusal::BadMagic));
        }
        if got < PREAMBLE_LEN {
            return Err(refuse(Refusal::NoHeader));
        }
        let version = u16::from_le_bytes([pre[8], pre[9]]);
        if version > VERSION {
            return Err(refuse(Refusal::NewerVersion { found: version, reads: VERSION }));
        }
        if version < OLDEST_VERSION {
            return Err(refuse(Refusal::OlderVersion { found: version, reads: OLDEST_VERSION }));
        }
        // Format 1 stores a u16 of flags here (none defined); format 2 a minor version and a byte
        // of flags (format-2 files that predate the minor version hold 0 there).
        let (minor, flags) = if version == 1 { (0, u16::from_le_bytes([pre[10], pre[11]])) } else { (pre[10], u16::from(pre[11])) };
        if flags & !u16::from(KNOWN_FLAGS) != 0 {
            return Err(refuse(Refusal::UnknownFlags(flags & !u16::from(KNOWN_FLAGS))));
        }
        let mut r = TraceReader {
            src,
            path: path.to_path_buf(),
            len,
            at: PREAMBLE_LEN as u64,
            frame_at: PREAMBLE_LEN,
            version,
            minor,
            header: Header::default(),
            budget: crate::limits::decoded_budget(len),
            decompressed: 0,
            sampling_memory: 0,
            check: crate::validate::Checker::default(),
            raw_items: 0,
            parts: Vec::new(),
            pending_parts: false,
            frame_parts: false,
            footer: None,
            truncated: false,
            sampling: Vec::new(),
            build: None,
            level: None,
            settings: None,
            penalty: Vec::new(),
            buf: Vec::new(),
            stored: 0,
            dctx: zstd::bulk::Decompressor::new().map_err(|e| Error::trace(path, format!("cannot make a zstd context: {e}")))?,
            items_frames: 0,
            last_sum: 0,
            skip: None,
            spare: Spare::default(),
        };
        // The header must be the first frame (optional frames of later versions excepted).
        loop {
            let Some((kind, raw, at)) = r.frame()? else { return Err(refuse(Refusal::NoHeader)) };
            match kind {
                KIND_HEADER => {
                    let h: Header = decode(&raw, at).map_err(|why| r.refuse(why))?;
                    crate::validate::header(&h).map_err(|msg| refuse(Refusal::Invalid { at, msg }))?;
                    if crate::validate::header_weight(&h) > r.budget {
                        return Err(refuse(Refusal::MemoryBudget { at, budget: r.budget }));
                    }
                    r.header = h;
                    return Ok(r);
                }
                KIND_ITEMS | KIND_FOOTER | KIND_SAMPLING | KIND_BUILD | KIND_SETTINGS | KIND_PENALTY => return Err(refuse(Refusal::Misplaced { at, what: "frame before the header".into() })),
                _ => continue,
            }
        }
    }

    /// The header frame's value.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Reads only the items frames `skip` wants from here on (see [`Skip`]); the footer's counts
    /// are then not checked (the earlier pass did).
    pub fn skipping(mut self, skip: Skip) -> Self {
        self.skip = Some(skip);
        self
    }

    /// The level the trace was recorded at ([`crate::site::Level::Ops`] when the file has no
    /// level frame), known once the first items frame was read ([`TraceReader::next_items`]).
    pub fn level(&self) -> crate::site::Level {
        self.level.unwrap_or_default()
    }

    /// Hands back items this reader returned once they are no longer needed: the frames it
    /// decodes next are read into their op records, in place (no allocation a record), rather
    /// than into new ones.
    pub fn recycle(&mut self, items: Vec<Item>) {
        self.spare.keep(items);
    }

    /// (op records, sites) declared so far, and the checksum of the last items frame: what
    /// [`Skip`] notes of the next frame.
    pub fn position(&self) -> (u64, u32, u64) {
        (self.check.op_records(), self.check.sites(), self.last_sum)
    }

    /// Whether the last items frame returned held value parts of a dump or operand: they are
    /// joined into the value that follows them (maybe frames later) and dropped from the frame's
    /// items, so a later pass that reads the value must read this frame too ([`Skip`]).
    pub fn held_value_parts(&self) -> bool {
        self.frame_parts
    }

    /// The file (or the name given to [`TraceReader::from_bytes`]).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `why` as an error naming the file. A frame that does not decode in a file of a newer minor
    /// version holds what this build does not know (an enum variant added later): that is said,
    /// with both versions, rather than "does not decode".
    fn refuse(&self, why: Refusal) -> Error {
        let why = match why {
            Refusal::Decode { at, msg } if self.version == VERSION && self.minor > MINOR => Refusal::NewerMinor { at, msg, found: (self.version, self.minor), reads: (VERSION, MINOR) },
            why => why,
        };
        Error::refused(&self.path, why)
    }

    /// The next frame this build reads, decompressed and checked: (kind, payload, offset);
    /// `None` at the end of the file or where it is cut inside a frame (then `truncated`).
    /// Optional frames of later versions are skipped.
    fn frame(&mut self) -> Result<Option<(u8, Vec<u8>, usize)>> {
        let Some((kind, ulen, sum, at)) = self.stored(&|_| false)? else { return Ok(None) };
        self.unpack(ulen, sum, at).map(|raw| Some((kind, raw, at)))
    }

    /// The next frame this build reads, as stored (its compressed payload in `buf`), lengths
    /// checked: (kind, uncompressed length, checksum, offset); `None` as [`TraceReader::frame`].
    /// The payload of an items frame whose ordinal `pass_over` names is not read (`stored` is
    /// 0): the frame is read as its summary.
    fn stored(&mut self, pass_over: &dyn Fn(usize) -> bool) -> Result<Option<(u8, u32, u64, usize)>> {
        loop {
            self.jump().map_err(|e| Error::io(&self.path, e))?;
            let at = self.at as usize;
            if self.at >= self.len {
                return self.ended();
            }
            let Some(h) = FrameHeader::read(&mut self.src).map_err(|e| Error::io(&self.path, e))? else {
                self.truncated = true;
                return self.ended();
            };
            let FrameHeader { kind, clen, ulen, sum } = h;
            if kind == 0 || (kind > KIND_FOOTER && kind < FIRST_OPTIONAL_KIND) {
                return Err(self.refuse(Refusal::UnknownFrameKind { at, kind }));
            }
            if !h.within_caps() {
                return Err(self.refuse(Refusal::FrameTooLarge { at, compressed: clen, decompressed: ulen }));
            }
            let next = h.next(self.at);
            if next > self.len {
                self.truncated = true;
                self.at = self.len;
                return self.ended();
            }
            // An items frame read as its summary, or one a later pass does not want: its
            // payload is passed over, nothing allocated or read.
            let unwanted = self.skip.as_ref().is_some_and(|s| s.want.get(self.items_frames) == Some(&false));
            let got = if kind == KIND_ITEMS && (unwanted || (pass_over(self.items_frames) && !self.pending_parts)) {
                self.stored = 0;
                self.src.seek_relative(clen as i64).map_err(|e| Error::io(&self.path, e))?;
                clen as usize
            } else {
                // The length was checked against the file's before this allocation.
                if self.buf.len() < clen as usize {
                    self.buf.resize(clen as usize, 0);
                }
                self.stored = read_up_to(&mut self.src, &mut self.buf[..clen as usize]).map_err(|e| Error::io(&self.path, e))?;
                self.stored
            };
            if got < clen as usize {
                // The file shrank while it was read.
                self.truncated = true;
                self.at = self.len;
                return self.ended();
            }
            self.at = next;
            if kind == KIND_ITEMS {
                let ordinal = self.items_frames;
                self.items_frames += 1;
                self.last_sum = sum;
                if let Some(skip) = &self.skip {
                    if ordinal >= skip.sums.len() {
                        // Written after the earlier pass (a run still recording): not read.
                        self.at = self.len;
                        return Ok(None);
                    }
                    if skip.sums.get(ordinal) != Some(&sum) {
                        return Err(self.refuse(Refusal::Sequence("the file changed between two reads of it".into())));
                    }
                    if !skip.want.get(ordinal).copied().unwrap_or(true) {
                        continue;
                    }
                    if let Some(&(ops, sites)) = skip.before.get(ordinal) {
                        self.check.resume(ops, sites);
                    }
                }
            }
            if kind > LAST_KNOWN_KIND {
                // An optional frame of a later minor version: its lengths were checked; skip it.
                continue;
            }
            return Ok(Some((kind, ulen, sum, at)));
        }
    }

    /// With [`Skip::index`]: moves to the next items frame the skip wants, or past the file's
    /// end when none is left, reading nothing on the way. Not while value parts wait for their
    /// value, nor to an offset behind the reader (an index not of this file: read on in order).
    fn jump(&mut self) -> std::io::Result<()> {
        let Some(skip) = &self.skip else { return Ok(()) };
        let Some(index) = skip.index.as_ref().filter(|i| i.len() == skip.sums.len() && self.items_frames < i.len()) else { return Ok(()) };
        if self.pending_parts {
            return Ok(());
        }
        match super::scan::next_wanted_frame(index, self.items_frames, |o| skip.want.get(o) != Some(&false)) {
            Some((o, at)) if at > self.at => {
                self.src.seek(std::io::SeekFrom::Start(at))?;
                (self.at, self.items_frames) = (at, o);
            }
            Some(_) => {}
            None => (self.at, self.items_frames) = (self.len, index.len()),
        }
        Ok(())
    }

    /// The payload of the frame [`TraceReader::stored`] read, decompressed within the budget
    /// and checked against its length and checksum.
    fn unpack(&mut self, ulen: u32, sum: u64, at: usize) -> Result<Vec<u8>> {
        self.decompressed += ulen as u64;
        if self.decompressed > self.budget {
            return Err(self.refuse(Refusal::DecompressedBudget { at, budget: self.budget }));
        }
        let raw = self.dctx.decompress(&self.buf[..self.stored], ulen as usize).map_err(|e| self.refuse(Refusal::Decompress { at, msg: e.to_string() }))?;
        if raw.len() != ulen as usize {
            return Err(self.refuse(Refusal::LengthMismatch { at, got: raw.len(), want: ulen }));
        }
        if xxh3_64(&raw) != sum {
            return Err(self.refuse(Refusal::Checksum { at }));
        }
        Ok(raw)
    }

    /// The end of the file: `None`, unless a later pass has not yet seen every items frame the
    /// earlier one noted (the file was cut in between).
    fn ended<T>(&self) -> Result<Option<T>> {
        match &self.skip {
            Some(skip) if self.items_frames < skip.sums.len() => Err(self.refuse(Refusal::Sequence("the file changed between two reads of it".into()))),
            _ => Ok(None),
        }
    }

    /// The next items frame's items, checked, value parts joined into their values; sampling,
    /// build and footer frames on the way are kept for [`TraceReader::finish`]. `None` once
    /// the file ends.
    ///
    /// # Errors
    /// [`Error::Refused`] with the first check that fails; [`Error::Io`] when reading fails.
    pub fn next_items(&mut self) -> Result<Option<Vec<Item>>> {
        match self.next_frame(&mut |_| None, &|_| false)? {
            Some(Frame::Own(items)) => Ok(Some(items)),
            // Not reached (nothing is offered for reuse or summarised here); moved out when not
            // shared.
            Some(Frame::Reused(items)) => Ok(Some(Arc::unwrap_or_clone(items))),
            Some(Frame::Summary(..)) => Err(self.bug()),
            None => Ok(None),
        }
    }

    /// An error for a state this reader cannot reach without a bug, naming the file.
    fn bug(&self) -> Error {
        Error::trace(&self.path, "a frame summary where items were asked for (a bug in candle-trace: please report it)")
    }

    /// [`TraceReader::next_items`], but each items frame is first offered, as stored, to
    /// `reuse`: when it returns the [`Decoded`] items of a frame with the same stored bytes
    /// (decoded ahead on another thread, from this file or from another holding the same frame),
    /// those items are checked and returned instead of decompressing and decoding the frame
    /// here. The checks, the budgets and the errors are the ones decoding it would give. Bisect
    /// decodes the frames of two runs on two threads ahead of their checks, and the frames the
    /// runs share once.
    ///
    /// # Errors
    /// As [`TraceReader::next_items`].
    pub fn next_items_reusing(&mut self, reuse: &mut dyn FnMut(&Stored<'_>) -> Option<Decoded>) -> Result<Option<Arc<Vec<Item>>>> {
        match self.next_or_summary(reuse, &|_| false)? {
            Some(Next::Items(items)) => Ok(Some(items)),
            Some(Next::Summary(..)) => Err(self.bug()),
            None => Ok(None),
        }
    }

    /// [`TraceReader::next_items_reusing`], but an items frame whose ordinal `summarised`
    /// names is read as its summary frame ([`KIND_SUMMARY`], right after it): checked against
    /// the trace's structure and returned in place of the items, the frame itself neither
    /// decompressed nor decoded. Bisect reads so the frames two runs hold identically.
    ///
    /// # Errors
    /// As [`TraceReader::next_items`]; a summarised frame without its summary frame (the file
    /// changed since `summarised` was worked out) is refused.
    pub fn next_or_summary(&mut self, reuse: &mut dyn FnMut(&Stored<'_>) -> Option<Decoded>, summarised: &dyn Fn(usize) -> bool) -> Result<Option<Next>> {
        Ok(self.next_frame(reuse, summarised)?.map(|f| match f {
            Frame::Own(items) => Next::Items(Arc::new(items)),
            Frame::Reused(items) => Next::Items(items),
            Frame::Summary(s, at) => Next::Summary(s, at),
        }))
    }

    /// Reads the summary frame just read as stored (`ulen`, `sum` at `at`) for the items frame
    /// at `items_at` (`items_len` bytes uncompressed), checks it and moves the checks past the
    /// frame's items.
    fn summary(&mut self, (ulen, sum, at): (u32, u64, usize), (items_at, items_len): (usize, u32)) -> Result<Frame> {
        let raw = self.unpack(ulen, sum, at)?;
        self.frame_parts = false;
        let s: crate::summary::FrameSummary = decode(&raw, at).map_err(|why| self.refuse(why))?;
        if s.kept.iter().map(crate::validate::weight).sum::<u64>() > self.budget {
            return Err(self.refuse(Refusal::MemoryBudget { at, budget: self.budget }));
        }
        self.check.summary(&s, items_len).map_err(|msg| self.refuse(Refusal::Invalid { at, msg }))?;
        self.frame_at = items_at;
        self.raw_items += s.items as u64;
        Ok(Frame::Summary(Arc::new(s), items_at as u64))
    }

    /// Takes `d` for the items frame just read as stored, which it is (`Decoded::is`), checking
    /// its items as [`TraceReader::joined`] checks a decoded frame's (it holds no value part).
    fn adopt(&mut self, d: Decoded, at: usize) -> Result<Arc<Vec<Item>>> {
        self.decompressed += d.ulen as u64;
        if self.decompressed > self.budget {
            return Err(self.refuse(Refusal::DecompressedBudget { at, budget: self.budget }));
        }
        self.frame_at = at;
        self.frame_parts = false;
        let mut weight = 0u64;
        for item in d.items.iter() {
            self.check_item(item, &mut weight, at)?;
        }
        Ok(d.items)
    }

    /// The checks every item of an items frame passes in stream order: the frame's memory
    /// weight so far (`weight`, against the budget) and the trace's structure; counts it.
    fn check_item(&mut self, item: &Item, weight: &mut u64, at: usize) -> Result<()> {
        *weight += crate::validate::weight(item);
        if *weight > self.budget {
            return Err(self.refuse(Refusal::MemoryBudget { at, budget: self.budget }));
        }
        self.check.item(item).map_err(|msg| self.refuse(Refusal::Invalid { at, msg }))?;
        self.raw_items += 1;
        Ok(())
    }

    fn next_frame(&mut self, reuse: &mut dyn FnMut(&Stored<'_>) -> Option<Decoded>, summarised: &dyn Fn(usize) -> bool) -> Result<Option<Frame>> {
        // The items frame read as stored whose summary comes next.
        let mut awaiting: Option<(usize, u32)> = None;
        let changed = |r: &Self| r.refuse(Refusal::Sequence("the file changed between two reads of it: a frame summary is missing".into()));
        loop {
            if self.footer.is_some() {
                if self.at < self.len {
                    let at = self.at as usize;
                    return Err(self.refuse(Refusal::Misplaced { at, what: format!("{} bytes after the footer frame", self.len - self.at) }));
                }
                return Ok(None);
            }
            let Some((kind, ulen, sum, at)) = self.stored(summarised)? else {
                return if awaiting.is_some() { Err(changed(self)) } else { Ok(None) };
            };
            if kind == KIND_SUMMARY {
                match awaiting.take() {
                    Some((items_at, items_len)) => return self.summary((ulen, sum, at), (items_at, items_len)).map(Some),
                    None => continue,
                }
            }
            if awaiting.is_some() {
                return Err(changed(self));
            }
            if kind == KIND_ITEMS && !self.pending_parts {
                if summarised(self.items_frames - 1) {
                    awaiting = Some((at, ulen));
                    continue;
                }
                let s = Stored { ordinal: self.items_frames - 1, version: self.version, sum, ulen, bytes: &self.buf[..self.stored] };
                if let Some(d) = reuse(&s).filter(|d| d.is(&s)) {
                    return self.adopt(d, at).map(|items| Some(Frame::Reused(items)));
                }
            }
            let raw = self.unpack(ulen, sum, at)?;
            match kind {
                KIND_ITEMS => {
                    self.frame_at = at;
                    let only = self.skip.as_ref().and_then(|s| s.records_in(self.items_frames - 1)).filter(|_| self.version > 1);
                    let items = match &only {
                        Some(wanted) => decode_items_only(&raw, at, wanted),
                        None => decode_items_reusing(&raw, at, self.version, &mut self.spare),
                    };
                    let items = items.map_err(|why| self.refuse(why))?;
                    return self.joined(items, at, only.is_some()).map(|items| Some(Frame::Own(items)));
                }
                KIND_FOOTER => self.footer = Some(decode::<Footer>(&raw, at).map_err(|why| self.refuse(why))?),
                KIND_HEADER => return Err(self.refuse(Refusal::Misplaced { at, what: "second header frame".into() })),
                KIND_SAMPLING => {
                    let steps: SamplingSteps = decode(&raw, at).map_err(|why| self.refuse(why))?;
                    self.sampling_memory += (steps.0.len() * std::mem::size_of::<crate::record::SamplingStep>()) as u64;
                    if self.sampling_memory > self.budget {
                        return Err(self.refuse(Refusal::MemoryBudget { at, budget: self.budget }));
                    }
                    self.sampling.extend(steps.0);
                }
                KIND_BUILD if self.build.is_none() => self.build = Some(decode::<crate::record::BuildInfo>(&raw, at).map_err(|why| self.refuse(why))?),
                KIND_BUILD => return Err(self.refuse(Refusal::Misplaced { at, what: "second build frame".into() })),
                KIND_LEVEL if self.level.is_none() && self.frame_at == PREAMBLE_LEN => self.level = Some(decode::<crate::site::Level>(&raw, at).map_err(|why| self.refuse(why))?),
                KIND_LEVEL => return Err(self.refuse(Refusal::Misplaced { at, what: "level frame after the items began, or a second one".into() })),
                KIND_SETTINGS if self.settings.is_none() && self.items_frames == 0 => self.settings = Some(self.settings_frame(&raw, at)?),
                KIND_SETTINGS => return Err(self.refuse(Refusal::Misplaced { at, what: "settings frame after the items began, or a second one".into() })),
                KIND_PENALTY => {
                    let steps: PenaltySteps = decode(&raw, at).map_err(|why| self.refuse(why))?;
                    self.sampling_memory += steps.0.iter().map(|s| std::mem::size_of::<crate::record::PenaltyStep>() + s.top.len() * 12).sum::<usize>() as u64;
                    if self.sampling_memory > self.budget {
                        return Err(self.refuse(Refusal::MemoryBudget { at, budget: self.budget }));
                    }
                    self.penalty.extend(steps.0);
                }
                kind => return Err(self.refuse(Refusal::UnknownFrameKind { at, kind })),
            }
        }
    }

    /// A settings frame's value, its keys checked sorted and unique.
    fn settings_frame(&self, raw: &[u8], at: usize) -> Result<crate::record::Settings> {
        let s = decode::<crate::record::Settings>(raw, at).map_err(|why| self.refuse(why))?;
        if !s.0.windows(2).all(|w| w[0].0 < w[1].0) {
            return Err(self.refuse(Refusal::Invalid { at, msg: "the settings frame's keys are not sorted and unique".into() }));
        }
        Ok(s)
    }

    /// Checks one frame's items in stream order and joins `ValuePart` items into the `Dump` or
    /// `Operand` that follows them (across frames too). `some_records`: the frame was read for
    /// some of its op records only ([`Skip::records_only`]), so each op record is checked as
    /// the next after those read past.
    fn joined(&mut self, mut items: Vec<Item>, at: usize, some_records: bool) -> Result<Vec<Item>> {
        // Items are kept in place (value parts, joined into their value, are dropped).
        let (mut weight, mut kept) = (0u64, 0);
        self.frame_parts = false;
        for k in 0..items.len() {
            let item = &mut items[k];
            if let (Item::Op(r), true) = (&*item, some_records) {
                self.check.resume(r.seq, self.check.sites());
            }
            self.check_item(item, &mut weight, at)?;
            match item {
                Item::ValuePart(p) => {
                    self.frame_parts = true;
                    // Freed now: only the joined value is kept.
                    self.parts.extend_from_slice(&std::mem::take(p));
                    self.pending_parts = true;
                    continue;
                }
                Item::Dump(d) if self.pending_parts => {
                    self.parts.extend_from_slice(&d.data);
                    d.data = std::mem::take(&mut self.parts);
                }
                Item::Operand(v) if self.pending_parts => {
                    let data = v.data_mut();
                    self.parts.extend_from_slice(data);
                    *data = std::mem::take(&mut self.parts);
                }
                _ if self.pending_parts => return Err(self.refuse(Refusal::Sequence("a value part is not followed by its value".into()))),
                _ => {}
            }
            self.pending_parts = false;
            crate::validate::values(std::slice::from_ref(item)).map_err(|msg| self.refuse(Refusal::Invalid { at, msg }))?;
            if kept != k {
                items.swap(kept, k);
            }
            kept += 1;
        }
        items.truncate(kept);
        Ok(items)
    }

    /// Reads what is left (when the items were not all read) and checks the end of the file:
    /// the footer's counts, value parts left without their value.
    ///
    /// # Errors
    /// As [`TraceReader::next_items`].
    pub fn finish(mut self) -> Result<Tail> {
        while self.next_items()?.is_some() {}
        if let (Some(f), None) = (&self.footer, &self.skip) {
            let ops = self.check.op_records();
            if f.items != self.raw_items || f.op_records != ops {
                return Err(self.refuse(Refusal::Sequence(format!(
                    "the footer counts {} items and {} op records, the file holds {} and {ops}: a frame is missing or repeated",
                    f.items, f.op_records, self.raw_items
                ))));
            }
        }
        let truncated = self.truncated || self.footer.is_none();
        if self.pending_parts && !truncated {
            return Err(self.refuse(Refusal::Sequence("the file ends with a value part".into())));
        }
        let extras = crate::record::Extras { settings: self.settings.unwrap_or_default(), penalty: self.penalty };
        Ok(Tail { footer: self.footer, truncated, sampling: self.sampling, build: self.build, level: self.level.unwrap_or_default(), extras })
    }
}

/// Reads into `buf` until it is full or the source ends: the bytes read.
pub(super) fn read_up_to(src: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match src.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// A sampling frame's payload: at most one step per batch row.
#[derive(serde::Deserialize)]
struct SamplingSteps(#[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_ROWS }>")] Vec<crate::record::SamplingStep>);

/// A penalty frame's payload: at most one step per batch row.
#[derive(serde::Deserialize)]
struct PenaltySteps(#[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_ROWS }>")] Vec<crate::record::PenaltyStep>);

#[cfg(test)]
mod tests;
