//! The format-2 encoding of items frames: op records without the fields a reader can derive,
//! and with record ids stored as small deltas. Every other item is stored as in format 1.
//!
//! An op record ([`OpRecord`]) is stored as a [`DiskOp`]:
//! - `seq` as the distance from the previous op record of the frame (from 0 for the first), and
//!   each input as the distance back from the record's own `seq`: small numbers, one byte each;
//! - digests as fixed bytes (a random u128 costs 19 bytes as a varint, 16 as bytes);
//! - `stats.count` only when it is not the product of `shape`; `stats.abs_max` only when it is
//!   not `max(|min|, |max|)`; `min` and `max` as f32 when that is exact (always, for f32, f16
//!   and bf16 tensors); the NaN/±Inf counts only when one is not 0;
//! - when the record's one token entry has the whole tensor's sum, abs-max and non-finite count
//!   (its slice is the whole tensor: a decode step of batch 1, nearly every record of a
//!   generation), those are not stored again, and when the whole tensor's samples are the
//!   entry's four (the tracer makes them so: `candle_trace_run::digest::summarize`) they are stored once;
//!   when that entry's xxh3-64 digest is the low half of the record's xxh3-128 one (always, for a
//!   tensor over 240 bytes) it is not stored either (format 2.4);
//! - other token entries column by column, XOR-delta and byte-shuffled ([`Columns`]).
//!
//! The encoding is lossless: a record whose fields cannot be derived stores them. See
//! `docs/trace-format.md` ("Format 2") for the layout and the trade-offs.

use crate::record::{InputRef, Item, Kernel, OpRecord, Reads, Stats, TokenAxis, TokenStat};
use serde::{Deserialize, Serialize};

/// An items-frame entry as written: an op record in compact form, or any other item as in
/// format 1. Variant order is the format: `Op` = 0, `Other` = 1.
#[allow(clippy::large_enum_variant)] // op records are nearly every entry; boxing them buys nothing
#[derive(Serialize)]
pub(crate) enum DiskItemRef<'a> {
    Op(DiskOpRef<'a>),
    Other(&'a Item),
}

/// [`DiskItemRef`] as read.
#[derive(Deserialize)]
pub(crate) enum DiskItem {
    Op(DiskOp),
    Other(Item),
}

/// `min` and `max` of a record's statistics.
#[derive(Serialize, Deserialize)]
enum Bounds {
    /// Both are exactly f32 values.
    F32(f32, f32),
    F64(f64, f64),
}

/// A record's token entries.
#[derive(Serialize, Deserialize)]
enum Tokens {
    /// One entry whose sum, abs-max and non-finite count are the whole tensor's.
    Whole { row: u32, pos: u32, digest: [u8; 8], samples: [f32; 4] },
    /// Every entry in full, column by column ([`Columns`]).
    List(Columns),
    /// [`Tokens::Whole`] whose digest is the low 64 bits of the record's xxh3-128 digest, and so
    /// not stored: XXH3's 128-bit hash of an input over 240 bytes has the 64-bit hash of the same
    /// input as its low half (xxHash's `doc/xxhash_spec.md`: both finish with the same
    /// accumulator merge), and the entry hashes the same bytes as the record. Format 2.4.
    WholeLow { row: u32, pos: u32, samples: [f32; 4] },
}

/// Token entries stored by column, so that zstd sees like with like: rows and positions as
/// deltas from the previous entry, non-finite counts as they are, and the bytes of the digests,
/// sums, abs-maxes and samples "shuffled": each value XOR the previous entry's (neighbouring
/// positions of one tensor have values of one magnitude, so the sign, exponent and leading
/// mantissa bits cancel), then byte 0 of every value, byte 1 of every value, and so on, so the
/// bytes that cancelled form runs of zeros.
#[derive(Serialize, Deserialize)]
struct Columns {
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_TOKEN_STATS }>")]
    rows: Vec<u32>,
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_TOKEN_STATS }>")]
    pos: Vec<u32>,
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_TOKEN_STATS }>")]
    nonfinite: Vec<u32>,
    /// Digests, sums, abs-maxes (8 bytes each) and samples (4 × 4 bytes), shuffled: 40 bytes
    /// an entry.
    #[serde(with = "serde_bytes_capped")]
    bytes: Vec<u8>,
}

/// Bytes of one token entry in [`Columns::bytes`].
const TOKEN_BYTES: usize = 40;

