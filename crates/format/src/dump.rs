//! Full tensor values in a trace (`trace record --dump none|all|GLOB`), for elementwise
//! comparison (ULP distances) and replay.
//!
//! A dump holds a tensor's logical values (row-major) as little-endian bytes, byte-plane
//! shuffled: for elements of `k` bytes, all first bytes, then all second bytes, … (the layout of
//! Blosc's and HDF5's shuffle filter). Sign/exponent bytes of neighbouring activations are
//! alike, so the frame's zstd compresses the planes better than the interleaved bytes; the
//! figures are in `docs/trace-format.md`.

use crate::error::{Error, Result};
use crate::record::{Dump, Phase};

/// Which op outputs to dump.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum DumpSpec {
    /// Dump nothing (the default).
    #[default]
    None,
    /// Dump every op output.
    All,
    /// Comma-separated module-path patterns; `*` matches any run of characters.
    Globs(Vec<String>),
    /// `outputs:SPEC`: the ops SPEC selects, their outputs only, not their operands (weights,
    /// masks): enough for `bisect --tolerance`, far smaller than a dump `replay` can re-run.
    Outputs(Box<DumpSpec>),
    /// `SPEC@decode` or `SPEC@from:N`: SPEC in the forward passes the bound covers only. A long
    /// prompt's prefill holds most of a dump (attention's `[heads, q, kv]` scores grow with the
    /// square of its length: 1.1 GB for Gemma 3 270M at 591 tokens), and a comparison of what
    /// was generated needs the decode steps alone.
    Bounded(Passes, Box<DumpSpec>),
}

/// Which forward passes a bounded dump ([`DumpSpec::Bounded`]) covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Passes {
    /// `@decode`: decode steps only.
    Decode,
    /// `@from:N`: passes that hold a position at or after `N` (0-based, as `index_pos`): a pass
    /// is dumped whole or not at all, so a whole prefill that reaches `N` is dumped whole
    /// (`--prefill-chunk` splits it).
    From(u32),
}

impl DumpSpec {
    /// Parses `none`, `all` or comma-separated globs (`layers.3.*,lm_head`), optionally prefixed
    /// `outputs:` (outputs without operands) and suffixed `@decode` or `@from:N` (the passes
    /// dumped, [`Passes`]).
    ///
    /// # Errors
    /// [`Error::Usage`] for an empty pattern.
    pub fn parse(s: &str) -> Result<Self> {
        if let Some((inner, bound)) = s.rsplit_once('@') {
            let passes = match bound.strip_prefix("from:").map(str::parse::<u32>) {
                None if bound == "decode" => Passes::Decode,
                Some(Ok(n)) => Passes::From(n),
                _ => return Err(Error::usage(format!("--dump {s:?}: the bound after '@' is `decode` or `from:N` (a position)"))),
            };
            return match DumpSpec::parse(inner)? {
                DumpSpec::None => Ok(DumpSpec::None),
                DumpSpec::Bounded(..) => Err(Error::usage(format!("--dump {s:?}: one bound ('@') at most"))),
                x => Ok(DumpSpec::Bounded(passes, Box::new(x))),
            };
        }
        if let Some(inner) = s.strip_prefix("outputs:") {
            return match DumpSpec::parse(inner)? {
                DumpSpec::None => Ok(DumpSpec::None),
                DumpSpec::Outputs(x) => Ok(DumpSpec::Outputs(x)),
                x => Ok(DumpSpec::Outputs(Box::new(x))),
            };
        }
        match s {
            "none" => Ok(DumpSpec::None),
            "all" => Ok(DumpSpec::All),
            _ => {
                let globs: Vec<String> = s.split(',').map(|g| g.trim().to_string()).collect();
                let bad = |g: &String| g.is_empty() || g.len() > 256 || !g.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.*-".contains(&b));
                if globs.iter().any(bad) {
                    return Err(Error::usage(format!("--dump {s:?}: expected none, all, or comma-separated module-path patterns (letters, digits, '_', '.', '-' and '*')")));
                }
                Ok(DumpSpec::Globs(globs))
            }
        }
    }

    /// True when the op at `path` is selected.
    pub fn matches(&self, path: &str) -> bool {
        match self {
            DumpSpec::None => false,
            DumpSpec::All => true,
            DumpSpec::Globs(g) => g.iter().any(|p| glob(p.as_bytes(), path.as_bytes())),
            DumpSpec::Outputs(x) | DumpSpec::Bounded(_, x) => x.matches(path),
        }
    }

    /// True when the forward pass over positions `index_pos .. index_pos + seq_len` in `phase`
    /// is dumped: always, but for a [`DumpSpec::Bounded`] spec outside its bound.
    pub fn covers(&self, phase: Phase, index_pos: u32, seq_len: u32) -> bool {
        match self {
            DumpSpec::Bounded(Passes::Decode, _) => phase == Phase::Decode,
            DumpSpec::Bounded(Passes::From(n), _) => index_pos.saturating_add(seq_len) > *n,
            _ => true,
        }
    }

