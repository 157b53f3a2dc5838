// Summaries of a contiguous tensor on the device: the algorithm of crates/instrument/src/digest/device
// (mod.rs and xxh3_blocks.rs hold its CPU reference, tested against the CPU summary).
//
// A stream is a logical run of elements: `segs` runs of `seg` elements, run m starting at element
// `first + m * stride` (streams.rs). Stream descriptors are 4 u64 each. Kernels:
//   ct_block_deltas  one thread per full 1024-byte XXH3 block of any stream: the block's additive
//                    contribution to the 8 accumulators.
//   ct_lane_stats    one thread per (stream, lane k): f64 reductions over elements k, k+8, ... of
//                    the stream, in order, finite values only; NaN/+Inf/-Inf counted.
//   ct_finish        one thread per stream: the ordered fold of its block deltas, the tail, the
//                    merge (64-bit, or 128-bit for a stream flagged wide); lanes combined in order;
//                    a stream of at most 240 bytes copied out for the host to hash.
//   ct_gather        the raw bits of the elements at given offsets (samples; converted on the host).
// Sums use __dadd_rn/__dmul_rn so that nvcc does not fuse them into FMAs: the CPU rounds each.

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math_constants.h>

typedef unsigned long long u64;
typedef unsigned char u8;

#define MID_MAX 240
#define BLOCK_LEN 1024
#define STRIPE_LEN 64
#define STRIPES_PER_BLOCK 16
#define OUT_WORDS 10

__constant__ u8 SECRET[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

#define PRIME32_1 0x9E3779B1ULL
#define PRIME32_2 0x85EBCA77ULL
#define PRIME32_3 0xC2B2AE3DULL
#define PRIME64_1 0x9E3779B185EBCA87ULL
#define PRIME64_2 0xC2B2AE3D27D4EB4FULL
#define PRIME64_3 0x165667B19E3779F9ULL
#define PRIME64_4 0x85EBCA77C2B2AE63ULL
#define PRIME64_5 0x27D4EB2F165667C5ULL

struct Stream {
    u64 first, stride, seg, segs;
};

__device__ Stream stream_at(const u64* streams, int s) {
    Stream r;
    r.first = streams[4 * s];
    r.stride = streams[4 * s + 1];
    r.seg = streams[4 * s + 2];
    r.segs = streams[4 * s + 3];
    return r;
}

__device__ u64 elem_offset(const Stream& s, u64 i) {
    return s.first + (i / s.seg) * s.stride + i % s.seg;
}

__device__ u8 byte_at(const u8* data, const Stream& s, u64 esize, u64 j) {
    return data[elem_offset(s, j / esize) * esize + j % esize];
}

// The little-endian u64 at byte `at` of the stream.
__device__ u64 word_at(const u8* data, const Stream& s, u64 esize, u64 at) {
    u64 e0 = at / esize, e1 = (at + 7) / esize;
    u64 w = 0;
    if (e0 / s.seg == e1 / s.seg) {  // all 8 bytes in one run: consecutive in memory
        const u8* p = data + elem_offset(s, e0) * esize + at % esize;
        for (int j = 7; j >= 0; --j) w = (w << 8) | p[j];
    } else {
        for (int j = 7; j >= 0; --j) w = (w << 8) | byte_at(data, s, esize, at + j);
    }
    return w;
}

__device__ u64 secret64(int at) {
    u64 w = 0;
    for (int j = 7; j >= 0; --j) w = (w << 8) | SECRET[at + j];
    return w;
}

__device__ void stripe(u64* acc, const u8* data, const Stream& s, u64 esize, u64 at, int key) {
    for (int i = 0; i < 8; ++i) {
        u64 v = word_at(data, s, esize, at + 8 * i);
        u64 k = v ^ secret64(key + 8 * i);
        acc[i ^ 1] += v;
        acc[i] += (k & 0xFFFFFFFFULL) * (k >> 32);
    }
}

__device__ u64 avalanche(u64 h) {
    h ^= h >> 37;
    h *= 0x165667919E3779F9ULL;
    return h ^ (h >> 32);
}

__device__ u64 merge(const u64* acc, int key, u64 start) {
    u64 r = start;
    for (int i = 0; i < 4; ++i) {
        u64 a = acc[2 * i] ^ secret64(key + 16 * i);
        u64 b = acc[2 * i + 1] ^ secret64(key + 16 * i + 8);
        r += (a * b) ^ __umul64hi(a, b);
    }
    return avalanche(r);
}

// Finds the stream whose range [starts[s], starts[s+1]) holds g (starts has n + 1 entries).
__device__ int find_stream(const u64* starts, int n, u64 g) {
    int lo = 0, hi = n;  // starts[lo] <= g < starts[hi]
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (starts[mid] <= g) lo = mid; else hi = mid;
    }
    return lo;
}

__device__ double load(const u8* data, int dtype, u64 i) {
    switch (dtype) {
        case 0: return (double)((const float*)data)[i];
        case 1: return (double)__half2float(((const __half*)data)[i]);
        case 2: return (double)__bfloat162float(((const __nv_bfloat16*)data)[i]);
        default: return ((const double*)data)[i];
    }
}