/// A byte string of at most `MAX_TOKEN_STATS × TOKEN_BYTES` bytes, refused before it is copied.
mod serde_bytes_capped {
    use serde::{Deserializer, Serializer};
    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(v)
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        crate::limits::vec::<_, u8, { crate::limits::MAX_TOKEN_STATS * super::TOKEN_BYTES }>(d)
    }
}

impl Columns {
    fn encode(tokens: &[TokenStat]) -> Columns {
        let n = tokens.len();
        let mut words: Vec<[u64; 5]> = Vec::with_capacity(n);
        let mut prev = [0u64; 5];
        for t in tokens {
            let s = t.samples.map(f32::to_bits);
            let w = [t.digest, t.sum.to_bits(), t.abs_max.to_bits(), (s[0] as u64) | ((s[1] as u64) << 32), (s[2] as u64) | ((s[3] as u64) << 32)];
            words.push(std::array::from_fn(|k| if k == 0 { w[0] } else { w[k] ^ prev[k] }));
            prev = w;
        }
        let mut bytes = vec![0u8; n * TOKEN_BYTES];
        for (i, w) in words.iter().enumerate() {
            for (k, x) in w.iter().enumerate() {
                for (b, byte) in x.to_le_bytes().into_iter().enumerate() {
                    bytes[(k * 8 + b) * n + i] = byte;
                }
            }
        }
        let delta = |f: fn(&TokenStat) -> u32| -> Vec<u32> {
            let mut last = 0u32;
            tokens
                .iter()
                .map(|t| {
                    let v = f(t).wrapping_sub(last);
                    last = f(t);
                    v
                })
                .collect()
        };
        Columns { rows: delta(|t| t.row), pos: delta(|t| t.pos), nonfinite: tokens.iter().map(|t| t.nonfinite).collect(), bytes }
    }

    fn decode(self) -> Result<Vec<TokenStat>, String> {
        let n = self.rows.len();
        if self.pos.len() != n || self.nonfinite.len() != n || self.bytes.len() != n * TOKEN_BYTES {
            return Err("an op record's token columns differ in length".into());
        }
        let mut out = Vec::with_capacity(n);
        let (mut row, mut pos, mut prev) = (0u32, 0u32, [0u64; 5]);
        for i in 0..n {
            let w: [u64; 5] = std::array::from_fn(|k| {
                let x = u64::from_le_bytes(std::array::from_fn(|b| self.bytes[(k * 8 + b) * n + i]));
                if k == 0 {
                    x
                } else {
                    x ^ prev[k]
                }
            });
            prev = w;
            row = row.wrapping_add(self.rows[i]);
            pos = pos.wrapping_add(self.pos[i]);
            let lanes = [w[3] as u32, (w[3] >> 32) as u32, w[4] as u32, (w[4] >> 32) as u32].map(f32::from_bits);
            out.push(TokenStat { row, pos, digest: w[0], sum: f64::from_bits(w[1]), abs_max: f64::from_bits(w[2]), nonfinite: self.nonfinite[i], samples: lanes });
        }
        Ok(out)
    }
}

/// An op record as stored in a format-2 items frame (see the module docs).
#[derive(Serialize, Deserialize)]
pub(crate) struct DiskOp {
    seq_delta: u64,
    step: u32,
    site: u32,
    /// (distance back from `seq`, how it is read), wrapping.
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_INPUTS }>")]
    inputs: Vec<(u64, Reads)>,
    #[serde(deserialize_with = "crate::limits::string")]
    dtype: String,
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_RANK }>")]
    shape: Vec<u32>,
    digest: [u8; 16],
    /// `stats.count` when it is not the product of `shape`.
    count: Option<u64>,
    sum: f64,
    l2: f64,
    bounds: Bounds,
    /// `stats.abs_max` when it is not `max(|min|, |max|)`.
    abs_max: Option<f64>,
    /// `(nan, pos_inf, neg_inf)` when one is not 0.
    nonfinite: Option<(u64, u64, u64)>,
    /// The whole tensor's samples, unless `tokens` is [`Tokens::Whole`] and they are its four.
    #[serde(deserialize_with = "crate::limits::option_vec::<_, _, { crate::limits::MAX_SAMPLES }>")]
    samples: Option<Vec<f32>>,
    tokens: Tokens,
    axis: Option<TokenAxis>,
    kernel: Option<Kernel>,
    #[serde(deserialize_with = "crate::limits::vec::<_, _, { crate::limits::MAX_INPUTS }>")]
    operands: Vec<u64>,
    perturbed: bool,
}

