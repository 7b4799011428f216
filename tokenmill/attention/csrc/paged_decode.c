/* Paged decode attention for CPU: one query token per sequence attends over its paged K/V.
 *
 * Layouts (row-major, contiguous):
 *   q          [num_seqs, num_heads, head_dim]
 *   k/v cache  [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_table[num_seqs, max_blocks] (int64), seq_lens[num_seqs] (int64)
 *   out        [num_seqs, num_heads, head_dim]
 * One task per sequence walks its tokens once, reading each token's whole K (then V) row for all
 * kv heads contiguously; GQA query heads share the row. Scores are float32 and softmaxed exactly
 * (max-subtracted); V is accumulated in float32. head_dim 64 and 128 get specialised code.
 * Built at run time by tokenmill/attention/cpu_decode.py; the torch reference path in
 * torch_paged.py is the specification this must match.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    uint32_t u = v.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline float f32_id(float x) { return x; }

/* One sequence. qf: [H, D] scaled float query; scores: [H, L] scratch; acc: [H, D] scratch. */
#if defined(__AVX512F__)
#include <immintrin.h>

static inline void prefetch_block(const void* p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch((const char*)p + off, _MM_HINT_T0);
}

static inline __m512 load16_f32(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const uint16_t* p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* AVX-512 path, head_dim a multiple of 16 (at most 256). */
#define DEFINE_SEQ_AVX512(NAME, T, LOAD16)                                                               \
static inline __attribute__((always_inline)) void NAME(                                                  \
    const float* restrict qf, const T* restrict k_cache, const T* restrict v_cache,                      \
    const int64_t* restrict bt, int L, float* restrict scores, float* restrict acc,                      \
    const int H, const int KVH, const int D, const int block_size) {                                     \
    const int G = H / KVH;                                                                               \
    const int NV = D / 16;                                                                               \
    const int64_t row = (int64_t)KVH * D;                                                                \
    __m512 kv[16];                                                                                       \
    for (int t = 0; t < L; t++) {                                                                        \
        const T* kp = k_cache + (bt[t / block_size] * block_size + t % block_size) * row;                \
        if (t % block_size == 0 && t + block_size < L)                                                   \
            prefetch_block(k_cache + bt[t / block_size + 1] * block_size * row, block_size * row * sizeof(T)); \
        for (int kh = 0; kh < KVH; kh++) {                                                               \
            for (int j = 0; j < NV; j++) kv[j] = LOAD16(kp + kh * D + 16 * j);                           \
            for (int g = 0; g < G; g++) {                                                                \
                const int h = kh * G + g;                                                                \
                __m512 a = _mm512_mul_ps(kv[0], _mm512_loadu_ps(qf + h * D));                            \
                for (int j = 1; j < NV; j++) a = _mm512_fmadd_ps(kv[j], _mm512_loadu_ps(qf + h * D + 16 * j), a); \
                scores[h * L + t] = _mm512_reduce_add_ps(a);                                             \
            }                                                                                            \
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
        const T* vp = v_cache + (bt[t / block_size] * block_size + t % block_size) * row;                \
        if (t % block_size == 0 && t + block_size < L)                                                   \
            prefetch_block(v_cache + bt[t / block_size + 1] * block_size * row, block_size * row * sizeof(T)); \
        for (int kh = 0; kh < KVH; kh++) {                                                               \
            for (int j = 0; j < NV; j++) kv[j] = LOAD16(vp + kh * D + 16 * j);                           \
            for (int g = 0; g < G; g++) {                                                                \
                const int h = kh * G + g;                                                                \
                const __m512 p = _mm512_set1_ps(scores[h * L + t]);                                      \
                float* ah = acc + h * D;                                                                 \
                for (int j = 0; j < NV; j++)                                                             \
                    _mm512_storeu_ps(ah + 16 * j, _mm512_fmadd_ps(p, kv[j], _mm512_loadu_ps(ah + 16 * j))); \
            }                                                                                            \
        }                                                                                                \
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
    const int64_t* restrict bt, int L, float* restrict scores, float* restrict acc,                      \
    const int H, const int KVH, const int D, const int block_size) {                                     \
    const int G = H / KVH;                                                                               \
    const int64_t row = (int64_t)KVH * D;                                                                \
    float krow[KVH * D];                                                                                 \
    for (int t = 0; t < L; t++) {                                                                        \
        const T* kp = k_cache + (bt[t / block_size] * block_size + t % block_size) * row;                \
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
        const T* vp = v_cache + (bt[t / block_size] * block_size + t % block_size) * row;                \
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
        if (HAVE_AVX512 && D == 64)                                                                      \
            FAST(qf, k_cache, v_cache, bt, L, scores, acc, H, num_kv_heads, 64, block_size);             \
        else if (HAVE_AVX512 && D == 128)                                                                \
            FAST(qf, k_cache, v_cache, bt, L, scores, acc, H, num_kv_heads, 128, block_size);            \
        else if (HAVE_AVX512 && D % 16 == 0 && D <= 256)                                                 \
            FAST(qf, k_cache, v_cache, bt, L, scores, acc, H, num_kv_heads, D, block_size);              \
        else                                                                                             \
            SEQ(qf, k_cache, v_cache, bt, L, scores, acc, H, num_kv_heads, D, block_size);               \
        T* os = out + (int64_t)s * H * D;                                                                \
        for (int i = 0; i < H * D; i++) os[i] = STORE(acc[i]);                                           \
        free(qf);                                                                                        \
        free(acc);                                                                                       \
        free(scores);                                                                                    \
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
