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
use std::io::Write;
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
/// Preamble: magic (8) + version u16 LE + flags u16 LE (0).
pub const PREAMBLE_LEN: usize = 12;
/// Frame header: kind u8 + compressed length u32 LE + uncompressed length u32 LE + xxh3-64 u64 LE.
pub const FRAME_HEADER_LEN: usize = 17;
/// Hard cap on either length of one frame (64 MiB): larger values are refused unread.
pub use crate::limits::MAX_FRAME_LEN;
/// Flag bits this build knows (none): a file with any other bit set is refused.
pub const KNOWN_FLAGS: u16 = 0;
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
    pre[10..12].copy_from_slice(&0u16.to_le_bytes());
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
                return Err(Error::usage(format!(
                    "{}: a dumped tensor of {} MiB does not fit the {} MiB frame cap; narrow --dump",
                    self.path.display(),
                    value_bytes >> 20,
                    MAX_FRAME_LEN >> 20
                )));
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
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if meta.is_dir() {
        return Err(Error::trace(path, "is a directory, not a trace file"));
    }
    if !meta.is_file() {
        // A device or a pipe could be read without end.
        return Err(Error::trace(path, "is not a regular file (a device or a pipe?), not a trace file"));
    }
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    decode_trace(&bytes, path)
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
    let refuse = |why: Refusal| Error::refused(path, why);
    if bytes.is_empty() {
        return Err(refuse(Refusal::Empty));
    }
    if bytes.len() < MAGIC.len() || bytes[..MAGIC.len()] != MAGIC {
        return Err(refuse(Refusal::BadMagic));
    }
    if bytes.len() < PREAMBLE_LEN {
        return Err(refuse(Refusal::NoHeader));
    }
    let version = u16::from_le_bytes([bytes[8], bytes[9]]);
    if version > VERSION {
        return Err(refuse(Refusal::NewerVersion { found: version, reads: VERSION }));
    }
    if version < OLDEST_VERSION {
        return Err(refuse(Refusal::OlderVersion { found: version, reads: OLDEST_VERSION }));
    }
    let flags = u16::from_le_bytes([bytes[10], bytes[11]]);
    if flags & !KNOWN_FLAGS != 0 {
        return Err(refuse(Refusal::UnknownFlags(flags & !KNOWN_FLAGS)));
    }
    let budget = crate::limits::decoded_budget(bytes.len() as u64);
    let (mut decompressed, mut memory) = (0u64, 0u64);
    let mut at = PREAMBLE_LEN;
    let mut header: Option<Header> = None;
    let mut items = Vec::new();
    let mut footer = None;
    let mut truncated = false;
    let mut check = crate::validate::Checker::default();
    let mut sampling: Vec<crate::record::SamplingStep> = Vec::new();
    let mut build = None;
    while at < bytes.len() {
        if footer.is_some() {
            return Err(refuse(Refusal::Misplaced { at, what: format!("{} bytes after the footer frame", bytes.len() - at) }));
        }
        let Some(frame) = read_frame(bytes, at).map_err(refuse)? else {
            truncated = true;
            break;
        };
        if frame.kind > KIND_BUILD {
            // An optional frame of a later minor version: its lengths were checked; skip it.
            at = frame.next;
            continue;
        }
        decompressed += frame.ulen as u64;
        if decompressed > budget {
            return Err(refuse(Refusal::DecompressedBudget { at, budget }));
        }
        let raw = frame.decompress(bytes, at).map_err(refuse)?;
        match (frame.kind, header.is_some()) {
            (KIND_HEADER, false) => {
                let h: Header = decode(&raw, at).map_err(refuse)?;
                crate::validate::header(&h).map_err(|msg| refuse(Refusal::Invalid { at, msg }))?;
                memory += crate::validate::header_weight(&h);
                header = Some(h);
            }
            (KIND_HEADER, true) => return Err(refuse(Refusal::Misplaced { at, what: "second header frame".into() })),
            (_, false) => return Err(refuse(Refusal::Misplaced { at, what: "frame before the header".into() })),
            (KIND_ITEMS, true) => {
                for item in decode_items(&raw, at, version).map_err(refuse)? {
                    memory += crate::validate::weight(&item);
                    if memory > budget {
                        return Err(refuse(Refusal::MemoryBudget { at, budget }));
                    }
                    check.item(&item).map_err(|msg| refuse(Refusal::Invalid { at, msg }))?;
                    items.push(item);
                }
            }
            (KIND_FOOTER, true) => footer = Some(decode::<Footer>(&raw, at).map_err(refuse)?),
            (KIND_SAMPLING, true) => {
                let steps: SamplingSteps = decode(&raw, at).map_err(refuse)?;
                memory += (steps.0.len() * std::mem::size_of::<crate::record::SamplingStep>()) as u64;
                sampling.extend(steps.0);
            }
            (KIND_BUILD, true) if build.is_none() => build = Some(decode::<crate::record::BuildInfo>(&raw, at).map_err(refuse)?),
            (KIND_BUILD, true) => return Err(refuse(Refusal::Misplaced { at, what: "second build frame".into() })),
            (kind, _) => return Err(refuse(Refusal::UnknownFrameKind { at, kind })),
        }
        if memory > budget {
            return Err(refuse(Refusal::MemoryBudget { at, budget }));
        }
        at = frame.next;
    }
    let header = header.ok_or_else(|| refuse(Refusal::NoHeader))?;
    check_footer(&items, check.op_records(), footer.as_ref()).map_err(refuse)?;
    let items = join_value_parts(items, truncated || footer.is_none()).map_err(refuse)?;
    crate::validate::values(&items).map_err(|msg| refuse(Refusal::Invalid { at, msg }))?;
    if footer.is_none() {
        truncated = true;
    }
    Ok(Trace { path: path.to_path_buf(), header, items, footer, truncated, sampling, build })
}