extern "C" __global__ void ct_block_deltas(const u8* data, u64 esize, const u64* streams, int n_streams,
                                           const u64* block_starts, u64* deltas) {
    u64 g = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= block_starts[n_streams]) return;
    int si = find_stream(block_starts, n_streams, g);
    Stream s = stream_at(streams, si);
    u64 b = g - block_starts[si];
    u64 d[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = 0; k < STRIPES_PER_BLOCK; ++k) stripe(d, data, s, esize, b * BLOCK_LEN + k * STRIPE_LEN, k * 8);
    for (int i = 0; i < 8; ++i) deltas[8 * g + i] = d[i];
}

// lanes: per (stream, lane) 5 doubles: sum, sq, min, max, abs_max; counts: 3 u64: NaN, +Inf, -Inf.
extern "C" __global__ void ct_lane_stats(const u8* data, int dtype, const u64* streams, int n_streams,
                                         double* lanes, u64* counts) {
    u64 g = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= (u64)n_streams * 8) return;
    Stream s = stream_at(streams, (int)(g / 8));
    double sum = 0.0, sq = 0.0, mn = CUDART_INF, mx = -CUDART_INF, am = 0.0;
    u64 nan = 0, pinf = 0, ninf = 0;
    u64 n = s.seg * s.segs;
    for (u64 i = g % 8; i < n; i += 8) {
        double v = load(data, dtype, s.segs == 1 ? s.first + i : elem_offset(s, i));
        if (isfinite(v)) {
            sum = __dadd_rn(sum, v);
            sq = __dadd_rn(sq, __dmul_rn(v, v));
            mn = fmin(mn, v);
            mx = fmax(mx, v);
            am = fmax(am, fabs(v));
        } else if (isnan(v)) {
            nan++;
        } else if (v > 0) {
            pinf++;
        } else {
            ninf++;
        }
    }
    double* l = lanes + 5 * g;
    l[0] = sum; l[1] = sq; l[2] = mn; l[3] = mx; l[4] = am;
    counts[3 * g] = nan; counts[3 * g + 1] = pinf; counts[3 * g + 2] = ninf;
}

// out: per stream OUT_WORDS u64: digest low, digest high, then the bits of sum, sum of squares,
// min, max, abs_max, then NaN, +Inf, -Inf counts. Stream 0 takes the 128-bit digest when wide0.
extern "C" __global__ void ct_finish(const u8* data, u64 esize, const u64* streams, int n_streams, int wide0,
                                     const u64* block_starts, const u64* deltas, const double* lanes,
                                     const u64* counts, u64* out, u8* short_bytes) {
    int si = blockIdx.x * blockDim.x + threadIdx.x;
    if (si >= n_streams) return;
    Stream s = stream_at(streams, si);
    u64 len = s.seg * s.segs * esize;
    u64 lo = 0, hi = 0;
    if (len <= MID_MAX) {
        for (u64 j = 0; j < len; ++j) short_bytes[(u64)si * MID_MAX + j] = byte_at(data, s, esize, j);
    } else {
        u64 acc[8] = {PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1};
        u64 nb = (len - 1) / BLOCK_LEN;
        const u64* d = deltas + 8 * block_starts[si];
        for (u64 b = 0; b < nb; ++b) {
            for (int i = 0; i < 8; ++i) {
                u64 a = acc[i] + d[8 * b + i];
                a ^= a >> 47;
                a ^= secret64(192 - STRIPE_LEN + 8 * i);
                acc[i] = a * PRIME32_1;
            }
        }
        u64 stripes = ((len - 1) - nb * BLOCK_LEN) / STRIPE_LEN;
        for (u64 k = 0; k < stripes; ++k) stripe(acc, data, s, esize, nb * BLOCK_LEN + k * STRIPE_LEN, (int)k * 8);
        stripe(acc, data, s, esize, len - STRIPE_LEN, 192 - STRIPE_LEN - 7);
        lo = merge(acc, 11, len * PRIME64_1);
        if (si == 0 && wide0) hi = merge(acc, 192 - STRIPE_LEN - 11, ~(len * PRIME64_2));
    }
    const double* l = lanes + 40 * (u64)si;
    const u64* c = counts + 24 * (u64)si;
    double sum = -0.0, sq = -0.0, mn = CUDART_INF, mx = -CUDART_INF, am = 0.0;
    u64 nan = 0, pinf = 0, ninf = 0;
    for (int k = 0; k < 8; ++k) {
        sum = __dadd_rn(sum, l[5 * k]);
        sq = __dadd_rn(sq, l[5 * k + 1]);
        mn = fmin(mn, l[5 * k + 2]);
        mx = fmax(mx, l[5 * k + 3]);
        am = fmax(am, l[5 * k + 4]);
        nan += c[3 * k]; pinf += c[3 * k + 1]; ninf += c[3 * k + 2];
    }
    u64* o = out + OUT_WORDS * (u64)si;
    o[0] = lo; o[1] = hi;
    o[2] = __double_as_longlong(sum); o[3] = __double_as_longlong(sq);
    o[4] = __double_as_longlong(mn); o[5] = __double_as_longlong(mx); o[6] = __double_as_longlong(am);
    o[7] = nan; o[8] = pinf; o[9] = ninf;
}

// The raw bits of each sampled element (little-endian, zero-extended): the host converts them as
// the CPU summary does, so a NaN keeps its sign and payload (the GPU's conversions would not).
extern "C" __global__ void ct_gather(const u8* data, u64 esize, const u64* offsets, int n, u64* out) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    u64 w = 0;
    for (int j = (int)esize - 1; j >= 0; --j) w = (w << 8) | data[offsets[i] * esize + j];
    out[i] = w;
}
