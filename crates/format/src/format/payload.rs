//! Decoding a frame's payload once decompressed and checked: an items frame's items, whole or
//! for some of its op records only (bisect's second pass), and the one value of other frames.

use super::*;

/// Decodes one postcard value that must use all of `raw`.
pub(super) fn decode<T: DeserializeOwned>(raw: &[u8], at: usize) -> std::result::Result<T, Refusal> {
    let (v, rest) = take::<T>(raw, at)?;
    if !rest.is_empty() {
        return Err(Refusal::LeftOver { at, bytes: rest.len() });
    }
    Ok(v)
}

/// Decodes one postcard value from the start of `raw`: the value and the bytes after it.
pub(super) fn take<'de, T: serde::Deserialize<'de>>(raw: &'de [u8], at: usize) -> std::result::Result<(T, &'de [u8]), Refusal> {
    take_seed(raw, at, std::marker::PhantomData::<T>)
}

/// [`take`] of a value read by `seed` (into storage it holds).
fn take_seed<'de, S: serde::de::DeserializeSeed<'de>>(raw: &'de [u8], at: usize, seed: S) -> std::result::Result<(S::Value, &'de [u8]), Refusal> {
    crate::limits::clear_refusal();
    let mut de = postcard::Deserializer::from_bytes(raw);
    seed.deserialize(&mut de).and_then(|v| Ok((v, de.finalize()?))).map_err(|e| Refusal::Decode {
        at,
        msg: crate::limits::take_refusal().unwrap_or_else(|| {
            use postcard::Error as P;
            match e {
                P::DeserializeBadEnum => "an unknown enum variant (a newer format, or corruption)".into(),
                P::DeserializeBadUtf8 => "a string that is not UTF-8".into(),
                P::DeserializeUnexpectedEnd => "the value ends before its last field".into(),
                P::DeserializeBadVarint => "a malformed varint".into(),
                P::DeserializeBadBool => "a bool that is neither 0 nor 1".into(),
                P::SerdeDeCustom => "a value that does not decode (an unknown variant, or corruption)".into(),
                P::DeserializeBadOption => "an option tag that is neither 0 nor 1".into(),
                P::DeserializeBadChar => "an invalid char".into(),
                other => other.to_string(),
            }
        }),
    })
}

/// Decodes an items frame: a postcard `Vec<Item>` whose length is checked against
/// [`crate::limits::MAX_ITEMS_PER_FRAME`] before any item is decoded.
pub(super) fn decode_items(raw: &[u8], at: usize, version: u16) -> std::result::Result<Vec<Item>, Refusal> {
    decode_items_reusing(raw, at, version, &mut Spare::default())
}

/// Frames already read, whose op records the next frame decoded with [`decode_items_reusing`]
/// is read into, slot by slot, in place: their lists and strings are cleared and refilled, so a
/// record read into a spare one costs no move, and no allocation when it fits the room left
/// there (a decode step's record, with its one whole-tensor token entry, always does; a record
/// with a token list allocates its stored columns, and a kernel holding a string is built new).
/// It keeps up to [`Spare::FRAMES`] frames (frames are handed back in bursts: one kept frame
/// alone would free all but the last of a burst, and the decodes after it would allocate
/// again), each of at most [`Spare::MOST`] items, each an op record with room for at most
/// [`Spare::ROOM`] token entries and [`Spare::ROOM`]` / 4` inputs and operands: any other item
/// (a dumped value, which may be hundreds of MB) or a larger record (a crafted file's, with
/// millions of token entries) is freed and its slot left empty, so what is kept stays under
/// about 5 MB a frame.
#[derive(Default)]
pub(crate) struct Spare(Vec<Vec<Item>>);

impl Spare {
    /// Items of the frame kept at most: as many as the writer puts in one items frame.
    pub(crate) const MOST: usize = 1024;
    /// The most token entries a record kept may have room for.
    pub(crate) const ROOM: usize = 64;
    /// Frames kept at most (with two, over a quarter of the records of a differing stretch of
    /// bisect's pass 1 were decoded into new ones; with four, a fifth).
    pub(crate) const FRAMES: usize = 4;

