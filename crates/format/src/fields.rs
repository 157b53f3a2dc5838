//! The typed meaning of header and footer fields the file stores as words: why a run stopped
//! ([`crate::record::Footer::stop`]) and how it was altered ([`crate::record::RunInfo::perturb`]).
//! The file keeps the words, so a trace written by a later version still reads; these types are
//! how this build writes and reads them, in one place.

use crate::error::{Error, Result};
use crate::record::RunInfo;

/// Why a run stopped, as [`crate::record::Footer::stop`] writes it (the file holds the words, so a trace keeps
/// whatever a later version writes; [`StopReason::parse`] reads the ones this build knows).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// `--max-tokens` tokens were generated: "max_tokens".
    MaxTokens,
    /// Every row generated its end-of-sequence token (each row stops at its own): "eos".
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
    /// A `--perturb` spec (`layers.3.mlp@5`).
    Perturb(Perturb),
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
            Alteration::Perturb(p) => write!(f, "{}", p.to_arg()),
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
    /// The run's alterations, in order (empty entries skipped).
    ///
    /// # Errors
    /// [`Error::Usage`] for an entry that is neither a `patch:PATH@POSITION` nor a perturb spec
    /// (see [`Perturb`]'s `FromStr`).
    pub fn alterations(&self) -> Result<Vec<Alteration>> {
        let entries = self.perturb.iter().flat_map(|s| s.split(',')).filter(|p| !p.is_empty());
        entries
            .map(|p| match p.strip_prefix(PATCH_PREFIX) {
                Some(x) => match x.rsplit_once('@').and_then(|(path, pos)| Some((path, pos.parse().ok()?))) {
                    Some((path, position)) if !path.is_empty() => Ok(Alteration::Patch { path: path.to_string(), position }),
                    _ => Err(Error::usage(format!("alteration {p:?}: expected {PATCH_PREFIX}PATH@POSITION"))),
                },
                None => p.parse().map(Alteration::Perturb),
            })
            .collect()
    }

    /// Sets [`RunInfo::perturb`] to `list` ([`Alteration::field`]).
    pub fn set_alterations(&mut self, list: &[Alteration]) {
        self.perturb = Alteration::field(list);
    }

    /// Whether the run was patched by `bisect --causal-out` (it cannot be re-run from its header).
    pub fn patched(&self) -> bool {
        self.perturb.iter().flat_map(|s| s.split(',')).any(|p| p.starts_with(PATCH_PREFIX))
    }
}

/// `--perturb PATH[@POSITION[#ELEMENT]]`: flip the lowest mantissa bit of element ELEMENT
/// (default 0) of batch row 0's slice at POSITION (default: the first position the op writes) of
/// the op at module path PATH, once. On the logits, ELEMENT is a token id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Perturb {
    /// Module path of the op.
    pub path: String,
    /// Position in batch row 0 (its own, in a padded batch); `None`: the first position the op
    /// writes.
    pub pos: Option<u32>,
    /// Element within the position's slice (0 when not given).
    pub element: Option<u32>,
}

impl Perturb {
    /// The spec as written on the command line (`PATH`, `PATH@POS` or `PATH@POS#ELEMENT`).
    pub fn to_arg(&self) -> String {
        match (self.pos, self.element) {
            (Some(pos), Some(e)) => format!("{}@{pos}#{e}", self.path),
            (Some(pos), None) => format!("{}@{pos}", self.path),
            _ => self.path.clone(),
        }
    }
}

impl std::str::FromStr for Perturb {
    type Err = Error;
    fn from_str(s: &str) -> Result<Perturb> {
        let (s_pos, element) = match s.rsplit_once('#') {
            Some((head, e)) if head.contains('@') => {
                let e = e.parse::<u32>().map_err(|_| Error::usage(format!("--perturb {s}: element '{e}' is not a whole number")))?;
                (head, Some(e))
            }
            _ => (s, None),
        };
        let s = s_pos;
        let (path, pos) = match s.rsplit_once('@') {
            None => (s, None),
            Some((p, n)) => {
                let n = n.parse::<u32>().map_err(|_| Error::usage(format!("--perturb {s}: position '{n}' is not a whole number")))?;
                (p, Some(n))
            }
        };
        if path.is_empty() || path.contains('@') {
            return Err(Error::usage(format!("--perturb {s}: expected PATH or PATH@POSITION")));
        }
        Ok(Perturb { path: path.to_string(), pos, element })
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
        let mut run = RunInfo { perturb: Some("layers.3.mlp@5,,patch:layers.1.self_attn.softmax@12,lm_head@29#135".into()), ..RunInfo::default() };
        let list = run.alterations().unwrap();
        let perturb = |path: &str, pos, element| Alteration::Perturb(Perturb { path: path.into(), pos, element });
        assert_eq!(list, [perturb("layers.3.mlp", Some(5), None), Alteration::Patch { path: "layers.1.self_attn.softmax".into(), position: 12 }, perturb("lm_head", Some(29), Some(135))]);
        assert!(run.patched());
        run.set_alterations(&list[..2]);
        assert_eq!(run.perturb.as_deref(), Some("layers.3.mlp@5,patch:layers.1.self_attn.softmax@12"));
        run.set_alterations(&[]);
        assert_eq!((run.perturb.clone(), run.alterations().unwrap().is_empty()), (None, true));
        for bad in ["patch:bad@", "patch:@3", "x@y", "@4", "a@1#z"] {
            run.perturb = Some(bad.into());
            assert!(run.alterations().is_err(), "{bad}");
        }
    }
}
