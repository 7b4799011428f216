/* Batch-invariant SiLU-and-multiply for the deterministic mode: out[m, j] = silu(x[m, j]) * x[m, I + j].
 *
 * Layout: x [M, 2 * I] row-major (gate | up), out [M, I] row-major; float32 or bfloat16.
 * Why it is batch-invariant: torch's elementwise kernels send the elements at the end of each
 * thread's chunk through a scalar path whose exp differs from the vectorised one in the last bit,
 * and chunk boundaries move with the number of rows. Here every element goes through the same
 * instruction sequence, so a value never depends on its row, the row count or the thread count.
 * exp is written out below: Cody-Waite range reduction, degree-6 polynomial, then a correctly
 * rounded 2^n scaling (overflow to inf, subnormals rounded once).
 * Rounding follows torch's bf16 semantics: silu is rounded to bf16, then the product is rounded.
 *
 * ISA paths (csrc_build.py picks one; built with -ffp-contract=off): plain C one element at a time,
 * AVX-512 (16 lanes, masked tail), AVX2+FMA (8 lanes) and NEON (4 lanes), the last two finishing a
 * row through a zero-padded buffer. Every path gives the plain C path's bits, NaN and inf included:
 * each step is one IEEE operation (fma, mul, add, div, round-to-nearest-even) in the same order.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* exp(x) polynomial constants: exp(r) ~ 1 + r + r^2/2! + ... + r^6/6! for |r| <= ln2/2. */
#include "exp_poly.h" /* EXP_C2..EXP_C6, LN2_HI, LN2_LO, LOG2E */
/* Above ln(FLT_MAX) = 88.72 the result overflows to +inf, as torch's exp does (so silu of a gate below
 * -88.72 is g / inf = -0, and of -inf NaN); the clamp only keeps inf - inf out of the reduction. */
#define EXP_MAX_ARG 89.0f
#define EXP_MIN_ARG -87.0f

/* ---- plain C, one element at a time: the reference every other path matches bit for bit. */

static inline float exp1(float x) {
    x = fminf(fmaxf(x, EXP_MIN_ARG), EXP_MAX_ARG); /* a NaN becomes -87: silu's g / (...) stays NaN */
    const float n = nearbyintf(x * LOG2E);
    float r = fmaf(-n, LN2_HI, x);
    r = fmaf(-n, LN2_LO, r);
    float p = EXP_C6;
    p = fmaf(p, r, EXP_C5);
    p = fmaf(p, r, EXP_C4);
    p = fmaf(p, r, EXP_C3);
    p = fmaf(p, r, EXP_C2);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    return ldexpf(p, (int)n); /* n in [-126, 128]: correctly rounded, inf past FLT_MAX */
}

static inline float silu1(float g) { return g / (1.0f + exp1(-g)); }

static inline void row_f32_portable(const float* g, const float* u, float* o, int64_t I) {
    for (int64_t j = 0; j < I; j++) o[j] = silu1(g[j]) * u[j];
}

static inline void row_bf16_portable(const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t I) {
    for (int64_t j = 0; j < I; j++) {
        const float s = bf16_to_f32(f32_to_bf16(silu1(bf16_to_f32(g[j]))));
        o[j] = f32_to_bf16(s * bf16_to_f32(u[j]));
    }
}

#if defined(TM_PORTABLE)
#define ISA_PATH "portable"
#define PORTABLE_ROWS 1

#elif defined(__AVX512F__)
#include <immintrin.h>
#define ISA_PATH "avx512"

static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_MIN_ARG)), _mm512_set1_ps(EXP_MAX_ARG));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_C6);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C5));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 silu16(__m512 g) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

static inline __m512 load_bf16(const uint16_t* p, __mmask16 m) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* Round 16 floats to bf16 and store the masked lanes: the same rounding as f32_to_bf16 (bf16.h),
 * NaN becomes the canonical quiet NaN 0x7fc0. */
static inline void store_bf16(uint16_t* p, __m512 v, __mmask16 m) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(rounded));
}

static inline __m512 round_bf16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_ps(_mm512_castsi512_ps(r), nan, v);
}

