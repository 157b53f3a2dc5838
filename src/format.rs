//! The trace file, version 1: a preamble, then independently decodable zstd frames (header,
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
/// The format version this build writes and reads.
pub const VERSION: u16 = 1;
/// Preamble: magic (8) + version u16 LE + flags u16 LE (0).
pub const PREAMBLE_LEN: usize = 12;
/// Frame header: kind u8 + compressed length u32 LE + uncompressed length u32 LE + xxh3-64 u64 LE.
pub const FRAME_HEADER_LEN: usize = 17;
/// Hard cap on either length of one frame (64 MiB): larger values are refused unread.
pub const MAX_FRAME_LEN: u32 = 64 << 20;
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
pub const KIND_ITEMS: u8 = 2;
pub const KIND_FOOTER: u8 = 3;

/// Streams a trace to a file.
pub struct TraceWriter {
    path: PathBuf,
    file: File,
    pending: Vec<Item>,
    pending_token_stats: usize,
    /// Bytes of dumped values queued.
    pending_value_bytes: usize,
    items: u64,
}

impl TraceWriter {
    /// Creates (truncates) `path` and writes the preamble and the header frame.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be created or written.
    pub fn create(path: &Path, header: &Header) -> Result<Self> {
        let mut file = File::create(path).map_err(|e| Error::io(path, e))?;
        let mut pre = Vec::with_capacity(PREAMBLE_LEN);
        pre.extend_from_slice(&MAGIC);
        pre.extend_from_slice(&VERSION.to_le_bytes());
        pre.extend_from_slice(&0u16.to_le_bytes());
        file.write_all(&pre).map_err(|e| Error::io(path, e))?;
        let mut w = TraceWriter { path: path.to_path_buf(), file, pending: Vec::new(), pending_token_stats: 0, pending_value_bytes: 0, items: 0 };
        w.write_frame(KIND_HEADER, header)?;
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
        self.write_frame(KIND_ITEMS, &items)
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
        let raw = postcard::to_stdvec(value)
            .map_err(|e| Error::trace(&self.path, format!("cannot encode frame: {e}")))?;
        let packed = zstd::bulk::compress(&raw, ZSTD_LEVEL).map_err(|e| Error::io(&self.path, e))?;
        if raw.len() > MAX_FRAME_LEN as usize || packed.len() > MAX_FRAME_LEN as usize {
            return Err(Error::trace(&self.path, "frame over the 64 MiB cap"));
        }
        let mut frame = Vec::with_capacity(FRAME_HEADER_LEN + packed.len());
        frame.push(kind);
        frame.extend_from_slice(&(packed.len() as u32).to_le_bytes());
        frame.extend_from_slice(&(raw.len() as u32).to_le_bytes());
        frame.extend_from_slice(&xxh3_64(&raw).to_le_bytes());
        frame.extend_from_slice(&packed);
        self.file.write_all(&frame).map_err(|e| Error::io(&self.path, e))
    }
}

/// A trace read back from a file.
#[derive(Clone, Debug)]
pub struct Trace {
    pub path: PathBuf,
    pub header: Header,
    pub items: Vec<Item>,
    pub footer: Option<Footer>,
    /// True when the file ended before its footer (a run that died or is still running).
    pub truncated: bool,
}

/// Reads a whole trace file.
///
/// # Errors
/// [`Error::Io`] when the file cannot be read; [`Error::Trace`] when it is not a trace, is of
/// another format version, ends before its header frame is complete, or holds a frame that fails
/// its length, checksum or decoding checks.
pub fn read_trace(path: &Path) -> Result<Trace> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    decode_trace(&bytes, path)
}

/// Decodes a trace held in memory; `path` is used in error messages only. See [`read_trace`].
pub fn decode_trace(bytes: &[u8], path: &Path) -> Result<Trace> {
    let err = |msg: String| Error::trace(path, msg);
    if bytes.is_empty() {
        return Err(err("empty file, not a candle-trace file".into()));
    }
    if bytes.len() < MAGIC.len() || bytes[..MAGIC.len()] != MAGIC {
        return Err(err("not a candle-trace file (bad magic bytes)".into()));
    }
    if bytes.len() < PREAMBLE_LEN {
        return Err(err("truncated before the header".into()));
    }
    let version = u16::from_le_bytes([bytes[8], bytes[9]]);
    if version != VERSION {
        return Err(err(format!(
            "trace format version {version}; this build reads version {VERSION}"
        )));
    }
    let mut at = PREAMBLE_LEN;
    let mut header: Option<Header> = None;
    let mut items = Vec::new();
    let mut footer = None;
    let mut truncated = false;
    while at < bytes.len() {
        if footer.is_some() {
            return Err(err(format!("{} bytes after the footer frame", bytes.len() - at)));
        }
        let Some((kind, raw, next)) = read_frame(bytes, at, path)? else {
            truncated = true;
            break;
        };
        match (kind, header.is_some()) {
            (KIND_HEADER, false) => header = Some(decode(&raw, at, path)?),
            (KIND_HEADER, true) => return Err(err(format!("second header frame at byte {at}"))),
            (_, false) => return Err(err(format!("frame at byte {at} comes before the header"))),
            (KIND_ITEMS, true) => items.extend(decode::<Vec<Item>>(&raw, at, path)?),
            (KIND_FOOTER, true) => footer = Some(decode(&raw, at, path)?),
            (k, _) => return Err(err(format!("unknown frame kind {k} at byte {at}"))),
        }
        at = next;
    }
    let header = header.ok_or_else(|| err("truncated before the header".into()))?;
    check_sequence(&items, footer.as_ref(), path)?;
    let items = join_value_parts(items, truncated || footer.is_none(), path)?;
    if footer.is_none() {
        truncated = true;
    }
    Ok(Trace { path: path.to_path_buf(), header, items, footer, truncated })
}

