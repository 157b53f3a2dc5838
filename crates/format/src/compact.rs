//! The format-2 encoding of items frames: op records without the fields a reader can derive,
//! and with record ids stored as small deltas. Every other item is stored as in format 1.
//!
//! An op record ([`OpRecord`]) is stored as a [`DiskOpRef`] and read back by [`EntryInto`]:
//! - `seq` as the distance from the previous op record of the frame (from 0 for the first), and
//!   each input as the distance back from the record's own `seq`: small numbers, one byte each;
//! - digests as fixed bytes (a random u128 costs 19 bytes as a varint, 16 as bytes);
//! - `stats.count` only when it is not the product of `shape`; `stats.abs_max` only when it is
//!   not `max(|min|, |max|)`; `min` and `max` as f32 when that is exact (always, for f32, f16
//!   and bf16 tensors); the NaN/±Inf counts only when one is not 0;
//! - when the record's one token entry has the whole tensor's sum, abs-max and non-finite count
//!   (its slice is the whole tensor: a decode step of batch 1, nearly every record of a
//!   generation), those are not stored again, and when the whole tensor's samples are the
//!   entry's four (the tracer makes them so: `candle_trace_instrument::digest::summarize`) they are stored once;
//!   when that entry's xxh3-64 digest is the low half of the record's xxh3-128 one (always, for a
//!   tensor over 240 bytes) it is not stored either (format 2.4);
//! - other token entries column by column, XOR-delta and byte-shuffled ([`Columns`]).
//!
//! The encoding is lossless: a record whose fields cannot be derived stores them. See
//! `docs/trace-format.md` ("Format 2") for the layout and the trade-offs.

mod read;
pub(crate) use read::op_entry;

use crate::limits::{fill, Fill, OptionFill, StrInto, MAX_INPUTS, MAX_RANK, MAX_SAMPLES};
use crate::record::{InputRef, Item, Kernel, OpRecord, Reads, Stats, TokenAxis, TokenStat};
use serde::de::{DeserializeSeed, EnumAccess, SeqAccess, VariantAccess, Visitor};
use serde::{Deserialize, Serialize};
use std::marker::PhantomData;

/// An items-frame entry as written: an op record in compact form, or any other item as in
/// format 1. Variant order is the format: `Op` = 0, `Other` = 1.
#[allow(clippy::large_enum_variant)] // op records are nearly every entry; boxing them buys nothing
#[derive(Serialize)]
pub(crate) enum DiskItemRef<'a> {
    Op(DiskOpRef<'a>),
    Other(&'a Item),
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

    /// Appends the entries to `out`.
    fn decode_into(self, out: &mut Vec<TokenStat>) -> Result<(), String> {
        let n = self.rows.len();
        if self.pos.len() != n || self.nonfinite.len() != n || self.bytes.len() != n * TOKEN_BYTES {
            return Err("an op record's token columns differ in length".into());
        }
        out.reserve(n);
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
        Ok(())
    }
}

/// A record's statistics as stored: fields of [`DiskOpRef`] in place (postcard writes a nested
/// struct's fields inline, with nothing around them).
#[derive(Serialize, Deserialize)]
struct StoredStats {
    /// `stats.count` when it is not the product of `shape`.
    count: Option<u64>,
    sum: f64,
    l2: f64,
    bounds: Bounds,
    /// `stats.abs_max` when it is not `max(|min|, |max|)`.
    abs_max: Option<f64>,
    /// `(nan, pos_inf, neg_inf)` when one is not 0.
    nonfinite: Option<(u64, u64, u64)>,
}

/// An op record as stored in a format-2 items frame (see the module docs), borrowing from the
/// record. Field order is the format; [`OpInto`] reads the fields back in the same order.
#[derive(Serialize)]
pub(crate) struct DiskOpRef<'a> {
    seq_delta: u64,
    step: u32,
    site: u32,
    inputs: InputDeltas<'a>,
    dtype: &'a str,
    shape: &'a [u32],
    digest: [u8; 16],
    stats: StoredStats,
    samples: Option<&'a [f32]>,
    tokens: Tokens,
    axis: Option<&'a TokenAxis>,
    kernel: Option<&'a Kernel>,
    operands: &'a [u64],
    perturbed: bool,
}

/// An items-frame entry read past rather than built: an op record's id delta, its other fields
/// parsed and dropped (no allocation: strings and byte strings are borrowed, lists walked), or
/// any other item whole. Bisect's second pass reads a frame so to build only the records it
/// names (`format::payload::decode_items_only`). Variant and field order are [`DiskItemRef`]'s
/// and [`DiskOpRef`]'s; `skim_reads_what_decode_reads` holds them together.
#[derive(Deserialize)]
pub(crate) enum SkimItem<'a> {
    Op(#[serde(borrow)] SkimOp<'a>),
    Other(Item),
}