    /// The spec without its bound, if it has one.
    pub fn unbounded(&self) -> &DumpSpec {
        match self {
            DumpSpec::Bounded(_, x) => x,
            x => x,
        }
    }

    /// True when a selected op's operands are stored with its output (all but `outputs:`).
    pub fn operands(&self) -> bool {
        !matches!(self.unbounded(), DumpSpec::Outputs(_))
    }

    /// The spec as written on the command line.
    pub fn to_arg(&self) -> String {
        match self {
            DumpSpec::None => "none".into(),
            DumpSpec::All => "all".into(),
            DumpSpec::Globs(g) => g.join(","),
            DumpSpec::Outputs(x) => format!("outputs:{}", x.to_arg()),
            DumpSpec::Bounded(Passes::Decode, x) => format!("{}@decode", x.to_arg()),
            DumpSpec::Bounded(Passes::From(n), x) => format!("{}@from:{n}", x.to_arg()),
        }
    }
}

/// `*`-only glob match, in O(|p|·|s|) at worst (one backtrack point: the last `*`), so a
/// pattern of many stars cannot take exponential time.
fn glob(p: &[u8], s: &[u8]) -> bool {
    let (mut i, mut j) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while j < s.len() {
        if i < p.len() && p[i] == b'*' {
            star = Some((i, j));
            i += 1;
        } else if i < p.len() && p[i] == s[j] {
            i += 1;
            j += 1;
        } else if let Some((si, sj)) = star {
            i = si + 1;
            j = sj + 1;
            star = Some((si, sj + 1));
        } else {
            return false;
        }
    }
    p[i..].iter().all(|&c| c == b'*')
}

/// Splits `bytes` (elements of `k` bytes) into byte planes.
pub fn shuffle(bytes: &[u8], k: usize) -> Vec<u8> {
    let n = bytes.len() / k;
    let mut out = vec![0u8; bytes.len()];
    for (i, chunk) in bytes.chunks_exact(k).enumerate() {
        for (j, b) in chunk.iter().enumerate() {
            out[j * n + i] = *b;
        }
    }
    out
}

/// Inverse of [`shuffle`].
pub fn unshuffle(planes: &[u8], k: usize) -> Vec<u8> {
    let n = planes.len() / k;
    let mut out = vec![0u8; planes.len()];
    for i in 0..n {
        for j in 0..k {
            out[i * k + j] = planes[j * n + i];
        }
    }
    out
}

/// Checks that a dump's dtype is known and its byte length is exactly what its shape needs
/// (with checked arithmetic); returns (bytes per element, elements).
///
/// # Errors
/// [`Error::Usage`] naming the dump's record for an unknown dtype, a shape over the caps of
/// [`crate::limits::elements`], or a byte length that does not match.
pub fn check(d: &Dump) -> Result<(usize, usize)> {
    let k = crate::limits::dtype_size(&d.dtype).ok_or_else(|| Error::usage(format!("dump of record {}: unknown dtype {:?}", d.seq, d.dtype)))?;
    let n = crate::limits::elements(&d.shape).ok_or_else(|| Error::usage(format!("dump of record {}: shape {:?} is over the caps", d.seq, d.shape)))?;
    if (d.data.len() as u64) != n.saturating_mul(k as u64) {
        return Err(Error::usage(format!("dump of record {}: {} bytes for {n} elements of {k} bytes", d.seq, d.data.len())));
    }
    Ok((k, n as usize))
}

/// A dump's values: as f64 (exact for every float dtype) and as integers ordered like the
/// floats (for ULP distances: adjacent representable values differ by 1).
#[derive(Clone, Debug, PartialEq)]
pub struct Values {
    /// Candle dtype name of the dump.
    pub dtype: String,
    /// Dims, outermost first.
    pub shape: Vec<usize>,
    /// The elements as f64, row-major.
    pub f64: Vec<f64>,
    /// The elements as ordered integers (floats: −0 and +0 both 0; integer dtypes: the value), so
    /// the ULP distance of two floats of one dtype is the difference.
    pub ordered: Vec<i64>,
}

/// Maps a float's bits to an integer whose order is the float's order (−0 and +0 both 0).
fn ordered(bits: u64, width: u32) -> i64 {
    let sign = 1u64 << (width - 1);
    let mag = (bits & (sign - 1)) as i64;
    if bits & sign != 0 {
        -mag
    } else {
        mag
    }
}

