//! The documented caps of the trace reader, and the bounded deserializers that enforce them while
//! a frame is decoded (before a container is filled, not after).
//!
//! A trace is untrusted input: it is attached to public bug reports and opened by strangers. Every
//! count read from a file is checked against one of these caps before anything is allocated for
//! it, and every product of counts is computed with checked arithmetic. `docs/trace-format.md`
//! lists the same numbers; a test keeps the two in step.
//!
//! The caps fall in three groups:
//! - per frame: [`MAX_FRAME_LEN`] bytes compressed and decompressed, [`MAX_ITEMS_PER_FRAME`] items;
//! - per trace: decompressed bytes and decoded memory, each at most [`decoded_budget`] of the file
//!   size (a tiny file cannot expand without bound: the classic decompression-bomb defence);
//! - per field: the longest list each field of a record may hold ([`MAX_RANK`], [`MAX_ROWS`], …),
//!   so that no small encoding (an empty string is one byte) expands into a large allocation.

use serde::de::{Deserialize, Deserializer, SeqAccess, Visitor};
use std::fmt;
use std::marker::PhantomData;

/// Either length of one frame, compressed or decompressed: 64 MiB.
pub const MAX_FRAME_LEN: u32 = 64 << 20;
/// Items in one items frame (the writer puts at most 1024).
pub const MAX_ITEMS_PER_FRAME: u64 = 4096;
/// Decompressed bytes, and decoded memory, that any trace may reach whatever its size: 32 MiB.
pub const MIN_DECODED_BUDGET: u64 = 32 << 20;
/// ...and per byte of the file beyond that: a trace may expand to 256 times its size.
pub const DECODED_PER_FILE_BYTE: u64 = 256;
/// Dimensions of a tensor shape.
pub const MAX_RANK: usize = 8;
/// Elements of one tensor (2^40): shapes whose product is larger are refused.
pub const MAX_ELEMENTS: u64 = 1 << 40;
/// Bytes of one string field (a prompt, a text, a path): 16 MiB.
pub const MAX_STRING_LEN: usize = 16 << 20;
/// Batch rows: choices per decode step, texts of an encoder run, generated texts, embeddings.
pub const MAX_ROWS: usize = 1024;
/// Token ids of one prompt or one forward pass.
pub const MAX_TOKEN_IDS: usize = 1 << 21;
/// Per-(row, position) entries of one op record.
pub const MAX_TOKEN_STATS: usize = 1 << 22;
/// Inputs, operands (of a record or a counterpart) and samples of one op record.
pub const MAX_INPUTS: usize = 64;
/// Samples of one op record.
pub const MAX_SAMPLES: usize = 8;
/// (token, logit) pairs of one decode-step choice.
pub const MAX_TOP: usize = 64;
/// Key/value pairs of a model config, and SIMD feature names.
pub const MAX_CONFIG_ENTRIES: usize = 4096;
/// Environment variables kept in a header.
pub const MAX_ENV_VARS: usize = 256;
/// Dimensions of one embedding vector.
pub const MAX_EMBEDDING_DIM: usize = 1 << 16;

/// The most a trace file of `file_len` bytes may decompress to, and may take in memory once
/// decoded: `max(MIN_DECODED_BUDGET, DECODED_PER_FILE_BYTE × file_len)` bytes.
pub fn decoded_budget(file_len: u64) -> u64 {
    MIN_DECODED_BUDGET.max(file_len.saturating_mul(DECODED_PER_FILE_BYTE))
}

/// The number of elements of `shape`, or `None` when the rank is over [`MAX_RANK`] or the
/// product overflows or passes [`MAX_ELEMENTS`].
pub fn elements(shape: &[u32]) -> Option<u64> {
    if shape.len() > MAX_RANK {
        return None;
    }
    shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d as u64)).filter(|&n| n <= MAX_ELEMENTS)
}

/// Bytes per element of a dense dtype name as traces store it (`f32`, `bf16`, `u8`, …).
pub fn dtype_size(dtype: &str) -> Option<usize> {
    Some(match dtype {
        "f64" | "i64" => 8,
        "f32" | "u32" => 4,
        "f16" | "bf16" => 2,
        "u8" => 1,
        _ => return None,
    })
}