/// [`DiskOpRef`], every field but `seq_delta` parsed and dropped.
#[derive(Deserialize)]
pub(crate) struct SkimOp<'a> {
    pub(crate) seq_delta: u64,
    _step: u32,
    _site: u32,
    _inputs: Passed<(u64, Reads)>,
    _dtype: &'a str,
    _shape: Passed<u32>,
    _digest: [u8; 16],
    _stats: StoredStats,
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
            inputs: InputDeltas { seq: r.seq, inputs: &r.inputs },
            dtype: &r.dtype,
            shape: &r.shape,
            digest: r.digest.to_le_bytes(),
            stats: StoredStats {
                count: (elements(&r.shape) != Some(s.count)).then_some(s.count),
                sum: s.sum,
                l2: s.l2,
                bounds: if f32_exact(s.min) && f32_exact(s.max) { Bounds::F32(s.min as f32, s.max as f32) } else { Bounds::F64(s.min, s.max) },
                abs_max: (!same(abs_max_of(s.min, s.max), s.abs_max)).then_some(s.abs_max),
                nonfinite: (s.nan != 0 || s.pos_inf != 0 || s.neg_inf != 0).then_some((s.nan, s.pos_inf, s.neg_inf)),
            },
            samples: (!samples_derived).then_some(r.samples.as_slice()),
            tokens,
            axis: r.axis.as_ref(),
            kernel: r.kernel.as_ref(),
            operands: &r.operands,
            perturbed: r.perturbed,
        }
    }
}

/// A record's inputs as stored: per input, `seq` minus the input's `seq` (wrapping) and how it
/// is read; written as the list of pairs `Vec<(u64, Reads)>` would be, without building it.
pub(crate) struct InputDeltas<'a> {
    seq: u64,
    inputs: &'a [InputRef],
}

impl Serialize for InputDeltas<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.inputs.iter().map(|i| (self.seq.wrapping_sub(i.seq), i.reads)))
    }
}

/// The entries of one format-2 items frame for `items`: written as the list
/// `Vec<DiskItemRef>` would be (a length, then each entry), each entry encoded as it is
/// written, so no list is built.
pub(crate) struct FrameItems<'a>(&'a [Item]);

impl Serialize for FrameItems<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        let mut seq = s.serialize_seq(Some(self.0.len()))?;
        let mut prev = 0;
        for item in self.0 {
            match item {
                Item::Op(r) => {
                    seq.serialize_element(&DiskItemRef::Op(DiskOpRef::encode(r, prev)))?;
                    prev = r.seq;
                }
                other => seq.serialize_element(&DiskItemRef::Other(other))?,
            }
        }
        seq.end()
    }
}

/// The entries of one format-2 items frame for `items` (see [`FrameItems`]).
pub(crate) fn encode_items(items: &[Item]) -> FrameItems<'_> {
    FrameItems(items)
}

/// One items-frame entry as [`EntryInto`] reads it.
pub(crate) enum Entry {
    /// An op record, read into the record given; [`OpParts::finish`] fills in the rest.
    Op(OpParts),
    /// Any other item, as in format 1 (the record given is left as it was).
    Other(Item),
}

/// Reads one items-frame entry ([`DiskItemRef`]): an op record into `rec`, whose lists and
/// string are cleared and refilled, so a record reused from a frame already read costs no
/// allocation; `prev` is the id of the frame's op record before it (0 for the first). Every
/// field of `rec` is written, here or by [`OpParts::finish`].
pub(crate) struct EntryInto<'r> {
    pub(crate) rec: &'r mut OpRecord,
    pub(crate) prev: u64,
}

impl<'de> DeserializeSeed<'de> for EntryInto<'_> {
    type Value = Entry;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Entry, D::Error> {
        d.deserialize_enum("DiskItem", &["Op", "Other"], self)
    }
}

impl<'de> Visitor<'de> for EntryInto<'_> {
    type Value = Entry;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an items-frame entry")
    }
    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<Entry, A::Error> {
        let (variant, v): (u32, _) = data.variant()?;
        match variant {
            0 => v.newtype_variant_seed(OpInto { rec: self.rec, prev: self.prev }).map(Entry::Op),
            1 => v.newtype_variant::<Item>().map(Entry::Other),
            n => Err(serde::de::Error::invalid_value(serde::de::Unexpected::Unsigned(n as u64), &"variant index 0 <= i < 2")),
        }
    }
}