    /// Keeps `items` (a frame no longer needed), less what is large, unless [`Spare::FRAMES`]
    /// are kept already or it holds no op record (a frame read as its summary hands back
    /// none): then it is freed.
    pub(crate) fn keep(&mut self, mut items: Vec<Item>) {
        if self.0.len() >= Self::FRAMES || !items.iter().any(|i| matches!(i, Item::Op(_))) {
            return;
        }
        items.truncate(Self::MOST);
        items.shrink_to(Self::MOST);
        for item in &mut items {
            let small = match item {
                Item::Op(r) => {
                    r.kernel = None;
                    r.tokens.capacity() <= Self::ROOM
                        && r.inputs.capacity() <= Self::ROOM / 4
                        && r.operands.capacity() <= Self::ROOM / 4
                        && r.dtype.capacity() <= 16
                        && r.shape.capacity() <= crate::limits::MAX_RANK
                        && r.samples.capacity() <= crate::limits::MAX_SAMPLES
                }
                _ => false,
            };
            if !small {
                *item = Item::Op(Default::default());
            }
        }
        self.0.push(items);
    }

    /// A frame kept, to read into (empty when none is).
    fn take(&mut self) -> Vec<Item> {
        self.0.pop().unwrap_or_default()
    }
}

/// [`decode_items`], the op records read into those of the frame `spare` keeps.
pub(super) fn decode_items_reusing(raw: &[u8], at: usize, version: u16, spare: &mut Spare) -> std::result::Result<Vec<Item>, Refusal> {
    let (count, mut rest) = item_count(raw, at)?;
    let items = if version == 1 {
        let mut items = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let (item, r) = take::<Item>(rest, at)?;
            items.push(item);
            rest = r;
        }
        items
    } else {
        // Each entry becomes its item as it is read: no frame-long list of entries.
        let (mut items, mut prev) = (spare.take(), 0);
        items.reserve((count as usize).saturating_sub(items.len()));
        for k in 0..count as usize {
            if k == items.len() {
                items.push(Item::Op(Default::default()));
            }
            rest = entry(rest, at, &mut prev, &mut items[k])?;
        }
        items.truncate(count as usize);
        items
    };
    all_read(rest, at)?;
    Ok(items)
}

/// [`decode_items`] of a format-2 frame read for its op records `wanted` (ids, ascending): each
/// entry is first read past ([`crate::compact::SkimItem`]: nothing built, no allocation for an
/// op record) and decoded only when it is one of them; every other item is kept. The frame is
/// read no further than the last record wanted, so what follows it is neither decoded nor
/// checked (bisect's second pass, whose first pass checked the whole frame).
pub(super) fn decode_items_only(raw: &[u8], at: usize, wanted: &[u64]) -> std::result::Result<Vec<Item>, Refusal> {
    let (count, mut rest) = item_count(raw, at)?;
    let (mut items, mut prev, mut wanted) = (Vec::new(), 0u64, wanted.iter().copied().peekable());
    let mut read = crate::record::OpRecord::default();
    for _ in 0..count {
        if wanted.peek().is_none() {
            return Ok(items);
        }
        // An op record read directly (into one record, reused), completed only when wanted.
        if let Some((parts, after)) = crate::compact::op_entry(rest, prev, &mut read) {
            let seq = read.seq;
            if is_wanted(&mut wanted, seq) {
                parts.finish(&mut read).map_err(|msg| Refusal::Decode { at, msg })?;
                items.push(Item::Op(std::mem::take(&mut read)));
            }
            prev = seq;
            rest = after;
            continue;
        }
        let (skim, after) = take::<crate::compact::SkimItem<'_>>(rest, at)?;
        // An op record's id, and the record when it is stored in full (format 1's encoding).
        let (seq, full) = match skim {
            crate::compact::SkimItem::Op(op) => (prev.wrapping_add(op.seq_delta), None),
            crate::compact::SkimItem::Other(Item::Op(r)) => (r.seq, Some(r)),
            crate::compact::SkimItem::Other(item) => {
                items.push(item);
                rest = after;
                continue;
            }
        };
        if is_wanted(&mut wanted, seq) {
            let item = match full {
                Some(r) => Item::Op(r),
                None => {
                    let mut item = Item::Op(Default::default());
                    entry(rest, at, &mut prev, &mut item)?;
                    item
                }
            };
            items.push(item);
        }
        prev = seq;
        rest = after;
    }
    all_read(rest, at)?;
    Ok(items)
}