/// (elements per block, bytes per block) of a GGML quantization type, by candle's `GgmlDType`
/// debug name. Source: ggml's `ggml-common.h` block structs (`block_q4_0` … `block_q8_K`), the
/// same sizes candle's `k_quants` module declares; a unit test compares them with candle's.
pub fn ggml_block(name: &str) -> Option<(u64, u64)> {
    Some(match name {
        "F32" => (1, 4),
        "F16" | "BF16" => (1, 2),
        "Q4_0" => (32, 18),
        "Q4_1" => (32, 20),
        "Q5_0" => (32, 22),
        "Q5_1" => (32, 24),
        "Q8_0" => (32, 34),
        "Q8_1" => (32, 36),
        "Q2K" => (256, 84),
        "Q3K" => (256, 110),
        "Q4K" => (256, 144),
        "Q5K" => (256, 176),
        "Q6K" => (256, 210),
        "Q8K" => (256, 292),
        _ => return None,
    })
}

/// The byte length a quantized tensor of type `ggml` and shape `shape` must have: `None` when the
/// type is unknown, the shape is refused by [`elements`], or its last dimension is not a whole
/// number of blocks.
pub fn ggml_bytes(ggml: &str, shape: &[u32]) -> Option<u64> {
    let (block, size) = ggml_block(ggml)?;
    let n = elements(shape)?;
    let last = *shape.last()? as u64;
    if !last.is_multiple_of(block) {
        return None;
    }
    (n / block).checked_mul(size)
}

thread_local! {
    /// The reason of the last refusal by a bounded deserializer (postcard keeps only a generic
    /// "custom error"): the reader puts it in its message.
    static REFUSAL: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

fn refuse<E: serde::de::Error>(msg: String) -> E {
    REFUSAL.with(|r| *r.borrow_mut() = Some(msg.clone()));
    E::custom(msg)
}

/// Forgets the last refusal (the reader calls it before decoding a value).
pub fn clear_refusal() {
    REFUSAL.with(|r| *r.borrow_mut() = None);
}

/// The last refusal's reason, if a bounded deserializer refused since [`clear_refusal`].
pub fn take_refusal() -> Option<String> {
    REFUSAL.with(|r| r.borrow_mut().take())
}

/// A `Vec<T>` deserializer that refuses more than `N` elements before reading them (`fill`
/// into a new vector). Use as `#[serde(deserialize_with = "crate::limits::vec::<_, _, N>")]`.
pub fn vec<'de, D, T, const N: usize>(d: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    let mut out = Vec::new();
    serde::de::DeserializeSeed::deserialize(fill::<T, N>(&mut out), d)?;
    Ok(out)
}

/// An `Option<Vec<T>>` deserializer: [`vec()`] inside the option.
pub fn option_vec<'de, D, T, const N: usize>(d: D) -> Result<Option<Vec<T>>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    struct Bounded<T, const N: usize>(Vec<T>);
    impl<'de, T: Deserialize<'de>, const N: usize> Deserialize<'de> for Bounded<T, N> {
        fn deserialize<D2: Deserializer<'de>>(d: D2) -> Result<Self, D2::Error> {
            vec::<_, _, N>(d).map(Bounded)
        }
    }
    Ok(Option::<Bounded<T, N>>::deserialize(d)?.map(|b| b.0))
}

/// A `Vec<String>` deserializer: at most `N` strings of at most [`MAX_STRING_LEN`] bytes.
pub fn strings<'de, D: Deserializer<'de>, const N: usize>(d: D) -> Result<Vec<String>, D::Error> {
    let v: Vec<Str> = vec::<_, _, N>(d)?;
    Ok(v.into_iter().map(|s| s.0).collect())
}

/// A `Vec<(String, String)>` deserializer: at most `N` pairs of capped strings.
pub fn pairs<'de, D: Deserializer<'de>, const N: usize>(d: D) -> Result<Vec<(String, String)>, D::Error> {
    let v: Vec<(Str, Str)> = vec::<_, _, N>(d)?;
    Ok(v.into_iter().map(|(a, b)| (a.0, b.0)).collect())
}

/// A `String` deserializer refusing more than [`MAX_STRING_LEN`] bytes (`StrInto` a new
/// string).
pub fn string<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let mut s = String::new();
    serde::de::DeserializeSeed::deserialize(StrInto(&mut s), d)?;
    Ok(s)
}

/// A `Vec<Vec<f32>>` deserializer: at most [`MAX_ROWS`] vectors of at most
/// [`MAX_EMBEDDING_DIM`] values.
pub fn embeddings<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Vec<f32>>, D::Error> {
    #[derive(serde::Deserialize)]
    struct Row(#[serde(deserialize_with = "vec::<_, _, MAX_EMBEDDING_DIM>")] Vec<f32>);
    let v: Vec<Row> = vec::<_, _, MAX_ROWS>(d)?;
    Ok(v.into_iter().map(|r| r.0).collect())
}

/// Reads a list of at most `N` elements of type `W` into an existing `Vec<T>`, each element
/// mapped by the closure: the vector is cleared first, so its capacity is reused (the decoder
/// of op records fills records it reuses, [`crate::compact::EntryInto`]). Refuses a declared
/// length over `N` before anything is read or allocated, and stops past the `N`th element.
pub(crate) struct Fill<'v, W, T, F: FnMut(W) -> T, const N: usize>(pub &'v mut Vec<T>, pub F, pub PhantomData<W>);