/// The fields of a stored op record ([`DiskOpRef`], in its order) read into `rec`.
struct OpInto<'r> {
    rec: &'r mut OpRecord,
    prev: u64,
}

/// Fields of [`DiskOpRef`].
const OP_FIELDS: usize = 14;

impl<'de> DeserializeSeed<'de> for OpInto<'_> {
    type Value = OpParts;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<OpParts, D::Error> {
        // postcard stores a struct as the tuple of its fields.
        d.deserialize_tuple(OP_FIELDS, self)
    }
}

impl<'de> Visitor<'de> for OpInto<'_> {
    type Value = OpParts;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "an op record's {OP_FIELDS} fields")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<OpParts, A::Error> {
        // Every field named: a field added to `OpRecord` does not compile until it is read.
        let OpRecord { seq, step, site, inputs, dtype, shape, digest, stats: _, samples, tokens: _, axis, kernel, operands, perturbed } = self.rec;
        let mut read = 0usize;
        macro_rules! field {
            ($seed:expr) => {{
                read += 1;
                match s.next_element_seed($seed)? {
                    Some(v) => v,
                    None => return Err(serde::de::Error::invalid_length(read - 1, &"an op record's fields")),
                }
            }};
        }
        *seq = self.prev.wrapping_add(field!(PhantomData::<u64>));
        *step = field!(PhantomData);
        *site = field!(PhantomData);
        let id = *seq;
        field!(Fill::<(u64, Reads), InputRef, _, MAX_INPUTS>(inputs, |(back, reads)| InputRef { seq: id.wrapping_sub(back), reads }, PhantomData));
        field!(StrInto(dtype));
        field!(fill::<u32, MAX_RANK>(shape));
        *digest = u128::from_le_bytes(field!(PhantomData));
        let stats = field!(PhantomData);
        let samples_stored = field!(OptionFill::<f32, MAX_SAMPLES>(samples));
        let tokens = field!(PhantomData);
        *axis = field!(PhantomData);
        *kernel = field!(PhantomData);
        field!(fill::<u64, MAX_INPUTS>(operands));
        *perturbed = field!(PhantomData);
        Ok(OpParts { stats, samples_stored, tokens })
    }
}

/// What of a stored op record is not kept as stored: [`OpParts::finish`] derives the record's
/// statistics, token entries and (unless stored) samples from it.
pub(crate) struct OpParts {
    stats: StoredStats,
    /// The record's samples were stored (and read into it); else they are the whole-tensor
    /// token entry's four.
    samples_stored: bool,
    tokens: Tokens,
}

impl OpParts {
    /// Fills in `rec`'s statistics, token entries and, unless stored, samples: `rec` is the
    /// record [`OpInto`] read these parts with.
    ///
    /// # Errors
    /// A message when the shape's element count overflows and no count is stored, the
    /// non-finite count passes a token entry's, the token columns differ in length, or no
    /// samples were stored and there is no whole-tensor token entry to take them from.
    pub(crate) fn finish(self, rec: &mut OpRecord) -> Result<(), String> {
        let s = self.stats;
        let count = match s.count {
            Some(c) => c,
            None => elements(&rec.shape).ok_or("an op record's shape overflows its element count")?,
        };
        let (min, max) = match s.bounds {
            Bounds::F32(a, b) => (a as f64, b as f64),
            Bounds::F64(a, b) => (a, b),
        };
        let (nan, pos_inf, neg_inf) = s.nonfinite.unwrap_or((0, 0, 0));
        rec.stats = Stats { count, sum: s.sum, min, max, abs_max: s.abs_max.unwrap_or_else(|| abs_max_of(min, max)), l2: s.l2, nan, pos_inf, neg_inf };
        rec.tokens.clear();
        let (row, pos, token_digest, samples) = match self.tokens {
            Tokens::Whole { row, pos, digest, samples } => (row, pos, u64::from_le_bytes(digest), samples),
            Tokens::WholeLow { row, pos, samples } => (row, pos, rec.digest as u64, samples),
            Tokens::List(columns) => {
                columns.decode_into(&mut rec.tokens)?;
                return match self.samples_stored {
                    true => Ok(()),
                    false => Err("an op record without samples has no token slice to take them from".into()),
                };
            }
        };
        let nonfinite = u32::try_from(nan.saturating_add(pos_inf).saturating_add(neg_inf)).map_err(|_| "an op record counts more non-finite values than a token slice holds")?;
        rec.tokens.push(TokenStat { row, pos, digest: token_digest, sum: rec.stats.sum, abs_max: rec.stats.abs_max, nonfinite, samples });
        if !self.samples_stored {
            rec.samples.clear();
            rec.samples.extend_from_slice(&samples);
        }
        Ok(())
    }
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

