//! XXH3 (seed 0, default secret; 64- and 128-bit) of an input longer than [`MID_MAX`] bytes,
//! computed as independent per-block deltas folded in order: the form the CUDA kernel
//! (`crates/instrument/kernels/digest.cu`) computes, one thread per 1024-byte block, then one thread per
//! stream for the fold.
//!
//! Source: the XXH3 long-input algorithm of xxHash's `doc/xxhash_spec.md` (stripes of 64 bytes,
//! blocks of 16 stripes, the accumulator scrambled after each block, two merges at the end). The
//! accumulate step only *adds* to the eight 64-bit accumulators terms that depend on the input
//! and the secret, never on the accumulators, so a block's contribution can be computed from
//! zero on its own and added before that block's scramble. The tests pin this against
//! `candle_trace_format::hash` (the `twox-hash` crate) for every length class.

/// Inputs up to this many bytes take XXH3's short paths; this module covers the longer ones.
pub const MID_MAX: usize = 240;
/// Bytes per block: 16 stripes of 64 bytes with the 192-byte default secret.
pub const BLOCK_LEN: usize = 1024;
const STRIPE_LEN: usize = 64;
const STRIPES_PER_BLOCK: usize = 16;
const SECRET_LASTACC_START: usize = 7;
const SECRET_MERGEACCS_START: usize = 11;

const PRIME32_1: u64 = 0x9E37_79B1;
const PRIME32_2: u64 = 0x85EB_CA77;
const PRIME32_3: u64 = 0xC2B2_AE3D;
const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;
const PRIME64_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const PRIME64_3: u64 = 0x1656_67B1_9E37_79F9;
const PRIME64_4: u64 = 0x85EB_CA77_C2B2_AE63;
const PRIME64_5: u64 = 0x27D4_EB2F_1656_67C5;

/// The specification's default secret `kSecret` (192 bytes).
pub const SECRET: [u8; 192] = [
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c, //
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, //
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21, //
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c, //
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3, //
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, //
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, //
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, //
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, //
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, //
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, //
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e, //
];

/// Eight 64-bit accumulators (or a block's additive contribution to them).
pub type Acc = [u64; 8];

/// A logical byte sequence read 8 bytes at a time (little-endian), at any byte offset.
pub trait Words {
    /// Length in bytes.
    fn len(&self) -> usize;
    /// True when the sequence has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The little-endian u64 at bytes `at .. at + 8` (`at + 8 <= len`).
    fn word(&self, at: usize) -> u64;
}

fn secret64(at: usize) -> u64 {
    u64::from_le_bytes(SECRET[at..at + 8].try_into().expect("8 bytes"))
}

/// One 64-byte stripe at byte `at` of the input, keyed by the secret from byte `key`.
fn stripe(acc: &mut Acc, src: &impl Words, at: usize, key: usize) {
    for i in 0..8 {
        let v = src.word(at + 8 * i);
        let k = v ^ secret64(key + 8 * i);
        acc[i ^ 1] = acc[i ^ 1].wrapping_add(v);
        acc[i] = acc[i].wrapping_add((k & 0xFFFF_FFFF).wrapping_mul(k >> 32));
    }
}

/// Full blocks that are scrambled: `(len - 1) / BLOCK_LEN` (the last byte always falls in the
/// unscrambled tail). `len` must exceed [`MID_MAX`].
pub fn full_blocks(len: usize) -> usize {
    (len - 1) / BLOCK_LEN
}

/// Block `b`'s additive contribution to the accumulators (`b < full_blocks(len)`).
pub fn block_delta(src: &impl Words, b: usize) -> Acc {
    let mut d = [0u64; 8];
    for s in 0..STRIPES_PER_BLOCK {
        stripe(&mut d, src, b * BLOCK_LEN + s * STRIPE_LEN, s * 8);
    }
    d
}

/// Folds the full blocks' deltas in order (add, then scramble), then accumulates the tail:
/// the last partial block's whole stripes and the input's last 64 bytes.
pub fn fold(src: &impl Words, deltas: impl IntoIterator<Item = Acc>) -> Acc {
    let mut acc = [PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1];
    let scramble_key = SECRET.len() - STRIPE_LEN;
    for d in deltas {
        for i in 0..8 {
            let a = acc[i].wrapping_add(d[i]);
            let a = a ^ (a >> 47) ^ secret64(scramble_key + 8 * i);
            acc[i] = a.wrapping_mul(PRIME32_1);
        }
    }
    let len = src.len();
    let nb = full_blocks(len);
    for s in 0..((len - 1) - nb * BLOCK_LEN) / STRIPE_LEN {
        stripe(&mut acc, src, nb * BLOCK_LEN + s * STRIPE_LEN, s * 8);
    }
    stripe(&mut acc, src, len - STRIPE_LEN, SECRET.len() - STRIPE_LEN - SECRET_LASTACC_START);
    acc
}

fn avalanche(mut h: u64) -> u64 {
    h ^= h >> 37;
    h = h.wrapping_mul(0x1656_6791_9E37_79F9);
    h ^ (h >> 32)
}

fn merge(acc: &Acc, key: usize, start: u64) -> u64 {
    let mut r = start;
    for i in 0..4 {
        let p = u128::from(acc[2 * i] ^ secret64(key + 16 * i)) * u128::from(acc[2 * i + 1] ^ secret64(key + 16 * i + 8));
        r = r.wrapping_add((p as u64) ^ ((p >> 64) as u64));
    }
    avalanche(r)
}

/// XXH3-64 of an input of `len` bytes from its folded accumulators.
pub fn finish64(acc: &Acc, len: usize) -> u64 {
    merge(acc, SECRET_MERGEACCS_START, (len as u64).wrapping_mul(PRIME64_1))
}

/// XXH3-128 of an input of `len` bytes from its folded accumulators (high half in the top bits,
/// as `candle_trace_format::hash::xxh3_128` returns it).
pub fn finish128(acc: &Acc, len: usize) -> u128 {
    let lo = merge(acc, SECRET_MERGEACCS_START, (len as u64).wrapping_mul(PRIME64_1));
    let hi = merge(acc, SECRET.len() - STRIPE_LEN - SECRET_MERGEACCS_START, !(len as u64).wrapping_mul(PRIME64_2));
    (u128::from(hi) << 64) | u128::from(lo)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_trace_format::hash::{xxh3_128, xxh3_64};

    impl Words for &[u8] {
        fn len(&self) -> usize {
            <[u8]>::len(self)
        }
        fn word(&self, at: usize) -> u64 {
            u64::from_le_bytes(self[at..at + 8].try_into().expect("8 bytes"))
        }
    }

    /// Every length class of the long path: just over the short paths, whole stripes, a block
    /// boundary either side, several blocks with a partial tail, and exact multiples of a block.
    #[test]
    fn block_form_equals_xxh3_for_every_length_class() {
        let data: Vec<u8> = (0..9000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for len in [241, 255, 256, 257, 1023, 1024, 1025, 1088, 2048, 2049, 3000, 4096, 8191, 9000] {
            let src = &data[..len];
            let acc = fold(&src, (0..full_blocks(len)).map(|b| block_delta(&src, b)));
            assert_eq!(finish64(&acc, len), xxh3_64(src), "64-bit, {len} bytes");
            assert_eq!(finish128(&acc, len), xxh3_128(src), "128-bit, {len} bytes");
        }
    }
}
