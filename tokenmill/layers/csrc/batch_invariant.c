/* Batch-invariant CPU kernels: linear (y = x W^T + b) and RMSNorm, for every ISA path.
 *
 * Layouts (row-major, contiguous; bf16 passed as its uint16 bits, accumulation always float32):
 *   linear   x [M, K], W [N, K] (nn.Linear layout), bias [N] or NULL, y [M, N]
 *            (x, W and bias share a dtype; y is that dtype or float32: see bi_linear_bf16_f32out)
 *   rms_norm x [M, H], weight [H], y [M, H]
 *
 * The canonical order. y[m, n] is one fixed sequence of float32 operations that reads only x[m, :],
 * W[n, :] and bias[n]:
 *   1. 16 partial sums p[0..15], all +0 at first. For k = 0, 1, ... in steps of 16, lane c does
 *      p[c] = fma(x[k + c], W[n, k + c], p[c]); lanes past K use x = W = 0.
 *   2. A fixed tree: p[c] += p[c + 8] (c < 8), then += p[c + 4] (c < 4), += p[c + 2], += p[c + 1].
 *   3. The bias is added in float32, then one rounding (to nearest even) to the output dtype.
 * The portable, AVX2, AVX-512 (float32, and bf16 without AVX512_BF16) and NEON paths all compute
 * exactly this, so their bits are equal; where a register holds the lanes in another arrangement
 * (bf16 on AVX2/NEON: even k in one register, odd k in another) the tree is applied in canonical
 * lane numbers. The AVX512_BF16 path instead adds 32 products per step with vdpbf16ps
 * (lane i += x[2i] w[2i] + x[2i+1] w[2i+1], its own rounding and denormal flushing): invariant for
 * the same reason, but its bits differ from the other paths. K is never split, OpenMP threads split
 * the columns N (each column computed by one thread), and register tiles decide only which of these
 * sequences share a loop, so neither M, the row's position, the other rows nor the thread count can
 * change a bit of y[m, n]. Built without -ffast-math and with -ffp-contract=off so the compiler
 * cannot reassociate or fuse anything.
 *
 * RMSNorm (one row per task): the sum of squares in the same 16-lane order and tree (fma(v, v, p)),
 * r = 1 / sqrtf(sum / H + eps); y = round(x * r) to x's dtype, then round(y * weight) (torch's
 * order). Bit-equal on every path.
 *
 * Blocking: each thread owns a contiguous range of 16-column blocks of W. Rows of x go in chunks
 * that fit in L2 (decode-sized M is one chunk, so W streams from memory exactly once per call).
 * Inside a chunk, a few columns of W stay in L1 while every row tile passes over them.
 * Built at run time by tokenmill/layers/batch_invariant.py; csrc_build.py picks the ISA path.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define INLINE static inline __attribute__((always_inline))

#if defined(TM_PORTABLE)
#define PATH_PORTABLE 1
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define PATH_AVX512 1
#include <immintrin.h>
#if defined(__AVX512BF16__)
#define HAVE_AVX512_BF16 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define PATH_AVX2 1
#include <immintrin.h>
#elif defined(__ARM_NEON)
#define PATH_NEON 1
#include <arm_neon.h>
#else
#define PATH_PORTABLE 1
#endif

/* Tuning knobs (none changes a result bit); measured on Zen 4, 1 MiB L2 per core. */
#define BLOCK_N 16 /* columns per block: the unit of work split between threads */
#ifndef CHUNK_BYTES
#define CHUNK_BYTES (256 * 1024) /* x rows per chunk: as many as fit in this many bytes ... */
#endif
#define DECODE_ROWS 64 /* ... but at least this many */
#ifndef PF_HINT
#define PF_HINT 2 /* AVX-512: software prefetch of W into L2 (_MM_HINT_T1); -1: none */
#endif
#ifndef PF_AHEAD
#define PF_AHEAD 2 /* prefetch distance in tiles (of C rows of W) */
#endif
#define MIN_PARALLEL_MACS (1 << 18) /* below this many multiply-adds, one thread */

/* One linear call. xp/kp: x converted to float32 and zero-padded to kp (a multiple of 16) columns,
 * in the lane order the path's registers use (prepare_x); NULL where the path reads x directly. */
typedef struct {
    const void *x, *w;
    const float *bias; /* float32, zero-padded to whole column blocks, or NULL */
    void *y;
    int in_bf16, out_bf16;
    int64_t M, N, K;
    const float *xp;
    int64_t kp;
} linear_args;

