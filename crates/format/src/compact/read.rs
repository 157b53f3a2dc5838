//! A direct reader of the common format-2 entry, an op record ([`super::DiskOpRef`]), from its
//! postcard bytes: the serde path ([`super::EntryInto`]) walks each field through the
//! deserializer's visitors, and was most of bisect's time on frames that differ.
//!
//! The reader follows postcard's wire format (postcard 1.x, `spec/` in its repository): a
//! varint (LEB128, at most 5 bytes for a u32 and 10 for a u64, the last byte within the type's
//! width) for integers, lengths and enum variant indices; f32 and f64 as little-endian bytes;
//! a `u8` array as its bytes; an option or a bool as one byte 0 or 1; a struct or a tuple as
//! its fields in order. It takes no decision of its own: on anything it does not read the way
//! the serde path would (an unknown variant, a list over its cap, bytes that end early, a
//! string that is not UTF-8) it gives up and the caller reads the entry through serde, which
//! gives the error. `fast_reads_what_serde_reads` holds the two together, on the example
//! traces and on every one-byte change of their entries.

use super::{Bounds, Columns, OpParts, StoredStats, Tokens};
use crate::limits::{MAX_INPUTS, MAX_RANK, MAX_SAMPLES, MAX_STRING_LEN};
use crate::record::{InputRef, Kernel, OpRecord, Reads, TokenAxis};

/// The bytes left to read.
struct Wire<'a>(&'a [u8]);

impl<'a> Wire<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.0.len() {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N).map(|b| b.try_into().expect("N bytes taken"))
    }

    /// A varint of at most `bytes` bytes whose last byte is at most `last` (postcard's
    /// `try_take_varint_u64` and `_u32`). One or two bytes (nearly every varint here: ids,
    /// sites, steps, dims) are read in line; longer ones by [`Wire::long_varint`].
    #[inline(always)]
    fn varint(&mut self, bytes: usize, last: u8) -> Option<u64> {
        match *self.0 {
            [b0, ..] if b0 < 0x80 => {
                self.0 = &self.0[1..];
                Some(b0 as u64)
            }
            [b0, b1, ..] if b1 < 0x80 => {
                self.0 = &self.0[2..];
                Some((b0 & 0x7f) as u64 | (b1 as u64) << 7)
            }
            _ => self.long_varint(bytes, last),
        }
    }

    /// [`Wire::varint`] of three bytes or more (or bytes that end early).
    #[inline(never)]
    fn long_varint(&mut self, bytes: usize, last: u8) -> Option<u64> {
        let mut out = 0u64;
        for i in 0..bytes {
            let b = *self.0.get(i)?;
            out |= ((b & 0x7f) as u64) << (7 * i);
            if b & 0x80 == 0 {
                if i == bytes - 1 && b > last {
                    return None;
                }
                self.0 = &self.0[i + 1..];
                return Some(out);
            }
        }
        None
    }

    #[inline(always)]
    fn u64(&mut self) -> Option<u64> {
        self.varint(10, 0x01)
    }

    #[inline(always)]
    fn u32(&mut self) -> Option<u32> {
        self.varint(5, 0x0f).map(|v| v as u32)
    }

    /// A list's length, refused over `cap`.
    #[inline(always)]
    fn len(&mut self, cap: usize) -> Option<usize> {
        self.u64().filter(|&n| n <= cap as u64).map(|n| n as usize)
    }

    /// An option's tag or a bool: 0 or 1.
    fn flag(&mut self) -> Option<bool> {
        match self.take(1)?[0] {
            0 => Some(false),
            1 => Some(true),
            _ => None,
        }
    }

    fn f32(&mut self) -> Option<f32> {
        self.array().map(f32::from_le_bytes)
    }

    fn f64(&mut self) -> Option<f64> {
        self.array().map(f64::from_le_bytes)
    }

    fn samples4(&mut self) -> Option<[f32; 4]> {
        Some([self.f32()?, self.f32()?, self.f32()?, self.f32()?])
    }

    /// A value of type `T` read by its own serde implementation (fields this reader leaves to
    /// it: a kernel, a token list).
    fn serde<T: serde::de::DeserializeOwned>(&mut self) -> Option<T> {
        let (v, rest) = postcard::take_from_bytes::<T>(self.0).ok()?;
        self.0 = rest;
        Some(v)
    }
}

