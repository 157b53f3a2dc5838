//! XXH3 as the trace format uses it: the 64-bit and 128-bit hashes of xxHash's XXH3 with seed 0
//! and the default secret (xxHash's `doc/xxhash_spec.md`), in one call or streamed, computed by
//! the `twox-hash` crate, which picks its vector unit (AVX2, NEON) at run time: on a build for
//! the default x86-64 target it hashes 1.2-1.6 times as fast as a library fixed to SSE2 at
//! compile time (docs/performance.md, "Digest throughput").
//!
//! Every digest and checksum in a trace is one of these: frame checksums, op and per-token
//! digests, sampling digests. The streaming hashers keep no heap memory (their secret is the
//! static default), so making one costs a few hundred bytes of stack and no allocation.

use std::hash::Hasher;
use twox_hash::xxhash3_128::SecretBuffer;

/// xxh3-64 of `bytes`.
pub fn xxh3_64(bytes: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(bytes)
}

/// xxh3-128 of `bytes`: the high 64 bits of the XXH128 result are the high half.
pub fn xxh3_128(bytes: &[u8]) -> u128 {
    twox_hash::XxHash3_128::oneshot(bytes)
}

/// XXH3's default secret, `kSecret` of the specification (192 bytes).
static SECRET: [u8; 192] = [
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

/// The streaming state both widths start from: seed 0, the default secret.
fn secret() -> SecretBuffer<&'static [u8; 192]> {
    match SecretBuffer::new(0, &SECRET) {
        Ok(s) => s,
        // The default secret is 192 bytes; XXH3 needs at least 136.
        Err(_) => unreachable!("XXH3's default secret is long enough"),
    }
}

/// xxh3-64 of bytes that arrive in pieces: [`Xxh3_64::digest`] is [`xxh3_64`] of everything
/// [`Xxh3_64::update`] was given since it was made or [`Xxh3_64::reset`].
pub struct Xxh3_64(twox_hash::xxhash3_64::RawHasher<&'static [u8; 192]>);

impl Xxh3_64 {
    /// A hasher that has seen nothing.
    pub fn new() -> Self {
        Xxh3_64(twox_hash::xxhash3_64::RawHasher::new(secret()))
    }
    /// Forgets what it has seen.
    pub fn reset(&mut self) {
        *self = Self::new();
    }
    /// Hashes the next piece.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
    }
    /// The digest of the pieces so far.
    pub fn digest(&self) -> u64 {
        self.0.finish()
    }
}

impl Default for Xxh3_64 {
    fn default() -> Self {
        Self::new()
    }
}

/// xxh3-128 of bytes that arrive in pieces (see [`Xxh3_64`]).
pub struct Xxh3_128(twox_hash::xxhash3_128::RawHasher<&'static [u8; 192]>);

impl Xxh3_128 {
    /// A hasher that has seen nothing.
    pub fn new() -> Self {
        Xxh3_128(twox_hash::xxhash3_128::RawHasher::new(secret()))
    }
    /// Hashes the next piece.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
    }
    /// The digest of the pieces so far.
    pub fn digest(&self) -> u128 {
        self.0.finish_128()
    }
}

impl Default for Xxh3_128 {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The specification's values for no input, and one byte (`xxhsum -H3`/`-H2`).
    #[test]
    fn known_values() {
        assert_eq!(xxh3_64(b""), 0x2D06_8005_38D3_94C2);
        assert_eq!(xxh3_128(b""), 0x99AA_06D3_0147_98D8_6001_C324_468D_497F);
        assert_eq!(xxh3_64(b"a"), 0xE6C6_32B6_1E96_4E1F);
    }

    /// Streamed in pieces of every size class (under a stripe, across the 240-byte and
    /// 1 024-byte boundaries, several blocks), both widths equal the one-shot hashes, and the
    /// 64-bit hash of an input over 240 bytes is the low half of the 128-bit one (the identity
    /// format 2.4's compact records rely on).
    #[test]
    fn streamed_equals_one_shot() {
        let data: Vec<u8> = (0..20_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        let mut h64 = Xxh3_64::new();
        for len in (0..600).chain([1023, 1024, 1025, 4096, 8191, 8192, 8193, 19_999]) {
            let input = &data[..len];
            for piece in [1usize, 7, 64, 255, 1000, 8192] {
                h64.reset();
                let mut h128 = Xxh3_128::new();
                for p in input.chunks(piece) {
                    h64.update(p);
                    h128.update(p);
                }
                assert_eq!(h64.digest(), xxh3_64(input), "64-bit, {len} bytes in pieces of {piece}");
                assert_eq!(h128.digest(), xxh3_128(input), "128-bit, {len} bytes in pieces of {piece}");
            }
            if len > 240 {
                assert_eq!(xxh3_64(input), xxh3_128(input) as u64, "{len} bytes");
            }
        }
    }
}