INLINE float load_elt(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE void store_out(const linear_args *a, int64_t m, int64_t n, float dot) {
    float v = a->bias ? dot + a->bias[n] : dot;
    if (a->out_bf16) ((uint16_t *)a->y)[m * a->N + n] = f32_to_bf16(v);
    else ((float *)a->y)[m * a->N + n] = v;
}

/* Rows of x per chunk: as many as fit in CHUNK_BYTES, but at least DECODE_ROWS so that a
 * decode-sized batch is one chunk and W streams from memory once. */
static int64_t chunk_rows(int64_t K, int64_t elt) {
    int64_t rows = CHUNK_BYTES / (K * elt + 1);
    rows &= ~(int64_t)3;
    return rows < DECODE_ROWS ? DECODE_ROWS : rows;
}

/* Bias as float32, zero-padded to whole column blocks (so tiles can load it unmasked). */
static float *bias_f32(const void *bias, int is_bf16, int64_t N) {
    if (bias == NULL) return NULL;
    int64_t padded = (N + BLOCK_N - 1) / BLOCK_N * BLOCK_N;
    float *out = (float *)calloc((size_t)padded, sizeof(float));
    for (int64_t n = 0; n < N; n++) out[n] = load_elt(bias, n, is_bf16);
    return out;
}

/* ---------------------------------------------------------------- the canonical order in plain C */

/* Steps 1-2 for one row pair, any dtype (also the reference the SIMD paths are tested against). */
__attribute__((unused)) static float dot_canonical(const void *x, const void *w, int64_t K, int is_bf16) {
    float p[16] = {0};
    for (int64_t k0 = 0; k0 < K; k0 += 16)
        for (int c = 0; c < 16; c++) {
            int64_t k = k0 + c;
            float xv = k < K ? load_elt(x, k, is_bf16) : 0.0f, wv = k < K ? load_elt(w, k, is_bf16) : 0.0f;
            p[c] = fmaf(xv, wv, p[c]);
        }
    for (int s = 8; s >= 1; s /= 2)
        for (int c = 0; c < s; c++) p[c] += p[c + s];
    return p[0];
}

/* RMSNorm of one row in the canonical order (every path but AVX-512 runs this; with -mfma or on
 * aarch64 fmaf is one instruction). */
__attribute__((unused)) static void rms_norm_row_canonical(const void *x, const void *w, void *y, int is_bf16,
                                                           int64_t H, float eps) {
    float p[16] = {0};
    for (int64_t h0 = 0; h0 < H; h0 += 16)
        for (int c = 0; c < 16; c++) {
            float v = h0 + c < H ? load_elt(x, h0 + c, is_bf16) : 0.0f;
            p[c] = fmaf(v, v, p[c]);
        }
    for (int s = 8; s >= 1; s /= 2)
        for (int c = 0; c < s; c++) p[c] += p[c + s];
    float r = 1.0f / sqrtf(p[0] / (float)H + eps);
    if (is_bf16) {
        const uint16_t *xs = (const uint16_t *)x, *ws = (const uint16_t *)w;
        uint16_t *ys = (uint16_t *)y;
        for (int64_t h = 0; h < H; h++)
            ys[h] = f32_to_bf16(bf16_to_f32(f32_to_bf16(bf16_to_f32(xs[h]) * r)) * bf16_to_f32(ws[h]));
    } else {
        const float *xs = (const float *)x, *ws = (const float *)w;
        float *ys = (float *)y;
        for (int64_t h = 0; h < H; h++) ys[h] = (xs[h] * r) * ws[h];
    }
}

/* ---------------------------------------------------------------- portable */
#if defined(PATH_PORTABLE)
#define PREPARE_X 0
static void linear_cols(const linear_args *a, int64_t m0, int64_t m1, int64_t n0, int64_t n1, void **pad) {
    (void)pad;
    int64_t elt = a->in_bf16 ? 2 : 4;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = m0; m < m1; m++)
            store_out(a, m, n, dot_canonical((const char *)a->x + m * a->K * elt, (const char *)a->w + n * a->K * elt,
                                             a->K, a->in_bf16));
}
#define rms_norm_row rms_norm_row_canonical
#endif

/* ---------------------------------------------------------------- AVX2 + FMA and NEON: x prepared */
#if defined(PATH_AVX2) || defined(PATH_NEON)
#define PREPARE_X 1
/* Registers hold a 16-lane step of bf16 W as even k (bits << 16) and odd k (bits & 0xffff0000),
 * so x rows are stored per 16-step as [x0 x2 .. x14 | x1 x3 .. x15]; float32 W loads in order. */
static void prepare_x(const void *x, int is_bf16, int64_t m0, int64_t m1, int64_t K, int64_t kp, float *xp) {
    for (int64_t m = m0; m < m1; m++) {
        float *row = xp + (m - m0) * kp;
        for (int64_t k0 = 0; k0 < kp; k0 += 16)
            for (int c = 0; c < 16; c++) {
                int64_t k = k0 + c;
                int slot = is_bf16 ? (c % 2) * 8 + c / 2 : c;
                row[k0 + slot] = k < K ? load_elt(x, m * K + k, is_bf16) : 0.0f;
            }
    }
}
#endif

#if defined(PATH_AVX2)
/* Canonical lanes 8h .. 8h + 7 in one __m256 (float32) or the even / odd lanes (bf16). */
typedef struct { __m256 a, b; } acc16;

