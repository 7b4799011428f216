/* Test-only <immintrin.h>: the AVX-512 intrinsics from SIMDe (portable C), everything narrower native.
 *
 * tests/test_avx512_emulated.py compiles a kernel's AVX-512 branch on a CPU without AVX-512 by putting
 * this directory first on the include path and defining the __AVX512*__ macros the kernel's macro
 * ladder tests (-D__AVX512F__ -D__AVX512BW__ -D__AVX512VL__ -D__AVX512DQ__ [-D__AVX512BF16__]), with
 * -mavx2 -mfma -mf16c but no -mavx512*. The compiler's own header is included first with those
 * macros hidden, so it declares AVX2/FMA/F16C (run natively) and its AVX-512 intrinsics the usual way
 * (callable only from AVX-512 target functions, which nothing here is). SIMDe then #defines every
 * _mm512_* / __m512* name the kernel uses to its own implementation, built from __m256 halves: the
 * *_NO_NATIVE macros stop it from forwarding to the real AVX-512 instructions because the __AVX512*__
 * macros say they exist. An AVX-512 intrinsic that neither SIMDe nor this file replaces reaches the
 * compiler's own and fails the build ("target specific option mismatch"), so nothing runs natively by
 * accident. FMA stays native on purpose: SIMDe's non-native fmadd is a multiply and a separate add (two
 * roundings), which is not the kernel's arithmetic.
 */
#ifndef TOKENMILL_SIMDE_SHIM_IMMINTRIN_H
#define TOKENMILL_SIMDE_SHIM_IMMINTRIN_H

#pragma push_macro("__AVX512F__")
#pragma push_macro("__AVX512BW__")
#pragma push_macro("__AVX512VL__")
#pragma push_macro("__AVX512DQ__")
#pragma push_macro("__AVX512BF16__")
#pragma push_macro("__AVX512VNNI__")
#undef __AVX512VNNI__
#undef __AVX512F__
#undef __AVX512BW__
#undef __AVX512VL__
#undef __AVX512DQ__
#undef __AVX512BF16__
#include_next <immintrin.h>
#pragma pop_macro("__AVX512F__")
#pragma pop_macro("__AVX512BW__")
#pragma pop_macro("__AVX512VL__")
#pragma pop_macro("__AVX512DQ__")
#pragma pop_macro("__AVX512BF16__")
#pragma pop_macro("__AVX512VNNI__")

#define SIMDE_X86_AVX512VNNI_NO_NATIVE
#define SIMDE_X86_AVX512F_NO_NATIVE
#define SIMDE_X86_AVX512BW_NO_NATIVE
#define SIMDE_X86_AVX512VL_NO_NATIVE
#define SIMDE_X86_AVX512DQ_NO_NATIVE
#define SIMDE_X86_AVX512BF16_NO_NATIVE
#define SIMDE_X86_AVX512CD_NO_NATIVE
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

/* <complex.h>, pulled in by SIMDe's SVML part, defines I; the kernels name a dimension I. */
#undef I

/* ---- What the SIMDe release in Debian 12 (0.7.4) lacks or gets wrong: each written from the
 * instruction's definition in Intel's intrinsics guide, lane by lane, and used whatever the SIMDe version
 * (the aliases are replaced, so every build runs the same emulation). Masked loads read only the
 * selected elements and masked stores write only those, as the instructions do (a kernel reading past
 * its buffer under a mask stays correct). */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* SIMDe 0.7.4 aliases the unmasked vpmaddwd to its masked form's four arguments. */
#undef _mm512_madd_epi16
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)

/* vcvtdq2ps: each 32-bit integer lane to float, rounded to nearest (native AVX2 on each half). */
static inline __m512 tm_shim_mm512_cvtepi32_ps(__m512i a) {
    __m256i h[2];
    __m256 r[2];
    memcpy(h, &a, sizeof h);
    r[0] = _mm256_cvtepi32_ps(h[0]);
    r[1] = _mm256_cvtepi32_ps(h[1]);
    __m512 v;
    memcpy(&v, r, sizeof v);
    return v;
}
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps tm_shim_mm512_cvtepi32_ps