/// Whether op record `seq` is the next of the ascending ids `wanted`, which are moved past it.
fn is_wanted(wanted: &mut std::iter::Peekable<impl Iterator<Item = u64>>, seq: u64) -> bool {
    while wanted.next_if(|&w| w < seq).is_some() {}
    wanted.next_if_eq(&seq).is_some()
}

/// Reads the format-2 entry at the start of `raw` into `slot`: an op record into the one
/// `slot` holds (else a new one), any other item in its place; the bytes after it. `prev` is
/// the id of the frame's op record before it, updated.
fn entry<'r>(raw: &'r [u8], at: usize, prev: &mut u64, slot: &mut Item) -> std::result::Result<&'r [u8], Refusal> {
    use crate::compact::{Entry, EntryInto};
    if !matches!(slot, Item::Op(_)) {
        *slot = Item::Op(Default::default());
    }
    let Item::Op(rec) = slot else { unreachable!("made an op record above") };
    // Nearly every entry is an op record: read directly, else (another item, or an entry the
    // direct reader leaves to serde, which then gives the error) through serde.
    if let Some((parts, rest)) = crate::compact::op_entry(raw, *prev, rec) {
        parts.finish(rec).map_err(|msg| Refusal::Decode { at, msg })?;
        *prev = rec.seq;
        return Ok(rest);
    }
    let (entry, rest) = take_seed(raw, at, EntryInto { rec, prev: *prev })?;
    match entry {
        Entry::Op(parts) => {
            parts.finish(rec).map_err(|msg| Refusal::Decode { at, msg })?;
            *prev = rec.seq;
        }
        Entry::Other(item) => {
            // An op record stored in full: the next record's id is a delta from its.
            if let Item::Op(r) = &item {
                *prev = r.seq;
            }
            *slot = item;
        }
    }
    Ok(rest)
}

/// An items frame's item count, checked against [`crate::limits::MAX_ITEMS_PER_FRAME`] before
/// any item is decoded, and the bytes after it.
fn item_count(raw: &[u8], at: usize) -> std::result::Result<(u64, &[u8]), Refusal> {
    let (count, rest) = varint(raw).ok_or_else(|| Refusal::Decode { at, msg: "bad item count".into() })?;
    if count > crate::limits::MAX_ITEMS_PER_FRAME {
        return Err(Refusal::TooManyItems { at, count });
    }
    Ok((count, rest))
}

/// Refuses bytes left after a frame's last item.
fn all_read(rest: &[u8], at: usize) -> std::result::Result<(), Refusal> {
    match rest.len() {
        0 => Ok(()),
        bytes => Err(Refusal::LeftOver { at, bytes }),
    }
}

