/* Batch-invariant CPU kernels for deterministic inference: linear (y = x W^T + b) and RMSNorm.
 *
 * Layouts (row-major, contiguous; bf16 passed as its uint16 bits, accumulation always float32):
 *   linear   x [M, K], W [N, K] (nn.Linear layout), bias [N] or NULL, y [M, N]
 *   rms_norm x [M, H], weight [H], y [M, H]
 *
 * Why y[m, n] is batch-invariant: it is produced by one fixed instruction sequence that reads only
 * x[m, :], W[n, :] and bias[n]:
 *   1. 16 float32 partial sums. Step j adds the products for k in [32j, 32j + 32) with one vdpbf16ps
 *      (bf16: lane i += x[2i] w[2i] + x[2i+1] w[2i+1]) or for k in [16j, 16j + 16) with one vfmadd
 *      (fp32: lane i += x[i] w[i]); the last step loads its lanes past K as zeros.
 *   2. The 16 lanes are summed by one fixed tree: (i, i+8), then (i, i+4), (i, i+2), (i, i+1).
 *   3. The bias is added in float32, then one rounding (to nearest even) to the output dtype.
 * Register tiles (4 rows x 4 columns, 2 x 8, 1 x 16) decide only which of these sequences share a
 * loop: every tile keeps exactly 16 accumulators, and reduce16() transposes them lane-wise, so each
 * output goes through the same tree whatever slot it occupies. K is never split. OpenMP threads split
 * the columns N, each column computed by one thread. So neither M, the row's position, the other
 * rows, nor the thread count can change a bit of y[m, n]. The file must be built without
 * -ffast-math and with -ffp-contract=off so the compiler cannot reassociate or fuse anything.
 *
 * Blocking: each thread owns a contiguous range of 16-column blocks of W. Rows of x go in chunks
 * that fit in L2 (decode-sized M is one chunk, so W streams from memory exactly once per call).
 * Inside a chunk, a 4-column slice of W (4 x K) stays in L1 while every 4-row tile passes over it,
 * and each tile's k loop prefetches (into L2) the same k range of the W rows two tiles ahead.
 *
 * RMSNorm (one row per task): float32 sum of squares in the same 16-lane + tree order, / H,
 * r = 1 / sqrtf(var + eps); y = round(x * r) to x's dtype, then round(y * weight) (torch's order).
 *
 * Portable builds (no AVX-512, or no AVX512_BF16 for the bf16 linear) use plain loops: one float32
 * sum over k in increasing order, bias, one rounding. Their values differ from the AVX-512 build but
 * are invariant for the same reason. Bits are therefore stable per build and CPU feature set, not
 * across machines (vdpbf16ps also rounds and flushes denormals in its own way).
 * Built at run time by tokenmill/layers/batch_invariant.py.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* Tuning knobs (none changes a result bit); measured on Zen 4, 1 MiB L2 per core. */
#define BLOCK_N 16 /* columns per block: the unit of work split between threads */
#ifndef CHUNK_BYTES
#define CHUNK_BYTES (256 * 1024) /* x rows per chunk: as many as fit in this many bytes ... */
#endif
#define DECODE_ROWS 64 /* ... but at least this many */
#ifndef PF_HINT
#define PF_HINT 2 /* software prefetch of W into L2 (_MM_HINT_T1); -1: none */
#endif
#ifndef PF_AHEAD
#define PF_AHEAD 2 /* prefetch distance in tiles (of C rows of W) */
#endif
#define MIN_PARALLEL_MACS (1 << 18) /* below this many multiply-adds, one thread */

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
    for (int64_t n = 0; n < N; n++)
        out[n] = is_bf16 ? bf16_to_f32(((const uint16_t *)bias)[n]) : ((const float *)bias)[n];
    return out;
}

/* ---------------------------------------------------------------- portable loops (unused where AVX-512 covers a case) */

/* y[m0:m1, n_begin:n_end]: one float32 sum per output, k in increasing order. */
__attribute__((unused)) static void linear_portable(const void *xv, const void *wv, const float *bias, void *yv, int is_bf16, int64_t m0,
                                                   int64_t m1, int64_t N, int64_t K, int64_t n_begin, int64_t n_end) {
    for (int64_t n = n_begin; n < n_end; n++) {
        for (int64_t m = m0; m < m1; m++) {
            float acc = 0.0f;
            if (is_bf16) {
                const uint16_t *x = (const uint16_t *)xv + m * K, *w = (const uint16_t *)wv + n * K;
                for (int64_t k = 0; k < K; k++) acc += bf16_to_f32(x[k]) * bf16_to_f32(w[k]);
            } else {
                const float *x = (const float *)xv + m * K, *w = (const float *)wv + n * K;
                for (int64_t k = 0; k < K; k++) acc += x[k] * w[k];
            }
            if (bias) acc += bias[n];
            if (is_bf16) ((uint16_t *)yv)[m * N + n] = f32_to_bf16(acc);
            else ((float *)yv)[m * N + n] = acc;
        }
    }
}