/* Lanes (i, i+4), then (i, i+2), then (i, i+1): the tree's last three levels on 8 lanes. */
INLINE float r8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

/* float32: level 1 adds lanes c and c + 8 (a + b). bf16: level 1..3 run inside the even and the odd
 * register (canonical c and c + 8 are lanes i and i + 4 of the same register), level 4 adds them. */
INLINE float reduce_acc(acc16 v, int w_bf16) { return w_bf16 ? r8(v.a) + r8(v.b) : r8(_mm256_add_ps(v.a, v.b)); }

INLINE acc16 load_w(const void *w, int64_t k, int w_bf16) {
    acc16 r;
    if (w_bf16) {
        __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k));
        r.a = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        r.b = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
    } else {
        r.a = _mm256_loadu_ps((const float *)w + k);
        r.b = _mm256_loadu_ps((const float *)w + k + 8);
    }
    return r;
}

/* R x C outputs (R * C <= 4): rows xp (stride kp) against columns w (stride K). */
INLINE void tile(const float *xp, int64_t kp, const void *w, int64_t K, int w_bf16, int R, int C, float *out) {
    acc16 acc[4];
    for (int i = 0; i < 4; i++) acc[i].a = acc[i].b = _mm256_setzero_ps();
    int64_t elt = w_bf16 ? 2 : 4, kfull = K / 16 * 16;
    for (int64_t k = 0; k < kp; k += 16) {
        acc16 xv[4];
        for (int r = 0; r < R; r++) {
            xv[r].a = _mm256_loadu_ps(xp + r * kp + k);
            xv[r].b = _mm256_loadu_ps(xp + r * kp + k + 8);
        }
        for (int c = 0; c < C; c++) {
            const char *wc = (const char *)w + c * K * elt;
            acc16 wv;
#if PF_HINT >= 0
            _mm_prefetch(wc + (PF_AHEAD * C * K + k) * elt, PF_HINT);
#endif
            if (k < kfull) {
                wv = load_w(wc, k, w_bf16);
            } else { /* the last, partial step: lanes past K are zeros */
                _Alignas(32) char tail[64] = {0};
                memcpy(tail, wc + k * elt, (size_t)((K - k) * elt));
                wv = load_w(tail, 0, w_bf16);
            }
            for (int r = 0; r < R; r++) {
                acc[r * C + c].a = _mm256_fmadd_ps(xv[r].a, wv.a, acc[r * C + c].a);
                acc[r * C + c].b = _mm256_fmadd_ps(xv[r].b, wv.b, acc[r * C + c].b);
            }
        }
    }
    for (int i = 0; i < R * C; i++) out[i] = reduce_acc(acc[i], w_bf16);
}
#endif

#if defined(PATH_NEON)
/* Canonical lanes in four float32x4: float32 a0 = k 0..3, a1 = 4..7, b0 = 8..11, b1 = 12..15; bf16
 * a0/a1 = even k (0..6, 8..14), b0/b1 = odd k. */
typedef struct { float32x4_t a0, a1, b0, b1; } acc16;

/* Lanes (0, 2) and (1, 3), then the two sums. */
INLINE float r4(float32x4_t v) {
    float32x2_t s = vadd_f32(vget_low_f32(v), vget_high_f32(v));
    return vget_lane_f32(s, 0) + vget_lane_f32(s, 1);
}

/* float32: level 1 (c, c + 8) is a0 + b0 and a1 + b1, level 2 (c, c + 4) adds those; r4 does levels
 * 3-4. bf16: level 1 (c, c + 8) is a0 + a1 (even) and b0 + b1 (odd); r4 does levels 2-3; level 4
 * adds even and odd. */
INLINE float reduce_acc(acc16 v, int w_bf16) {
    if (w_bf16) return r4(vaddq_f32(v.a0, v.a1)) + r4(vaddq_f32(v.b0, v.b1));
    return r4(vaddq_f32(vaddq_f32(v.a0, v.b0), vaddq_f32(v.a1, v.b1)));
}

INLINE acc16 load_w(const void *w, int64_t k, int w_bf16) {
    acc16 r;
    if (w_bf16) {
        const uint32_t *p = (const uint32_t *)((const uint16_t *)w + k);
        uint32x4_t lo = vld1q_u32(p), hi = vld1q_u32(p + 4), mask = vdupq_n_u32(0xffff0000u);
        r.a0 = vreinterpretq_f32_u32(vshlq_n_u32(lo, 16));
        r.a1 = vreinterpretq_f32_u32(vshlq_n_u32(hi, 16));
        r.b0 = vreinterpretq_f32_u32(vandq_u32(lo, mask));
        r.b1 = vreinterpretq_f32_u32(vandq_u32(hi, mask));
    } else {
        const float *p = (const float *)w + k;
        r.a0 = vld1q_f32(p), r.a1 = vld1q_f32(p + 4), r.b0 = vld1q_f32(p + 8), r.b1 = vld1q_f32(p + 12);
    }
    return r;
}

