//! Fault injection for the crash-safety tests: `CANDLE_TRACE_KILL_AT=N` makes the trace writer
//! kill its own process with SIGKILL right after frame `N` (0 = the header frame) reaches the
//! file; `CANDLE_TRACE_KILL_AT=N.5` kills it halfway through writing frame `N`. A test can so
//! kill a recording at a chosen moment (after N frames, not after a sleep). Unset in normal use;
//! the variable is never recorded in a trace header.

/// Where to kill the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KillPoint {
    /// Frame index (0 = header frame).
    pub frame: u64,
    /// Kill with half of frame `frame` written, rather than after all of it.
    pub mid_frame: bool,
}

/// The variable that sets the kill point.
pub const KILL_AT_VAR: &str = "CANDLE_TRACE_KILL_AT";

/// The kill point from [`KILL_AT_VAR`], if set and well-formed (`N` or `N.5`).
pub fn kill_point() -> Option<KillPoint> {
    let v = std::env::var(KILL_AT_VAR).ok()?;
    let (n, mid) = match v.strip_suffix(".5") {
        Some(n) => (n, true),
        None => (v.as_str(), false),
    };
    Some(KillPoint { frame: n.parse().ok()?, mid_frame: mid })
}

impl KillPoint {
    /// Sends SIGKILL to this process: nothing after this runs, no destructor, no flush.
    pub fn kill(self) -> ! {
        // SAFETY: kill(2) with our own pid and a valid signal number has no memory effects.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
        // SIGKILL cannot be caught; should the call fail, end just as abruptly.
        std::process::abort()
    }
}