    /// Reads a frame's entries as the reader does ([`EntryInto`], then [`OpParts::finish`]),
    /// into records taken from `spare`.
    fn read_entries(bytes: &[u8], spare: &mut Vec<OpRecord>) -> Vec<Item> {
        let (count, mut rest) = postcard::take_from_bytes::<u64>(bytes).unwrap();
        let (mut items, mut prev) = (Vec::new(), 0);
        for _ in 0..count {
            let mut rec = spare.pop().unwrap_or_default();
            let mut de = postcard::Deserializer::from_bytes(rest);
            match (EntryInto { rec: &mut rec, prev }).deserialize(&mut de).unwrap() {
                Entry::Op(parts) => {
                    parts.finish(&mut rec).unwrap();
                    prev = rec.seq;
                    items.push(Item::Op(rec));
                }
                Entry::Other(item) => items.push(item),
            }
            rest = de.finalize().unwrap();
        }
        assert!(rest.is_empty());
        items
    }

    fn round_trip(items: &[Item]) -> Vec<Item> {
        read_entries(&postcard::to_stdvec(&encode_items(items)).unwrap(), &mut Vec::new())
    }

    /// Records read into records reused from other frames are the records stored, whatever
    /// the reused ones held (token lists, kernels, operands, stored samples read into records
    /// that derive them, and the reverse), each frame read into the records of the frames
    /// before it. (`format::payload`'s tests read the example traces so.)
    #[test]
    fn records_read_into_reused_ones_are_the_records_stored() {
        let stats = Stats { count: 6, sum: 1.25, min: -0.5, max: 2.0, abs_max: 2.0, l2: 3.5, nan: 0, pos_inf: 0, neg_inf: 0 };
        let t = TokenStat { row: 0, pos: 9, digest: 77, sum: 1.25, abs_max: 2.0, nonfinite: 0, samples: [1.0, -0.5, 2.0, 0.25] };
        let odd_stats = Stats { count: 99, sum: -0.0, min: 0.1, max: f64::MAX, abs_max: 7.0, l2: f64::NAN, nan: 1, pos_inf: 2, neg_inf: 3 };
        let list: Vec<TokenStat> = (0..40).map(|i| TokenStat { row: i % 3, pos: 9 + i, digest: u64::MAX - i as u64, sum: i as f64, ..t.clone() }).collect();
        let rich: Vec<Item> = (0..6).map(|i| Item::Op(record(10 + i, list.clone(), odd_stats.clone(), vec![0.5; 8]))).collect();
        let plain = |seq| OpRecord {
            inputs: Vec::new(),
            kernel: None,
            axis: None,
            operands: Vec::new(),
            perturbed: false,
            dtype: "f32".into(),
            shape: vec![6],
            ..record(seq, vec![t.clone()], stats.clone(), t.samples.to_vec())
        };
        let plain: Vec<Item> = (0..6).map(|i| Item::Op(plain(20 + i))).collect();
        let site = Item::Site { id: 7, path: "layers.0.mlp".into(), op: "add".into() };
        let mixed: Vec<Item> = plain.iter().cloned().chain([site]).chain(rich.iter().cloned()).collect();
        let frames = [rich.clone(), plain.clone(), mixed, rich, plain];
        let mut spare = Vec::new();
        for (k, frame) in frames.iter().enumerate() {
            let got = read_entries(&postcard::to_stdvec(&encode_items(frame)).unwrap(), &mut spare);
            assert_eq!(format!("{got:?}"), format!("{frame:?}"), "frame {k}, read into {} spare records", spare.len());
            spare.extend(got.into_iter().filter_map(|i| if let Item::Op(r) = i { Some(r) } else { None }));
        }
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

    /// [`SkimItem`] reads each entry to the same end as [`EntryInto`], with the same id delta:
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
        let mut prev = 0u64;
        for _ in 0..count {
            let (skim, after_skim) = postcard::take_from_bytes::<SkimItem<'_>>(rest).unwrap();
            let mut rec = OpRecord::default();
            let mut de = postcard::Deserializer::from_bytes(rest);
            let entry = (EntryInto { rec: &mut rec, prev }).deserialize(&mut de).unwrap();
            let after = de.finalize().unwrap();
            assert_eq!(after_skim.len(), after.len(), "the skim ends where the entry does");
            match (skim, entry) {
                (SkimItem::Op(s), Entry::Op(_)) => {
                    assert_eq!(prev.wrapping_add(s.seq_delta), rec.seq);
                    deltas.push(s.seq_delta);
                    prev = rec.seq;
                }
                (SkimItem::Other(a), Entry::Other(b)) => assert_eq!(format!("{a:?}"), format!("{b:?}")),
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
