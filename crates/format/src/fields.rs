//! The typed meaning of header and footer fields the file stores as words: why a run stopped
//! ([`crate::record::Footer::stop`]) and how it was altered ([`crate::record::RunInfo::perturb`]).
//! The file keeps the words, so a trace written by a later version still reads; these types are
//! how this build writes and reads them, in one place.

use crate::record::RunInfo;

/// Why a run stopped, as [`crate::record::Footer::stop`] writes it (the file holds the words, so a trace keeps
/// whatever a later version writes; [`StopReason::parse`] reads the ones this build knows).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// `--max-tokens` tokens were generated: "max_tokens".
    MaxTokens,
    /// Row 0 generated the end-of-sequence token: "eos".
    Eos,
    /// `--stop-on-nonfinite`: op record `seq` produced a NaN or ±Inf: "nonfinite (op record N)".
    NonFinite {
        /// Record id of that op record.
        seq: u64,
    },
    /// An encoder run embedded its texts: "done".
    Done,
    /// A repro trace cut by `trace extract`: "extract".
    Extract,
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StopReason::MaxTokens => write!(f, "max_tokens"),
            StopReason::Eos => write!(f, "eos"),
            StopReason::NonFinite { seq } => write!(f, "nonfinite (op record {seq})"),
            StopReason::Done => write!(f, "done"),
            StopReason::Extract => write!(f, "extract"),
        }
    }
}

impl StopReason {
    /// The reason `stop` (a footer's words) names; `None` for words this build does not write.
    pub fn parse(stop: &str) -> Option<Self> {
        Some(match stop {
            "max_tokens" => StopReason::MaxTokens,
            "eos" => StopReason::Eos,
            "done" => StopReason::Done,
            "extract" => StopReason::Extract,
            _ => StopReason::NonFinite { seq: stop.strip_prefix("nonfinite (op record ")?.strip_suffix(')')?.parse().ok()? },
        })
    }
}

/// One way a run was altered, as [`RunInfo::perturb`] lists them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Alteration {
    /// A `--perturb` spec, as given (`layers.3.mlp@5`; parsed by the recorder).
    Perturb(String),
    /// A slice patched with the other run's values by `bisect --causal-out`: module path and
    /// token position.
    Patch {
        /// Module path of the patched op output.
        path: String,
        /// Token position patched.
        position: u32,
    },
}

/// The prefix of a [`Alteration::Patch`] entry.
pub const PATCH_PREFIX: &str = "patch:";

impl std::fmt::Display for Alteration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Alteration::Perturb(p) => write!(f, "{p}"),
            Alteration::Patch { path, position } => write!(f, "{PATCH_PREFIX}{path}@{position}"),
        }
    }
}

impl Alteration {
    /// `list` as [`RunInfo::perturb`] stores it: comma-separated, `None` when empty.
    pub fn field(list: &[Alteration]) -> Option<String> {
        (!list.is_empty()).then(|| list.iter().map(Alteration::to_string).collect::<Vec<_>>().join(","))
    }
}

impl RunInfo {
    /// The run's alterations, in order (empty entries skipped; a `patch:` entry whose position
    /// does not parse is kept as a perturb spec, which the recorder then refuses).
    pub fn alterations(&self) -> Vec<Alteration> {
        let entries = self.perturb.iter().flat_map(|s| s.split(',')).filter(|p| !p.is_empty());
        entries
            .map(|p| match p.strip_prefix(PATCH_PREFIX).and_then(|x| x.rsplit_once('@')).and_then(|(path, pos)| Some((path, pos.parse().ok()?))) {
                Some((path, position)) => Alteration::Patch { path: path.to_string(), position },
                None => Alteration::Perturb(p.to_string()),
            })
            .collect()
    }

    /// Sets [`RunInfo::perturb`] to `list` ([`Alteration::field`]).
    pub fn set_alterations(&mut self, list: &[Alteration]) {
        self.perturb = Alteration::field(list);
    }

    /// Whether the run was patched by `bisect --causal-out` (it cannot be re-run from its header).
    pub fn patched(&self) -> bool {
        self.alterations().iter().any(|a| matches!(a, Alteration::Patch { .. }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_reasons_and_alterations_round_trip_through_their_words() {
        for r in [StopReason::MaxTokens, StopReason::Eos, StopReason::NonFinite { seq: 41 }, StopReason::Done, StopReason::Extract] {
            assert_eq!(StopReason::parse(&r.to_string()), Some(r));
        }
        assert_eq!(StopReason::parse("nonfinite (op record x)"), None);
        let mut run = RunInfo { perturb: Some("layers.3.mlp@5,,patch:layers.1.self_attn.softmax@12,patch:bad@".into()), ..RunInfo::default() };
        let list = run.alterations();
        assert_eq!(list, [Alteration::Perturb("layers.3.mlp@5".into()), Alteration::Patch { path: "layers.1.self_attn.softmax".into(), position: 12 }, Alteration::Perturb("patch:bad@".into())]);
        assert!(run.patched());
        run.set_alterations(&list[..2]);
        assert_eq!(run.perturb.as_deref(), Some("layers.3.mlp@5,patch:layers.1.self_attn.softmax@12"));
        run.set_alterations(&[]);
        assert_eq!((run.perturb.clone(), run.alterations().is_empty()), (None, true));
    }
}