__attribute__((unused)) static void rms_norm_row_portable(const void *xv, const void *wv, void *yv, int is_bf16, int64_t H, float eps) {
    float ss = 0.0f;
    for (int64_t h = 0; h < H; h++) {
        float v = is_bf16 ? bf16_to_f32(((const uint16_t *)xv)[h]) : ((const float *)xv)[h];
        ss += v * v;
    }
    float r = 1.0f / sqrtf(ss / (float)H + eps);
    for (int64_t h = 0; h < H; h++) {
        if (is_bf16) {
            float y = bf16_to_f32(f32_to_bf16(bf16_to_f32(((const uint16_t *)xv)[h]) * r));
            ((uint16_t *)yv)[h] = f32_to_bf16(y * bf16_to_f32(((const uint16_t *)wv)[h]));
        } else {
            ((float *)yv)[h] = (((const float *)xv)[h] * r) * ((const float *)wv)[h];
        }
    }
}

/* ---------------------------------------------------------------- AVX-512 */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define HAVE_AVX512 1
#include <immintrin.h>
#define INLINE static inline __attribute__((always_inline))

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
INLINE void store_tile(__m512 t, const float *bias, void *y, int is_bf16, int64_t ldy, int R, int C, int nrows, int ncols) {
    if (bias) t = _mm512_add_ps(t, tile_bias(bias, C));
    if (ncols == C) {
        if (is_bf16) {
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
        if (is_bf16) memcpy((uint16_t *)y + r * ldy, tmp16 + r * C, (size_t)ncols * 2);
        else memcpy((float *)y + r * ldy, tmp + r * C, (size_t)ncols * 4);
    }
}

#if defined(__AVX512BF16__)
/* R x C dot products (R * C == 16) of bf16 rows x[r] (stride ldx) and w[c] (stride ldw). */
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
#define HAVE_AVX512_BF16 1
#endif

INLINE __m512 tile_f32(const float *x, int64_t ldx, const float *w, int64_t ldw, int64_t K, int R, int C) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
#if PF_HINT >= 0
        for (int c = 0; c < C; c++) _mm_prefetch((const char *)(w + (PF_AHEAD * C + c) * ldw + k), PF_HINT);
#endif
        __m512 xv[4];
        for (int r = 0; r < R; r++) xv[r] = _mm512_loadu_ps(x + r * ldx + k);
        for (int c = 0; c < C; c++) {
            __m512 wv = _mm512_loadu_ps(w + c * ldw + k);
            for (int r = 0; r < R; r++) acc[r * C + c] = _mm512_fmadd_ps(xv[r], wv, acc[r * C + c]);
        }
    }
    if (k < K) {
        __mmask16 mask = (__mmask16)((1u << (K - k)) - 1);
        __m512 xv[4];
        for (int r = 0; r < R; r++) xv[r] = _mm512_maskz_loadu_ps(mask, x + r * ldx + k);
        for (int c = 0; c < C; c++) {
            __m512 wv = _mm512_maskz_loadu_ps(mask, w + c * ldw + k);
            for (int r = 0; r < R; r++) acc[r * C + c] = _mm512_fmadd_ps(xv[r], wv, acc[r * C + c]);
        }
    }
    return reduce16(acc);
}

/* One column block (BLOCK_N columns at n0, ncols valid; w points at its first row, padded to
 * BLOCK_N rows) against rows [m0, m1) of x. */
#define DEFINE_BLOCK(NAME, T, TILE, IS_BF16)                                                               \
    static void NAME(const T *x, const T *w, const float *bias, T *y, int64_t m0, int64_t m1, int64_t N,  \
                     int64_t K, int64_t n0, int ncols) {                                                 \
        int64_t m4 = m0 + (m1 - m0) / 4 * 4;                                                             \
        for (int c0 = 0; c0 < ncols; c0 += 4) {                                                          \
            int nc = ncols - c0 < 4 ? ncols - c0 : 4;                                                    \
            for (int64_t m = m0; m < m4; m += 4)                                                         \
                store_tile(TILE(x + m * K, K, w + c0 * K, K, K, 4, 4), bias ? bias + n0 + c0 : NULL,       \
                           y + m * N + n0 + c0, IS_BF16, N, 4, 4, 4, nc);                                \
        }                                                                                                \
        int64_t m = m4;                                                                                  \
        if (m1 - m >= 2) {                                                                               \
            for (int c0 = 0; c0 < ncols; c0 += 8) {                                                      \
                int nc = ncols - c0 < 8 ? ncols - c0 : 8;                                                \
                store_tile(TILE(x + m * K, K, w + c0 * K, K, K, 2, 8), bias ? bias + n0 + c0 : NULL,       \
                           y + m * N + n0 + c0, IS_BF16, N, 2, 8, 2, nc);                                \
            }                                                                                            \
            m += 2;                                                                                      \
        }                                                                                                \
        if (m < m1)                                                                                      \
            store_tile(TILE(x + m * K, K, w, K, K, 1, 16), bias ? bias + n0 : NULL, y + m * N + n0,        \
                       IS_BF16, N, 1, 16, 1, ncols);                                                     \
    }