INLINE void tile(const float *xp, int64_t kp, const void *w, int64_t K, int w_bf16, int R, int C, float *out) {
    acc16 acc[4];
    for (int i = 0; i < 4; i++) acc[i].a0 = acc[i].a1 = acc[i].b0 = acc[i].b1 = vdupq_n_f32(0.0f);
    int64_t elt = w_bf16 ? 2 : 4, kfull = K / 16 * 16;
    for (int64_t k = 0; k < kp; k += 16) {
        acc16 xv[4];
        for (int r = 0; r < R; r++) { /* prepared layout: a0 a1 b0 b1 in memory order */
            const float *p = xp + r * kp + k;
            xv[r].a0 = vld1q_f32(p), xv[r].a1 = vld1q_f32(p + 4), xv[r].b0 = vld1q_f32(p + 8), xv[r].b1 = vld1q_f32(p + 12);
        }
        for (int c = 0; c < C; c++) {
            const char *wc = (const char *)w + c * K * elt;
            acc16 wv;
            if (k < kfull) {
                wv = load_w(wc, k, w_bf16);
            } else {
                _Alignas(16) char tail[64] = {0};
                memcpy(tail, wc + k * elt, (size_t)((K - k) * elt));
                wv = load_w(tail, 0, w_bf16);
            }
            for (int r = 0; r < R; r++) {
                acc16 *o = &acc[r * C + c];
                o->a0 = vfmaq_f32(o->a0, xv[r].a0, wv.a0);
                o->a1 = vfmaq_f32(o->a1, xv[r].a1, wv.a1);
                o->b0 = vfmaq_f32(o->b0, xv[r].b0, wv.b0);
                o->b1 = vfmaq_f32(o->b1, xv[r].b1, wv.b1);
            }
        }
    }
    for (int i = 0; i < R * C; i++) out[i] = reduce_acc(acc[i], w_bf16);
}
#endif

#if defined(PATH_AVX2) || defined(PATH_NEON)
/* Columns [n0, n1) in groups of 4 against rows [m0, m1): 2 x 2 tiles for row pairs, 1 x 4 for a last
 * odd row (8 independent accumulators either way). xp holds rows m0.. (prepared). */
INLINE void cols_dtype(const linear_args *a, int w_bf16, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    int64_t elt = w_bf16 ? 2 : 4, K = a->K, kp = a->kp;
    float out[4];
    for (int64_t n = n0; n < n1; n += 4) {
        int nc = n1 - n < 4 ? (int)(n1 - n) : 4;
        const char *wn = (const char *)a->w + n * K * elt;
        int64_t m = m0;
        for (; m + 2 <= m1; m += 2)
            for (int c0 = 0; c0 < nc; c0 += 2) {
                int C = nc - c0 < 2 ? 1 : 2;
                const float *xr = a->xp + (m - m0) * kp;
                if (C == 2) tile(xr, kp, wn + c0 * K * elt, K, w_bf16, 2, 2, out);
                else tile(xr, kp, wn + c0 * K * elt, K, w_bf16, 2, 1, out);
                for (int r = 0; r < 2; r++)
                    for (int c = 0; c < C; c++) store_out(a, m + r, n + c0 + c, out[r * C + c]);
            }
        if (m < m1) {
            const float *xr = a->xp + (m - m0) * kp;
            switch (nc) { /* constant tile shapes, so the accumulators stay in registers */
            case 4: tile(xr, kp, wn, K, w_bf16, 1, 4, out); break;
            case 3: tile(xr, kp, wn, K, w_bf16, 1, 3, out); break;
            case 2: tile(xr, kp, wn, K, w_bf16, 1, 2, out); break;
            default: tile(xr, kp, wn, K, w_bf16, 1, 1, out); break;
            }
            for (int c = 0; c < nc; c++) store_out(a, m, n + c, out[c]);
        }
    }
}

static void linear_cols(const linear_args *a, int64_t m0, int64_t m1, int64_t n0, int64_t n1, void **pad) {
    (void)pad;
    if (a->in_bf16) cols_dtype(a, 1, m0, m1, n0, n1);
    else cols_dtype(a, 0, m0, m1, n0, n1);
}
#define rms_norm_row rms_norm_row_canonical
#endif

/* ---------------------------------------------------------------- AVX-512 */
#if defined(PATH_AVX512)
#define PREPARE_X 0

/* Lane L of the result is the fixed-tree sum of the 16 lanes of v[L]. Internally slot s carries
 * v[4 * (s % 4) + s / 4]; after the four transposing levels lane 4j + t holds slot 4t + j, which is
 * v[4j + t] = v[L]. Every level adds lane pairs of one accumulator only: (i, i+8), (i, i+4), (i, i+2), (i, i+1). */
