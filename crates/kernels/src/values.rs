//! Test values: `len` numbers in [-1, 1) from a xorshift generator (candle's CPU RNG cannot be
//! seeded). One file for the kernel tests (`src/tests.rs`) and the bench, which includes it by
//! path (a bench cannot reach the library's `cfg(test)` items).

/// `len` values in [-1, 1), the same for one `seed` on every platform.
pub fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}
