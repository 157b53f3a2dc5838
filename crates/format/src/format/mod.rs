//! The trace file, version 2 (version 1 is read too): a preamble, then independently decodable zstd frames (header,
//! item batches, footer). Specified byte by byte in `docs/trace-format.md`; this module is the
//! reference writer and reader. It knows nothing of models.
//!
//! Crash safety: the writer cuts a frame at the end of every forward pass and every
//! [`ITEMS_PER_FRAME`] items, and its writing thread emits each with a single `write_all` on an
//! unbuffered file, so a run killed at any moment leaves every completed frame readable (and
//! loses at most three hand-overs cut and not yet written: the one being compressed, the one
//! queued behind it and the one waiting to be queued; each an items frame with its summary
//! frame, or a sampling frame). The reader recovers all complete frames of a
//! truncated file and reports `truncated = true`; a frame that is complete but fails its checks is
//! an error.

use crate::error::{Error, Result};
use crate::hash::xxh3_64;
use crate::record::{Footer, Header, Item};
use serde::de::DeserializeOwned;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

mod file_at;
mod output;
mod payload;
mod reader;
mod scan;
mod writer;
pub use file_at::FileAt;
use payload::*;
use reader::*;
pub use reader::{Decoded, Next, Skip, Stored, Tail, TraceReader};
pub use scan::{frame_digests, frames_compared, same_frames, FrameDigest, Scan};
pub use writer::TraceWriter;
use writer::*;

/// The first 8 bytes of every trace file.
pub const MAGIC: [u8; 8] = *b"\x89CTRACE\n";
/// The format version this build writes: 2, whose items frames store op records compactly
/// (the private `compact` module; `docs/trace-format.md`, "Format 2").
pub const VERSION: u16 = 2;
/// The oldest format version this build reads: format-1 files (golden traces, traces of older
/// builds) stay readable, and compare with format-2 ones (the values recorded are the same).
pub const OLDEST_VERSION: u16 = 1;
/// The minor version this build writes and reads, within [`VERSION`]: 2.0 held kernels 0..=19;
/// 2.1 added `Kernel::Affine`, 2.2 `Kernel::FlashAttn`, 2.3 the recording-level frame, 2.4
/// token entries whose digest is the record's low half, 2.5 frame summaries, 2.6 weight norms and
/// `Kernel::SoftmaxWide`, 2.7 the settings and repeat-penalty frames
/// (`docs/trace-format.md`, "Evolution"). A minor version only appends (enum variants at the end, optional frame kinds),
/// so an older reader refuses what it cannot decode as written by a newer version, naming both.
/// Format-2 files written before the minor version was stored hold `00` (they read as 2.0, and
/// may hold the 2.1 and 2.2 kernels, which this build knows).
pub const MINOR: u8 = 7;
/// Preamble: magic (8) + major version u16 LE + minor version u8 + flags u8 (0).
pub const PREAMBLE_LEN: usize = 12;
/// Frame header: kind u8 + compressed length u32 LE + uncompressed length u32 LE + xxh3-64 u64 LE.
pub const FRAME_HEADER_LEN: usize = 17;
/// A frame header as stored (docs/trace-format.md, "Frame"): kind, the compressed and
/// uncompressed payload lengths in bytes, and the xxh3-64 of the uncompressed payload. The one
/// place its 17 bytes are read and written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// Frame kind ([`KIND_HEADER`], [`KIND_ITEMS`], …).
    pub kind: u8,
    /// `C`: bytes of the zstd-compressed payload that follows.
    pub clen: u32,
    /// `U`: bytes of the payload once decompressed.
    pub ulen: u32,
    /// xxh3-64 of the `U` uncompressed bytes.
    pub sum: u64,
}

impl FrameHeader {
    /// Reads the next 17 bytes of `src` as a header; `None` when fewer remain (a file cut there).
    ///
    /// # Errors
    /// `src`'s I/O errors.
    pub fn read(src: &mut impl Read) -> std::io::Result<Option<Self>> {
        let mut h = [0u8; FRAME_HEADER_LEN];
        if read_up_to(src, &mut h)? < FRAME_HEADER_LEN {
            return Ok(None);
        }
        let word = |r: std::ops::Range<usize>| h[r].iter().rev().fold(0u64, |n, &b| (n << 8) | b as u64);
        Ok(Some(FrameHeader { kind: h[0], clen: word(1..5) as u32, ulen: word(5..9) as u32, sum: word(9..17) }))
    }