/// A sampling frame's payload: at most one step per batch row.
#[derive(serde::Deserialize)]
struct SamplingSteps(#[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_ROWS }>")] Vec<crate::record::SamplingStep>);

/// Joins `ValuePart` items into the `Dump`/`Operand` item that follows them. Parts left at the
/// end of a truncated file are dropped; anywhere else a part must precede a value.
fn join_value_parts(items: Vec<Item>, truncated: bool) -> std::result::Result<Vec<Item>, Refusal> {
    let mut out = Vec::with_capacity(items.len());
    let mut parts: Vec<u8> = Vec::new();
    let mut pending = false;
    for mut item in items {
        match &mut item {
            Item::ValuePart(p) => {
                parts.extend_from_slice(p);
                pending = true;
                continue;
            }
            Item::Dump(d) if pending => {
                parts.extend_from_slice(&d.data);
                d.data = std::mem::take(&mut parts);
            }
            Item::Operand(v) if pending => {
                let data = v.data_mut();
                parts.extend_from_slice(data);
                *data = std::mem::take(&mut parts);
            }
            _ if pending => return Err(Refusal::Sequence("a value part is not followed by its value".into())),
            _ => {}
        }
        pending = false;
        out.push(item);
    }
    if pending && !truncated {
        return Err(Refusal::Sequence("the file ends with a value part".into()));
    }
    Ok(out)
}

/// A footer must count the items and op records the file holds: a missing or repeated frame
/// (each intact on its own) breaks one or the other.
fn check_footer(items: &[Item], op_records: u64, footer: Option<&Footer>) -> std::result::Result<(), Refusal> {
    if let Some(f) = footer {
        if f.items != items.len() as u64 || f.op_records != op_records {
            return Err(Refusal::Sequence(format!(
                "the footer counts {} items and {} op records, the file holds {} and {op_records}: a frame is missing or repeated",
                f.items,
                f.op_records,
                items.len()
            )));
        }
    }
    Ok(())
}

/// A frame header read and checked, its payload not yet decompressed.
struct Frame {
    kind: u8,
    clen: u32,
    ulen: u32,
    sum: u64,
    next: usize,
}

impl Frame {
    fn decompress(&self, bytes: &[u8], at: usize) -> std::result::Result<Vec<u8>, Refusal> {
        let start = at + FRAME_HEADER_LEN;
        let raw = zstd::bulk::decompress(&bytes[start..start + self.clen as usize], self.ulen as usize)
            .map_err(|e| Refusal::Decompress { at, msg: e.to_string() })?;
        if raw.len() != self.ulen as usize {
            return Err(Refusal::LengthMismatch { at, got: raw.len(), want: self.ulen });
        }
        if xxh3_64(&raw) != self.sum {
            return Err(Refusal::Checksum { at });
        }
        Ok(raw)
    }
}

/// Reads the frame header at `at`: `Ok(None)` when the file ends inside the frame (truncation).
fn read_frame(bytes: &[u8], at: usize) -> std::result::Result<Option<Frame>, Refusal> {
    let Some(h) = bytes.get(at..).and_then(|b| b.get(..FRAME_HEADER_LEN)) else {
        return Ok(None);
    };
    let word = |r: std::ops::Range<usize>| h[r].iter().rev().fold(0u64, |n, &b| (n << 8) | b as u64);
    let (kind, clen, ulen, sum) = (h[0], word(1..5) as u32, word(5..9) as u32, word(9..17));
    if kind == 0 || (kind > KIND_FOOTER && kind < FIRST_OPTIONAL_KIND) {
        return Err(Refusal::UnknownFrameKind { at, kind });
    }
    if clen > MAX_FRAME_LEN || ulen > MAX_FRAME_LEN {
        return Err(Refusal::FrameTooLarge { at, compressed: clen, decompressed: ulen });
    }
    let next = at + FRAME_HEADER_LEN + clen as usize;
    if next > bytes.len() {
        return Ok(None);
    }
    Ok(Some(Frame { kind, clen, ulen, sum, next }))
}

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
