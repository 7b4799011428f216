/* Paged decode attention for CPU: one query token per sequence attends over its paged K/V.
 *
 * Layouts (row-major, contiguous):
 *   q          [num_seqs, num_heads, head_dim]
 *   k/v cache  [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_table[num_seqs, max_blocks] (int64), seq_lens[num_seqs] (int64)
 *   out        [num_seqs, num_heads, head_dim]
 * One task per (group of rows sharing a context, kv head), split over query heads when tasks are fewer than
 * twice the threads, OpenMP over tasks; a row's output depends
 * only on its own query, keys and values (see DEFINE_PAGED_DECODE for the groups). The sequence's row offsets are computed once from its block table; scores
 * are float32, softmaxed exactly (max-subtracted), and V is accumulated in float32.
 * window > 0 (sliding-window attention, as transformers' masks): a query at position p = seq_len - 1 sees
 * keys p - window < j <= p only, i.e. its last min(seq_len, window) keys; the row offsets then start at the
 * window's first key, so the row is computed exactly as a sequence of those keys alone. softcap > 0 (Gemma 2):
 * scores become softcap * tanh(score / softcap) before the softmax. 0 turns either off.
 * ISA paths (csrc_build.py picks one): AVX512_BF16 for bf16 caches with head_dim % 32 == 0 (VDPBF16PS on the
 * cache's bf16 values, whole cache rows per task; see seq_dp_bf16), AVX-512 for head_dim % 16 == 0, AVX2+FMA for head_dim % 8 == 0,
 * NEON for head_dim % 4 == 0 (each at most 256, 64 and 128 specialised), plain C loops otherwise. The
 * SIMD paths share one chunked routine (each K/V row read once for every query head of its kv head).
 * Built at run time by tokenmill/attention/cpu_decode.py; the torch reference path in
 * torch_paged.py is the specification this must match.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "cpu_vendor.h"

static inline float f32_id(float x) { return x; }

#define MAX_SIMD_DIM 256
/* exp(x) for the softmax, x <= 0: Cody-Waite reduction and a degree-6 polynomial (as silu_and_mul.c);
 * x is clamped to [-87, 88] so 2^n stays a normal float; a NaN propagates. */
#include "exp_poly.h" /* EXP_C2..EXP_C6, LN2_HI, LN2_LO, LOG2E */

#if defined(TM_PORTABLE)
#define ISA_PATH "portable"
#define LANES 0

#elif defined(__AVX512F__)
#include <immintrin.h>
#if defined(__AVX512BF16__)
#define ISA_PATH "avx512_bf16" /* the AVX-512 path, with VDPBF16PS for bf16 caches (seq_dp_bf16) */
#else
#define ISA_PATH "avx512"
#endif
#define LANES 16
#define CHUNKED_SEQ 1
typedef __m512 vf;
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_load(const float* p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vf_hsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline float vf_hmax(vf v) { return _mm512_reduce_max_ps(v); }
static inline vf vf_exp(vf x) {
    x = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), x));
    const vf n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vf r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    vf p = _mm512_set1_ps(EXP_C6);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C5));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_load_bf16(const uint16_t* p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
/* [sum(a[0]), ..., sum(a[7])] of 8 vectors: each folded to 256 bits, then a hadd tree. */
static inline __m256 fold512(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
static inline __m256 reduce8(const __m512* a) {
    const __m256 h01 = _mm256_hadd_ps(fold512(a[0]), fold512(a[1])), h23 = _mm256_hadd_ps(fold512(a[2]), fold512(a[3]));
    const __m256 h45 = _mm256_hadd_ps(fold512(a[4]), fold512(a[5])), h67 = _mm256_hadd_ps(fold512(a[6]), fold512(a[7]));
    const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67); /* per 128-bit half */
    return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}
/* [sum(a[0]), ..., sum(a[15])]. */
static inline vf vf_reduce(const vf* a) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(reduce8(a))),
                                               _mm256_castps_pd(reduce8(a + 8)), 1));
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ISA_PATH "avx2"
#define LANES 8
#define CHUNKED_SEQ 1
typedef __m256 vf;
typedef __m256i vi;
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_load(const float* p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
/* Clamp with a NaN x kept NaN (maxps/minps return the second operand when either is NaN). */
static inline vf vf_clamp(vf x, float lo, float hi) {
    return _mm256_min_ps(_mm256_set1_ps(hi), _mm256_max_ps(_mm256_set1_ps(lo), x));
}
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }  /* a * b + c */
static inline vf vf_fnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); } /* c - a * b */
static inline vf vf_round(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* 2^n for integral n in [-126, 127], from the exponent bits. */
static inline vf vf_pow2(vf n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline float vf_hsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float vf_hmax(vf v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
/* [sum(a[0]), ..., sum(a[7])]: a hadd tree, no per-vector reduction. */
static inline vf vf_reduce(const vf* a) {
    const vf h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    const vf h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    const vf h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67); /* per 128-bit half */
    return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}
static inline vf vf_load_bf16(const uint16_t* p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

#elif defined(__ARM_NEON)
#include <arm_neon.h>
#define ISA_PATH "neon"
#define LANES 4
#define CHUNKED_SEQ 1
typedef float32x4_t vf;
static inline vf vf_set1(float x) { return vdupq_n_f32(x); }
static inline vf vf_zero(void) { return vdupq_n_f32(0.0f); }
static inline vf vf_load(const float* p) { return vld1q_f32(p); }
static inline void vf_store(float* p, vf v) { vst1q_f32(p, v); }
static inline vf vf_add(vf a, vf b) { return vaddq_f32(a, b); }
static inline vf vf_sub(vf a, vf b) { return vsubq_f32(a, b); }
static inline vf vf_mul(vf a, vf b) { return vmulq_f32(a, b); }
static inline vf vf_max(vf a, vf b) { return vmaxq_f32(a, b); }
/* fmax/fmin (not the nm forms) return NaN when either operand is NaN. */
static inline vf vf_clamp(vf x, float lo, float hi) { return vminq_f32(vmaxq_f32(x, vdupq_n_f32(lo)), vdupq_n_f32(hi)); }
static inline vf vf_fma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }  /* a * b + c */
static inline vf vf_fnma(vf a, vf b, vf c) { return vfmsq_f32(c, a, b); } /* c - a * b */
static inline vf vf_round(vf x) { return vrndnq_f32(x); }
static inline vf vf_pow2(vf n) {
    return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23));
}
static inline float vf_hsum(vf v) { return vaddvq_f32(v); }
static inline float vf_hmax(vf v) { return vmaxvq_f32(v); }
/* [sum(a[0]), ..., sum(a[3])] by pairwise adds. */
static inline vf vf_reduce(const vf* a) { return vpaddq_f32(vpaddq_f32(a[0], a[1]), vpaddq_f32(a[2], a[3])); }
static inline vf vf_load_bf16(const uint16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }

#else
#define ISA_PATH "portable"
#define LANES 0
#endif

#if defined(CHUNKED_SEQ) && !defined(__AVX512F__) /* AVX2 and NEON spell exp out of the primitives above */
static inline vf vf_exp(vf x) {
    x = vf_clamp(x, -87.0f, 88.0f);
    const vf n = vf_round(vf_mul(x, vf_set1(LOG2E)));
    vf r = vf_fnma(n, vf_set1(LN2_HI), x);
    r = vf_fnma(n, vf_set1(LN2_LO), r);
    vf p = vf_set1(EXP_C6);
    p = vf_fma(p, r, vf_set1(EXP_C5));
    p = vf_fma(p, r, vf_set1(EXP_C4));
    p = vf_fma(p, r, vf_set1(EXP_C3));
    p = vf_fma(p, r, vf_set1(EXP_C2));
    p = vf_fma(p, r, vf_set1(1.0f));
    p = vf_fma(p, r, vf_set1(1.0f));
    return vf_mul(p, vf_pow2(n));
}
#endif

#if LANES
/* s[t] = exp(s[t] - max(s)) for t < L; returns 1 / sum. A NaN score makes the whole row NaN, as in torch. */
static inline float softmax_exp(float* restrict s, int L) {
    int t = 0;
    vf mv = vf_set1(-INFINITY);
    for (; t + LANES <= L; t += LANES) mv = vf_max(mv, vf_load(s + t));
    float m = vf_hmax(mv);
    for (; t < L; t++) m = s[t] > m ? s[t] : m;
    const vf mb = vf_set1(m);
    vf sv = vf_set1(0.0f);
    for (t = 0; t + LANES <= L; t += LANES) {
        const vf e = vf_exp(vf_sub(vf_load(s + t), mb));
        vf_store(s + t, e);
        sv = vf_add(sv, e);
    }
    float sum = vf_hsum(sv);
    for (; t < L; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
    return 1.f / sum;
}
#endif

/* Gemma 2's attention logit soft-capping, in place on n scores: s = cap * tanh(s / cap); cap 0: none. */
static inline void cap_scores(float* restrict s, int64_t n, const float cap) {
    if (cap > 0.f)
        for (int64_t i = 0; i < n; i++) s[i] = tanhf(s[i] / cap) * cap;
}

/* One sequence. qf: [H, D] scaled float query; rows[t]: element offset of token t's cache row;
 * scores: [H, L] scratch; acc: [H, D] output (float). */

#if defined(CHUNKED_SEQ)
/* A kv head's rows for LANES tokens as float rows: float caches are read in place, bf16 rows are
 * widened once into buf (so the G query heads sharing them do not convert them again). */
static inline const float* widen_f32(const float* src, float* buf, int D) { (void)buf; (void)D; return src; }
static inline const float* widen_bf16(const uint16_t* src, float* buf, int D) {
    for (int j = 0; j < D; j += LANES) vf_store(buf + j, vf_load_bf16(src + j));
    return buf;
}

/* AVX-512/AVX2/NEON paths, head_dim a multiple of LANES (at most 256). Scores: LANES keys at a time, every kv
 * head of them before the next keys (each cache row is streamed once); for each kv head, the query
 * heads sharing it form LANES partial-sum vectors, reduced together into LANES scores (a short last
 * chunk repeats its first key and keeps only its real scores). Values: V_CHUNK rows at a time, in the
 * same order; each query head accumulates them into output tiles of 64 dims held in registers and
 * saved to acc between chunks. Nothing depends on other sequences or on the thread running this. */
#define V_CHUNK 16
/* Paged rows defeat the hardware prefetcher at every block boundary: ask for the rows PREFETCH_AHEAD
 * tokens ahead (all kv heads: the whole row is read in this pass). On AMD CPUs into L2 (prefetcht2): on
 * the project's Zen 4 the L1 form stalled the core once its miss buffers filled, and L2 prefetches read
 * the cache 1.8x faster (benchmarks/RESULTS.md, "Decode attention"); an Intel Xeon measured the other
 * way round earlier, so it keeps prefetcht0. */
#define PREFETCH_AHEAD 32
static int prefetch_into_l2(void) { return tm_cpu_is_amd(); }
#define prefetch_rows_hint(cache, rows, t_first, count, L, row_elems, HINT)                            \
    do {                                                                                                 \
        for (int t_ = (t_first); t_ < (t_first) + (count) && t_ < (L); t_++) {                           \
            const char* r_ = (const char*)((cache) + (rows)[t_]);                                        \
            for (size_t b_ = 0; b_ < sizeof(*(cache)) * (size_t)(row_elems); b_ += 64)                  \
                __builtin_prefetch(r_ + b_, 0, HINT);                                                    \
        }                                                                                                \
    } while (0)
/* `l2` is prefetch_into_l2(), read once per sequence */
#define prefetch_rows(cache, rows, t_first, count, L, row_elems)                                         \
    do {                                                                                                 \
        if (l2) prefetch_rows_hint(cache, rows, t_first, count, L, row_elems, 1);                        \
        else prefetch_rows_hint(cache, rows, t_first, count, L, row_elems, 3);                           \
    } while (0)
#define TILE (64 / LANES)
#define DEFINE_SEQ_FAST(NAME, T, WIDEN)                                                                  \
static inline __attribute__((always_inline)) void NAME(                                                  \
    const float* restrict qf, const T* restrict k_cache, const T* restrict v_cache,                      \
    const int64_t* restrict rows, int L, float* restrict scores, float* restrict acc,                    \
    const int H, const int KVH, const int D, const int* restrict lens, const float softcap) {            \
    const int G = H / KVH, l2 = prefetch_into_l2();                                                      \
    float buf[V_CHUNK * MAX_SIMD_DIM];                                                                   \
    const float* kr[V_CHUNK];                                                                            \
    for (int t0 = 0; t0 < L; t0 += LANES) {                                                              \
        const int n = L - t0 < LANES ? L - t0 : LANES;                                                   \
        prefetch_rows(k_cache, rows, t0 + PREFETCH_AHEAD, LANES, L, KVH * D);                            \
        for (int kh = 0; kh < KVH; kh++) {                                                               \
            const int64_t head_off = (int64_t)kh * D;                                                    \
            for (int i = 0; i < LANES; i++)                                                              \
                kr[i] = WIDEN(k_cache + rows[t0 + (i < n ? i : 0)] + head_off, buf + i * D, D);          \
            for (int h = kh * G; h < (kh + 1) * G; h++) {                                                \
                const float* qh = qf + h * D;                                                            \
                vf a[LANES];                                                                             \
                for (int i = 0; i < LANES; i++) a[i] = vf_mul(vf_load(kr[i]), vf_load(qh));              \
                for (int j = LANES; j < D; j += LANES) {                                                 \
                    const vf qv = vf_load(qh + j);                                                       \
                    for (int i = 0; i < LANES; i++) a[i] = vf_fma(vf_load(kr[i] + j), qv, a[i]);         \
                }                                                                                        \
                if (n == LANES) {                                                                        \
                    vf_store(scores + (int64_t)h * L + t0, vf_reduce(a));                                \
                } else {                                                                                 \
                    float s[LANES];                                                                      \
                    vf_store(s, vf_reduce(a));                                                           \
                    memcpy(scores + (int64_t)h * L + t0, s, sizeof(float) * (size_t)n);                  \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
    cap_scores(scores, (int64_t)H * L, softcap);                                                         \
    float inv[H];                                                                                        \
    for (int h = 0; h < H; h++) { /* head h attends to its first lens[h] keys; the rest weigh exactly 0 */ \
        float* sh = scores + (int64_t)h * L;                                                             \
        const int n = lens[h];                                                                           \
        inv[h] = softmax_exp(sh, n);                                                                     \
        for (int t = n; t < L; t++) sh[t] = 0.f;                                                         \
    }                                                                                                    \
    for (int i = 0; i < H * D; i++) acc[i] = 0.f;                                                        \
    for (int t0 = 0; t0 < L; t0 += V_CHUNK) {                                                            \
        const int n = L - t0 < V_CHUNK ? L - t0 : V_CHUNK;                                               \
        prefetch_rows(v_cache, rows, t0 + PREFETCH_AHEAD, V_CHUNK, L, KVH * D);                          \
        for (int kh = 0; kh < KVH; kh++) {                                                               \
            const int64_t head_off = (int64_t)kh * D;                                                    \
            for (int i = 0; i < n; i++) kr[i] = WIDEN(v_cache + rows[t0 + i] + head_off, buf + i * D, D); \
            for (int h = kh * G; h < (kh + 1) * G; h++) {                                                \
                const float* ph = scores + (int64_t)h * L + t0;                                          \
                for (int d0 = 0; d0 < D; d0 += 64) {                                                     \
                    const int nv = (D - d0 < 64 ? D - d0 : 64) / LANES;                                  \
                    float* ah = acc + h * D + d0;                                                        \
                    vf o[TILE];                                                                          \
                    for (int j = 0; j < nv; j++) o[j] = vf_load(ah + j * LANES);                         \
                    for (int i = 0; i < n; i++) {                                                        \
                        const vf p = vf_set1(ph[i]);                                                     \
                        for (int j = 0; j < nv; j++) o[j] = vf_fma(p, vf_load(kr[i] + d0 + j * LANES), o[j]); \
                    }                                                                                    \
                    for (int j = 0; j < nv; j++) vf_store(ah + j * LANES, o[j]);                         \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
    for (int h = 0; h < H; h++)                                                                          \
        for (int d = 0; d < D; d++) acc[h * D + d] *= inv[h];                                            \
}
DEFINE_SEQ_FAST(seq_fast_f32, float, widen_f32)
DEFINE_SEQ_FAST(seq_fast_bf16, uint16_t, widen_bf16)
#endif

/* Portable path (any head_dim). */
#define DEFINE_SEQ(NAME, T, LOAD)                                                                        \
static inline __attribute__((always_inline)) void NAME(                                                  \
    const float* restrict qf, const T* restrict k_cache, const T* restrict v_cache,                      \
    const int64_t* restrict rows, int L, float* restrict scores, float* restrict acc,                    \
    const int H, const int KVH, const int D, const int* restrict lens, const float softcap) {            \
    const int G = H / KVH;                                                                               \
    float krow[KVH * D];                                                                                 \
    for (int t = 0; t < L; t++) {                                                                        \
        const T* kp = k_cache + rows[t];                                                                 \
        for (int i = 0; i < KVH * D; i++) krow[i] = LOAD(kp[i]);                                         \
        for (int h = 0; h < H; h++) {                                                                    \
            const float* kh = krow + (h / G) * D;                                                        \
            const float* qh = qf + h * D;                                                                \
            float dot = 0.f;                                                                             \
            for (int d = 0; d < D; d++) dot += qh[d] * kh[d];                                            \
            scores[h * L + t] = dot;                                                                     \
        }                                                                                                \
    }                                                                                                    \
    cap_scores(scores, (int64_t)H * L, softcap);                                                         \
    for (int h = 0; h < H; h++) {                                                                        \
        float* sh = scores + h * L;                                                                      \
        const int n = lens[h];                                                                           \
        float m = -INFINITY;                                                                             \
        for (int t = 0; t < n; t++) m = sh[t] > m ? sh[t] : m;                                           \
        float sum = 0.f;                                                                                 \
        for (int t = 0; t < n; t++) { sh[t] = expf(sh[t] - m); sum += sh[t]; }                           \
        const float inv = 1.f / sum;                                                                     \
        for (int t = 0; t < n; t++) sh[t] *= inv;                                                        \
        for (int t = n; t < L; t++) sh[t] = 0.f;                                                         \
    }                                                                                                    \
    memset(acc, 0, sizeof(float) * H * D);                                                               \
    for (int t = 0; t < L; t++) {                                                                        \
        const T* vp = v_cache + rows[t];                                                                 \
        for (int i = 0; i < KVH * D; i++) krow[i] = LOAD(vp[i]);                                         \
        for (int h = 0; h < H; h++) {                                                                    \
            const float p = scores[h * L + t];                                                           \
            const float* vh = krow + (h / G) * D;                                                        \
            float* ah = acc + h * D;                                                                     \
            for (int d = 0; d < D; d++) ah[d] += p * vh[d];                                              \
        }                                                                                                \
    }                                                                                                    \
}
DEFINE_SEQ(seq_f32, float, f32_id)
DEFINE_SEQ(seq_bf16, uint16_t, bf16_to_f32)
#if !LANES
#define seq_fast_f32 seq_f32
#define seq_fast_bf16 seq_bf16
#endif

/* Rows that read the same context: consecutive sequences whose block tables agree over the blocks they
 * use and whose lengths grow by one (the verify rows of one request's draft tokens, in order) form a
 * group; each (group, kv head) is one task. A task scores the group's rows together: each K/V row is
 * read once for all of them, and row r's heads see only its first seq_lens keys (scores past them weigh
 * exactly 0, and softmax runs over its own length), so every row gets the bits it gets alone. Under a sliding
 * window only rows whose keys all fit in it are grouped (the window then cuts nothing off any of them); a
 * longer row is a group of its own, whose keys start at its window's first. */
#define MAX_GROUP 16
static int same_context(const int64_t* block_table, int max_blocks, int block_size, const int64_t* seq_lens,
                        int first, int s, int window) {
    if (s - first >= MAX_GROUP || seq_lens[s] != seq_lens[s - 1] + 1) return 0;
    if (window > 0 && seq_lens[s] > window) return 0;
    const int64_t used = (seq_lens[s] + block_size - 1) / block_size;
    return memcmp(block_table + (int64_t)first * max_blocks, block_table + (int64_t)s * max_blocks,
                  sizeof(int64_t) * (size_t)used) == 0;
}

/* The first key a query at position seq_len - 1 sees: seq_len - window under a window shorter than the
 * sequence (keys p - window < j <= p), else 0. */
static inline int first_key(int64_t seq_len, int window) {
    return window > 0 && seq_len > window ? (int)(seq_len - window) : 0;
}

/* rows[t] = element offset of key first + t's cache row (row: elements per token row), t < L. */
static inline void row_offsets(int64_t* restrict rows, const int64_t* restrict bt, int first, int L, int block_size,
                               int64_t row) {
    for (int b = first / block_size, i = first % block_size, t = 0; t < L; b++, i = 0)
        for (; i < block_size && t < L; i++, t++) rows[t] = (bt[b] * block_size + i) * row;
}

/* Few tasks for the threads (one request verifying drafts: KVH tasks of R * G query heads each) leave
 * threads idle: 3 tasks on 2 threads take as long as 4. Then each (group, kv head) is split into `parts`
 * tasks over its query heads, at least MIN_PART_HEADS each (each head's scores, softmax and output are
 * computed alone, so a head's bits do not depend on which heads share its task); a part re-reads its kv
 * head's K/V rows, which costs less than an idle thread once a task has several heads (measured: one
 * decode row, 3 heads a task, is slower split). */
#define MIN_PART_HEADS 4
static int head_parts(int num_tasks, int max_heads_per_task, int num_threads) {
    if (num_threads <= 1 || num_tasks >= 2 * num_threads) return 1;
    int parts = (2 * num_threads + num_tasks - 1) / num_tasks;
    const int most = max_heads_per_task / MIN_PART_HEADS;
    parts = parts < most ? parts : most;
    return parts > 1 ? parts : 1;
}

#if defined(__AVX512BF16__)
/* AVX512_BF16 path for bf16 caches (head_dim a multiple of 32, at most MAX_SIMD_DIM; a task reads at most
 * DP_MAX_ROW elements of each cache row): VDPBF16PS on the cache's own bf16 values, nothing widened.
 * Scores: the query's bf16 values (unscaled) dot each key, two dims per lane, float32 accumulation, then
 * times scale (as torch's bf16 SDPA scales q.k after its bf16 GEMM). Values: the softmax numerators
 * exp(s - max) rounded to bf16 (torch's CPU flash attention rounds them so before its P.V GEMM) weigh
 * pairs of value rows interleaved by VPUNPCK{L,H}WD, float32 accumulation; the float sum of the numerators
 * divides at the end. The interleave permutes dims inside each 128-bit lane; acc keeps that order until
 * the last step. Each head's output is computed alone, so it depends only on its query, keys and values.
 * qb: [H, D] bf16 queries; koff[h]: element offset of head h's kv head in a row slice of W elements
 * (k_cache/v_cache point at the slice); rows[t]: element offset of token t's row; scores: [H, L]; acc: [H, D]. */
#define DP_BF16 1
#define DP_MAX_ROW 1024
#include "bf16_pairs.h"
static inline __attribute__((always_inline)) void seq_dp_bf16(
    const uint16_t* restrict qb, const int* restrict koff, const float scale, const uint16_t* restrict k_cache,
    const uint16_t* restrict v_cache, const int64_t* restrict rows, const int L, float* restrict scores,
    float* restrict acc, const int H, const int D, const int W, const int* restrict lens, const float softcap) {
    const int DV = D / 32, l2 = prefetch_into_l2(); /* DV: 512-bit vectors per head row */
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int t0 = 0; t0 < L; t0 += 16) {
        const int n = L - t0 < 16 ? L - t0 : 16;
        prefetch_rows(k_cache, rows, t0 + PREFETCH_AHEAD, 16, L, W);
        const uint16_t* kr[16];
        for (int i = 0; i < 16; i++) kr[i] = k_cache + rows[t0 + (i < n ? i : 0)];
        for (int h = 0; h < H; h++) {
            const uint16_t* qh = qb + (int64_t)h * D;
            const int ko = koff[h];
            __m512 a[16];
            const __m512bh q0 = tm_load_bh(qh);
            for (int i = 0; i < 16; i++)
                a[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), tm_load_bh(kr[i] + ko), q0);
            for (int j = 1; j < DV; j++) {
                const __m512bh qv = tm_load_bh(qh + 32 * j);
                for (int i = 0; i < 16; i++)
                    a[i] = _mm512_dpbf16_ps(a[i], tm_load_bh(kr[i] + ko + 32 * j), qv);
            }
            _mm512_mask_storeu_ps(scores + (int64_t)h * L + t0, (__mmask16)((1u << n) - 1u),
                                  _mm512_mul_ps(vf_reduce(a), vscale));
        }
    }
    cap_scores(scores, (int64_t)H * L, softcap);
    float inv[H];
    for (int h = 0; h < H; h++) { /* head h attends to its first lens[h] keys; the rest weigh exactly 0 */
        float* sh = scores + (int64_t)h * L;
        const int n = lens[h];
        inv[h] = softmax_exp(sh, n);
        for (int t = n; t < L; t++) sh[t] = 0.f;
    }
    for (int i = 0; i < H * D; i++) acc[i] = 0.f;
    uint16_t vb[8 * 2 * DP_MAX_ROW] __attribute__((aligned(64))); /* the chunk's 8 value-row pairs, interleaved */
    for (int t0 = 0; t0 < L; t0 += 16) {
        const int n = L - t0 < 16 ? L - t0 : 16, np = (n + 1) / 2;
        prefetch_rows(v_cache, rows, t0 + PREFETCH_AHEAD, 16, L, W);
        for (int ip = 0; ip < np; ip++) {
            const uint16_t* x = v_cache + rows[t0 + 2 * ip];
            const int has_y = 2 * ip + 1 < n; /* an odd last row pairs with zeros */
            const uint16_t* y = v_cache + rows[t0 + 2 * ip + has_y];
            for (int j = 0; j < W; j += 32) {
                const __m512i xv = _mm512_loadu_si512(x + j);
                const __m512i yv = has_y ? _mm512_loadu_si512(y + j) : _mm512_setzero_si512();
                _mm512_store_si512(vb + ip * 2 * W + 2 * j, _mm512_unpacklo_epi16(xv, yv));
                _mm512_store_si512(vb + ip * 2 * W + 2 * j + 32, _mm512_unpackhi_epi16(xv, yv));
            }
        }
        for (int h = 0; h < H; h++) {
            uint32_t pp[8] __attribute__((aligned(32)));
            const __m512 p = _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), scores + (int64_t)h * L + t0);
            _mm256_store_si256((__m256i*)pp, _mm512_cvtepi32_epi16(tm_round_bf16_lanes(p)));
            float* ah = acc + (int64_t)h * D;
            const uint16_t* vh = vb + 2 * koff[h];
            for (int d0 = 0; d0 < 2 * D; d0 += 128) { /* 64 dims (4 vectors of interleaved pairs) at a time */
                const int nv = (2 * D - d0 < 128 ? 2 * D - d0 : 128) / 32;
                __m512 o[4];
                for (int k = 0; k < nv; k++) o[k] = _mm512_loadu_ps(ah + d0 / 2 + 16 * k);
                for (int ip = 0; ip < np; ip++) {
                    const __m512bh pv = (__m512bh)_mm512_set1_epi32((int)pp[ip]);
                    for (int k = 0; k < nv; k++)
                        o[k] = _mm512_dpbf16_ps(o[k], tm_load_bh(vh + ip * 2 * W + d0 + 32 * k), pv);
                }
                for (int k = 0; k < nv; k++) _mm512_storeu_ps(ah + d0 / 2 + 16 * k, o[k]);
            }
        }
    }
    /* undo the pair layout's order (bf16_pairs.h) */
    float tmp[MAX_SIMD_DIM];
    for (int h = 0; h < H; h++) {
        float* ah = acc + (int64_t)h * D;
        for (int i = 0; i < D; i++) tmp[tm_pair_dim(i)] = ah[i];
        for (int d = 0; d < D; d++) ah[d] = tmp[d] * inv[h];
    }
}

/* paged_decode_bf16 on the AVX512_BF16 path. Tasks: one per group of rows with all its kv heads (each
 * 16-token block is then one contiguous read) when the groups keep the threads busy; otherwise one per
 * (group, kv head), split over its query heads as head_parts says. */
static void paged_decode_bf16_dp(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                                 const int64_t* block_table, const int64_t* seq_lens, uint16_t* out,
                                 const int* start, int num_groups, int max_rows, int H, int KVH, int D,
                                 int block_size, int max_blocks, float scale, int window, float softcap,
                                 int num_threads) {
    const int G = H / KVH;
    const int whole = num_groups >= 2 * num_threads && KVH * D <= DP_MAX_ROW;
    const int per_group = whole ? 1 : KVH;
    const int parts = whole ? 1 : head_parts(num_groups * KVH, max_rows * G, num_threads);
    _Pragma("omp parallel for schedule(dynamic) num_threads(num_threads)")
    for (int task = 0; task < num_groups * per_group * parts; task++) {
        const int gi = task / (per_group * parts), part = task % parts;
        const int kv0 = whole ? 0 : (task / parts) % KVH, nkv = whole ? KVH : 1;
        const int g0 = start[gi], R = start[gi + 1] - g0;
        /* the task's heads, row-major over (row, head): all of each row's heads, or part `part` of the
         * R * G heads of kv head kv0 */
        const int all = R * G * nkv, h0 = (int)((int64_t)all * part / parts), h1 = (int)((int64_t)all * (part + 1) / parts);
        const int HG = h1 - h0;
        if (HG == 0) continue;
        const int first = first_key(seq_lens[g0 + R - 1], window), L = (int)seq_lens[g0 + R - 1] - first;
        uint16_t* qb = (uint16_t*)malloc(sizeof(uint16_t) * (size_t)HG * D);
        float* acc = (float*)malloc(sizeof(float) * (size_t)HG * D);
        float* scores = (float*)malloc(sizeof(float) * (size_t)HG * (L > 0 ? L : 1));
        int* lens = (int*)malloc(sizeof(int) * (size_t)HG * 3);
        int *koff = lens + HG, *head = lens + 2 * HG;
        for (int j = 0; j < HG; j++) {
            const int r = (h0 + j) / (G * nkv), hh = kv0 * G + (h0 + j) % (G * nkv); /* hh: head in the row */
            head[j] = (g0 + r) * H + hh;
            memcpy(qb + (int64_t)j * D, q + (int64_t)head[j] * D, sizeof(uint16_t) * (size_t)D);
            koff[j] = (hh / G - kv0) * D;
            lens[j] = (int)seq_lens[g0 + r] - first;
        }
        const int64_t* bt = block_table + (int64_t)g0 * max_blocks;
        int64_t* rows = (int64_t*)malloc(sizeof(int64_t) * (size_t)(L > 0 ? L : 1));
        const int64_t row = (int64_t)KVH * D;
        row_offsets(rows, bt, first, L, block_size, row);
        const uint16_t* kc = k_cache + (int64_t)kv0 * D;
        const uint16_t* vc = v_cache + (int64_t)kv0 * D;
        const int W = nkv * D;
        if (D == 64)
            seq_dp_bf16(qb, koff, scale, kc, vc, rows, L, scores, acc, HG, 64, W, lens, softcap);
        else if (D == 128)
            seq_dp_bf16(qb, koff, scale, kc, vc, rows, L, scores, acc, HG, 128, W, lens, softcap);
        else
            seq_dp_bf16(qb, koff, scale, kc, vc, rows, L, scores, acc, HG, D, W, lens, softcap);
        for (int j = 0; j < HG; j++)
            for (int d = 0; d < D; d++) out[(int64_t)head[j] * D + d] = f32_to_bf16(acc[(int64_t)j * D + d]);
        free(qb);
        free(acc);
        free(scores);
        free(lens);
        free(rows);
    }
}
#else
#define DP_BF16 0
#define DP_MAX_ROW 0
#define paged_decode_bf16_dp(...) ((void)0)
#endif

/* Whether bf16 decode takes the AVX512_BF16 path: dp_mode -1 auto (on AMD CPUs: 2.2x the per-kv-head float kernel's speed on a
 * Zen 4, where VDPBF16PS does twice the work of an FMA in one slot; an Intel Xeon, with two FMA ports,
 * measured a VDPBF16PS variant no faster earlier, so it keeps the float kernel), 0 off, 1 on (tests). */
static int dp_mode = -1;

/* Set the AVX512_BF16 path's use for bf16 caches: -1 auto (by CPU vendor), 0 off, 1 on. Returns whether
 * bf16 decode now takes it (always 0 in a build without it). */
int paged_decode_set_dp(int mode) {
    tm_amd_path_set(&dp_mode, mode);
    return DP_BF16 && tm_amd_path_on(&dp_mode);
}

#define DEFINE_PAGED_DECODE(NAME, SEQ, FAST, DP, T, LOAD, STORE)                                             \
void NAME(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_table,                    \
          const int64_t* seq_lens, T* out, int num_seqs, int num_heads, int num_kv_heads, int head_dim,  \
          int block_size, int max_blocks, float scale, int window, float softcap, int num_threads) {     \
    const int H = num_heads, D = head_dim, KVH = num_kv_heads, G = H / KVH;                              \
    const int simd = LANES && D % (LANES ? LANES : 1) == 0 && D <= MAX_SIMD_DIM;                         \
    int* start = (int*)malloc(sizeof(int) * (size_t)(num_seqs + 1));                                     \
    int num_groups = 0;                                                                                  \
    for (int s = 0; s < num_seqs; s++)                                                                   \
        if (s == 0 || !same_context(block_table, max_blocks, block_size, seq_lens, start[num_groups - 1], s, window)) \
            start[num_groups++] = s;                                                                     \
    start[num_groups] = num_seqs;                                                                        \
    int max_rows = 1;                                                                                    \
    for (int i = 0; i < num_groups; i++)                                                                 \
        max_rows = start[i + 1] - start[i] > max_rows ? start[i + 1] - start[i] : max_rows;              \
    if (DP && D % 32 == 0 && D <= MAX_SIMD_DIM && D <= DP_MAX_ROW && tm_amd_path_on(&dp_mode)) {      \
        paged_decode_bf16_dp((const uint16_t*)q, (const uint16_t*)k_cache, (const uint16_t*)v_cache, block_table, \
                             seq_lens, (uint16_t*)out, start, num_groups, max_rows, H, KVH, D, block_size, \
                             max_blocks, scale, window, softcap, num_threads);                           \
        free(start);                                                                                     \
        return;                                                                                          \
    }                                                                                                    \
    const int parts = head_parts(num_groups * KVH, max_rows * G, num_threads);                           \
    _Pragma("omp parallel for schedule(dynamic) num_threads(num_threads)")                              \
    for (int task = 0; task < num_groups * KVH * parts; task++) {                                        \
        const int gk = task / parts, part = task % parts;                                                \
        const int g0 = start[gk / KVH], R = start[gk / KVH + 1] - g0, kh = gk % KVH;                     \
        /* the task's query heads: part `part` of the group's R * G, row-major over (row, head in group) */ \
        const int all = R * G, h0 = (int)((int64_t)all * part / parts), h1 = (int)((int64_t)all * (part + 1) / parts); \
        const int HG = h1 - h0;                                                                          \
        if (HG == 0) continue; /* a smaller group than the one the parts were sized for */               \
        const int first = first_key(seq_lens[g0 + R - 1], window), L = (int)seq_lens[g0 + R - 1] - first; \
        float* qf = (float*)malloc(sizeof(float) * (size_t)HG * D);                                      \
        float* acc = (float*)malloc(sizeof(float) * (size_t)HG * D);                                     \
        float* scores = (float*)malloc(sizeof(float) * (size_t)HG * (L > 0 ? L : 1));                    \
        int* lens = (int*)malloc(sizeof(int) * (size_t)HG);                                              \
        for (int j = 0; j < HG; j++) {                                                                   \
            const int r = (h0 + j) / G, g = (h0 + j) % G;                                                \
            const T* qh = q + ((int64_t)(g0 + r) * H + kh * G + g) * D;                                  \
            for (int d = 0; d < D; d++) qf[j * D + d] = LOAD(qh[d]) * scale;                             \
            lens[j] = (int)seq_lens[g0 + r] - first;                                                     \
        }                                                                                                \
        const int64_t* bt = block_table + (int64_t)g0 * max_blocks;                                      \
        int64_t* rows = (int64_t*)malloc(sizeof(int64_t) * (size_t)(L > 0 ? L : 1));                     \
        const int64_t row = (int64_t)KVH * D;                                                            \
        row_offsets(rows, bt, first, L, block_size, row);                                                \
        const T* kc = k_cache + (int64_t)kh * D; /* this kv head's slice of every token row */           \
        const T* vc = v_cache + (int64_t)kh * D;                                                         \
        if (simd && D == 64)                                                                             \
            FAST(qf, kc, vc, rows, L, scores, acc, HG, 1, 64, lens, softcap);                            \
        else if (simd && D == 128)                                                                       \
            FAST(qf, kc, vc, rows, L, scores, acc, HG, 1, 128, lens, softcap);                           \
        else if (simd)                                                                                   \
            FAST(qf, kc, vc, rows, L, scores, acc, HG, 1, D, lens, softcap);                             \
        else                                                                                             \
            SEQ(qf, kc, vc, rows, L, scores, acc, HG, 1, D, lens, softcap);                              \
        for (int j = 0; j < HG; j++) {                                                                   \
            const int r = (h0 + j) / G, g = (h0 + j) % G;                                                \
            T* oh = out + ((int64_t)(g0 + r) * H + kh * G + g) * D;                                      \
            for (int d = 0; d < D; d++) oh[d] = STORE(acc[j * D + d]);                                   \
        }                                                                                                \
        free(qf);                                                                                        \
        free(acc);                                                                                       \
        free(scores);                                                                                    \
        free(lens);                                                                                      \
        free(rows);                                                                                      \
    }                                                                                                    \
    free(start);                                                                                         \
}

/* Which path this build compiled: "portable", "avx2", "avx512", "avx512_bf16" or "neon". */
const char* paged_decode_isa(void) { return ISA_PATH; }

DEFINE_PAGED_DECODE(paged_decode_f32, seq_f32, seq_fast_f32, 0, float, f32_id, f32_id)
DEFINE_PAGED_DECODE(paged_decode_bf16, seq_bf16, seq_fast_bf16, DP_BF16, uint16_t, bf16_to_f32, f32_to_bf16)