INLINE __m512 reduce16(const __m512 *v) {
    __m512 s1[8], s2[4], s3[2];
    for (int p = 0; p < 8; p++) {
        int sa = 2 * p, sb = 2 * p + 1;
        __m512 a = v[4 * (sa % 4) + sa / 4], b = v[4 * (sb % 4) + sb / 4];
        /* lanes 0-7: a[i] + a[i+8]; lanes 8-15: b[i] + b[i+8] */
        s1[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    }
    for (int q = 0; q < 4; q++) /* 128-bit block j: (i, i+4) sums of slot 4q + j */
        s2[q] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * q], s1[2 * q + 1], 0x88),
                              _mm512_shuffle_f32x4(s1[2 * q], s1[2 * q + 1], 0xDD));
    for (int r = 0; r < 2; r++) { /* block j: (i, i+2) sums of slots 8r + j (lanes 0-1) and 8r + 4 + j (lanes 2-3) */
        __m512d u = _mm512_castps_pd(s2[2 * r]), w = _mm512_castps_pd(s2[2 * r + 1]);
        s3[r] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(u, w)), _mm512_castpd_ps(_mm512_unpackhi_pd(u, w)));
    }
    /* block j: (i, i+1) sums of slots j, 4 + j, 8 + j, 12 + j */
    return _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], 0x88), _mm512_shuffle_ps(s3[0], s3[1], 0xDD));
}

/* The same tree for one vector (RMSNorm). */
INLINE float reduce1(__m512 v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

INLINE __m512 bf16x16_to_f32(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

INLINE __m256i f32x16_to_bf16(__m512 f) { /* the same rounding as f32_to_bf16 */
    __m512i u = _mm512_castps_si512(f);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
}

/* Bias for a tile with C columns: lane r * C + c gets bias[c]. */
INLINE __m512 tile_bias(const float *b, int C) {
    if (C == 4) return _mm512_broadcast_f32x4(_mm_loadu_ps(b));
    if (C == 8) return _mm512_broadcast_f32x8(_mm256_loadu_ps(b));
    return _mm512_loadu_ps(b);
}

/* Write tile result t (lane r * C + c = y[r, c]) for nrows x ncols valid outputs. */
INLINE void store_tile(__m512 t, const float *bias, void *y, int out_bf16, int64_t ldy, int R, int C, int nrows, int ncols) {
    if (bias) t = _mm512_add_ps(t, tile_bias(bias, C));
    if (ncols == C) {
        if (out_bf16) {
            __m256i h = f32x16_to_bf16(t);
            for (int r = 0; r < R && r < nrows; r++) /* lanes rC .. rC + C - 1 land at row r, columns 0 .. C - 1 */
                _mm256_mask_storeu_epi16((uint16_t *)y + r * ldy - r * C, (__mmask16)(((1u << C) - 1) << (r * C)), h);
        } else {
            for (int r = 0; r < R && r < nrows; r++)
                _mm512_mask_storeu_ps((float *)y + r * ldy - r * C, (__mmask16)(((1u << C) - 1) << (r * C)), t);
        }
        return;
    }
    float tmp[16];
    uint16_t tmp16[16];
    _mm512_storeu_ps(tmp, t);
    _mm256_storeu_si256((__m256i *)tmp16, f32x16_to_bf16(t));
    for (int r = 0; r < R && r < nrows; r++) {
        if (out_bf16) memcpy((uint16_t *)y + r * ldy, tmp16 + r * C, (size_t)ncols * 2);
        else memcpy((float *)y + r * ldy, tmp + r * C, (size_t)ncols * 4);
    }
}

/* x rows as 16 floats at k: float32 loads them, bf16 widens 16 bf16 (the canonical lane order). */
INLINE __m512 load16(const void *p, int64_t k, int is_bf16, __mmask16 mask) {
    if (is_bf16) return bf16x16_to_f32(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)p + k));
    return _mm512_maskz_loadu_ps(mask, (const float *)p + k);
}

/* R x C canonical-order dot products (R * C == 16) with FMA: float32, or bf16 widened to float32. */
INLINE __m512 tile_fma(const void *x, int64_t ldx, const void *w, int64_t ldw, int64_t K, int R, int C, int is_bf16) {
    __m512 acc[16];
    int64_t elt = is_bf16 ? 2 : 4;
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __mmask16 mask = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);
#if PF_HINT >= 0
        for (int c = 0; c < C; c++) _mm_prefetch((const char *)w + ((PF_AHEAD * C + c) * ldw + k) * elt, PF_HINT);
#endif
        __m512 xv[4];
        for (int r = 0; r < R; r++) xv[r] = load16((const char *)x + r * ldx * elt, k, is_bf16, mask);
        for (int c = 0; c < C; c++) {
            __m512 wv = load16((const char *)w + c * ldw * elt, k, is_bf16, mask);
            for (int r = 0; r < R; r++) acc[r * C + c] = _mm512_fmadd_ps(xv[r], wv, acc[r * C + c]);
        }
    }
    return reduce16(acc);
}
INLINE __m512 tile_f32(const float *x, int64_t ldx, const float *w, int64_t ldw, int64_t K, int R, int C) {
    return tile_fma(x, ldx, w, ldw, K, R, C, 0);
}