/// [`DiskOp`] as written: the same fields in the same order, borrowing from the record.
#[derive(Serialize)]
pub(crate) struct DiskOpRef<'a> {
    seq_delta: u64,
    step: u32,
    site: u32,
    inputs: Vec<(u64, Reads)>,
    dtype: &'a str,
    shape: &'a [u32],
    digest: [u8; 16],
    count: Option<u64>,
    sum: f64,
    l2: f64,
    bounds: Bounds,
    abs_max: Option<f64>,
    nonfinite: Option<(u64, u64, u64)>,
    samples: Option<&'a [f32]>,
    tokens: Tokens,
    axis: Option<&'a TokenAxis>,
    kernel: Option<&'a Kernel>,
    operands: &'a [u64],
    perturbed: bool,
}

/// [`DiskItem`] read past rather than built: an op record's id delta, its other fields parsed
/// and dropped (no allocation: strings and byte strings are borrowed, lists walked), or any
/// other item whole. Bisect's second pass reads a frame so to build only the records it names
/// (`format::reader::decode_items_only`). Variant and field order are [`DiskItem`]'s and
/// [`DiskOp`]'s; `skim_reads_what_decode_reads` holds them together.
#[derive(Deserialize)]
pub(crate) enum SkimItem<'a> {
    Op(#[serde(borrow)] SkimOp<'a>),
    Other(Item),
}

/// [`DiskOp`], every field but `seq_delta` parsed and dropped.
#[derive(Deserialize)]
pub(crate) struct SkimOp<'a> {
    pub(crate) seq_delta: u64,
    _step: u32,
    _site: u32,
    _inputs: Passed<(u64, Reads)>,
    _dtype: &'a str,
    _shape: Passed<u32>,
    _digest: [u8; 16],
    _count: Option<u64>,
    _sum: f64,
    _l2: f64,
    _bounds: Bounds,
    _abs_max: Option<f64>,
    _nonfinite: Option<(u64, u64, u64)>,
    _samples: Option<Passed<f32>>,
    #[serde(borrow)]
    _tokens: SkimTokens<'a>,
    _axis: Option<TokenAxis>,
    _kernel: Option<Kernel>,
    _operands: Passed<u64>,
    _perturbed: bool,
}

/// [`Tokens`], parsed and dropped.
#[allow(dead_code)] // read only to be passed over
#[derive(Deserialize)]
enum SkimTokens<'a> {
    Whole { _row: u32, _pos: u32, _digest: [u8; 8], _samples: [f32; 4] },
    List(#[serde(borrow)] SkimColumns<'a>),
    WholeLow { _row: u32, _pos: u32, _samples: [f32; 4] },
}

/// [`Columns`], parsed and dropped.
#[derive(Deserialize)]
struct SkimColumns<'a> {
    _rows: Passed<u32>,
    _pos: Passed<u32>,
    _nonfinite: Passed<u32>,
    _bytes: &'a [u8],
}

/// A list whose elements (of type `T`) are parsed one by one and dropped: nothing is allocated
/// whatever the length read, and a length past the data ends the parse with an error.
struct Passed<T>(std::marker::PhantomData<T>);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Passed<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Walk<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for Walk<T> {
            type Value = Passed<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a list")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Passed<T>, A::Error> {
                while seq.next_element::<T>()?.is_some() {}
                Ok(Passed(std::marker::PhantomData))
            }
        }
        d.deserialize_seq(Walk(std::marker::PhantomData))
    }
}

/// The product of a shape, `None` on overflow.
fn elements(shape: &[u32]) -> Option<u64> {
    shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d as u64))
}

/// `max(|min|, |max|)`: the abs-max of finite values whose extremes are `min` and `max`.
fn abs_max_of(min: f64, max: f64) -> f64 {
    min.abs().max(max.abs())
}

fn same(a: f64, b: f64) -> bool {
    a.to_bits() == b.to_bits()
}