static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
}

static inline void row_f32(const float* g, const float* u, float* o, int64_t I) {
    for (int64_t j = 0; j < I; j += 16) {
        const __mmask16 k = tail_mask(I - j);
        const __m512 s = silu16(_mm512_maskz_loadu_ps(k, g + j));
        _mm512_mask_storeu_ps(o + j, k, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(k, u + j)));
    }
}

static inline void row_bf16(const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t I) {
    for (int64_t j = 0; j < I; j += 16) {
        const __mmask16 k = tail_mask(I - j);
        const __m512 s = round_bf16(silu16(load_bf16(g + j, k)));
        store_bf16(o + j, _mm512_mul_ps(s, load_bf16(u + j, k)), k);
    }
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ISA_PATH "avx2"
#define VL 8
typedef __m256 vf;
typedef __m256i vi;

static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_load(const float* p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vf_neg(vf a) { return _mm256_sub_ps(_mm256_setzero_ps(), a); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }  /* a * b + c */
static inline vf vf_fnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); } /* c - a * b */
static inline vf vf_round(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* fmaxf/fminf: a NaN x gives the constant, as in exp1 (maxps returns its second operand on NaN). */
static inline vf vf_clamp(vf x, float lo, float hi) {
    return _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(lo)), _mm256_set1_ps(hi));
}
static inline vi vf_to_int(vf x) { return _mm256_cvtps_epi32(x); }
static inline vi vi_half(vi n) { return _mm256_srai_epi32(n, 1); }
static inline vi vi_sub(vi a, vi b) { return _mm256_sub_epi32(a, b); }
/* 2^n for integer n in [-126, 127], built from the exponent bits. */
static inline vf vf_pow2(vi n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}
static inline vf vf_load_bf16(const uint16_t* p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
/* f32_to_bf16 (bf16.h) on every lane, as 32-bit lanes holding the bf16 bits: NaN -> 0x7fc0. */
static inline vi vf_bf16_bits(vf v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}
static inline vf vf_round_bf16(vf v) { return _mm256_castsi256_ps(_mm256_slli_epi32(vf_bf16_bits(v), 16)); }
static inline void vf_store_bf16(uint16_t* p, vf v) {
    __m256i r = vf_bf16_bits(v); /* every lane <= 0xffff: packus is exact */
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128((__m128i*)p, packed);
}

#elif defined(__ARM_NEON)
#include <arm_neon.h>
#define ISA_PATH "neon"
#define VL 4
typedef float32x4_t vf;
typedef int32x4_t vi;

static inline vf vf_set1(float x) { return vdupq_n_f32(x); }
static inline vf vf_load(const float* p) { return vld1q_f32(p); }
static inline void vf_store(float* p, vf v) { vst1q_f32(p, v); }
static inline vf vf_mul(vf a, vf b) { return vmulq_f32(a, b); }
static inline vf vf_add(vf a, vf b) { return vaddq_f32(a, b); }
static inline vf vf_div(vf a, vf b) { return vdivq_f32(a, b); }
static inline vf vf_neg(vf a) { return vsubq_f32(vdupq_n_f32(0.0f), a); }
static inline vf vf_fma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }  /* a * b + c */
static inline vf vf_fnma(vf a, vf b, vf c) { return vfmsq_f32(c, a, b); } /* c - a * b */
static inline vf vf_round(vf x) { return vrndnq_f32(x); }
/* maxnm/minnm are fmaxf/fminf: a NaN x gives the constant, as in exp1. */
static inline vf vf_clamp(vf x, float lo, float hi) {
    return vminnmq_f32(vmaxnmq_f32(x, vdupq_n_f32(lo)), vdupq_n_f32(hi));
}
static inline vi vf_to_int(vf x) { return vcvtnq_s32_f32(x); }
static inline vi vi_half(vi n) { return vshrq_n_s32(n, 1); }
static inline vi vi_sub(vi a, vi b) { return vsubq_s32(a, b); }
static inline vf vf_pow2(vi n) { return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n, vdupq_n_s32(127)), 23)); }
static inline vf vf_load_bf16(const uint16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
static inline uint32x4_t vf_bf16_bits(vf v) {
    uint32x4_t u = vreinterpretq_u32_f32(v);
    uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    uint32x4_t r = vshrq_n_u32(vaddq_u32(u, vaddq_u32(lsb, vdupq_n_u32(0x7fff))), 16);
    uint32x4_t ordered = vceqq_f32(v, v);
    return vbslq_u32(ordered, r, vdupq_n_u32(0x7fc0));
}
static inline vf vf_round_bf16(vf v) { return vreinterpretq_f32_u32(vshlq_n_u32(vf_bf16_bits(v), 16)); }
static inline void vf_store_bf16(uint16_t* p, vf v) { vst1_u16(p, vmovn_u32(vf_bf16_bits(v))); }

#else
#define ISA_PATH "portable"
#define PORTABLE_ROWS 1
#endif

#if defined(VL) /* AVX2 and NEON: the same steps as exp1/silu1, VL lanes at a time */
static inline vf vf_exp(vf x) {
    x = vf_clamp(x, EXP_MIN_ARG, EXP_MAX_ARG);
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
    /* p * 2^n as ldexpf: n = n1 + n2 with n1, n2 in [-63, 64], so p * 2^n1 is exact and the second
     * multiply is the only rounding (overflow to inf at n = 128, one rounding into the subnormals). */
    const vi ni = vf_to_int(n);
    const vi n1 = vi_half(ni);
    return vf_mul(vf_mul(p, vf_pow2(n1)), vf_pow2(vi_sub(ni, n1)));
}

static inline vf vf_silu(vf g) { return vf_div(g, vf_add(vf_set1(1.0f), vf_exp(vf_neg(g)))); }

static inline vf step_f32(const float* g, const float* u) { return vf_mul(vf_silu(vf_load(g)), vf_load(u)); }
static inline vf step_bf16(const uint16_t* g, const uint16_t* u) {
    return vf_mul(vf_round_bf16(vf_silu(vf_load_bf16(g))), vf_load_bf16(u));
}

/* The last I % VL columns go through the same vector step on a zero-padded copy. */
static inline void row_f32(const float* g, const float* u, float* o, int64_t I) {
    int64_t j = 0;
    for (; j + VL <= I; j += VL) vf_store(o + j, step_f32(g + j, u + j));
    if (j < I) {
        float gb[VL] = {0}, ub[VL] = {0}, ob[VL];
        memcpy(gb, g + j, sizeof(float) * (size_t)(I - j));
        memcpy(ub, u + j, sizeof(float) * (size_t)(I - j));
        vf_store(ob, step_f32(gb, ub));
        memcpy(o + j, ob, sizeof(float) * (size_t)(I - j));
    }
}

static inline void row_bf16(const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t I) {
    int64_t j = 0;
    for (; j + VL <= I; j += VL) vf_store_bf16(o + j, step_bf16(g + j, u + j));
    if (j < I) {
        uint16_t gb[VL] = {0}, ub[VL] = {0}, ob[VL];
        memcpy(gb, g + j, sizeof(uint16_t) * (size_t)(I - j));
        memcpy(ub, u + j, sizeof(uint16_t) * (size_t)(I - j));
        vf_store_bf16(ob, step_bf16(gb, ub));
        memcpy(o + j, ob, sizeof(uint16_t) * (size_t)(I - j));
    }
}
#endif

#if defined(PORTABLE_ROWS)
#define row_f32 row_f32_portable
#define row_bf16 row_bf16_portable
#endif

/* Which path this build compiled: "portable", "avx2", "avx512" or "neon". */
const char* silu_and_mul_isa(void) { return ISA_PATH; }

void silu_and_mul_f32(const float* x, float* out, int64_t M, int64_t I, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t m = 0; m < M; m++) row_f32(x + m * 2 * I, x + m * 2 * I + I, out + m * I, I);
}

void silu_and_mul_bf16(const uint16_t* x, uint16_t* out, int64_t M, int64_t I, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t m = 0; m < M; m++) row_bf16(x + m * 2 * I, x + m * 2 * I + I, out + m * I, I);
}