#if defined(HAVE_AVX512_BF16)
/* R x C dot products (R * C == 16) of bf16 rows x[r] (stride ldx) and w[c] (stride ldw), vdpbf16ps. */
INLINE __m512 tile_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw, int64_t K, int R, int C) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
#if PF_HINT >= 0
        for (int c = 0; c < C; c++) _mm_prefetch((const char *)(w + (PF_AHEAD * C + c) * ldw + k), PF_HINT);
#endif
        __m512bh xv[4];
        for (int r = 0; r < R; r++) xv[r] = (__m512bh)_mm512_loadu_si512(x + r * ldx + k);
        for (int c = 0; c < C; c++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(w + c * ldw + k);
            for (int r = 0; r < R; r++) acc[r * C + c] = _mm512_dpbf16_ps(acc[r * C + c], xv[r], wv);
        }
    }
    if (k < K) {
        __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);
        __m512bh xv[4];
        for (int r = 0; r < R; r++) xv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + r * ldx + k);
        for (int c = 0; c < C; c++) {
            __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + c * ldw + k);
            for (int r = 0; r < R; r++) acc[r * C + c] = _mm512_dpbf16_ps(acc[r * C + c], xv[r], wv);
        }
    }
    return reduce16(acc);
}
#else
INLINE __m512 tile_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw, int64_t K, int R, int C) {
    return tile_fma(x, ldx, w, ldw, K, R, C, 1);
}
#endif

/* One column block (BLOCK_N columns at n0, ncols valid; w points at its first row, padded to
 * BLOCK_N rows) against rows [m0, m1). */
#define DEFINE_BLOCK(NAME, T, TILE)                                                                      \
    static void NAME(const T *x, const T *w, const float *bias, void *y, int out_bf16, int64_t m0,       \
                     int64_t m1, int64_t N, int64_t K, int64_t n0, int ncols) {                          \
        int64_t m4 = m0 + (m1 - m0) / 4 * 4, oe = out_bf16 ? 2 : 4;                                      \
        char *yb = (char *)y;                                                                            \
        for (int c0 = 0; c0 < ncols; c0 += 4) {                                                          \
            int nc = ncols - c0 < 4 ? ncols - c0 : 4;                                                    \
            for (int64_t m = m0; m < m4; m += 4)                                                         \
                store_tile(TILE(x + m * K, K, w + c0 * K, K, K, 4, 4), bias ? bias + n0 + c0 : NULL,       \
                           yb + (m * N + n0 + c0) * oe, out_bf16, N, 4, 4, 4, nc);                       \
        }                                                                                                \
        int64_t m = m4;                                                                                  \
        if (m1 - m >= 2) {                                                                               \
            for (int c0 = 0; c0 < ncols; c0 += 8) {                                                      \
                int nc = ncols - c0 < 8 ? ncols - c0 : 8;                                                \
                store_tile(TILE(x + m * K, K, w + c0 * K, K, K, 2, 8), bias ? bias + n0 + c0 : NULL,       \
                           yb + (m * N + n0 + c0) * oe, out_bf16, N, 2, 8, 2, nc);                       \
            }                                                                                            \
            m += 2;                                                                                      \
        }                                                                                                \
        if (m < m1)                                                                                      \
            store_tile(TILE(x + m * K, K, w, K, K, 1, 16), bias ? bias + n0 : NULL, yb + (m * N + n0) * oe, \
                       out_bf16, N, 1, 16, 1, ncols);                                                    \
    }

DEFINE_BLOCK(block_bf16, uint16_t, tile_bf16)
DEFINE_BLOCK(block_f32, float, tile_f32)

/* Column blocks of [n0, n1) (n0 a multiple of BLOCK_N) against rows [m0, m1). *pad is this thread's
 * scratch for the last, partial block, copied into BLOCK_N zero-padded rows on first use. */
static void linear_cols(const linear_args *a, int64_t m0, int64_t m1, int64_t n0, int64_t n1, void **pad) {
    int64_t elt = a->in_bf16 ? 2 : 4, K = a->K;
    for (int64_t nb = n0; nb < n1; nb += BLOCK_N) {
        int ncols = n1 - nb < BLOCK_N ? (int)(n1 - nb) : BLOCK_N;
        const char *wb = (const char *)a->w + nb * K * elt;
        if (ncols < BLOCK_N) {
            if (*pad == NULL) {
                *pad = calloc((size_t)(BLOCK_N * K + 64), (size_t)elt);
                memcpy(*pad, wb, (size_t)(ncols * K * elt));
            }
            wb = (const char *)*pad;
        }
        if (a->in_bf16)
            block_bf16((const uint16_t *)a->x, (const uint16_t *)wb, a->bias, a->y, a->out_bf16, m0, m1, a->N, K, nb, ncols);
        else
            block_f32((const float *)a->x, (const float *)wb, a->bias, a->y, a->out_bf16, m0, m1, a->N, K, nb, ncols);
    }
}

