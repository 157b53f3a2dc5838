//! The trace file, version 2 (version 1 is read too): a preamble, then independently decodable zstd frames (header,
//! item batches, footer). Specified byte by byte in `docs/trace-format.md`; this module is the
//! reference writer and reader. It knows nothing of models.
//!
//! Crash safety: the writer emits each frame with a single `write_all` on an unbuffered file, at
//! the end of every forward pass and every [`ITEMS_PER_FRAME`] items, so a run killed at any
//! moment leaves every completed frame readable. The reader recovers all complete frames of a
//! truncated file and reports `truncated = true`; a frame that is complete but fails its checks is
//! an error.

use crate::error::{Error, Result};
use crate::record::{Footer, Header, Item};
use serde::de::DeserializeOwned;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use xxhash_rust::xxh3::xxh3_64;

/// The first 8 bytes of every trace file.
pub const MAGIC: [u8; 8] = *b"\x89CTRACE\n";
/// The format version this build writes: 2, whose items frames store op records compactly
/// (the private `compact` module; `docs/trace-format.md`, "Format 2").
pub const VERSION: u16 = 2;
/// The oldest format version this build reads: format-1 files (golden traces, traces of older
/// builds) stay readable, and compare with format-2 ones (the values recorded are the same).
pub const OLDEST_VERSION: u16 = 1;
/// The minor version this build writes and reads, within [`VERSION`]: 2.0 held kernels 0..=19;
/// 2.1 added `Kernel::Affine` and 2.2 `Kernel::FlashAttn` (`docs/trace-format.md`,
/// "Evolution"). A minor version only appends (enum variants at the end, optional frame kinds),
/// so an older reader refuses what it cannot decode as written by a newer version, naming both.
/// Format-2 files written before the minor version was stored hold `00` (they read as 2.0, and
/// may hold the 2.1 and 2.2 kernels, which this build knows).
pub const MINOR: u8 = 2;
/// Preamble: magic (8) + major version u16 LE + minor version u8 + flags u8 (0).
pub const PREAMBLE_LEN: usize = 12;
/// Frame header: kind u8 + compressed length u32 LE + uncompressed length u32 LE + xxh3-64 u64 LE.
pub const FRAME_HEADER_LEN: usize = 17;
/// Hard cap on either length of one frame (64 MiB): larger values are refused unread.
pub use crate::limits::MAX_FRAME_LEN;
/// Flag bits this build knows (none): a file with any other bit set is refused.
pub const KNOWN_FLAGS: u8 = 0;
/// The writer starts a new frame after this many items...
pub const ITEMS_PER_FRAME: usize = 1024;
/// ...or once the queued items hold this many per-token entries (about 45 bytes each encoded),
/// which keeps every frame far below [`MAX_FRAME_LEN`] whatever the prompt length and batch.
pub const TOKEN_STATS_PER_FRAME: usize = 100_000;
/// Dumped values are written in parts of at most this many bytes ([`Item::ValuePart`]).
pub const VALUE_PART_BYTES: usize = 16 << 20;
/// ...or before queued dumped values (`--dump`) would pass this many bytes.
pub const VALUE_BYTES_PER_FRAME: usize = 32 << 20;
/// zstd compression level of the writer.
pub const ZSTD_LEVEL: i32 = 3;

/// Frame kinds.
pub const KIND_HEADER: u8 = 1;
/// Frame kind of an items frame: a postcard `Vec<Item>`.
pub const KIND_ITEMS: u8 = 2;
/// Frame kind of the footer frame (a [`Footer`]).
pub const KIND_FOOTER: u8 = 3;
/// Frame kinds from this one up are optional: a reader that does not know one checks its
/// lengths and skips it. Kinds 4..128 are reserved for frames readers must understand.
pub const FIRST_OPTIONAL_KIND: u8 = 128;
/// Optional frame (format 1.1): one decode step's [`crate::record::SamplingStep`]s, a postcard
/// `Vec<SamplingStep>`, written before that step's `Token` item.
pub const KIND_SAMPLING: u8 = 128;
/// Optional frame (format 1.2): the writer's [`crate::record::BuildInfo`], postcard, right after
/// the header.
pub const KIND_BUILD: u8 = 129;

