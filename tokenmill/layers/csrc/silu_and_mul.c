/* Batch-invariant SiLU-and-multiply for the deterministic mode: out[m, j] = silu(x[m, j]) * x[m, I + j].
 *
 * Layout: x [M, 2 * I] row-major (gate | up), out [M, I] row-major; float32 or bfloat16.
 * Why it is batch-invariant: torch's elementwise kernels send the elements at the end of each
 * thread's chunk through a scalar path whose exp differs from the vectorised one in the last bit,
 * and chunk boundaries move with the number of rows. Here every element goes through the same
 * instruction sequence: a 16-lane AVX-512 loop per row whose tail uses masked loads, and an exp
 * written out below (Cody-Waite range reduction, degree-6 polynomial, 2^n by scalef), so a value
 * never depends on its row, the row count or the thread count.
 * Rounding follows torch's bf16 semantics: silu is rounded to bf16, then the product is rounded.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

/* exp(x) polynomial constants: exp(r) ~ 1 + r + r^2/2! + ... + r^6/6! for |r| <= ln2/2. */
#define EXP_C2 0.5f
#define EXP_C3 0.16666667f
#define EXP_C4 0.041666668f
#define EXP_C5 0.008333334f
#define EXP_C6 0.0013888889f
#define LN2_HI 0.693145751953125f
#define LN2_LO 1.42860682030941723212e-6f
#define LOG2E 1.44269504088896341f
/* Above ln(FLT_MAX) = 88.72 the result overflows to +inf, as torch's exp does (so silu of a gate below
 * -88.72 is g / inf = -0, and of -inf NaN); the clamp only keeps inf - inf out of the reduction. */
#define EXP_MAX_ARG 89.0f

#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(EXP_MAX_ARG));
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

void silu_and_mul_f32(const float* x, float* out, int64_t M, int64_t I, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t m = 0; m < M; m++) {
        const float* g = x + m * 2 * I;
        const float* u = g + I;
        float* o = out + m * I;
        for (int64_t j = 0; j < I; j += 16) {
            const __mmask16 k = (I - j >= 16) ? (__mmask16)0xffff : (__mmask16)((1u << (I - j)) - 1u);
            const __m512 s = silu16(_mm512_maskz_loadu_ps(k, g + j));
            _mm512_mask_storeu_ps(o + j, k, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(k, u + j)));
        }
    }
}

void silu_and_mul_bf16(const uint16_t* x, uint16_t* out, int64_t M, int64_t I, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t m = 0; m < M; m++) {
        const uint16_t* g = x + m * 2 * I;
        const uint16_t* u = g + I;
        uint16_t* o = out + m * I;
        for (int64_t j = 0; j < I; j += 16) {
            const __mmask16 k = (I - j >= 16) ? (__mmask16)0xffff : (__mmask16)((1u << (I - j)) - 1u);
            const __m512 s = round_bf16(silu16(load_bf16(g + j, k)));
            store_bf16(o + j, _mm512_mul_ps(s, load_bf16(u + j, k)), k);
        }
    }
}

#else /* portable: the same formula one element at a time */

static inline float exp1(float x) {
    x = fminf(fmaxf(x, -87.0f), EXP_MAX_ARG);
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
    return ldexpf(p, (int)n);
}

static inline float silu1(float g) { return g / (1.0f + exp1(-g)); }

void silu_and_mul_f32(const float* x, float* out, int64_t M, int64_t I, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < I; j++) out[m * I + j] = silu1(x[m * 2 * I + j]) * x[m * 2 * I + I + j];
}

void silu_and_mul_bf16(const uint16_t* x, uint16_t* out, int64_t M, int64_t I, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < I; j++) {
            const float s = bf16_to_f32(f32_to_bf16(silu1(bf16_to_f32(x[m * 2 * I + j]))));
            out[m * I + j] = f32_to_bf16(s * bf16_to_f32(x[m * 2 * I + I + j]));
        }
}
#endif
