/* Paged decode attention for CPU: one query token per sequence attends over its paged K/V.
 *
 * Layouts (row-major, contiguous):
 *   q          [num_seqs, num_heads, head_dim]
 *   k/v cache  [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_table[num_seqs, max_blocks] (int64), seq_lens[num_seqs] (int64)
 *   out        [num_seqs, num_heads, head_dim]
 * One task per sequence (OpenMP over sequences). The sequence's row offsets are computed once from
 * its block table; each query head then streams the K rows of its kv head (GQA heads re-read the
 * shared rows from cache), softmaxes float32 scores exactly (max-subtracted) and accumulates V in
 * float32 registers. AVX-512 code for head_dim % 16 == 0, portable loops otherwise.
 * Built at run time by tokenmill/attention/cpu_decode.py; the torch reference path in
 * torch_paged.py is the specification this must match.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

static inline float f32_id(float x) { return x; }

/* One sequence. qf: [H, D] scaled float query; scores: [H, L] scratch; acc: [H, D] scratch. */
#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 load16_f32(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const uint16_t* p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* Sum each of 8 vectors: returns [sum(a[0]), ..., sum(a[7])] with a hadd tree (no per-vector reduce). */
static inline __m256 fold512(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
static inline __m256 reduce8(const __m512* a) {
    __m256 h01 = _mm256_hadd_ps(fold512(a[0]), fold512(a[1]));
    __m256 h23 = _mm256_hadd_ps(fold512(a[2]), fold512(a[3]));
    __m256 h45 = _mm256_hadd_ps(fold512(a[4]), fold512(a[5]));
    __m256 h67 = _mm256_hadd_ps(fold512(a[6]), fold512(a[7]));
    __m256 h0123 = _mm256_hadd_ps(h01, h23); /* [a b c d | a b c d] partial sums per 128-bit half */
    __m256 h4567 = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

/* AVX-512 path, head_dim a multiple of 16 (at most 256). Per query head: q (and later the output
 * accumulator) stays in registers while the sequence's K (then V) rows stream past; rows of the
 * same kv head are re-read from cache by the G query heads that share them. Scores of 8 tokens
 * are reduced together. */
#define DEFINE_SEQ_AVX512(NAME, T, LOAD16)                                                               \
static inline __attribute__((always_inline)) void NAME(                                                  \
    const float* restrict qf, const T* restrict k_cache, const T* restrict v_cache,                      \
    const int64_t* restrict rows, int L, float* restrict scores, float* restrict acc,                    \
    const int H, const int KVH, const int D) {                                                           \
    const int G = H / KVH;                                                                               \
    const int NV = D / 16;                                                                               \
    const int L8 = L - L % 8;                                                                            \
    for (int h = 0; h < H; h++) {                                                                        \
        const int64_t head_off = (int64_t)(h / G) * D;                                                   \
        __m512 qv[16];                                                                                   \
        for (int j = 0; j < NV; j++) qv[j] = _mm512_loadu_ps(qf + h * D + 16 * j);                       \
        float* sh = scores + (int64_t)h * L;                                                             \
        for (int t0 = 0; t0 < L8; t0 += 8) {                                                             \
            __m512 part[8];                                                                              \
            for (int i = 0; i < 8; i++) {                                                                \
                const int t = t0 + i;                                                                    \
                const T* kp = k_cache + rows[t] + head_off;                                              \
                __m512 a = _mm512_mul_ps(LOAD16(kp), qv[0]);                                             \
                for (int j = 1; j < NV; j++) a = _mm512_fmadd_ps(LOAD16(kp + 16 * j), qv[j], a);         \
                part[i] = a;                                                                             \
            }                                                                                            \
            _mm256_storeu_ps(sh + t0, reduce8(part));                                                    \
        }                                                                                                \
        for (int t = L8; t < L; t++) {                                                                   \
            const T* kp = k_cache + rows[t] + head_off;                                              \
            __m512 a = _mm512_mul_ps(LOAD16(kp), qv[0]);                                                 \
            for (int j = 1; j < NV; j++) a = _mm512_fmadd_ps(LOAD16(kp + 16 * j), qv[j], a);             \
            sh[t] = _mm512_reduce_add_ps(a);                                                             \
        }                                                                                                \
        float m = -INFINITY;                                                                             \
        for (int t = 0; t < L; t++) m = sh[t] > m ? sh[t] : m;                                           \
        float sum = 0.f;                                                                                 \
        for (int t = 0; t < L; t++) { sh[t] = expf(sh[t] - m); sum += sh[t]; }                           \
        const float inv = 1.f / sum;                                                                     \
        __m512 o[16];                                                                                    \
        for (int j = 0; j < NV; j++) o[j] = _mm512_setzero_ps();                                         \
        for (int t = 0; t < L; t++) {                                                                    \
            const T* vp = v_cache + rows[t] + head_off;                                              \
            const __m512 p = _mm512_set1_ps(sh[t]);                                                      \
            for (int j = 0; j < NV; j++) o[j] = _mm512_fmadd_ps(p, LOAD16(vp + 16 * j), o[j]);           \
        }                                                                                                \
        const __m512 invv = _mm512_set1_ps(inv);                                                         \
        for (int j = 0; j < NV; j++) _mm512_storeu_ps(acc + h * D + 16 * j, _mm512_mul_ps(o[j], invv));  \
    }                                                                                                    \
}
DEFINE_SEQ_AVX512(seq_avx512_f32, float, load16_f32)
DEFINE_SEQ_AVX512(seq_avx512_bf16, uint16_t, load16_bf16)
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif

/* Portable path (any head_dim). */
#define DEFINE_SEQ(NAME, T, LOAD)                                                                        \
static inline __attribute__((always_inline)) void NAME(                                                  \
    const float* restrict qf, const T* restrict k_cache, const T* restrict v_cache,                      \
    const int64_t* restrict rows, int L, float* restrict scores, float* restrict acc,                    \
    const int H, const int KVH, const int D) {                                                           \
    const int G = H / KVH;                                                                               \
    float krow[KVH * D];                                                                                 \
    for (int t = 0; t < L; t++) {                                                                        \
        const T* kp = k_cache + rows[t];                \
        for (int i = 0; i < KVH * D; i++) krow[i] = LOAD(kp[i]);                                         \
        for (int h = 0; h < H; h++) {                                                                    \
            const float* kh = krow + (h / G) * D;                                                        \
            const float* qh = qf + h * D;                                                                \
            float dot = 0.f;                                                                             \
            for (int d = 0; d < D; d++) dot += qh[d] * kh[d];                                            \
            scores[h * L + t] = dot;                                                                     \
        }                                                                                                \
    }                                                                                                    \
    for (int h = 0; h < H; h++) {                                                                        \
        float* sh = scores + h * L;                                                                      \
        float m = -INFINITY;                                                                             \
        for (int t = 0; t < L; t++) m = sh[t] > m ? sh[t] : m;                                           \
        float sum = 0.f;                                                                                 \
        for (int t = 0; t < L; t++) { sh[t] = expf(sh[t] - m); sum += sh[t]; }                           \
        const float inv = 1.f / sum;                                                                     \
        for (int t = 0; t < L; t++) sh[t] *= inv;                                                        \
    }                                                                                                    \
    memset(acc, 0, sizeof(float) * H * D);                                                               \
    for (int t = 0; t < L; t++) {                                                                        \
        const T* vp = v_cache + rows[t];                \
        for (int i = 0; i < KVH * D; i++) krow[i] = LOAD(vp[i]);                                         \
        for (int h = 0; h < H; h++) {                                                                    \
            const float p = scores[h * L + t];                                                           \
            const float* vh = krow + (h / G) * D;                                                        \
            float* ah = acc + h * D;                                                                     \
            for (int d = 0; d < D; d++) ah[d] += p * vh[d];                                              \
        }                                                                                                \
    }                                                                                                    \
}

#define DEFINE_PAGED_DECODE(NAME, SEQ, FAST, T, LOAD, STORE)                                                   \
void NAME(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_table,                    \
          const int64_t* seq_lens, T* out, int num_seqs, int num_heads, int num_kv_heads, int head_dim,  \
          int block_size, int max_blocks, float scale, int num_threads) {                                \
    const int H = num_heads, D = head_dim;                                                               \
    _Pragma("omp parallel for schedule(dynamic) num_threads(num_threads)")                              \
    for (int s = 0; s < num_seqs; s++) {                                                                 \
        const int L = (int)seq_lens[s];                                                                  \
        float* qf = (float*)malloc(sizeof(float) * (size_t)H * D);                                       \
        float* acc = (float*)malloc(sizeof(float) * (size_t)H * D);                                      \
        float* scores = (float*)malloc(sizeof(float) * (size_t)H * (L > 0 ? L : 1));                     \
        const T* qs = q + (int64_t)s * H * D;                                                            \
        for (int i = 0; i < H * D; i++) qf[i] = LOAD(qs[i]) * scale;                                     \
        const int64_t* bt = block_table + (int64_t)s * max_blocks;                                       \
        int64_t* rows = (int64_t*)malloc(sizeof(int64_t) * (size_t)(L > 0 ? L : 1));                     \
        const int64_t row = (int64_t)num_kv_heads * D;                                                   \
        for (int b = 0, t = 0; t < L; b++)                                                               \
            for (int i = 0; i < block_size && t < L; i++, t++) rows[t] = (bt[b] * block_size + i) * row; \
        if (HAVE_AVX512 && D == 64)                                                                      \
            FAST(qf, k_cache, v_cache, rows, L, scores, acc, H, num_kv_heads, 64);             \
        else if (HAVE_AVX512 && D == 128)                                                                \
            FAST(qf, k_cache, v_cache, rows, L, scores, acc, H, num_kv_heads, 128);            \
        else if (HAVE_AVX512 && D % 16 == 0 && D <= 256)                                                 \
            FAST(qf, k_cache, v_cache, rows, L, scores, acc, H, num_kv_heads, D);              \
        else                                                                                             \
            SEQ(qf, k_cache, v_cache, rows, L, scores, acc, H, num_kv_heads, D);               \
        T* os = out + (int64_t)s * H * D;                                                                \
        for (int i = 0; i < H * D; i++) os[i] = STORE(acc[i]);                                           \
        free(qf);                                                                                        \
        free(acc);                                                                                       \
        free(scores);                                                                                    \
        free(rows);                                                                                      \
    }                                                                                                    \
}

DEFINE_SEQ(seq_f32, float, f32_id)
DEFINE_SEQ(seq_bf16, uint16_t, bf16_to_f32)
#if !HAVE_AVX512
#define seq_avx512_f32 seq_f32
#define seq_avx512_bf16 seq_bf16
#endif
DEFINE_PAGED_DECODE(paged_decode_f32, seq_f32, seq_avx512_f32, float, f32_id, f32_id)
DEFINE_PAGED_DECODE(paged_decode_bf16, seq_bf16, seq_avx512_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