static void rms_norm_row(const void *x, const void *w, void *y, int is_bf16, int64_t H, float eps) {
    __m512 acc = _mm512_setzero_ps();
    int64_t h = 0;
    for (; h < H; h += 16) {
        __mmask16 mask = H - h >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (H - h)) - 1);
        __m512 v = load16(x, h, is_bf16, mask);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    __m512 r = _mm512_set1_ps(1.0f / sqrtf(reduce1(acc) / (float)H + eps));
    for (h = 0; h < H; h += 16) {
        __mmask16 mask = H - h >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (H - h)) - 1);
        if (is_bf16) {
            __m512 v = bf16x16_to_f32(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)x + h));
            __m512 n = bf16x16_to_f32(f32x16_to_bf16(_mm512_mul_ps(v, r)));
            __m512 g = bf16x16_to_f32(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)w + h));
            _mm256_mask_storeu_epi16((uint16_t *)y + h, mask, f32x16_to_bf16(_mm512_mul_ps(n, g)));
        } else {
            __m512 v = _mm512_maskz_loadu_ps(mask, (const float *)x + h);
            __m512 g = _mm512_maskz_loadu_ps(mask, (const float *)w + h);
            _mm512_mask_storeu_ps((float *)y + h, mask, _mm512_mul_ps(_mm512_mul_ps(v, r), g));
        }
    }
}
#endif /* AVX-512 */

/* ---------------------------------------------------------------- driver */

#if PREPARE_X
/* This calling thread's buffer for prepared x (grown as needed, kept between calls). */
static __thread float *xp_buf = NULL;
static __thread int64_t xp_cap = 0;

static float *xp_scratch(int64_t n) {
    if (n > xp_cap) {
        free(xp_buf);
        xp_buf = (float *)aligned_alloc(64, (size_t)((n + 15) / 16 * 16) * sizeof(float));
        xp_cap = xp_buf ? (n + 15) / 16 * 16 : 0;
    }
    return xp_buf;
}
#endif

static void linear(const void *x, const void *w, const void *bias, void *y, int in_bf16, int out_bf16, int64_t M,
                   int64_t N, int64_t K, int num_threads) {
    if (M <= 0 || N <= 0) return;
    if (num_threads < 1) num_threads = 1;
    linear_args a = {x, w, bias_f32(bias, in_bf16, N), y, in_bf16, out_bf16, M, N, K, NULL, (K + 15) / 16 * 16};
    int64_t mc = chunk_rows(K, PREPARE_X ? 4 : (in_bf16 ? 2 : 4));
    int64_t num_blocks = (N + BLOCK_N - 1) / BLOCK_N;
    int parallel = num_threads > 1 && M * N * K >= MIN_PARALLEL_MACS && num_blocks > 1;
#if PREPARE_X
    float *xp = xp_scratch((mc < M ? mc : M) * a.kp);
    if (xp == NULL) abort();
#endif
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
        int64_t m1 = m0 + mc < M ? m0 + mc : M;
#if PREPARE_X
        prepare_x(x, in_bf16, m0, m1, K, a.kp, xp);
        a.xp = xp;
#endif
#pragma omp parallel num_threads(num_threads) if (parallel)
        {
            void *pad = NULL;
            /* each thread a contiguous range of blocks, the same for every row chunk (stays in its L2) */
            int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
            int64_t n0 = num_blocks * t / T * BLOCK_N, n1 = num_blocks * (t + 1) / T * BLOCK_N;
            if (n1 > N) n1 = N;
            if (n0 < n1) linear_cols(&a, m0, m1, n0, n1, &pad);
            free(pad);
        }
    }
    free((void *)a.bias);
}

void bi_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M, int64_t N,
                    int64_t K, int num_threads) {
    linear(x, w, bias, y, 1, 1, M, N, K, num_threads);
}

/* bf16 x, W and bias; float32 y: the accumulated sums plus bias, never rounded to bf16 (logits). */
void bi_linear_bf16_f32out(const uint16_t *x, const uint16_t *w, const uint16_t *bias, float *y, int64_t M, int64_t N,
                           int64_t K, int num_threads) {
    linear(x, w, bias, y, 1, 0, M, N, K, num_threads);
}

void bi_linear_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                   int num_threads) {
    linear(x, w, bias, y, 0, 0, M, N, K, num_threads);
}