#undef _mm512_shuffle_f32x4 /* SIMDe has it, without the alias */
#define _mm512_shuffle_f32x4(a, b, imm8) simde_mm512_shuffle_f32x4(a, b, imm8)

static inline __m512 tm_shim_mm512_maskz_loadu_ps(simde__mmask16 k, const void *p) {
    float r[16] = {0};
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) memcpy(&r[i], (const char *)p + 4 * i, 4);
    __m512 v;
    memcpy(&v, r, sizeof v);
    return v;
}
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps tm_shim_mm512_maskz_loadu_ps

static inline void tm_shim_mm512_mask_storeu_ps(void *p, simde__mmask16 k, __m512 a) {
    float r[16];
    memcpy(r, &a, sizeof r);
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) memcpy((char *)p + 4 * i, &r[i], 4);
}
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps tm_shim_mm512_mask_storeu_ps

static inline __m256i tm_shim_mm256_maskz_loadu_epi16(simde__mmask16 k, const void *p) {
    uint16_t r[16] = {0};
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) memcpy(&r[i], (const char *)p + 2 * i, 2);
    __m256i v;
    memcpy(&v, r, sizeof v);
    return v;
}
#undef _mm256_maskz_loadu_epi16
#define _mm256_maskz_loadu_epi16 tm_shim_mm256_maskz_loadu_epi16

static inline __m512i tm_shim_mm512_maskz_loadu_epi16(simde__mmask32 k, const void *p) {
    uint16_t r[32] = {0};
    for (int i = 0; i < 32; i++)
        if ((k >> i) & 1) memcpy(&r[i], (const char *)p + 2 * i, 2);
    __m512i v;
    memcpy(&v, r, sizeof v);
    return v;
}
#undef _mm512_maskz_loadu_epi16
#define _mm512_maskz_loadu_epi16 tm_shim_mm512_maskz_loadu_epi16

static inline void tm_shim_mm256_mask_storeu_epi16(void *p, simde__mmask16 k, __m256i a) {
    uint16_t r[16];
    memcpy(r, &a, sizeof r);
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) memcpy((char *)p + 2 * i, &r[i], 2);
}
#undef _mm256_mask_storeu_epi16
#define _mm256_mask_storeu_epi16 tm_shim_mm256_mask_storeu_epi16

/* vpcmpud with _MM_CMPINT_NLE: unsigned a > b per 32-bit lane. */
static inline simde__mmask16 tm_shim_mm512_cmpgt_epu32_mask(__m512i a, __m512i b) {
    uint32_t x[16], y[16];
    memcpy(x, &a, sizeof x);
    memcpy(y, &b, sizeof y);
    simde__mmask16 k = 0;
    for (int i = 0; i < 16; i++)
        if (x[i] > y[i]) k |= (simde__mmask16)(1u << i);
    return k;
}
#undef _mm512_cmpgt_epu32_mask
#define _mm512_cmpgt_epu32_mask tm_shim_mm512_cmpgt_epu32_mask

/* vpmovdw: each 32-bit lane truncated to its low 16 bits. */
static inline __m256i tm_shim_mm512_cvtepi32_epi16(__m512i a) {
    uint32_t x[16];
    uint16_t r[16];
    memcpy(x, &a, sizeof x);
    for (int i = 0; i < 16; i++) r[i] = (uint16_t)x[i];
    __m256i v;
    memcpy(&v, r, sizeof v);
    return v;
}
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16 tm_shim_mm512_cvtepi32_epi16

/* vpmovzxwd: each 16-bit lane zero-extended to 32 bits. */
static inline __m512i tm_shim_mm512_cvtepu16_epi32(__m256i a) {
    uint16_t x[16];
    uint32_t r[16];
    memcpy(x, &a, sizeof x);
    for (int i = 0; i < 16; i++) r[i] = x[i];
    __m512i v;
    memcpy(&v, r, sizeof v);
    return v;
}
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32 tm_shim_mm512_cvtepu16_epi32

