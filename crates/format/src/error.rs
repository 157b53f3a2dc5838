//! The crate's error type. Every error renders as one line that names the file (when there is
//! one) and the problem; the CLI maps all of them to exit code 2.

use std::fmt;
use std::path::{Path, PathBuf};

/// Errors returned by the library.
#[derive(Debug)]
pub enum Error {
    /// A file could not be opened, read or written.
    Io {
        /// The file concerned.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A trace file is malformed, truncated before its header, or of another format version.
    Trace {
        /// The trace file.
        path: PathBuf,
        /// What is wrong with it.
        msg: String,
    },
    /// A model file is missing, not a model, or of an unsupported architecture.
    Model {
        /// The model file or folder.
        path: PathBuf,
        /// What is wrong with it.
        msg: String,
    },
    /// Two traces cannot be compared (for example: different models).
    Mismatch(String),
    /// A bad argument or setting.
    Usage(String),
    /// A trace file refused by the reader's checks (see [`Refusal`]).
    Refused {
        /// The trace file.
        path: PathBuf,
        /// The check that refused it.
        why: Refusal,
    },
    /// A tensor operation failed inside candle.
    #[cfg(feature = "candle")]
    Candle(candle_core::Error),
    /// `--stop-on-nonfinite`: the run stopped after op record `seq` produced a NaN or ±Inf.
    /// Not a failure: the recorder catches it and completes the trace.
    StoppedOnNonFinite {
        /// Record id (`seq`) of the op record whose output held the NaN or ±Inf.
        seq: u64,
    },
}

/// Result alias over [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An [`Error::Io`] on `path`.
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        Error::Io { path: path.to_path_buf(), source }
    }
    /// An [`Error::Trace`] on `path`.
    pub fn trace(path: &Path, msg: impl Into<String>) -> Self {
        Error::Trace { path: path.to_path_buf(), msg: msg.into() }
    }
    /// An [`Error::Model`] on `path`.
    pub fn model(path: &Path, msg: impl Into<String>) -> Self {
        Error::Model { path: path.to_path_buf(), msg: msg.into() }
    }
    /// An [`Error::Usage`].
    pub fn usage(msg: impl Into<String>) -> Self {
        Error::Usage(msg.into())
    }
    /// An [`Error::Refused`] of `path`.
    pub fn refused(path: &Path, why: Refusal) -> Self {
        Error::Refused { path: path.to_path_buf(), why }
    }
}

/// Keeps only the first line of a message (candle errors may carry backtraces).
fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or("").trim_end()
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io { path, source } => {
                write!(f, "{}: {}", path.display(), first_line(&source.to_string()))
            }
            Error::Trace { path, msg } | Error::Model { path, msg } => {
                write!(f, "{}: {}", path.display(), first_line(msg))
            }
            Error::Mismatch(msg) | Error::Usage(msg) => write!(f, "{}", first_line(msg)),
            Error::Refused { path, why } => write!(f, "{}: {why}", path.display()),
            #[cfg(feature = "candle")]
            Error::Candle(e) => write!(f, "tensor op failed: {}", first_line(&e.to_string())),
            Error::StoppedOnNonFinite { seq } => write!(f, "stopped after op record {seq}: non-finite output"),
        }
    }
}

impl Error {
    /// The file the error names (I/O, trace, model and refusal errors), if any.
    pub fn path(&self) -> Option<&std::path::Path> {
        match self {
            Error::Io { path, .. } | Error::Trace { path, .. } | Error::Model { path, .. } | Error::Refused { path, .. } => Some(path),
            _ => None,
        }
    }
}

impl std::error::Error for Error {}

#[cfg(feature = "candle")]
impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        Error::Candle(e)
    }
}