#if defined(HAVE_AVX512_BF16)
DEFINE_BLOCK(block_bf16, uint16_t, tile_bf16, 1)
#endif
DEFINE_BLOCK(block_f32, float, tile_f32, 0)
#endif /* AVX-512 */

/* Column block b (BLOCK_N columns) against rows [m0, m1). *pad is this thread's scratch for the
 * last, partial block, copied into BLOCK_N zero-padded rows on first use. */
static void linear_block(const void *x, const void *w, const float *bias, void *y, int is_bf16, int64_t m0,
                         int64_t m1, int64_t N, int64_t K, int64_t b, void **pad) {
    int64_t n0 = b * BLOCK_N;
    int ncols = N - n0 < BLOCK_N ? (int)(N - n0) : BLOCK_N;
#if defined(HAVE_AVX512)
#if !defined(HAVE_AVX512_BF16)
    if (is_bf16) {
        linear_portable(x, w, bias, y, 1, m0, m1, N, K, n0, n0 + ncols);
        return;
    }
#endif
    int64_t elt = is_bf16 ? 2 : 4;
    const char *wb = (const char *)w + n0 * K * elt;
    if (ncols < BLOCK_N) {
        if (*pad == NULL) {
            *pad = calloc((size_t)(BLOCK_N * K + 64), (size_t)elt);
            memcpy(*pad, wb, (size_t)(ncols * K * elt));
        }
        wb = (const char *)*pad;
    }
#if defined(HAVE_AVX512_BF16)
    if (is_bf16) {
        block_bf16((const uint16_t *)x, (const uint16_t *)wb, bias, (uint16_t *)y, m0, m1, N, K, n0, ncols);
        return;
    }
#endif
    block_f32((const float *)x, (const float *)wb, bias, (float *)y, m0, m1, N, K, n0, ncols);
#else
    (void)pad;
    linear_portable(x, w, bias, y, is_bf16, m0, m1, N, K, n0, n0 + ncols);
#endif
}

static void linear(const void *x, const void *w, const void *bias, void *y, int is_bf16, int64_t M, int64_t N,
                   int64_t K, int num_threads) {
    if (M <= 0 || N <= 0) return;
    if (num_threads < 1) num_threads = 1;
    float *b32 = bias_f32(bias, is_bf16, N);
    int64_t elt = is_bf16 ? 2 : 4;
    int64_t mc = chunk_rows(K, elt);
    int64_t num_blocks = (N + BLOCK_N - 1) / BLOCK_N;
    int parallel = num_threads > 1 && M * N * K >= MIN_PARALLEL_MACS && num_blocks > 1;
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
        void *pad = NULL;
        /* each thread a contiguous range of blocks, the same for every row chunk (stays in its L2) */
        int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        for (int64_t m0 = 0; m0 < M; m0 += mc) {
            int64_t m1 = m0 + mc < M ? m0 + mc : M;
            for (int64_t b = num_blocks * t / T; b < num_blocks * (t + 1) / T; b++)
                linear_block(x, w, b32, y, is_bf16, m0, m1, N, K, b, &pad);
        }
        free(pad);
    }
    free(b32);
}

void bi_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M, int64_t N,
                    int64_t K, int num_threads) {
    linear(x, w, bias, y, 1, M, N, K, num_threads);
}

void bi_linear_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                   int num_threads) {
    linear(x, w, bias, y, 0, M, N, K, num_threads);
}

/* ---------------------------------------------------------------- RMSNorm */

static void rms_norm_row(const void *x, const void *w, void *y, int is_bf16, int64_t H, float eps) {
#if defined(HAVE_AVX512)
    __m512 acc = _mm512_setzero_ps();
    int64_t h = 0;
    for (; h < H; h += 16) {
        __mmask16 mask = H - h >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (H - h)) - 1);
        __m512 v = is_bf16 ? bf16x16_to_f32(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)x + h))
                           : _mm512_maskz_loadu_ps(mask, (const float *)x + h);
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
#else
    rms_norm_row_portable(x, w, y, is_bf16, H, eps);
#endif
}

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

/* Which code paths this build uses: "avx512_bf16", "avx512" (bf16 linear portable) or "portable". */
const char *bi_isa(void) {
#if defined(HAVE_AVX512_BF16)
    return "avx512_bf16";
#elif defined(HAVE_AVX512)
    return "avx512";
#else
    return "portable";
#endif
}
