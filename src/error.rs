//! The crate's error type. Every error renders as one line that names the file (when there is
//! one) and the problem; the CLI maps all of them to exit code 2.

use std::fmt;
use std::path::{Path, PathBuf};

pub use crate::format::Refusal;

/// Errors returned by the library.
#[derive(Debug)]
pub enum Error {
    /// A file could not be opened, read or written.
    Io { path: PathBuf, source: std::io::Error },
    /// A trace file is malformed, truncated before its header, or of another format version.
    Trace { path: PathBuf, msg: String },
    /// A model file is missing, not a model, or of an unsupported architecture.
    Model { path: PathBuf, msg: String },
    /// Two traces cannot be compared (for example: different models).
    Mismatch(String),
    /// A bad argument or setting.
    Usage(String),
    /// A trace file refused by the reader's checks (see [`Refusal`]).
    Refused { path: PathBuf, why: Refusal },
    /// A tensor operation failed inside candle.
    #[cfg(feature = "run")]
    Candle(candle_core::Error),
    /// `--stop-on-nonfinite`: the run stopped after op record `seq` produced a NaN or ±Inf.
    /// Not a failure: the recorder catches it and completes the trace.
    StoppedOnNonFinite { seq: u64 },
}

/// Result alias over [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        Error::Io { path: path.to_path_buf(), source }
    }
    pub fn trace(path: &Path, msg: impl Into<String>) -> Self {
        Error::Trace { path: path.to_path_buf(), msg: msg.into() }
    }
    pub fn model(path: &Path, msg: impl Into<String>) -> Self {
        Error::Model { path: path.to_path_buf(), msg: msg.into() }
    }
    pub fn usage(msg: impl Into<String>) -> Self {
        Error::Usage(msg.into())
    }
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
            #[cfg(feature = "run")]
            Error::Candle(e) => write!(f, "tensor op failed: {}", first_line(&e.to_string())),
            Error::StoppedOnNonFinite { seq } => write!(f, "stopped after op record {seq}: non-finite output"),
        }
    }
}

impl std::error::Error for Error {}

#[cfg(feature = "run")]
impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        Error::Candle(e)
    }
}