/// Reads the format-2 entry at the start of `raw` when it is an op record ([`super::DiskOpRef`],
/// variant 0), into `rec` as [`super::EntryInto`] does: the parts [`OpParts::finish`] completes
/// it from, and the bytes after the entry. `prev`: the id of the frame's op record before it.
/// `None` when the entry is another item or is not read here (see the module docs); `rec` is
/// then partly written, and the caller reads the entry again through serde.
#[inline(always)]
pub(crate) fn op_entry<'a>(raw: &'a [u8], prev: u64, rec: &mut OpRecord) -> Option<(OpParts, &'a [u8])> {
    let mut w = Wire(raw);
    if w.u32()? != 0 {
        return None;
    }
    // Every field named: a field added to `OpRecord` does not compile until it is read.
    let OpRecord { seq, step, site, inputs, dtype, shape, digest, stats: _, samples, tokens: _, axis, kernel, operands, perturbed } = rec;
    *seq = prev.wrapping_add(w.u64()?);
    *step = w.u32()?;
    *site = w.u32()?;
    let n = w.len(MAX_INPUTS)?;
    inputs.clear();
    for _ in 0..n {
        let back = w.u64()?;
        let reads = match w.u32()? {
            0 => Reads::Same,
            1 => Reads::Prefix,
            2 => Reads::All,
            _ => return None,
        };
        inputs.push(InputRef { seq: seq.wrapping_sub(back), reads });
    }
    let n = w.len(MAX_STRING_LEN)?;
    let bytes = w.take(n)?;
    // Nearly always the dtype of the record read into before: then nothing to check or copy.
    if dtype.as_bytes() != bytes {
        let text = std::str::from_utf8(bytes).ok()?;
        dtype.clear();
        dtype.push_str(text);
    }
    let n = w.len(MAX_RANK)?;
    shape.clear();
    for _ in 0..n {
        shape.push(w.u32()?);
    }
    *digest = u128::from_le_bytes(w.array()?);
    let stats = stored_stats(&mut w)?;
    let samples_stored = w.flag()?;
    if samples_stored {
        let n = w.len(MAX_SAMPLES)?;
        samples.clear();
        for _ in 0..n {
            samples.push(w.f32()?);
        }
    }
    let tokens = match w.u32()? {
        0 => Tokens::Whole { row: w.u32()?, pos: w.u32()?, digest: w.array()?, samples: w.samples4()? },
        1 => Tokens::List(w.serde::<Columns>()?),
        2 => Tokens::WholeLow { row: w.u32()?, pos: w.u32()?, samples: w.samples4()? },
        _ => return None,
    };
    *axis = match w.flag()? {
        false => None,
        true => Some(TokenAxis { seq_dim: if w.flag()? { Some(w.u32()?) } else { None }, first_pos: w.u32()?, keep_from: w.u32()?, causal: w.flag()? }),
    };
    *kernel = match w.flag()? {
        false => None,
        true => Some(w.serde::<Kernel>()?),
    };
    let n = w.len(MAX_INPUTS)?;
    operands.clear();
    for _ in 0..n {
        operands.push(w.u64()?);
    }
    *perturbed = w.flag()?;
    Some((OpParts { stats, samples_stored, tokens }, w.0))
}