impl<'de, W: Deserialize<'de>, T, F: FnMut(W) -> T, const N: usize> serde::de::DeserializeSeed<'de> for Fill<'_, W, T, F, N> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de, W: Deserialize<'de>, T, F: FnMut(W) -> T, const N: usize> Visitor<'de> for Fill<'_, W, T, F, N> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "a list of at most {N} elements")
    }
    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        let len = seq.size_hint().unwrap_or(0);
        if len > N {
            return Err(refuse(format!("a list of {len} elements, over the cap of {N}")));
        }
        self.0.clear();
        self.0.reserve(len);
        while let Some(x) = seq.next_element::<W>()? {
            if self.0.len() == N {
                return Err(refuse(format!("a list over the cap of {N} elements")));
            }
            self.0.push((self.1)(x));
        }
        Ok(())
    }
}

/// [`Fill`] of `T` as stored.
pub(crate) fn fill<T, const N: usize>(v: &mut Vec<T>) -> Fill<'_, T, T, fn(T) -> T, N> {
    Fill(v, std::convert::identity, PhantomData)
}

/// Reads an optional list into an existing `Vec<T>` as [`fill`] does: `true` when it was there
/// (`v` then holds it), `false` when it was not (`v` is left as it was).
pub(crate) struct OptionFill<'v, T, const N: usize>(pub &'v mut Vec<T>);

impl<'de, T: Deserialize<'de>, const N: usize> serde::de::DeserializeSeed<'de> for OptionFill<'_, T, N> {
    type Value = bool;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_option(self)
    }
}

impl<'de, T: Deserialize<'de>, const N: usize> Visitor<'de> for OptionFill<'_, T, N> {
    type Value = bool;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "an optional list of at most {N} elements")
    }
    fn visit_none<E: serde::de::Error>(self) -> Result<bool, E> {
        Ok(false)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        serde::de::DeserializeSeed::deserialize(fill::<T, N>(self.0), d).map(|()| true)
    }
}

/// Reads a string of at most [`MAX_STRING_LEN`] bytes into an existing `String` (cleared
/// first, its capacity reused), refusing more before the bytes are copied.
pub(crate) struct StrInto<'v>(pub &'v mut String);

impl<'de> serde::de::DeserializeSeed<'de> for StrInto<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_str(self)
    }
}

impl Visitor<'_> for StrInto<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "a string of at most {MAX_STRING_LEN} bytes")
    }
    fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<(), E> {
        if s.len() > MAX_STRING_LEN {
            return Err(refuse(format!("a string of {} bytes, over the cap of {MAX_STRING_LEN}", s.len())));
        }
        self.0.clear();
        self.0.push_str(s);
        Ok(())
    }
}

/// A string of at most [`MAX_STRING_LEN`] bytes (checked before the bytes are copied).
struct Str(String);

impl<'de> Deserialize<'de> for Str {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        string(d).map(Str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn element_counts_are_checked() {
        assert_eq!(elements(&[2, 3, 4]), Some(24));
        assert_eq!(elements(&[]), Some(1));
        assert_eq!(elements(&[u32::MAX, u32::MAX, u32::MAX]), None);
        assert_eq!(elements(&[1; 9]), None);
        assert_eq!(ggml_bytes("Q4_1", &[4, 64]), Some(8 * 20));
        assert_eq!(ggml_bytes("Q4_1", &[4, 65]), None);
        assert_eq!(ggml_bytes("Q9", &[4, 64]), None);
    }

    #[test]
    fn bounded_vec_refuses_before_reading() {
        #[derive(serde::Deserialize, Debug)]
        struct S(#[serde(deserialize_with = "vec::<_, _, 3>")] Vec<u32>);
        // postcard: varint length, then one-byte varints.
        assert_eq!(postcard::from_bytes::<S>(&[3, 1, 2, 3]).unwrap().0, [1, 2, 3]);
        clear_refusal();
        assert!(postcard::from_bytes::<S>(&[4, 1, 2, 3, 4]).is_err());
        assert_eq!(take_refusal().as_deref(), Some("a list of 4 elements, over the cap of 3"));
        // A huge declared length with no bytes behind it: refused, nothing allocated.
        assert!(postcard::from_bytes::<S>(&[0xff, 0xff, 0xff, 0xff, 0x0f]).is_err());
    }
}