/// The 12-byte preamble this build writes.
pub fn preamble() -> [u8; PREAMBLE_LEN] {
    let mut pre = [0u8; PREAMBLE_LEN];
    pre[..8].copy_from_slice(&MAGIC);
    pre[8..10].copy_from_slice(&VERSION.to_le_bytes());
    pre[10] = MINOR;
    pre[11] = 0;
    pre
}

/// One whole frame (17-byte frame header and zstd payload) holding `value`, postcard-encoded.
///
/// # Errors
/// A message when the value cannot be encoded or a length passes [`MAX_FRAME_LEN`].
pub fn frame_bytes<T: serde::Serialize>(kind: u8, value: &T) -> std::result::Result<Vec<u8>, String> {
    let mut z = zstd::bulk::Compressor::new(ZSTD_LEVEL).map_err(|e| format!("cannot compress frame: {e}"))?;
    frame_bytes_with(&mut z, kind, value)
}

/// [`frame_bytes`] with a zstd context the caller keeps (a writer reuses one for every frame,
/// instead of making one a frame).
fn frame_bytes_with<T: serde::Serialize>(z: &mut zstd::bulk::Compressor<'static>, kind: u8, value: &T) -> std::result::Result<Vec<u8>, String> {
    let raw = postcard::to_stdvec(value).map_err(|e| format!("cannot encode frame: {e}"))?;
    let packed = z.compress(&raw).map_err(|e| format!("cannot compress frame: {e}"))?;
    if raw.len() > MAX_FRAME_LEN as usize || packed.len() > MAX_FRAME_LEN as usize {
        return Err("frame over the 64 MiB cap".into());
    }
    let mut frame = Vec::with_capacity(FRAME_HEADER_LEN + packed.len());
    frame.push(kind);
    frame.extend_from_slice(&(packed.len() as u32).to_le_bytes());
    frame.extend_from_slice(&(raw.len() as u32).to_le_bytes());
    frame.extend_from_slice(&xxh3_64(&raw).to_le_bytes());
    frame.extend_from_slice(&packed);
    Ok(frame)
}

/// One format-2 items frame holding `items` (tests and fuzzing craft inputs with it).
///
/// # Errors
/// As [`frame_bytes`].
pub fn items_frame_bytes(items: &[Item]) -> std::result::Result<Vec<u8>, String> {
    frame_bytes(KIND_ITEMS, &crate::compact::encode_items(items))
}

/// A whole trace in memory: preamble, header frame, `items` in frames of at most
/// [`ITEMS_PER_FRAME`], and the footer frame when given (tests and fuzzing build inputs with it).
///
/// # Errors
/// As [`frame_bytes`].
pub fn encode_trace(header: &Header, items: &[Item], footer: Option<&Footer>) -> std::result::Result<Vec<u8>, String> {
    let mut out = preamble().to_vec();
    out.extend(frame_bytes(KIND_HEADER, header)?);
    for chunk in items.chunks(ITEMS_PER_FRAME) {
        out.extend(items_frame_bytes(chunk)?);
    }
    if let Some(f) = footer {
        out.extend(frame_bytes(KIND_FOOTER, f)?);
    }
    Ok(out)
}

/// Streams a trace to a file.
pub struct TraceWriter {
    path: PathBuf,
    file: File,
    pending: Vec<Item>,
    pending_token_stats: usize,
    /// Bytes of dumped values queued.
    pending_value_bytes: usize,
    items: u64,
    /// Frames written so far (header included).
    frames: u64,
    /// Crash tests only ([`crate::crash`]): where to SIGKILL this process.
    kill_at: Option<crate::crash::KillPoint>,
    /// The zstd context every frame is compressed with.
    zstd: zstd::bulk::Compressor<'static>,
}

impl TraceWriter {
    /// Creates (truncates) `path` and writes the preamble and the header frame.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be created or written.
    pub fn create(path: &Path, header: &Header) -> Result<Self> {
        Self::create_with(path, header, Some(&crate::env::build_info()))
    }