/// [`StoredStats`], in its field order.
fn stored_stats(w: &mut Wire<'_>) -> Option<StoredStats> {
    let count = if w.flag()? { Some(w.u64()?) } else { None };
    let (sum, l2) = (w.f64()?, w.f64()?);
    let bounds = match w.u32()? {
        0 => Bounds::F32(w.f32()?, w.f32()?),
        1 => Bounds::F64(w.f64()?, w.f64()?),
        _ => return None,
    };
    let abs_max = if w.flag()? { Some(w.f64()?) } else { None };
    let nonfinite = if w.flag()? { Some((w.u64()?, w.u64()?, w.u64()?)) } else { None };
    Some(StoredStats { count, sum, l2, bounds, abs_max, nonfinite })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Item;

    /// The serde path's reading of one entry: the record and the bytes left, or `None` when it
    /// refuses the entry or reads another item.
    fn by_serde(raw: &[u8], prev: u64) -> Option<(String, usize)> {
        let mut rec = OpRecord::default();
        let mut de = postcard::Deserializer::from_bytes(raw);
        let entry = serde::de::DeserializeSeed::deserialize(super::super::EntryInto { rec: &mut rec, prev }, &mut de).ok()?;
        let rest = de.finalize().ok()?.len();
        match entry {
            super::super::Entry::Op(parts) => parts.finish(&mut rec).ok()?,
            super::super::Entry::Other(_) => return None,
        }
        Some((format!("{rec:?}"), rest))
    }

    /// This reader's reading of the same entry, into a record holding other values (a reused
    /// one), or `None` when it gives up or `finish` refuses.
    fn by_wire(raw: &[u8], prev: u64, reused: &OpRecord) -> Option<(String, usize)> {
        let mut rec = reused.clone();
        let (parts, rest) = op_entry(raw, prev, &mut rec)?;
        parts.finish(&mut rec).ok()?;
        Some((format!("{rec:?}"), rest.len()))
    }

    /// On the first op entries of the example traces, and on every change of one byte of each
    /// (to 0x00, 0x01, 0x80, 0xff and its bits flipped; for an entry with a long
    /// token list, of the bytes at its ends and every 37th), this reader either gives up
    /// or reads what the serde path reads: the same record and the same bytes left. Every entry
    /// is read whole; a change may only make the reader give up, never read something else.
    #[test]
    fn fast_reads_what_serde_reads() {
        let (mut entries, mut read, mut gave_up) = (0, 0, 0);
        // Entries with a kernel, with a token list, with a token axis: each part read.
        let mut kinds = [0; 3];
        let mut reused = OpRecord::default();
        for name in ["builtin-whole", "gemma3-270m-fixed", "builtin-chunk1", "gemma3-270m-transformers"] {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces").join(format!("{name}.trace"));
            let items = crate::format::read_trace(&path).unwrap().items;
            let mut prev = 0;
            for item in items.iter().filter(|i| matches!(i, Item::Op(_))).take(100) {
                let Item::Op(r) = item else { unreachable!() };
                let mut raw = postcard::to_stdvec(&super::super::DiskItemRef::Op(super::super::DiskOpRef::encode(r, prev))).unwrap();
                raw.extend_from_slice(&[9, 9]);
                let want = by_serde(&raw, prev).expect("an entry as written reads");
                assert_eq!(by_wire(&raw, prev, &reused), Some(want.clone()), "{name}: seq {}", r.seq);
                entries += 1;
                kinds[0] += r.kernel.is_some() as usize;
                kinds[1] += (r.tokens.len() > 1) as usize;
                kinds[2] += r.axis.is_some() as usize;
                // Every byte of a short entry; of a long one (a token list) its ends and a stride.
                let len = raw.len() - 2;
                for at in (0..len).filter(|&at| len < 256 || at < 128 || at + 64 >= len || at % 37 == 0) {
                    for v in [0x00, 0x01, 0x80, 0xff, !raw[at]] {
                        let mut bad = raw.clone();
                        bad[at] = v;
                        match by_wire(&bad, prev, &reused) {
                            Some(got) => {
                                assert_eq!(Some(got), by_serde(&bad, prev), "{name}: seq {} byte {at} set to {v:#x}", r.seq);
                                read += 1;
                            }
                            None => gave_up += 1,
                        }
                    }
                }
                prev = r.seq;
                reused = r.clone();
            }
        }
        assert!(entries == 400 && read > 10_000 && gave_up > 1000, "{entries} entries, {read} changed entries read, {gave_up} given up");
        assert!(kinds.iter().all(|&k| k > 20), "entries with a kernel, a token list, a token axis: {kinds:?}");
    }
}