/// Why the reader refused a file: one variant per check, each naming the byte offset of the
/// frame concerned where there is one. [`Error::Refused`] carries it with the file's path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The file holds no byte.
    Empty,
    /// The first 8 bytes are not [`crate::format::MAGIC`].
    BadMagic,
    /// The file ends before its header frame is complete.
    NoHeader,
    /// Format major version newer than this build reads.
    NewerVersion {
        /// Major version in the file's preamble.
        found: u16,
        /// Major version this build reads ([`crate::format::VERSION`]).
        reads: u16,
    },
    /// Format major version older than any this build reads.
    OlderVersion {
        /// Major version in the file's preamble.
        found: u16,
        /// The oldest major version this build reads ([`crate::format::OLDEST_VERSION`]).
        reads: u16,
    },
    /// Flag bits this build does not know.
    UnknownFlags(u16),
    /// A frame that does not decode in a file of a newer minor version than this build's
    /// ([`crate::format::MINOR`]): it holds an item or kernel added since.
    NewerMinor {
        /// Byte offset of the frame.
        at: usize,
        /// postcard's message.
        msg: String,
        /// (major, minor) in the file's preamble.
        found: (u16, u8),
        /// (major, minor) this build reads.
        reads: (u16, u8),
    },
    /// A frame kind that is neither known nor optional (kinds 0 and 4..128).
    UnknownFrameKind {
        /// Byte offset of the frame.
        at: usize,
        /// The frame's kind byte.
        kind: u8,
    },
    /// A frame length over [`crate::format::MAX_FRAME_LEN`].
    FrameTooLarge {
        /// Byte offset of the frame.
        at: usize,
        /// Compressed payload length the frame header declares, in bytes.
        compressed: u32,
        /// Uncompressed payload length the frame header declares, in bytes.
        decompressed: u32,
    },
    /// The frames would decompress to more than [`crate::limits::decoded_budget`] bytes.
    DecompressedBudget {
        /// Byte offset of the frame that would pass the budget.
        at: usize,
        /// The budget in bytes: `max(32 MiB, 256 × file length)`.
        budget: u64,
    },
    /// The decoded items would take more than [`crate::limits::decoded_budget`] bytes.
    MemoryBudget {
        /// Byte offset of the frame whose items would pass the budget.
        at: usize,
        /// The budget in bytes: `max(32 MiB, 256 × file length)`.
        budget: u64,
    },
    /// zstd refused the payload.
    Decompress {
        /// Byte offset of the frame.
        at: usize,
        /// zstd's message.
        msg: String,
    },
    /// The payload decompressed to another length than the frame header says.
    LengthMismatch {
        /// Byte offset of the frame.
        at: usize,
        /// Bytes the payload decompressed to.
        got: usize,
        /// Uncompressed length the frame header declares, in bytes.
        want: u32,
    },
    /// The payload's xxh3-64 is not the frame header's.
    Checksum {
        /// Byte offset of the frame.
        at: usize,
    },
    /// An items frame declares more than [`crate::limits::MAX_ITEMS_PER_FRAME`] items.
    TooManyItems {
        /// Byte offset of the frame.
        at: usize,
        /// Item count the frame declares.
        count: u64,
    },
    /// The payload is not a postcard value of the frame's type, or one of its lists or strings
    /// is over its cap.
    Decode {
        /// Byte offset of the frame.
        at: usize,
        /// postcard's message, or the cap a list or string passed.
        msg: String,
    },
    /// Bytes left over after the frame's value.
    LeftOver {
        /// Byte offset of the frame.
        at: usize,
        /// Number of bytes left over.
        bytes: usize,
    },
    /// A frame where it may not be: a second header, a frame before the header, bytes after the
    /// footer.
    Misplaced {
        /// Byte offset of the misplaced frame, or of the bytes after the footer.
        at: usize,
        /// What is misplaced, in words (e.g. "second header frame").
        what: String,
    },
    /// Op records out of sequence, or a footer whose counts disagree with the file.
    Sequence(String),
    /// An item that contradicts the trace's structure or its own shape (unknown site, input of a
    /// later record, value bytes that do not fit the shape, …).
    Invalid {
        /// Byte offset of the frame holding the item (for the value-length checks made after the
        /// last frame: the offset where reading stopped).
        at: usize,
        /// What the item contradicts.
        msg: String,
    },
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Empty => write!(f, "empty file, not a candle-trace file"),
            Refusal::BadMagic => write!(f, "not a candle-trace file (bad magic bytes)"),
            Refusal::NoHeader => write!(f, "truncated before the header"),
            Refusal::NewerVersion { found, reads } => {
                write!(f, "trace format version {found}.x is newer than this build reads (version {reads}.x): update candle-trace")
            }
            Refusal::OlderVersion { found, reads } => {
                write!(f, "trace format version {found}.x is older than this build reads (version {reads}.x and later)")
            }
            Refusal::UnknownFlags(x) => write!(f, "unknown format flags 0x{x:04x} (written by a newer candle-trace?)"),
            Refusal::NewerMinor { at, msg, found, reads } => write!(
                f,
                "frame at byte {at} holds a record this build does not know ({msg}): the file was written by a newer version (trace format {}.{}; this build reads up to {}.{}): update candle-trace",
                found.0, found.1, reads.0, reads.1
            ),
            Refusal::UnknownFrameKind { at, kind } => write!(f, "unknown frame kind {kind} at byte {at}"),
            Refusal::FrameTooLarge { at, compressed, decompressed } => {
                write!(f, "frame at byte {at} is over the 64 MiB cap ({compressed} bytes compressed, {decompressed} decompressed)")
            }
            Refusal::DecompressedBudget { at, budget } => {
                write!(f, "frame at byte {at} would take the decompressed size past {budget} bytes, 256 times the file: refused as a decompression bomb")
            }
            Refusal::MemoryBudget { at, budget } => {
                write!(f, "frame at byte {at} would take the decoded trace past {budget} bytes of memory, 256 times the file: refused")
            }
            Refusal::Decompress { at, msg } => write!(f, "frame at byte {at} does not decompress: {msg}"),
            Refusal::LengthMismatch { at, got, want } => {
                write!(f, "frame at byte {at} decompresses to {got} bytes, header says {want}")
            }
            Refusal::Checksum { at } => write!(f, "frame at byte {at} fails its checksum"),
            Refusal::TooManyItems { at, count } => {
                write!(f, "frame at byte {at} declares {count} items, over the cap of {}", crate::limits::MAX_ITEMS_PER_FRAME)
            }
            Refusal::Decode { at, msg } => write!(f, "frame at byte {at} does not decode: {msg}"),
            Refusal::LeftOver { at, bytes } => write!(f, "frame at byte {at} has {bytes} bytes left over"),
            Refusal::Misplaced { at, what } => write!(f, "{what} at byte {at}"),
            Refusal::Sequence(msg) => write!(f, "{msg}"),
            Refusal::Invalid { at, msg } => write!(f, "frame at byte {at}: {msg}"),
        }
    }
}