    /// [`TraceWriter::create`], with `build` as the build fingerprint frame instead of this
    /// binary's (`None`: no such frame), for copies of a trace (`redact`, `extract`).
    ///
    /// # Errors
    /// As [`TraceWriter::create`].
    pub fn create_with(path: &Path, header: &Header, build: Option<&crate::record::BuildInfo>) -> Result<Self> {
        let mut file = File::create(path).map_err(|e| Error::io(path, e))?;
        file.write_all(&preamble()).map_err(|e| Error::io(path, e))?;
        let mut w = TraceWriter {
            path: path.to_path_buf(),
            file,
            pending: Vec::new(),
            pending_token_stats: 0,
            pending_value_bytes: 0,
            items: 0,
            frames: 0,
            kill_at: crate::crash::kill_point(),
            zstd: zstd::bulk::Compressor::new(ZSTD_LEVEL).map_err(|e| Error::io(path, std::io::Error::other(e)))?,
        };
        w.write_frame(KIND_HEADER, header)?;
        if let Some(b) = build {
            w.write_frame(KIND_BUILD, b)?;
        }
        Ok(w)
    }

    /// Queues one item; writes a frame when [`ITEMS_PER_FRAME`] items or
    /// [`TOKEN_STATS_PER_FRAME`] per-token entries are queued.
    pub fn push(&mut self, mut item: Item) -> Result<()> {
        // Values larger than a part go out as ValuePart items first, then the item with the rest.
        let data = match &mut item {
            Item::Dump(d) => Some(&mut d.data),
            Item::Operand(v) => Some(v.data_mut()),
            _ => None,
        };
        if let Some(data) = data {
            if data.len() > VALUE_PART_BYTES {
                let rest = data.split_off(data.len() - data.len() % VALUE_PART_BYTES);
                let head = std::mem::replace(data, rest);
                for part in head.chunks(VALUE_PART_BYTES) {
                    self.push(Item::ValuePart(part.to_vec()))?;
                }
            }
        }
        let value_bytes = match &item {
            Item::ValuePart(p) => p.len(),
            Item::Dump(d) => d.data.len(),
            Item::Operand(v) => v.data().len(),
            _ => 0,
        };
        if value_bytes > 0 {
            if value_bytes + 4096 > MAX_FRAME_LEN as usize {
                return Err(Error::usage(format!("{}: a dumped tensor of {} MiB does not fit the {} MiB frame cap; narrow --dump", self.path.display(), value_bytes >> 20, MAX_FRAME_LEN >> 20)));
            }
            // Values go in frames of their own once they would crowd the cap.
            if self.pending_value_bytes + value_bytes > VALUE_BYTES_PER_FRAME {
                self.flush()?;
            }
            self.pending_value_bytes += value_bytes;
        }
        if let Item::Op(r) = &item {
            self.pending_token_stats += r.tokens.len();
        }
        self.pending.push(item);
        self.items += 1;
        if self.pending.len() >= ITEMS_PER_FRAME || self.pending_token_stats >= TOKEN_STATS_PER_FRAME {
            self.flush()?;
        }
        Ok(())
    }

    /// Writes the queued items as one frame (nothing when none are queued).
    pub fn flush(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let items = std::mem::take(&mut self.pending);
        self.pending_token_stats = 0;
        self.pending_value_bytes = 0;
        self.write_frame(KIND_ITEMS, &crate::compact::encode_items(&items))
    }

    /// Writes one decode step's sampling records as an optional frame ([`KIND_SAMPLING`]),
    /// after the items queued so far.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be written.
    pub fn sampling(&mut self, steps: &[crate::record::SamplingStep]) -> Result<()> {
        self.flush()?;
        self.write_frame(KIND_SAMPLING, &steps)
    }

    /// Number of items pushed so far.
    pub fn items(&self) -> u64 {
        self.items
    }

    /// Flushes the queued items and writes the footer frame; the file is then complete.
    pub fn finish(mut self, footer: &Footer) -> Result<()> {
        self.finish_in_place(footer)
    }