/// A postcard varint (LEB128, at most 10 bytes) and the bytes after it.
fn varint(b: &[u8]) -> Option<(u64, &[u8])> {
    let mut n = 0u64;
    for (i, &x) in b.iter().enumerate().take(10) {
        n |= ((x & 0x7f) as u64).checked_shl(7 * i as u32)?;
        if x & 0x80 == 0 {
            return Some((n, &b[i + 1..]));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An op record stored in full (`Other`, format 1's encoding, which a format-2 frame may
    /// hold) among compact ones: the next compact record's id is a delta from its, in a whole
    /// read and in a read for some records.
    #[test]
    fn a_record_stored_in_full_sets_the_next_ones_id() {
        use crate::compact::{DiskItemRef, DiskOpRef};
        use crate::record::OpRecord;
        let op = |seq| OpRecord { seq, dtype: "f32".into(), shape: vec![1], samples: vec![0.5], ..OpRecord::default() };
        let (a, b, c) = (op(5), op(9), op(12));
        let full = Item::Op(b);
        let raw = postcard::to_stdvec(&vec![DiskItemRef::Op(DiskOpRef::encode(&a, 0)), DiskItemRef::Other(&full), DiskItemRef::Op(DiskOpRef::encode(&c, 9))]).unwrap();
        let seqs = |items: Vec<Item>| items.iter().map(|i| if let Item::Op(r) = i { r.seq } else { 0 }).collect::<Vec<_>>();
        let all = decode_items(&raw, 0, 2).unwrap();
        assert_eq!(format!("{all:?}"), format!("{:?}", [Item::Op(a), full, Item::Op(c)]));
        assert_eq!(seqs(decode_items_only(&raw, 0, &[9, 12]).unwrap()), [9, 12]);
        assert_eq!(seqs(decode_items_only(&raw, 0, &[12]).unwrap()), [12]);
        assert_eq!(seqs(decode_items_only(&raw, 0, &[5]).unwrap()), [5]);
    }

    /// A frame that holds a dumped value or large records is kept without them, and one with
    /// no op record at all is not kept.
    #[test]
    fn a_frame_is_kept_without_what_is_large() {
        use crate::record::{OpRecord, TokenStat};
        let t = TokenStat { row: 0, pos: 0, digest: 0, sum: 0.0, abs_max: 0.0, nonfinite: 0, samples: [0.0; 4] };
        let big = OpRecord { tokens: vec![t.clone(); Spare::ROOM + 1], ..OpRecord::default() };
        let mut spare = Spare::default();
        spare.keep(vec![Item::ValuePart(vec![0; 1 << 20]), Item::Op(big), Item::Op(OpRecord { tokens: vec![t; 3], ..OpRecord::default() })]);
        let room: Vec<usize> = spare.0[0].iter().map(|i| if let Item::Op(r) = i { r.tokens.capacity() } else { usize::MAX }).collect();
        assert_eq!(room, [0, 0, 3]);
        // A frame with no op record (a summary's, handed back empty) is not kept.
        spare.keep(Vec::new());
        spare.keep(vec![Item::ValuePart(vec![1])]);
        assert_eq!(spare.0.iter().map(Vec::len).collect::<Vec<_>>(), [3]);
        spare.keep(vec![Item::Op(OpRecord::default()); Spare::MOST + 5]);
        assert_eq!((spare.0[1].len(), spare.0[1].capacity()), (Spare::MOST, Spare::MOST));
        // Past `FRAMES` frames, a frame handed back is freed; a frame read takes the last kept.
        for len in 4..4 + Spare::FRAMES - 2 {
            spare.keep(vec![Item::Op(OpRecord::default()); len]);
        }
        spare.keep(vec![Item::Op(OpRecord::default()); 99]);
        let mut kept: Vec<usize> = vec![3, Spare::MOST];
        kept.extend(4..4 + Spare::FRAMES - 2);
        assert_eq!(spare.0.iter().map(Vec::len).collect::<Vec<_>>(), kept);
        let taken: Vec<usize> = (0..=Spare::FRAMES).map(|_| spare.take().len()).collect();
        kept.reverse();
        kept.push(0);
        assert_eq!(taken, kept);
    }

    /// A frame read into the frame kept ([`Spare`]) is the frame stored, whatever the kept one
    /// held slot by slot (op records, other items), and whether it was longer or shorter. Over
    /// the example traces' items, cut into frames of changing lengths.
    #[test]
    fn a_frame_read_into_a_kept_one_is_the_frame_stored() {
        let mut spare = Spare::default();
        let mut frames = 0;
        for name in ["builtin-whole", "gemma3-270m-fixed", "builtin-chunk1", "gemma3-270m-upstream"] {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces").join(format!("{name}.trace"));
            let items = crate::format::read_trace(&path).unwrap().items;
            let mut rest = &items[..];
            for len in [300, 17, 1000, 5, 64, 1].into_iter().cycle() {
                if rest.is_empty() {
                    break;
                }
                let (frame, after) = rest.split_at(len.min(rest.len()));
                rest = after;
                let raw = postcard::to_stdvec(&crate::compact::encode_items(frame)).unwrap();
                let kept: Vec<usize> = spare.0.iter().map(Vec::len).collect();
                let read = decode_items_reusing(&raw, 0, 2, &mut spare).unwrap();
                assert_eq!(format!("{read:?}"), format!("{frame:?}"), "{name}: a frame of {len} read into the last of {kept:?}");
                spare.keep(read);
                if frames % 3 == 0 {
                    // A second frame kept: the next is read into this one, other items and all.
                    spare.keep(frame.to_vec());
                }
                frames += 1;
            }
        }
        assert!(frames > 20, "{frames} frames read");
    }
}