/* H independent products, one per head: y[h] [M, N] = x[h] [M, K] @ W_h^T, W_h [N, K] at w + h * w_head_stride
 * elements (x [H, M, K] and y [H, M, N] contiguous; no bias). Each element is computed in the canonical order
 * above, so head h's result has the bits of linear() on x[h] and W_h alone (bi_linear per head), whatever H,
 * M or the thread count. Decode-sized M (one row chunk) runs in one parallel region over the H x column-block
 * units (each thread a contiguous range of them: the heads' weights stream once, with one fork and join for
 * all heads); larger M runs linear() per head. Multi-head latent attention's absorbed products (W_UK, W_UV per
 * head: models/deepseek.py) run here. */
#define HEADS_XP_BYTES (4 << 20) /* AVX2 / NEON: the most prepared x linear_heads keeps (per calling thread) */
static void linear_heads(const void *x, const void *w, void *y, int is_bf16, int out_bf16, int64_t H, int64_t M,
                         int64_t N, int64_t K, int64_t w_head_stride, int num_threads) {
    if (H <= 0 || M <= 0 || N <= 0) return;
    if (num_threads < 1) num_threads = 1;
    const int64_t elt = is_bf16 ? 2 : 4, oelt = out_bf16 ? 2 : 4;
    const int64_t mc = chunk_rows(K, PREPARE_X ? 4 : elt);
    /* past one row chunk, or where the prepared x of every head would pass HEADS_XP_BYTES: a call per head */
    if (M > mc || (PREPARE_X && H * M * ((K + 15) / 16 * 16) * 4 > HEADS_XP_BYTES)) {
        for (int64_t h = 0; h < H; h++)
            linear((const char *)x + h * M * K * elt, (const char *)w + h * w_head_stride * elt, NULL,
                   (char *)y + h * M * N * oelt, is_bf16, out_bf16, M, N, K, num_threads);
        return;
    }
    const int64_t kp = (K + 15) / 16 * 16, num_blocks = (N + BLOCK_N - 1) / BLOCK_N, units = H * num_blocks;
#if PREPARE_X
    float *xp = xp_scratch(H * M * kp);
    if (xp == NULL) abort();
    for (int64_t h = 0; h < H; h++) prepare_x((const char *)x + h * M * K * elt, is_bf16, 0, M, K, kp, xp + h * M * kp);
#endif
    int parallel = num_threads > 1 && H * M * N * K >= MIN_PARALLEL_MACS && units > 1;
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
        void *pad = NULL;
        int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        int64_t u0 = units * t / T, u1 = units * (t + 1) / T;
        while (u0 < u1) {
            const int64_t h = u0 / num_blocks, b1 = (h + 1) * num_blocks < u1 ? (h + 1) * num_blocks : u1;
            linear_args a = {(const char *)x + h * M * K * elt, (const char *)w + h * w_head_stride * elt, NULL,
                             (char *)y + h * M * N * oelt, is_bf16, out_bf16, M, N, K, NULL, kp};
#if PREPARE_X
            a.xp = xp + h * M * kp;
#endif
            int64_t n0 = (u0 - h * num_blocks) * BLOCK_N, n1 = (b1 - h * num_blocks) * BLOCK_N;
            if (n1 > N) n1 = N;
            if (n0 < n1) linear_cols(&a, 0, M, n0, n1, &pad);
            free(pad); /* the partial block's padded copy is this head's */
            pad = NULL;
            u0 = b1;
        }
    }
}

void bi_linear_heads_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t H, int64_t M, int64_t N,
                          int64_t K, int64_t w_head_stride, int num_threads) {
    linear_heads(x, w, y, 1, 1, H, M, N, K, w_head_stride, num_threads);
}

void bi_linear_heads_f32(const float *x, const float *w, float *y, int64_t H, int64_t M, int64_t N, int64_t K,
                         int64_t w_head_stride, int num_threads) {
    linear_heads(x, w, y, 0, 0, H, M, N, K, w_head_stride, num_threads);
}

/* ---------------------------------------------------------------- RMSNorm */

static void rms_norm(const void *x, const void *w, void *y, int is_bf16, int64_t M, int64_t H, float eps,
                     int num_threads) {
    int64_t elt = is_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && M > 1 && M * H >= 16384)
    for (int64_t m = 0; m < M; m++)
        rms_norm_row((const char *)x + m * H * elt, w, (char *)y + m * H * elt, is_bf16, H, eps);
}

void bi_rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t H, float eps,
                      int num_threads) {
    rms_norm(x, w, y, 1, M, H, eps, num_threads);
}

void bi_rms_norm_f32(const float *x, const float *w, float *y, int64_t M, int64_t H, float eps, int num_threads) {
    rms_norm(x, w, y, 0, M, H, eps, num_threads);
}

/* Which code path this build uses: "avx512_bf16", "avx512", "avx2", "neon" or "portable". */
const char *bi_isa(void) {
#if defined(HAVE_AVX512_BF16)
    return "avx512_bf16";
#elif defined(PATH_AVX512)
    return "avx512";
#elif defined(PATH_AVX2)
    return "avx2";
#elif defined(PATH_NEON)
    return "neon";
#else
    return "portable";
#endif
}