    /// [`TraceWriter::finish`] through a reference (for use behind `dyn Sink`); call it once.
    /// The footer's `items` is set to the number of items written.
    pub fn finish_in_place(&mut self, footer: &Footer) -> Result<()> {
        self.flush()?;
        let footer = Footer { items: self.items, ..footer.clone() };
        self.write_frame(KIND_FOOTER, &footer)?;
        // Durable on disk; special files (/dev/null, pipes) cannot be synced and need not be.
        if self.file.metadata().map(|m| m.is_file()).unwrap_or(false) {
            self.file.sync_all().map_err(|e| Error::io(&self.path, e))?;
        }
        Ok(())
    }

    fn write_frame<T: serde::Serialize>(&mut self, kind: u8, value: &T) -> Result<()> {
        let frame = frame_bytes_with(&mut self.zstd, kind, value).map_err(|e| Error::trace(&self.path, e))?;
        let index = self.frames;
        if let Some(k) = self.kill_at.filter(|k| k.frame == index && k.mid_frame) {
            // Half the frame reaches the file, then the process dies.
            let _ = self.file.write_all(&frame[..frame.len() / 2]);
            k.kill();
        }
        self.file.write_all(&frame).map_err(|e| Error::io(&self.path, e))?;
        self.frames += 1;
        if let Some(k) = self.kill_at.filter(|k| k.frame == index && !k.mid_frame) {
            k.kill();
        }
        Ok(())
    }
}

/// A trace read back from a file.
#[derive(Clone, Debug)]
pub struct Trace {
    /// The file read (for a trace kept in memory: the name given to `MemorySink::trace`).
    pub path: PathBuf,
    /// The header frame's value.
    pub header: Header,
    /// Every item of the items frames, in file order, value parts joined into their values.
    pub items: Vec<Item>,
    /// The footer frame's value; `None` when the file is truncated.
    pub footer: Option<Footer>,
    /// True when the file ended before its footer (a run that died or is still running).
    pub truncated: bool,
    /// How each decode step chose each row's token (format 1.1; empty in older traces).
    pub sampling: Vec<crate::record::SamplingStep>,
    /// How the writing binary was built (format 1.2; `None` in older traces).
    pub build: Option<crate::record::BuildInfo>,
}

pub use crate::error::Refusal;

/// Reads a whole trace file.
///
/// # Errors
/// [`Error::Io`] when the file cannot be read (a directory, a missing file);
/// [`Error::Refused`] when any check of [`decode_trace`] fails.
pub fn read_trace(path: &Path) -> Result<Trace> {
    read_trace_where(path, |_| true)
}

/// Reads a trace file frame by frame, keeping only the items `keep` accepts (bisect's second
/// pass keeps the few records its report needs). Every frame is checked as [`decode_trace`]
/// checks it, kept or not; the memory budget counts the kept items only.
///
/// # Errors
/// As [`read_trace`].
pub fn read_trace_where(path: &Path, keep: impl FnMut(&Item) -> bool) -> Result<Trace> {
    collect(TraceReader::open(path)?, keep)
}

/// Decodes a trace held in memory; `path` is used in error messages only.
///
/// Every length, count and index in the file is checked before it is used (see
/// [`crate::limits`] for the caps and `docs/trace-format.md` for the order of the checks), and
/// every item is checked against the trace's structure ([`crate::validate`]), so consumers
/// (`show`, `bisect`, `replay`) index only what exists.
///
/// # Errors
/// [`Error::Refused`] with the [`Refusal`] of the first check that fails.
pub fn decode_trace(bytes: &[u8], path: &Path) -> Result<Trace> {
    collect(TraceReader::from_bytes(bytes, path)?, |_| true)
}

/// Reads every frame of `r` into a [`Trace`], keeping the items `keep` accepts.
fn collect<R: Read>(mut r: TraceReader<R>, mut keep: impl FnMut(&Item) -> bool) -> Result<Trace> {
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
    Ok(Trace { path, header, items, footer: tail.footer, truncated: tail.truncated, sampling: tail.sampling, build: tail.build })
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
    footer: Option<Footer>,
    truncated: bool,
    sampling: Vec<crate::record::SamplingStep>,
    build: Option<crate::record::BuildInfo>,
    /// The compressed payload of the last frame (reused).
    buf: Vec<u8>,
    /// Items frames read so far (skipped ones included).
    items_frames: usize,
    /// The checksum of the last items frame read.
    last_sum: u64,
    /// Items frames to skip, from an earlier pass over the same file.
    skip: Option<Skip>,
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
}