/// Decodes a dump.
///
/// # Errors
/// [`Error::Usage`] for an unknown dtype or a byte length that does not match the shape.
pub fn decode(d: &Dump) -> Result<Values> {
    let (k, n) = check(d)?;
    let bytes = if d.shuffled { unshuffle(&d.data, k) } else { d.data.clone() };
    let (mut f, mut o) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for c in bytes.chunks_exact(k) {
        let (v, ord) = match d.dtype.as_str() {
            "f32" => {
                let b = u32::from_le_bytes(c.try_into().expect("4 bytes"));
                (f32::from_bits(b) as f64, ordered(b as u64, 32))
            }
            "f16" => {
                let b = u16::from_le_bytes(c.try_into().expect("2 bytes"));
                (half::f16::from_bits(b).to_f64(), ordered(b as u64, 16))
            }
            "bf16" => {
                let b = u16::from_le_bytes(c.try_into().expect("2 bytes"));
                (half::bf16::from_bits(b).to_f64(), ordered(b as u64, 16))
            }
            "f64" => {
                let b = u64::from_le_bytes(c.try_into().expect("8 bytes"));
                (f64::from_bits(b), ordered(b, 64))
            }
            "u32" => {
                let v = u32::from_le_bytes(c.try_into().expect("4 bytes"));
                (v as f64, v as i64)
            }
            "i64" => {
                let v = i64::from_le_bytes(c.try_into().expect("8 bytes"));
                (v as f64, v)
            }
            _ => (c[0] as f64, c[0] as i64),
        };
        f.push(v);
        o.push(ord);
    }
    Ok(Values { dtype: d.dtype.clone(), shape: d.shape.iter().map(|&x| x as usize).collect(), f64: f, ordered: o })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_prefix_keeps_the_selection_and_drops_operands() {
        let d = DumpSpec::parse("outputs:layers.3.*,lm_head").unwrap();
        assert!(d.matches("layers.3.mlp.act") && d.matches("lm_head") && !d.matches("layers.4.mlp.act"));
        assert!(!d.operands() && DumpSpec::parse("all").unwrap().operands());
        assert_eq!(d.to_arg(), "outputs:layers.3.*,lm_head");
        assert_eq!(DumpSpec::parse(&d.to_arg()).unwrap(), d);
        assert_eq!(DumpSpec::parse("outputs:none").unwrap(), DumpSpec::None);
        assert!(DumpSpec::parse("outputs:").is_err());
    }

    #[test]
    fn a_bound_selects_passes_and_round_trips() {
        let d = DumpSpec::parse("outputs:all@decode").unwrap();
        assert_eq!(d, DumpSpec::Bounded(Passes::Decode, Box::new(DumpSpec::Outputs(Box::new(DumpSpec::All)))));
        assert!(d.matches("layers.0.mlp.act") && !d.operands());
        assert!(d.covers(Phase::Decode, 591, 1) && !d.covers(Phase::Prefill, 0, 591) && !d.covers(Phase::Prefill, 512, 79));
        let f = DumpSpec::parse("layers.3.*@from:512").unwrap();
        assert!(f.operands() && f.matches("layers.3.mlp.act") && !f.matches("layers.4.mlp.act"));
        // A pass holds positions index_pos .. index_pos + seq_len.
        assert!(!f.covers(Phase::Prefill, 0, 512) && f.covers(Phase::Prefill, 0, 513) && f.covers(Phase::Prefill, 500, 20) && f.covers(Phase::Decode, 600, 1));
        for d in [d, f] {
            assert_eq!(DumpSpec::parse(&d.to_arg()).unwrap(), d);
        }
        assert_eq!(DumpSpec::parse("outputs:all@decode").unwrap().to_arg(), "outputs:all@decode");
        assert_eq!(DumpSpec::parse("none@decode").unwrap(), DumpSpec::None);
        assert!(DumpSpec::parse("all").unwrap().covers(Phase::Prefill, 0, 9));
        for bad in ["all@", "all@prefill", "all@from:", "all@from:-1", "all@decode@decode", "@decode"] {
            let e = DumpSpec::parse(bad).expect_err(bad).to_string();
            assert!(!e.contains('\n'), "{e}");
        }
    }

    #[test]
    fn shuffle_round_trips() {
        let b: Vec<u8> = (0..24).collect();
        let s = shuffle(&b, 4);
        assert_eq!(&s[..6], &[0, 4, 8, 12, 16, 20]);
        assert_eq!(unshuffle(&s, 4), b);
    }

    #[test]
    fn globs() {
        let s = DumpSpec::parse("layers.3.*,lm_head").unwrap();
        assert!(s.matches("layers.3.self_attn.softmax") && s.matches("lm_head"));
        assert!(!s.matches("layers.30.mlp.up_proj") && !s.matches("norm"));
        assert!(DumpSpec::parse("a,,b").is_err());
        assert!(DumpSpec::parse("layers 3").is_err());
        assert!(DumpSpec::parse("*a*b*").unwrap().matches("xaybz") && !DumpSpec::parse("*a*b").unwrap().matches("xaybz"));
        // Many stars against a long non-matching path: linear, not exponential.
        let stars = DumpSpec::parse(&"*".repeat(200).replace("**", "*a")).unwrap();
        assert!(!stars.matches(&format!("{}b", "a".repeat(300))));
    }
}