impl<'a> DiskOpRef<'a> {
    /// Encodes `r`, the op record after the one with id `prev` in this frame (0 for the first).
    pub(crate) fn encode(r: &'a OpRecord, prev: u64) -> DiskOpRef<'a> {
        let s = &r.stats;
        let nonfinite_total = s.nan.checked_add(s.pos_inf).and_then(|n| n.checked_add(s.neg_inf));
        let whole_token = match r.tokens.as_slice() {
            [t] if same(t.sum, s.sum) && same(t.abs_max, s.abs_max) && nonfinite_total == Some(t.nonfinite as u64) => Some(t),
            _ => None,
        };
        let tokens = match whole_token {
            Some(t) if t.digest == r.digest as u64 => Tokens::WholeLow { row: t.row, pos: t.pos, samples: t.samples },
            Some(t) => Tokens::Whole { row: t.row, pos: t.pos, digest: t.digest.to_le_bytes(), samples: t.samples },
            None => Tokens::List(Columns::encode(&r.tokens)),
        };
        let samples_derived = whole_token.is_some_and(|t| r.samples.len() == 4 && r.samples.iter().zip(&t.samples).all(|(a, b)| a.to_bits() == b.to_bits()));
        let f32_exact = |x: f64| same((x as f32) as f64, x);
        DiskOpRef {
            seq_delta: r.seq.wrapping_sub(prev),
            step: r.step,
            site: r.site,
            inputs: r.inputs.iter().map(|i| (r.seq.wrapping_sub(i.seq), i.reads)).collect(),
            dtype: &r.dtype,
            shape: &r.shape,
            digest: r.digest.to_le_bytes(),
            count: (elements(&r.shape) != Some(s.count)).then_some(s.count),
            sum: s.sum,
            l2: s.l2,
            bounds: if f32_exact(s.min) && f32_exact(s.max) { Bounds::F32(s.min as f32, s.max as f32) } else { Bounds::F64(s.min, s.max) },
            abs_max: (!same(abs_max_of(s.min, s.max), s.abs_max)).then_some(s.abs_max),
            nonfinite: (s.nan != 0 || s.pos_inf != 0 || s.neg_inf != 0).then_some((s.nan, s.pos_inf, s.neg_inf)),
            samples: (!samples_derived).then_some(r.samples.as_slice()),
            tokens,
            axis: r.axis.as_ref(),
            kernel: r.kernel.as_ref(),
            operands: &r.operands,
            perturbed: r.perturbed,
        }
    }
}

impl DiskOp {
    /// Decodes the record after the one with id `prev` in this frame.
    ///
    /// # Errors
    /// A message when the shape's element count overflows and no count is stored.
    pub(crate) fn decode(self, prev: u64) -> Result<OpRecord, String> {
        let seq = prev.wrapping_add(self.seq_delta);
        let count = match self.count {
            Some(c) => c,
            None => elements(&self.shape).ok_or("an op record's shape overflows its element count")?,
        };
        let (min, max) = match self.bounds {
            Bounds::F32(a, b) => (a as f64, b as f64),
            Bounds::F64(a, b) => (a, b),
        };
        let (nan, pos_inf, neg_inf) = self.nonfinite.unwrap_or((0, 0, 0));
        let stats = Stats { count, sum: self.sum, min, max, abs_max: self.abs_max.unwrap_or_else(|| abs_max_of(min, max)), l2: self.l2, nan, pos_inf, neg_inf };
        let digest = u128::from_le_bytes(self.digest);
        let whole = |row, pos, digest, samples: [f32; 4]| -> Result<_, String> {
            let nonfinite = u32::try_from(nan.saturating_add(pos_inf).saturating_add(neg_inf)).map_err(|_| "an op record counts more non-finite values than a token slice holds")?;
            Ok((vec![TokenStat { row, pos, digest, sum: stats.sum, abs_max: stats.abs_max, nonfinite, samples }], Some(samples.to_vec())))
        };
        let (tokens, derived_samples) = match self.tokens {
            Tokens::Whole { row, pos, digest: token_digest, samples } => whole(row, pos, u64::from_le_bytes(token_digest), samples)?,
            Tokens::WholeLow { row, pos, samples } => whole(row, pos, digest as u64, samples)?,
            Tokens::List(columns) => (columns.decode()?, None),
        };
        let samples = match (self.samples, derived_samples) {
            (Some(s), _) => s,
            (None, Some(s)) => s,
            (None, None) => return Err("an op record without samples has no token slice to take them from".into()),
        };
        Ok(OpRecord {
            seq,
            step: self.step,
            site: self.site,
            inputs: self.inputs.into_iter().map(|(back, reads)| InputRef { seq: seq.wrapping_sub(back), reads }).collect(),
            dtype: self.dtype,
            shape: self.shape,
            digest,
            stats,
            samples,
            tokens,
            axis: self.axis,
            kernel: self.kernel,
            operands: self.operands,
            perturbed: self.perturbed,
        })
    }
}

/// The entries of one format-2 items frame for `items`.
pub(crate) fn encode_items(items: &[Item]) -> Vec<DiskItemRef<'_>> {
    let mut prev = 0;
    items
        .iter()
        .map(|item| match item {
            Item::Op(r) => {
                let d = DiskOpRef::encode(r, prev);
                prev = r.seq;
                DiskItemRef::Op(d)
            }
            other => DiskItemRef::Other(other),
        })
        .collect()
}