/// Joins `ValuePart` items into the `Dump`/`Operand` item that follows them. Parts left at the
/// end of a truncated file are dropped; anywhere else a part must precede a value.
fn join_value_parts(items: Vec<Item>, truncated: bool, path: &Path) -> Result<Vec<Item>> {
    let mut out = Vec::with_capacity(items.len());
    let mut parts: Vec<u8> = Vec::new();
    for mut item in items {
        match &mut item {
            Item::ValuePart(p) => {
                parts.extend_from_slice(p);
                continue;
            }
            Item::Dump(d) if !parts.is_empty() => {
                parts.extend_from_slice(&d.data);
                d.data = std::mem::take(&mut parts);
            }
            Item::Operand(v) if !parts.is_empty() => {
                let data = v.data_mut();
                parts.extend_from_slice(data);
                *data = std::mem::take(&mut parts);
            }
            _ if !parts.is_empty() => {
                return Err(Error::trace(path, "a value part is not followed by its value"));
            }
            _ => {}
        }
        out.push(item);
    }
    if !parts.is_empty() && !truncated {
        return Err(Error::trace(path, "the file ends with a value part"));
    }
    Ok(out)
}

/// Op records must be numbered 0, 1, 2, … in file order, and a footer must count the items: a
/// missing or repeated frame (each intact on its own) breaks one or the other.
fn check_sequence(items: &[Item], footer: Option<&Footer>, path: &Path) -> Result<()> {
    let mut next = 0u64;
    for item in items {
        if let Item::Op(r) = item {
            if r.seq != next {
                return Err(Error::trace(
                    path,
                    format!("op record {} where {next} was expected: a frame is missing or repeated", r.seq),
                ));
            }
            next += 1;
        }
    }
    if let Some(f) = footer {
        if f.items != items.len() as u64 || f.op_records != next {
            return Err(Error::trace(
                path,
                format!(
                    "the footer counts {} items and {} op records, the file holds {} and {next}: a frame is missing or repeated",
                    f.items,
                    f.op_records,
                    items.len()
                ),
            ));
        }
    }
    Ok(())
}

/// Reads the frame at `at`: `Ok(None)` when the file ends inside it (truncation).
fn read_frame(bytes: &[u8], at: usize, path: &Path) -> Result<Option<(u8, Vec<u8>, usize)>> {
    let err = |msg: String| Error::trace(path, msg);
    if bytes.len() - at < FRAME_HEADER_LEN {
        return Ok(None);
    }
    let h = &bytes[at..at + FRAME_HEADER_LEN];
    let kind = h[0];
    let clen = u32::from_le_bytes(h[1..5].try_into().expect("4 bytes"));
    let ulen = u32::from_le_bytes(h[5..9].try_into().expect("4 bytes"));
    let sum = u64::from_le_bytes(h[9..17].try_into().expect("8 bytes"));
    if !(KIND_HEADER..=KIND_FOOTER).contains(&kind) {
        return Err(err(format!("unknown frame kind {kind} at byte {at}")));
    }
    if clen > MAX_FRAME_LEN || ulen > MAX_FRAME_LEN {
        return Err(err(format!("frame at byte {at} is over the 64 MiB cap")));
    }
    let start = at + FRAME_HEADER_LEN;
    let end = start + clen as usize;
    if end > bytes.len() {
        return Ok(None);
    }
    let raw = zstd::bulk::decompress(&bytes[start..end], ulen as usize)
        .map_err(|e| err(format!("frame at byte {at} does not decompress: {e}")))?;
    if raw.len() != ulen as usize {
        return Err(err(format!(
            "frame at byte {at} decompresses to {} bytes, header says {ulen}",
            raw.len()
        )));
    }
    if xxh3_64(&raw) != sum {
        return Err(err(format!("frame at byte {at} fails its checksum")));
    }
    Ok(Some((kind, raw, end)))
}

fn decode<T: DeserializeOwned>(raw: &[u8], at: usize, path: &Path) -> Result<T> {
    let (v, rest) = postcard::take_from_bytes::<T>(raw)
        .map_err(|e| Error::trace(path, format!("frame at byte {at} does not decode: {e}")))?;
    if !rest.is_empty() {
        return Err(Error::trace(path, format!("frame at byte {at} has {} bytes left over", rest.len())));
    }
    Ok(v)
}