/* vpmovsxwd: each 16-bit lane sign-extended to 32 bits. */
static inline __m512i tm_shim_mm512_cvtepi16_epi32(__m256i a) {
    int16_t x[16];
    int32_t r[16];
    memcpy(x, &a, sizeof x);
    for (int i = 0; i < 16; i++) r[i] = x[i];
    __m512i v;
    memcpy(&v, r, sizeof v);
    return v;
}
#undef _mm512_cvtepi16_epi32
#define _mm512_cvtepi16_epi32 tm_shim_mm512_cvtepi16_epi32

/* vextractf32x8: the 256-bit half selected by imm8 bit 0. */
static inline __m256 tm_shim_mm512_extractf32x8_ps(__m512 a, int imm8) {
    __m256 h[2];
    memcpy(h, &a, sizeof h);
    return h[imm8 & 1];
}
#undef _mm512_extractf32x8_ps
#define _mm512_extractf32x8_ps tm_shim_mm512_extractf32x8_ps

/* The horizontal reductions (a sequence of instructions, not one): in the order GCC's own header uses,
 * so a kernel sees the association it gets on real hardware: the two 256-bit halves, the two 128-bit
 * halves of that, lanes (0, 2) and (1, 3), then those two. */
static inline float tm_shim_mm512_reduce_add_ps(__m512 a) {
    __m256 h[2];
    memcpy(h, &a, sizeof h);
    __m256 s8 = _mm256_add_ps(h[1], h[0]);
    __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
    __m128 s2 = _mm_add_ps(s4, _mm_shuffle_ps(s4, s4, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(s2) + _mm_cvtss_f32(_mm_shuffle_ps(s2, s2, 1));
}
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps tm_shim_mm512_reduce_add_ps

static inline float tm_shim_mm512_reduce_max_ps(__m512 a) {
    __m256 h[2];
    memcpy(h, &a, sizeof h);
    __m256 s8 = _mm256_max_ps(h[1], h[0]);
    __m128 s4 = _mm_max_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
    __m128 s2 = _mm_max_ps(s4, _mm_shuffle_ps(s4, s4, _MM_SHUFFLE(1, 0, 3, 2)));
    __m128 s1 = _mm_max_ps(s2, _mm_shuffle_ps(s2, s2, _MM_SHUFFLE(0, 1, 0, 1)));
    return _mm_cvtss_f32(s1);
}
#undef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps tm_shim_mm512_reduce_max_ps

/* vscalefps: a * 2^floor(b), rounded once (denormal a used as it is, as with MXCSR.DAZ clear). SIMDe
 * 0.7.4 multiplies by exp2(floor(b)) instead, which is inf at b = 128 where a * 2^128 is still finite for
 * a < 1 (the kernels' exp at 88.5), and flushes a denormal a to zero. */
static inline float tm_shim_scalef1(float a, float b) {
    if (isnan(a) || isnan(b)) return a + b; /* a quiet NaN */
    if (isinf(b)) {
        if (a == 0.0f) return b > 0 ? NAN : a;    /* 0 * 2^inf: invalid; 0 * 2^-inf = 0 */
        if (isinf(a)) return b > 0 ? a : NAN;     /* inf * 2^-inf: invalid */
        return b > 0 ? copysignf(INFINITY, a) : copysignf(0.0f, a);
    }
    float n = floorf(b);
    n = n > 1000.0f ? 1000.0f : n < -1000.0f ? -1000.0f : n; /* past +-1000 every finite a saturates anyway */
    return scalbnf(a, (int)n);
}

static inline __m512 tm_shim_mm512_scalef_ps(__m512 a, __m512 b) {
    float x[16], y[16];
    memcpy(x, &a, sizeof x);
    memcpy(y, &b, sizeof y);
    for (int i = 0; i < 16; i++) x[i] = tm_shim_scalef1(x[i], y[i]);
    __m512 v;
    memcpy(&v, x, sizeof v);
    return v;
}
#undef _mm512_scalef_ps
#define _mm512_scalef_ps tm_shim_mm512_scalef_ps

#endif /* TOKENMILL_SIMDE_SHIM_IMMINTRIN_H */