impl DiskItem {
    /// The item this entry stores; `prev`: the id of the frame's op record before it (0 for the
    /// first), updated.
    ///
    /// # Errors
    /// As [`DiskOp::decode`].
    pub(crate) fn into_item(self, prev: &mut u64) -> Result<Item, String> {
        let item = match self {
            DiskItem::Op(d) => Item::Op(d.decode(*prev)?),
            DiskItem::Other(item) => item,
        };
        if let Item::Op(r) = &item {
            *prev = r.seq;
        }
        Ok(item)
    }
}

/// The items of one format-2 items frame, in order.
///
/// # Errors
/// As [`DiskOp::decode`].
#[cfg(test)]
pub(crate) fn decode_items(entries: Vec<DiskItem>) -> Result<Vec<Item>, String> {
    let mut prev = 0;
    entries.into_iter().map(|e| e.into_item(&mut prev)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(seq: u64, tokens: Vec<TokenStat>, stats: Stats, samples: Vec<f32>) -> OpRecord {
        OpRecord {
            seq,
            step: 3,
            site: 7,
            inputs: vec![InputRef { seq: seq.saturating_sub(2), reads: Reads::Prefix }, InputRef { seq: seq + 5, reads: Reads::Same }],
            dtype: "bf16".into(),
            shape: vec![1, 1, 6],
            digest: 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210,
            stats,
            samples,
            tokens,
            axis: Some(TokenAxis { seq_dim: Some(1), first_pos: 9, keep_from: 0, causal: false }),
            kernel: Some(Kernel::Add),
            operands: vec![4, 5],
            perturbed: true,
        }
    }

    fn round_trip(items: &[Item]) -> Vec<Item> {
        let bytes = postcard::to_stdvec(&encode_items(items)).unwrap();
        let entries: Vec<DiskItem> = postcard::from_bytes(&bytes).unwrap();
        decode_items(entries).unwrap()
    }

    /// Every field survives: derived ones when derivable, stored ones when not.
    #[test]
    fn records_round_trip_bit_for_bit() {
        let stats = Stats { count: 6, sum: 1.25, min: -0.5, max: 2.0, abs_max: 2.0, l2: 3.5, nan: 0, pos_inf: 0, neg_inf: 0 };
        let t = TokenStat { row: 0, pos: 9, digest: 77, sum: 1.25, abs_max: 2.0, nonfinite: 0, samples: [1.0, -0.5, 2.0, 0.25] };
        let whole = record(10, vec![t.clone()], stats.clone(), t.samples.to_vec());
        let odd_stats = Stats { count: 99, sum: -0.0, min: 0.1, max: f64::MAX, abs_max: 7.0, l2: f64::NAN, nan: 1, pos_inf: 2, neg_inf: 3 };
        let odd = record(11, vec![t.clone(), TokenStat { pos: 10, digest: u64::MAX, sum: f64::NAN, ..t.clone() }], odd_stats.clone(), vec![0.5; 8]);
        let mismatch = record(12, vec![TokenStat { sum: 1.0, ..t.clone() }], stats.clone(), vec![9.0; 8]);
        let low = record(13, vec![TokenStat { digest: 0x7654_3210, ..t.clone() }], stats.clone(), t.samples.to_vec());
        let low = OpRecord { digest: 0x0123_4567_0000_0000_0000_0000_7654_3210, ..low };
        let empty = record(3, Vec::new(), Stats::default(), Vec::new());
        let items = vec![Item::Site { id: 7, path: "x".into(), op: "add".into() }, Item::Op(whole), Item::Op(odd), Item::Op(mismatch), Item::Op(low), Item::Op(empty), Item::ValuePart(vec![1, 2])];
        let back = round_trip(&items);
        assert_eq!(format!("{back:?}"), format!("{items:?}"), "NaN-aware comparison through Debug");
    }

    /// [`SkimItem`] reads each entry to the same end as [`DiskItem`], with the same id delta:
    /// every variant of the fields that vary in length (token lists, `f64` bounds, stored
    /// samples and counts, non-finite counts, a kernel with fields, operands).
    #[test]
    fn skim_reads_what_decode_reads() {
        let stats = Stats { count: 6, sum: 1.25, min: -0.5, max: 2.0, abs_max: 2.0, l2: 3.5, nan: 0, pos_inf: 0, neg_inf: 0 };
        let t = TokenStat { row: 0, pos: 9, digest: 77, sum: 1.25, abs_max: 2.0, nonfinite: 0, samples: [1.0, -0.5, 2.0, 0.25] };
        let odd_stats = Stats { count: 99, sum: -0.0, min: 0.1, max: f64::MAX, abs_max: 7.0, l2: f64::NAN, nan: 1, pos_inf: 2, neg_inf: 3 };
        let list = (0..40).map(|i| TokenStat { row: i % 3, pos: 9 + i, digest: u64::MAX - i as u64, sum: i as f64, ..t.clone() }).collect();
        let mut kernel = record(20, vec![t.clone()], stats.clone(), t.samples.to_vec());
        kernel.kernel = Some(Kernel::RmsNorm { eps: 1e-6 });
        kernel.axis = None;
        let items = vec![
            Item::Site { id: 7, path: "layers.0.mlp".into(), op: "add".into() },
            Item::Op(record(10, vec![t.clone()], stats.clone(), t.samples.to_vec())),
            Item::Op(record(11, list, odd_stats, vec![0.5; 8])),
            Item::Op(record(12, vec![TokenStat { sum: 1.0, ..t.clone() }], stats.clone(), vec![9.0; 8])),
            Item::Op(OpRecord { digest: 0x0123_4567_0000_0000_0000_0000_0000_004d, ..record(13, vec![t.clone()], stats.clone(), t.samples.to_vec()) }),
            Item::Op(record(300, Vec::new(), Stats::default(), Vec::new())),
            Item::Op(kernel.clone()),
            Item::Op(OpRecord { seq: 21, kernel: Some(Kernel::ToDtype { dtype: "f16".into() }), ..kernel }),
            Item::ValuePart(vec![1, 2, 3]),
        ];
        let bytes = postcard::to_stdvec(&encode_items(&items)).unwrap();
        let (count, mut rest) = postcard::take_from_bytes::<u64>(&bytes).map(|(n, r)| (n as usize, r)).unwrap();
        assert_eq!(count, items.len());
        let mut deltas = Vec::new();
        for _ in 0..count {
            let (skim, after_skim) = postcard::take_from_bytes::<SkimItem<'_>>(rest).unwrap();
            let (entry, after) = postcard::take_from_bytes::<DiskItem>(rest).unwrap();
            assert_eq!(after_skim.len(), after.len(), "the skim ends where the entry does");
            match (skim, entry) {
                (SkimItem::Op(s), DiskItem::Op(d)) => {
                    assert_eq!(s.seq_delta, d.seq_delta);
                    deltas.push(s.seq_delta);
                }
                (SkimItem::Other(a), DiskItem::Other(b)) => assert_eq!(format!("{a:?}"), format!("{b:?}")),
                _ => panic!("the skim and the entry are different variants"),
            }
            rest = after;
        }
        assert!(rest.is_empty());
        assert_eq!(deltas, [10, 1, 1, 1, 287, 20u64.wrapping_sub(300), 1]);
    }

    /// A decode-step record whose token entry is the whole tensor stores its stats once.
    #[test]
    fn whole_slice_record_is_small() {
        let stats = Stats { count: 6, sum: 1.25, min: -0.5, max: 2.0, abs_max: 2.0, l2: 3.5, nan: 0, pos_inf: 0, neg_inf: 0 };
        let t = TokenStat { row: 0, pos: 9, digest: 77, sum: 1.25, abs_max: 2.0, nonfinite: 0, samples: [1.0, -0.5, 2.0, 0.25] };
        let r = record(10, vec![t.clone()], stats, t.samples.to_vec());
        let compact = postcard::to_stdvec(&encode_items(&[Item::Op(r.clone())])).unwrap().len();
        let full = postcard::to_stdvec(&vec![Item::Op(r.clone())]).unwrap().len();
        assert!(compact + 30 <= full, "compact {compact} vs format 1 {full}");
        // When the entry's digest is the low half of the record's, it is not stored (2.4).
        let low = OpRecord { digest: (r.digest >> 64 << 64) | 77, ..r.clone() };
        let lower = postcard::to_stdvec(&encode_items(&[Item::Op(low.clone())])).unwrap().len();
        assert_eq!(lower + 8, compact, "the entry's 8 digest bytes are not stored");
        assert_eq!(format!("{:?}", round_trip(&[Item::Op(low.clone())])), format!("{:?}", [Item::Op(low)]));
    }
}
