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
    crate::limits::clear_refusal();
    postcard::take_from_bytes::<T>(raw).map_err(|e| Refusal::Decode {
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
        let (mut items, mut prev) = (Vec::with_capacity(count as usize), 0);
        for _ in 0..count {
            let (entry, r) = take::<crate::compact::DiskItem>(rest, at)?;
            items.push(entry.into_item(&mut prev).map_err(|msg| Refusal::Decode { at, msg })?);
            rest = r;
        }
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
    for _ in 0..count {
        if wanted.peek().is_none() {
            return Ok(items);
        }
        let (skim, r) = take::<crate::compact::SkimItem<'_>>(rest, at)?;
        match skim {
            crate::compact::SkimItem::Op(op) => {
                let seq = prev.wrapping_add(op.seq_delta);
                while wanted.next_if(|&w| w < seq).is_some() {}
                if wanted.next_if_eq(&seq).is_some() {
                    let (entry, _) = take::<crate::compact::DiskItem>(rest, at)?;
                    items.push(entry.into_item(&mut prev).map_err(|msg| Refusal::Decode { at, msg })?);
                } else {
                    prev = seq;
                }
            }
            crate::compact::SkimItem::Other(item) => items.push(item),
        }
        rest = r;
    }
    all_read(rest, at)?;
    Ok(items)
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