impl TraceReader<std::io::BufReader<File>> {
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
        Self::start(std::io::BufReader::with_capacity(1 << 16, file), meta.len(), path)
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

impl<R: Read> TraceReader<R> {
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
            footer: None,
            truncated: false,
            sampling: Vec::new(),
            build: None,
            buf: Vec::new(),
            items_frames: 0,
            last_sum: 0,
            skip: None,
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
                KIND_ITEMS | KIND_FOOTER | KIND_SAMPLING | KIND_BUILD => return Err(refuse(Refusal::Misplaced { at, what: "frame before the header".into() })),
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

    /// (op records, sites) declared so far, and the checksum of the last items frame: what
    /// [`Skip`] notes of the next frame.
    pub fn position(&self) -> (u64, u32, u64) {
        (self.check.op_records(), self.check.sites(), self.last_sum)
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
        loop {
            let at = self.at as usize;
            if self.at >= self.len {
                return self.ended();
            }
            let mut h = [0u8; FRAME_HEADER_LEN];
            let got = read_up_to(&mut self.src, &mut h).map_err(|e| Error::io(&self.path, e))?;
            if got < FRAME_HEADER_LEN {
                self.truncated = true;
                return self.ended();
            }
            let word = |r: std::ops::Range<usize>| h[r].iter().rev().fold(0u64, |n, &b| (n << 8) | b as u64);
            let (kind, clen, ulen, sum) = (h[0], word(1..5) as u32, word(5..9) as u32, word(9..17));
            if kind == 0 || (kind > KIND_FOOTER && kind < FIRST_OPTIONAL_KIND) {
                return Err(self.refuse(Refusal::UnknownFrameKind { at, kind }));
            }
            if clen > MAX_FRAME_LEN || ulen > MAX_FRAME_LEN {
                return Err(self.refuse(Refusal::FrameTooLarge { at, compressed: clen, decompressed: ulen }));
            }
            let next = self.at + (FRAME_HEADER_LEN as u64) + clen as u64;
            if next > self.len {
                self.truncated = true;
                self.at = self.len;
                return self.ended();
            }
            // The length was checked against the file's before this allocation.
            self.buf.resize(clen as usize, 0);
            if read_up_to(&mut self.src, &mut self.buf).map_err(|e| Error::io(&self.path, e))? < clen as usize {
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
            if kind > KIND_BUILD {
                // An optional frame of a later minor version: its lengths were checked; skip it.
                continue;
            }
            self.decompressed += ulen as u64;
            if self.decompressed > self.budget {
                return Err(self.refuse(Refusal::DecompressedBudget { at, budget: self.budget }));
            }
            let raw = zstd::bulk::decompress(&self.buf, ulen as usize).map_err(|e| self.refuse(Refusal::Decompress { at, msg: e.to_string() }))?;
            if raw.len() != ulen as usize {
                return Err(self.refuse(Refusal::LengthMismatch { at, got: raw.len(), want: ulen }));
            }
            if xxh3_64(&raw) != sum {
                return Err(self.refuse(Refusal::Checksum { at }));
            }
            return Ok(Some((kind, raw, at)));
        }
    }

    /// The end of the file: `None`, unless a later pass has not yet seen every items frame the
    /// earlier one noted (the file was cut in between).
    fn ended(&self) -> Result<Option<(u8, Vec<u8>, usize)>> {
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
        loop {
            if self.footer.is_some() {
                if self.at < self.len {
                    let at = self.at as usize;
                    return Err(self.refuse(Refusal::Misplaced { at, what: format!("{} bytes after the footer frame", self.len - self.at) }));
                }
                return Ok(None);
            }
            let Some((kind, raw, at)) = self.frame()? else { return Ok(None) };
            match kind {
                KIND_ITEMS => {
                    self.frame_at = at;
                    let items = decode_items(&raw, at, self.version).map_err(|why| self.refuse(why))?;
                    return self.joined(items, at).map(Some);
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
                kind => return Err(self.refuse(Refusal::UnknownFrameKind { at, kind })),
            }
        }
    }

    /// Checks one frame's items in stream order and joins `ValuePart` items into the `Dump` or
    /// `Operand` that follows them (across frames too).
    fn joined(&mut self, items: Vec<Item>, at: usize) -> Result<Vec<Item>> {
        let mut out = Vec::with_capacity(items.len());
        let mut weight = 0u64;
        for mut item in items {
            weight += crate::validate::weight(&item);
            if weight > self.budget {
                return Err(self.refuse(Refusal::MemoryBudget { at, budget: self.budget }));
            }
            self.check.item(&item).map_err(|msg| self.refuse(Refusal::Invalid { at, msg }))?;
            self.raw_items += 1;
            match &mut item {
                Item::ValuePart(p) => {
                    self.parts.extend_from_slice(p);
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
            crate::validate::values(std::slice::from_ref(&item)).map_err(|msg| self.refuse(Refusal::Invalid { at, msg }))?;
            out.push(item);
        }
        Ok(out)
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
        Ok(Tail { footer: self.footer, truncated, sampling: self.sampling, build: self.build })
    }
}

/// Reads into `buf` until it is full or the source ends: the bytes read.
fn read_up_to(src: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
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

/// Decodes one postcard value that must use all of `raw`.
fn decode<T: DeserializeOwned>(raw: &[u8], at: usize) -> std::result::Result<T, Refusal> {
    let (v, rest) = take::<T>(raw, at)?;
    if !rest.is_empty() {
        return Err(Refusal::LeftOver { at, bytes: rest.len() });
    }
    Ok(v)
}

fn take<T: DeserializeOwned>(raw: &[u8], at: usize) -> std::result::Result<(T, &[u8]), Refusal> {
    crate::limits::clear_refusal();
    postcard::take_from_bytes::<T>(raw).map_err(|e| Refusal::Decode {
        at,
        msg: crate::limits::take_refusal().unwrap_or_else(|| {
            use postcard::Error as P;
            match e {
                P::DeserializeBadEnum => "an unknown enum variant (a newer format, or corruption)".into(),
                P::DeserializeBadUtf8 => "a string that is not UTF-8".into(),
                P::DeserializeUnexpectedEnd => "the value ends before its last field".into(),
                P::DeserializeBadVarint => "a malformed varint".into(),
                P::DeserializeBadBool => "a bool that is neither 0 nor 1".into(),
                P::SerdeDeCustom => "a value that does not decode (an unknown variant, or corruption)".into(),
                P::DeserializeBadOption => "an option tag that is neither 0 nor 1".into(),
                P::DeserializeBadChar => "an invalid char".into(),
                other => other.to_string(),
            }
        }),
    })
}

/// Decodes an items frame: a postcard `Vec<Item>` whose length is checked against
/// [`crate::limits::MAX_ITEMS_PER_FRAME`] before any item is decoded.
fn decode_items(raw: &[u8], at: usize, version: u16) -> std::result::Result<Vec<Item>, Refusal> {
    let (count, mut rest) = varint(raw).ok_or_else(|| Refusal::Decode { at, msg: "bad item count".into() })?;
    if count > crate::limits::MAX_ITEMS_PER_FRAME {
        return Err(Refusal::TooManyItems { at, count });
    }
    let items = if version == 1 {
        let mut items = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let (item, r) = take::<Item>(rest, at)?;
            items.push(item);
            rest = r;
        }
        items
    } else {
        let mut entries = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let (entry, r) = take::<crate::compact::DiskItem>(rest, at)?;
            entries.push(entry);
            rest = r;
        }
        crate::compact::decode_items(entries).map_err(|msg| Refusal::Decode { at, msg })?
    };
    if !rest.is_empty() {
        return Err(Refusal::LeftOver { at, bytes: rest.len() });
    }
    Ok(items)
}

/// A postcard varint (LEB128, at most 10 bytes) and the bytes after it.
fn varint(b: &[u8]) -> Option<(u64, &[u8])> {
    let mut n = 0u64;
    for (i, &x) in b.iter().enumerate().take(10) {
        n |= ((x & 0x7f) as u64).checked_shl(7 * i as u32)?;
        if x & 0x80 == 0 {
            return Some((n, &b[i + 1..]));
        }
    }
    None
}