    /// The 17 stored bytes.
    pub fn bytes(&self) -> [u8; FRAME_HEADER_LEN] {
        let mut h = [0u8; FRAME_HEADER_LEN];
        h[0] = self.kind;
        h[1..5].copy_from_slice(&self.clen.to_le_bytes());
        h[5..9].copy_from_slice(&self.ulen.to_le_bytes());
        h[9..17].copy_from_slice(&self.sum.to_le_bytes());
        h
    }

    /// Whether both lengths are within [`MAX_FRAME_LEN`] (a reader refuses the frame unread
    /// otherwise).
    pub fn within_caps(&self) -> bool {
        self.clen <= MAX_FRAME_LEN && self.ulen <= MAX_FRAME_LEN
    }

    /// Offset of the next frame, for this header at file offset `at`.
    pub fn next(&self, at: u64) -> u64 {
        at + FRAME_HEADER_LEN as u64 + self.clen as u64
    }
}

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
/// zstd compression level of the writer's frames, but for those holding dumped values. Level 1
/// against 3 (docs/performance.md, "zstd level 1"): 1.2-2.5x faster on real frames, and the
/// traces of SmolLM2 and the builtin 0.5% and 1.0% smaller, a 256-token prompt's 0.9% larger.
pub const ZSTD_LEVEL: i32 = 1;
/// zstd compression level of an items frame holding dumped values (`Dump`, `Operand` or
/// `ValuePart` items, or a `Counterpart` with operand values; `--dump`, `trace extract`): level
/// 1 made a builtin `--dump all` trace's frames 3.3% larger.
pub const VALUES_ZSTD_LEVEL: i32 = 3;

/// The zstd level of an items frame holding `items`: [`VALUES_ZSTD_LEVEL`] when one of them
/// holds dumped values, else [`ZSTD_LEVEL`].
pub fn items_zstd_level(items: &[Item]) -> i32 {
    let values = |i: &Item| match i {
        Item::Dump(_) | Item::Operand(_) | Item::ValuePart(_) => true,
        Item::Counterpart(c) => !c.operands.is_empty(),
        _ => false,
    };
    if items.iter().any(values) {
        VALUES_ZSTD_LEVEL
    } else {
        ZSTD_LEVEL
    }
}

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
/// Optional frame (format 2.3): the [`crate::site::Level`] the trace was recorded at, postcard,
/// after the header (and build) frame; absent when every op was recorded.
pub const KIND_LEVEL: u8 = 130;
/// Optional frame (format 2.5): the [`crate::summary::FrameSummary`] of the items frame right
/// before it, postcard; written after items frames that hold op records and no site,
/// embeddings or value.
pub const KIND_SUMMARY: u8 = 131;
/// Optional frame (format 2.7): the run's [`crate::record::Settings`] added since 2.6
/// (the repeat penalty), postcard, after the header, build and level frames; absent when every
/// such setting has its default.
pub const KIND_SETTINGS: u8 = 132;
/// Optional frame (format 2.7): one decode step's [`crate::record::PenaltyStep`]s, a postcard
/// `Vec<PenaltyStep>` (at most one per batch row), written before that step's sampling frame.
pub const KIND_PENALTY: u8 = 133;
/// The highest optional kind this build reads; later ones are skipped.
pub const LAST_KNOWN_KIND: u8 = KIND_PENALTY;

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
    let raw = postcard::to_stdvec(value).map_err(|e| format!("cannot encode frame: {e}"))?;
    let mut z = zstd::bulk::Compressor::new(ZSTD_LEVEL).map_err(|e| format!("cannot compress frame: {e}"))?;
    pack(&mut z, kind, &raw)
}

/// One format-2 items frame holding `items` (tests and fuzzing craft inputs with it).
///
/// # Errors
/// As [`frame_bytes`].
pub fn items_frame_bytes(items: &[Item]) -> std::result::Result<Vec<u8>, String> {
    let raw = postcard::to_stdvec(&crate::compact::encode_items(items)).map_err(|e| format!("cannot encode frame: {e}"))?;
    let mut z = zstd::bulk::Compressor::new(items_zstd_level(items)).map_err(|e| format!("cannot compress frame: {e}"))?;
    pack(&mut z, KIND_ITEMS, &raw)
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
    /// What the run recorded (format 2.3; [`crate::site::Level::Ops`] without a level frame).
    pub level: crate::site::Level,
    /// The settings frame and repeat-penalty records (format 2.7; empty in older traces).
    pub extras: crate::record::Extras,
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

/// Reads a trace file frame by frame, keeping only the items `keep` accepts (`trace extract`
/// keeps the chosen op's values; `check --collect` keeps none, for the footer). Every frame is checked as [`decode_trace`]
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
