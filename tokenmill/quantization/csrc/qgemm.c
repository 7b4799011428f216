/* Matrix products with GGUF block-quantized weights, read as stored (never expanded to float in memory).
 *
 *   y[m, n] = sum_k x[m, k] * W[n, k]      x: [M, K] float32 or bf16, y: [M, N] float32 or bf16 (row
 *                                           stride ldy), W: N rows of K/BLOCK blocks in a GGUF format
 *
 * Formats (ggml type ids; block layouts as the GGUF file format defines them, implemented here from
 * that description): Q4_0 (2), Q4_1 (3), Q8_0 (8), Q4_K (12), Q6_K (14). Every format is read as
 * groups of 32 weights, each group w_k = D * s_h * u_k + o_h, with u_k an unsigned code (4 or 6 bits,
 * or |q| for Q8_0), s_h an integer sub-scale per half group of 16 and o_h a float offset per half.
 *
 * Activations are quantized per group of 32 (llama.cpp's "q8" scheme, written from its description):
 * dx = max|x| / 127, xq = round(x / dx) in int8, plus the sum of xq per half group. A group then costs
 * one integer dot product (exact in int32) and two float multiply-adds:
 *   y += dx * D * sum_h(s_h * sum(u * xq)) + dx * sum_h(o_h * sum_h(xq)).
 * The error against float products is at most 0.5 * dx * sum|w| per group (the activation rounding).
 *
 * Each y[m, n] is computed by the same instructions whatever M, m, the other rows or the thread count
 * (threads split N; row tiles only share the decoded weight codes), so a row's result depends only on
 * its own input row: the kernel is batch invariant. ISA paths: plain C (TM_PORTABLE, or no SIMD),
 * AVX2 (maddubs), AVX-512BW (two groups per instruction), AVX-512 VNNI (vpdpbusd for the formats without
 * sub-scales) when TM_VNNI is set (the loader sets it where the CPU has avx512_vnni). The bf16 path has
 * nothing bf16-specific: activations are quantized to int8 whatever their type.
 * Built at run time by tokenmill/quantization/qgemm.py; tests/test_quantized_weights.py holds every path
 * to a dequantize-then-float reference (the `gguf` package's dequantizer).
 */
#if defined(TM_AMX)
#define _GNU_SOURCE /* syscall() under -std=c11, for the AMX permission request */
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "bf16.h"

#if !defined(TM_PORTABLE) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QG_AVX2 1
#define QG_AVX512 1
#if defined(TM_VNNI) && defined(__AVX512VNNI__)
#define QG_VNNI 1
#endif
#if defined(TM_AMX) && defined(QG_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define QG_AMX 1
#if defined(TM_AMX_BF16) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define QG_AMX_BF16 1
#endif
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__AVX512BF16__)
#define ISA_PATH "avx512_bf16"
#else
#define ISA_PATH "avx512"
#endif
#elif !defined(TM_PORTABLE) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QG_AVX2 1
#define ISA_PATH "avx2"
#elif !defined(TM_PORTABLE) && defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#define QG_NEON 1
#define ISA_PATH "neon"
#else
#define ISA_PATH "portable"
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
       IQ4_NL = 20, IQ4_XS = 23 };
/* IQ4_NL / IQ4_XS: a 4-bit code indexes this table of int8 values (the GGUF format's non-linear grid). */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* Formats whose stored-layout codes are signed (the value itself: Q8_0's q, IQ4's table value). */
#define SIGNED_CODES(qt) ((qt) == Q8_0 || (qt) == IQ4_NL || (qt) == IQ4_XS)
#define QK 32    /* weights per group */
#define QKK 256  /* weights per K-quant super block */
#define ROW_TILE 4

static float half_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal half: normalise */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400u));
            bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    union { uint32_t u; float f; } v = {bits};
    return v.f;
}

#define AI static inline __attribute__((always_inline))

#if defined(__F16C__) && !defined(TM_PORTABLE)
AI float rd_half(const uint8_t* p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }
#else
static inline float rd_half(const uint8_t* p) { return half_to_f32((uint16_t)(p[0] | (p[1] << 8))); }
#endif

int64_t qg_block_size(int qtype) {
    switch (qtype) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: case IQ4_NL: return QK;
    case Q2_K: case Q3_K: case Q4_K: case Q5_K: case Q6_K: case IQ4_XS: return QKK;
    default: return 0;
    }
}

int64_t qg_block_bytes(int qtype) {
    switch (qtype) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q2_K: return 84;
    case Q3_K: return 110;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case IQ4_NL: return 18;
    case IQ4_XS: return 136;
    case Q6_K: return 210;
    default: return 0;
    }
}

static inline int64_t row_bytes(int qtype, int64_t K) { return K / qg_block_size(qtype) * qg_block_bytes(qtype); }

/* Q4_K's 6-bit sub-block scale and min, sub-block j in 0..7 of the 12 packed bytes. */
AI void k4_scale_min(const uint8_t* s, int j, int* sc, int* mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Q3_K's signed scale of sub-block i (0..15) from the 12 packed bytes: low 4 bits in byte i % 8 (nibble
 * i / 8), high 2 bits in byte 8 + i % 4 (bits 2 (i / 4)), minus 32. */
AI int q3k_scale(const uint8_t* s, int i) {
    return (((s[i % 8] >> (4 * (i / 8))) & 15) | (((s[8 + i % 4] >> (2 * (i / 4))) & 3) << 4)) - 32;
}

/* IQ4_XS's signed scale of group j (0..7) of a super block b: 4 low bits in b[4 + j / 2] (nibble j % 2),
 * 2 high bits in the 16-bit scales_h at b + 2 (bits 2j), minus 32. */
AI int iq4xs_scale(const uint8_t* b, int j) {
    const int h = (b[2 + j / 4] >> (2 * (j % 4))) & 3;
    return (((b[4 + j / 2] >> (4 * (j % 2))) & 15) | (h << 4)) - 32;
}

/* What every path needs of group g of a weight row besides its codes: D, integer half scales s0/s1
 * and float half offsets o0/o1 (w = D * s_h * u + o_h). */
typedef struct { float D, o0, o1; int s0, s1; } group_info;

AI group_info group_params(int qtype, const uint8_t* row, int64_t g) {
    group_info gi;
    switch (qtype) {
    case Q4_0: {
        const uint8_t* b = row + g * 18;
        gi.D = rd_half(b); gi.s0 = gi.s1 = 1; gi.o0 = gi.o1 = -8.0f * gi.D;
        break;
    }
    case Q4_1: {
        const uint8_t* b = row + g * 20;
#if defined(__F16C__) && !defined(TM_PORTABLE)
        int32_t dm;
        memcpy(&dm, b, 4);
        const __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128(dm)); /* d, m */
        gi.D = _mm_cvtss_f32(v); gi.o0 = gi.o1 = _mm_cvtss_f32(_mm_movehdup_ps(v));
#else
        gi.D = rd_half(b); gi.o0 = gi.o1 = rd_half(b + 2);
#endif
        gi.s0 = gi.s1 = 1;
        break;
    }
    case Q8_0: {
        const uint8_t* b = row + g * 34;
        gi.D = rd_half(b); gi.s0 = gi.s1 = 1; gi.o0 = gi.o1 = 0.0f;
        break;
    }
    case Q5_0: {
        const uint8_t* b = row + g * 22;
        gi.D = rd_half(b); gi.s0 = gi.s1 = 1; gi.o0 = gi.o1 = -16.0f * gi.D;
        break;
    }
    case Q5_1: {
        const uint8_t* b = row + g * 24;
        gi.D = rd_half(b); gi.s0 = gi.s1 = 1; gi.o0 = gi.o1 = rd_half(b + 2);
        break;
    }
    case Q4_K: case Q5_K: {
        const uint8_t* b = row + (g / 8) * (qtype == Q4_K ? 144 : 176);
        int sc, mn;
        k4_scale_min(b + 4, (int)(g % 8), &sc, &mn);
        gi.D = rd_half(b); gi.s0 = gi.s1 = sc; gi.o0 = gi.o1 = -rd_half(b + 2) * (float)mn;
        break;
    }
    case Q2_K: { /* per 16 weights a 4-bit scale (low nibble) and a 4-bit min (high nibble) */
        const uint8_t* b = row + (g / 8) * 84;
        const int j = (int)(g % 8);
        const float dmin = rd_half(b + 82);
        gi.D = rd_half(b + 80);
        gi.s0 = b[2 * j] & 15;
        gi.s1 = b[2 * j + 1] & 15;
        gi.o0 = -dmin * (float)(b[2 * j] >> 4);
        gi.o1 = -dmin * (float)(b[2 * j + 1] >> 4);
        break;
    }
    case Q3_K: { /* per 16 weights a 6-bit scale - 32; codes u = q + 4 */
        const uint8_t* b = row + (g / 8) * 110;
        const int j = (int)(g % 8);
        gi.D = rd_half(b + 108);
        gi.s0 = q3k_scale(b + 96, 2 * j);
        gi.s1 = q3k_scale(b + 96, 2 * j + 1);
        gi.o0 = -4.0f * gi.D * (float)gi.s0;
        gi.o1 = -4.0f * gi.D * (float)gi.s1;
        break;
    }
    case IQ4_NL: {
        gi.D = rd_half(row + g * 18); gi.s0 = gi.s1 = 1; gi.o0 = gi.o1 = 0.0f;
        break;
    }
    case IQ4_XS: { /* per 32 weights a 6-bit scale - 32 (4 low bits in scales_l, 2 high in scales_h) */
        const uint8_t* b = row + (g / 8) * 136;
        gi.D = rd_half(b);
        gi.s0 = gi.s1 = iq4xs_scale(b, (int)(g % 8));
        gi.o0 = gi.o1 = 0.0f;
        break;
    }
    default: { /* Q6_K */
        const uint8_t* b = row + (g / 8) * 210;
        const int8_t* sc = (const int8_t*)(b + 192);
        const int j = (int)(g % 8), half = j / 4, gi4 = j % 4;
        gi.D = rd_half(b + 208);
        gi.s0 = sc[8 * half + 2 * gi4];
        gi.s1 = sc[8 * half + 2 * gi4 + 1];
        gi.o0 = -32.0f * gi.D * (float)gi.s0;
        gi.o1 = -32.0f * gi.D * (float)gi.s1;
        break;
    }
    }
    return gi;
}

/* The 32 codes of group g (plain C): unsigned 4/5/6-bit codes, or Q8_0's signed q (its offset is 0). */
static inline void group_codes(int qtype, const uint8_t* row, int64_t g, int* u) {
    switch (qtype) {
    case Q5_0: case Q5_1: { /* low nibbles as Q4_0/Q4_1, bit k of the 32-bit qh the fifth bit of code k */
        const uint8_t* b = row + g * (qtype == Q5_0 ? 22 : 24) + (qtype == Q5_0 ? 2 : 4);
        const uint32_t qh = (uint32_t)b[0] | ((uint32_t)b[1] << 8) | ((uint32_t)b[2] << 16) | ((uint32_t)b[3] << 24);
        for (int i = 0; i < 16; i++) {
            u[i] = (b[4 + i] & 15) | (int)(((qh >> i) & 1) << 4);
            u[i + 16] = (b[4 + i] >> 4) | (int)(((qh >> (i + 16)) & 1) << 4);
        }
        break;
    }
    case Q2_K: case Q3_K: { /* 2 bits of qs[32 (j / 4) + i] at bit 2 (j % 4); Q3_K: the third bit, bit j of hmask[i] */
        const uint8_t* b = row + (g / 8) * (qtype == Q2_K ? 84 : 110);
        const int j = (int)(g % 8);
        const uint8_t* qs = b + (qtype == Q2_K ? 16 : 32) + 32 * (j / 4);
        for (int i = 0; i < 32; i++) {
            u[i] = (qs[i] >> (2 * (j % 4))) & 3;
            if (qtype == Q3_K) u[i] |= ((b[i] >> j) & 1) << 2;
        }
        break;
    }
    case IQ4_NL: case IQ4_XS: { /* nibbles as Q4_0's, each the index of its signed value */
        const uint8_t* qs = qtype == IQ4_NL ? row + g * 18 + 2 : row + (g / 8) * 136 + 8 + 16 * (g % 8);
        for (int i = 0; i < 16; i++) { u[i] = IQ4_VALUES[qs[i] & 15]; u[i + 16] = IQ4_VALUES[qs[i] >> 4]; }
        break;
    }
    case Q5_K: { /* sub-block j: nibble j % 2 of qs[32 (j / 2) + i], fifth bit: bit j of qh[i] */
        const uint8_t* b = row + (g / 8) * 176;
        const int j = (int)(g % 8), shift = (j % 2) * 4;
        const uint8_t* qs = b + 48 + (j / 2) * 32;
        for (int i = 0; i < 32; i++) u[i] = ((qs[i] >> shift) & 15) | (((b[16 + i] >> j) & 1) << 4);
        break;
    }
    case Q4_0: case Q4_1: {
        const uint8_t* qs = row + g * (qtype == Q4_0 ? 18 : 20) + (qtype == Q4_0 ? 2 : 4);
        for (int i = 0; i < 16; i++) { u[i] = qs[i] & 15; u[i + 16] = qs[i] >> 4; }
        break;
    }
    case Q8_0: {
        const int8_t* qs = (const int8_t*)(row + g * 34 + 2);
        for (int i = 0; i < 32; i++) u[i] = qs[i];
        break;
    }
    case Q4_K: {
        const uint8_t* qs = row + (g / 8) * 144 + 16 + (g % 8) / 2 * 32;
        const int shift = (int)(g % 2) * 4;
        for (int i = 0; i < 32; i++) u[i] = (qs[i] >> shift) & 15;
        break;
    }
    default: { /* Q6_K */
        const uint8_t* b = row + (g / 8) * 210;
        const int j = (int)(g % 8), half = j / 4, gi4 = j % 4;
        const uint8_t* ql = b + 64 * half + (gi4 & 1) * 32;
        const uint8_t* qh = b + 128 + 32 * half;
        const int lshift = (gi4 >> 1) * 4, hshift = 2 * gi4;
        for (int i = 0; i < 32; i++) u[i] = ((ql[i] >> lshift) & 15) | (((qh[i] >> hshift) & 3) << 4);
        break;
    }
    }
}

/* The offset term of group g for activation row m: one product for the formats with one offset per
 * group (Q4_0, Q4_1, Q5_x, Q4_K), none for the signed-code formats, two for those with one per 16 weights. */
AI float offset_term(int qtype, const group_info* gi, const float* s, const float* t, int64_t idx) {
    if (SIGNED_CODES(qtype)) return 0.0f;
    if (qtype == Q6_K || qtype == Q3_K || qtype == Q2_K) return gi->o0 * s[idx * 2] + gi->o1 * s[idx * 2 + 1];
    return gi->o0 * t[idx];
}

/* One row of K weights as float32 (of) or bf16 (ob): w = D * (s_h * u) + o_h per element. qtype is a
 * constant at each call below, so the format's switch folds away and the element loops vectorise. */
#if defined(QG_AVX512)
/* 16 floats to bf16 bits, rounded to nearest even, any NaN the canonical 0x7fc0 (as f32_to_bf16). */
AI __m256i bf16x16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
}
#endif

AI void dequantize_row(int qtype, const uint8_t* row, int64_t G, float* of, uint16_t* ob) {
    for (int64_t g = 0; g < G; g++) {
        int u[32];
        float v[32];
        const group_info gi = group_params(qtype, row, g);
#if defined(QG_AVX512)
        /* The same products and sums as the loops below, 16 lanes at a time (no FMA: bit-identical). */
        __m512i c0, c1;
        if (qtype == Q4_0 || qtype == Q4_1) { /* bytes widened via 16 bits (the SIMDe test shim has no vpmovzxbd) */
            const __m128i q = _mm_loadu_si128((const __m128i*)(row + g * (qtype == Q4_0 ? 18 : 20) + (qtype == Q4_0 ? 2 : 4)));
            const __m512i b = _mm512_cvtepu16_epi32(_mm256_cvtepu8_epi16(q));
            c0 = _mm512_and_si512(b, _mm512_set1_epi32(15));
            c1 = _mm512_srli_epi32(b, 4);
        } else if (qtype == Q8_0) { /* signed bytes, eight at a time (AVX2), joined into 16 lanes */
            const int8_t* qs = (const int8_t*)(row + g * 34 + 2);
            __m256i part[4];
            for (int i = 0; i < 4; i++) part[i] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(qs + 8 * i)));
            c0 = _mm512_inserti64x4(_mm512_castsi256_si512(part[0]), part[1], 1);
            c1 = _mm512_inserti64x4(_mm512_castsi256_si512(part[2]), part[3], 1);
        } else {
            group_codes(qtype, row, g, u);
            c0 = _mm512_loadu_si512(u);
            c1 = _mm512_loadu_si512(u + 16);
        }
        const __m512 d = _mm512_set1_ps(gi.D);
        const __m512 v0 = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_mullo_epi32(_mm512_set1_epi32(gi.s0), c0))),
                                        _mm512_set1_ps(gi.o0));
        const __m512 v1 = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_mullo_epi32(_mm512_set1_epi32(gi.s1), c1))),
                                        _mm512_set1_ps(gi.o1));
        if (of) {
            _mm512_storeu_ps(of + g * QK, v0);
            _mm512_storeu_ps(of + g * QK + 16, v1);
        } else {
            _mm256_storeu_si256((__m256i*)(ob + g * QK), bf16x16(v0));
            _mm256_storeu_si256((__m256i*)(ob + g * QK + 16), bf16x16(v1));
        }
        continue;
#endif
        group_codes(qtype, row, g, u);
        for (int i = 0; i < 16; i++) v[i] = gi.D * (float)(gi.s0 * u[i]) + gi.o0;
        for (int i = 16; i < 32; i++) v[i] = gi.D * (float)(gi.s1 * u[i]) + gi.o1;
        if (of) memcpy(of + g * QK, v, sizeof(v));
        else for (int i = 0; i < 32; i++) ob[g * QK + i] = f32_to_bf16(v[i]);
    }
}

/* ---------------------------------------------------------------- activations */

typedef struct {
    int8_t* q;    /* [M, K] */
    float* d;     /* [M, G] */
    float* s;     /* [M, 2G]: dx * (sum of q per half group) */
    float* t;     /* [M, G]: dx * (sum of q over the group) */
    int32_t* i;   /* [M, G]: sum of q over the group (the tiled kernels' integer offset term) */
    int32_t* h;   /* [M, 2G]: sum of q per half group (Q6_K tiles: one scale per half) */
    int64_t K, G;
} act_q;

/* A group's scale d = max|x| / 127 and its inverse. Returns 0 when the group's int8 codes are all 0
 * instead: a NaN or an infinity in the group (d is then NaN, so the products come out NaN, as float
 * products would), or max|x| so small (below 127 / FLT_MAX, or 0) that 127 / max|x| is not finite
 * (d is then that tiny scale, or 0, and the group adds nothing). Both quantization paths use it, so they
 * agree on these groups too. */
static inline int group_scales(float amax, int nan, float* d, float* id) {
    *d = amax / 127.0f;
    *id = 0.0f;
    if (nan || isinf(amax)) { *d = NAN; return 0; }
    const float inv = 127.0f / amax; /* amax == 0: +inf */
    if (isinf(inv)) return 0;
    *id = inv;
    return 1;
}

#if defined(QG_AVX2)
static inline int hsum_i32x8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* One group of 32 as the scalar loop below computes it, 8 lanes at a time (the same bits: one float
 * multiply per value, round-half-even by MXCSR's default mode like nearbyintf, |x*id| <= 127 needs no
 * saturation, integer sums exact). NaN values are ignored by the maximum, as there. */
static inline void quantize_group_avx2(const float* v32, const uint16_t* b32, int8_t* q, float* dp, int* s0p, int* s1p) {
    __m256 v[4];
    for (int j = 0; j < 4; j++)
        v[j] = b32 ? _mm256_castsi256_ps(_mm256_slli_epi32(
                         _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(b32 + 8 * j))), 16))
                   : _mm256_loadu_ps(v32 + 8 * j);
    const __m256 nosign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 mx = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) mx = _mm256_max_ps(_mm256_and_ps(v[j], nosign), mx); /* NaN lane: keeps mx */
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 0x55));
    const float amax = _mm_cvtss_f32(m4);
    int nan = 0;
    for (int j = 0; j < 4; j++) nan |= _mm256_movemask_ps(_mm256_cmp_ps(v[j], v[j], _CMP_UNORD_Q));
    float d, id;
    if (!group_scales(amax, nan, &d, &id)) { /* the group's codes are 0 (see group_scales) */
        memset(q, 0, 32);
        *dp = d;
        *s0p = *s1p = 0;
        return;
    }
    const __m256 idv = _mm256_set1_ps(id);
    __m256i i[4];
    for (int j = 0; j < 4; j++) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], idv));
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    *dp = d;
    *s0p = hsum_i32x8(_mm256_add_epi32(i[0], i[1]));
    *s1p = hsum_i32x8(_mm256_add_epi32(i[2], i[3]));
}
#endif

/* Group idx's scale and code sums, as the products read them. */
static inline void store_group(act_q* a, int64_t idx, float d, int s0, int s1) {
    a->d[idx] = d;
    a->s[idx * 2] = d * (float)s0;
    a->s[idx * 2 + 1] = d * (float)s1;
    a->t[idx] = d * (float)(s0 + s1);
    a->i[idx] = s0 + s1;
    a->h[idx * 2] = s0;
    a->h[idx * 2 + 1] = s1;
}

static void quantize_row(const void* x, int x_bf16, int64_t m, act_q* a) {
    const int64_t K = a->K;
#if defined(QG_AVX2)
    for (int64_t g = 0; g < a->G; g++) {
        const int64_t k0 = m * K + g * QK;
        float d;
        int s0, s1;
        quantize_group_avx2(x_bf16 ? NULL : (const float*)x + k0, x_bf16 ? (const uint16_t*)x + k0 : NULL,
                            a->q + k0, &d, &s0, &s1);
        store_group(a, m * a->G + g, d, s0, s1);
    }
    return;
#endif
    for (int64_t g = 0; g < a->G; g++) {
        float v[32], amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            const int64_t k = m * K + g * QK + i;
            v[i] = x_bf16 ? bf16_to_f32(((const uint16_t*)x)[k]) : ((const float*)x)[k];
            const float av = fabsf(v[i]);
            amax = av > amax ? av : amax;
        }
        int nan = 0;
        for (int i = 0; i < 32; i++) nan |= v[i] != v[i];
        float d, id;
        int8_t* q = a->q + m * K + g * QK;
        int s0 = 0, s1 = 0;
        if (!group_scales(amax, nan, &d, &id)) memset(q, 0, 32);
        else for (int i = 0; i < 32; i++) {
            float r = nearbyintf(v[i] * id);
            r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
            q[i] = (int8_t)r;
            if (i < 16) s0 += q[i]; else s1 += q[i];
        }
        store_group(a, m * a->G + g, d, s0, s1);
    }
}

static inline void store_out(void* y, int y_bf16, int64_t idx, float v) {
    if (y_bf16) ((uint16_t*)y)[idx] = f32_to_bf16(v); else ((float*)y)[idx] = v;
}

#if defined(QG_NEON)
/* ---------------------------------------------------------------- NEON integer parts */

/* Group g's codes as two vectors of 16 int8 (codes <= 63, or Q8_0's signed q). */
AI void codes_neon(int qtype, const uint8_t* row, int64_t g, int8x16_t* c0, int8x16_t* c1) {
    const uint8x16_t m4 = vdupq_n_u8(15);
    switch (qtype) {
    case Q5_0: case Q5_1: case Q5_K: case Q2_K: case Q3_K: case IQ4_NL: case IQ4_XS: { /* codes in plain C */
        int u[32];
        int8_t b[32];
        group_codes(qtype, row, g, u);
        for (int i = 0; i < 32; i++) b[i] = (int8_t)u[i];
        *c0 = vld1q_s8(b);
        *c1 = vld1q_s8(b + 16);
        break;
    }
    case Q4_0: case Q4_1: {
        const uint8x16_t q = vld1q_u8(row + g * (qtype == Q4_0 ? 18 : 20) + (qtype == Q4_0 ? 2 : 4));
        *c0 = vreinterpretq_s8_u8(vandq_u8(q, m4));
        *c1 = vreinterpretq_s8_u8(vshrq_n_u8(q, 4));
        break;
    }
    case Q8_0: {
        const int8_t* qs = (const int8_t*)(row + g * 34 + 2);
        *c0 = vld1q_s8(qs);
        *c1 = vld1q_s8(qs + 16);
        break;
    }
    case Q4_K: {
        const uint8_t* qs = row + (g / 8) * 144 + 16 + (g % 8) / 2 * 32;
        uint8x16_t a = vld1q_u8(qs), b = vld1q_u8(qs + 16);
        if (g % 2) { a = vshrq_n_u8(a, 4); b = vshrq_n_u8(b, 4); }
        *c0 = vreinterpretq_s8_u8(vandq_u8(a, m4));
        *c1 = vreinterpretq_s8_u8(vandq_u8(b, m4));
        break;
    }
    default: { /* Q6_K */
        const uint8_t* bl = row + (g / 8) * 210;
        const int j = (int)(g % 8), half = j / 4, gi4 = j % 4;
        const uint8_t* ql = bl + 64 * half + (gi4 & 1) * 32;
        const uint8_t* qh = bl + 128 + 32 * half;
        const int8x16_t lshift = vdupq_n_s8((int8_t)(-((gi4 >> 1) * 4))), hshift = vdupq_n_s8((int8_t)(-2 * gi4));
        const uint8x16_t three = vdupq_n_u8(3);
        for (int h = 0; h < 2; h++) {
            const uint8x16_t lo = vandq_u8(vshlq_u8(vld1q_u8(ql + 16 * h), lshift), m4);
            const uint8x16_t hi = vandq_u8(vshlq_u8(vld1q_u8(qh + 16 * h), hshift), three);
            const int8x16_t c = vreinterpretq_s8_u8(vorrq_u8(lo, vshlq_n_u8(hi, 4)));
            if (h == 0) *c0 = c; else *c1 = c;
        }
        break;
    }
    }
}

/* Exact int32 sum of 16 products of int8 (|products| <= 128 * 127 fit int16). */
AI int32_t dot16_neon(int8x16_t c, const int8_t* x) {
    const int8x16_t v = vld1q_s8(x);
    const int32x4_t s = vaddq_s32(vpaddlq_s16(vmull_s8(vget_low_s8(c), vget_low_s8(v))),
                                  vpaddlq_s16(vmull_high_s8(c, v)));
    return vaddvq_s32(s);
}
#endif

/* ---------------------------------------------------------------- plain C product (and NEON) */

/* The integer sums are exact, and the float part below is the same code on both, so the NEON build
 * gives the portable build's bits. */
AI void rows_portable(int qtype, const uint8_t* row, const act_q* a, int64_t m0, int R, float* out) {
    float acc[ROW_TILE] = {0};
    for (int64_t g = 0; g < a->G; g++) {
        group_info gi = group_params(qtype, row, g);
#if defined(QG_NEON)
        int8x16_t c0, c1;
        codes_neon(qtype, row, g, &c0, &c1);
#else
        int u[32];
        group_codes(qtype, row, g, u);
#endif
        for (int r = 0; r < R; r++) {
            const int8_t* xq = a->q + (m0 + r) * a->K + g * QK;
#if defined(QG_NEON)
            const int32_t p0 = dot16_neon(c0, xq), p1 = dot16_neon(c1, xq + 16);
#else
            int32_t p0 = 0, p1 = 0;
            for (int i = 0; i < 16; i++) { p0 += u[i] * xq[i]; p1 += u[i + 16] * xq[i + 16]; }
#endif
            const int64_t gi_idx = (m0 + r) * a->G + g;
            acc[r] += a->d[gi_idx] * gi.D * (float)(gi.s0 * p0 + gi.s1 * p1)
                      + offset_term(qtype, &gi, a->s, a->t, gi_idx);
        }
    }
    for (int r = 0; r < R; r++) out[r] = acc[r];
}

#if defined(QG_AVX2)
/* ---------------------------------------------------------------- AVX2 */

/* Group g's codes in 32 bytes and its half scales as 16 int16 lanes (lanes 0-7: bytes 0-15). For Q8_0
 * the codes are |q| and *sign holds q (the activations take q's sign: vpsignb), so no code exceeds 128
 * and vpmaddubsw cannot saturate. */
AI __m256i codes_avx2(int qtype, const uint8_t* row, int64_t g, __m256i* sign) {
    const __m256i m4 = _mm256_set1_epi8(15);
    switch (qtype) {
    case Q5_0: case Q5_1: case Q5_K: case Q2_K: case Q3_K: case IQ4_NL: case IQ4_XS: {
        /* written out in plain C (the tiled layout is the fast one); IQ4's signed values as |q| and sign */
        int u[32];
        uint8_t b[32];
        group_codes(qtype, row, g, u);
        for (int i = 0; i < 32; i++) b[i] = (uint8_t)u[i];
        const __m256i q = _mm256_loadu_si256((const __m256i*)b);
        if (!SIGNED_CODES(qtype)) return q;
        *sign = q;
        return _mm256_sign_epi8(q, q);
    }
    case Q4_0: case Q4_1: {
        const uint8_t* qs = row + g * (qtype == Q4_0 ? 18 : 20) + (qtype == Q4_0 ? 2 : 4);
        const __m128i q = _mm_loadu_si128((const __m128i*)qs);
        const __m256i qq = _mm256_set_m128i(_mm_srli_epi16(q, 4), q);
        return _mm256_and_si256(qq, m4);
    }
    case Q8_0: {
        const __m256i q = _mm256_loadu_si256((const __m256i*)(row + g * 34 + 2));
        *sign = q;
        return _mm256_sign_epi8(q, q);
    }
    case Q4_K: {
        const __m256i q = _mm256_loadu_si256((const __m256i*)(row + (g / 8) * 144 + 16 + (g % 8) / 2 * 32));
        return _mm256_and_si256(g % 2 ? _mm256_srli_epi16(q, 4) : q, m4);
    }
    default: { /* Q6_K */
        const uint8_t* b = row + (g / 8) * 210;
        const int j = (int)(g % 8), half = j / 4, gi4 = j % 4;
        __m256i ql = _mm256_loadu_si256((const __m256i*)(b + 64 * half + (gi4 & 1) * 32));
        __m256i qh = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * half));
        if (gi4 >> 1) ql = _mm256_srli_epi16(ql, 4);
        ql = _mm256_and_si256(ql, m4);
        qh = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * gi4)), _mm256_set1_epi8(3));
        return _mm256_or_si256(ql, _mm256_slli_epi16(qh, 4));
    }
    }
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One group's contribution for R rows (the AVX2 step, also the AVX-512 paths' odd tail group). */
AI void group_avx2(int qtype, const uint8_t* row, int64_t g, const act_q* a, int64_t m0, int R,
                              __m256* accv, float* accs) {
    __m256i sign = _mm256_setzero_si256();
    const __m256i u = codes_avx2(qtype, row, g, &sign);
    const group_info gi = group_params(qtype, row, g);
    const __m256i sc = _mm256_set_m128i(_mm_set1_epi16((short)gi.s1), _mm_set1_epi16((short)gi.s0));
    for (int r = 0; r < R; r++) {
        __m256i xq = _mm256_loadu_si256((const __m256i*)(a->q + (m0 + r) * a->K + g * QK));
        if (SIGNED_CODES(qtype)) xq = _mm256_sign_epi8(xq, sign);
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, xq), sc);
        const int64_t idx = (m0 + r) * a->G + g;
        const float dx = a->d[idx];
        accv[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(gi.D * dx), accv[r]);
        accs[r] += offset_term(qtype, &gi, a->s, a->t, idx);
    }
}
#endif

#if defined(QG_AVX512)
/* ---------------------------------------------------------------- AVX-512: two groups per step */

AI void groups_avx512(int qtype, const uint8_t* row, int64_t g, const act_q* a, int64_t m0, int R,
                                 __m512* accv, float* accs) {
    __m256i sign0 = _mm256_setzero_si256(), sign1 = _mm256_setzero_si256();
    const __m256i u0 = codes_avx2(qtype, row, g, &sign0), u1 = codes_avx2(qtype, row, g + 1, &sign1);
    const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(u0), u1, 1);
    const __m512i sign = _mm512_inserti64x4(_mm512_castsi256_si512(sign0), sign1, 1);
    const group_info g0 = group_params(qtype, row, g), g1 = group_params(qtype, row, g + 1);
    const int unit = qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0 || qtype == IQ4_NL;
    const __m512i sc = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_set_m128i(_mm_set1_epi16((short)g0.s1), _mm_set1_epi16((short)g0.s0))),
        _mm256_set_m128i(_mm_set1_epi16((short)g1.s1), _mm_set1_epi16((short)g1.s0)), 1);
    (void)unit;
    for (int r = 0; r < R; r++) {
        __m512i xq = _mm512_loadu_si512((const void*)(a->q + (m0 + r) * a->K + g * QK));
        if (SIGNED_CODES(qtype)) { /* negate the activations where q < 0 (no 512-bit vpsignb) */
            const __mmask64 neg = _mm512_movepi8_mask(sign);
            xq = _mm512_mask_sub_epi8(xq, neg, _mm512_setzero_si512(), xq);
        }
        __m512i p;
#if defined(QG_VNNI)
        if (unit) p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, xq);
        else p = _mm512_madd_epi16(_mm512_maddubs_epi16(u, xq), sc);
#else
        p = _mm512_madd_epi16(_mm512_maddubs_epi16(u, xq), sc);
#endif
        const int64_t idx = (m0 + r) * a->G + g;
        const float dx0 = a->d[idx], dx1 = a->d[idx + 1];
        const __m512 scale = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(g0.D * dx0)),
                                                _mm256_set1_ps(g1.D * dx1), 1);
        accv[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, accv[r]);
        accs[r] += offset_term(qtype, &g0, a->s, a->t, idx);
        accs[r] += offset_term(qtype, &g1, a->s, a->t, idx + 1);
    }
}
#endif

/* out[r] = y[m0 + r, n] for R <= ROW_TILE rows against one weight row. */
AI void rows_dot(int qtype, const uint8_t* row, const act_q* a, int64_t m0, int R, float* out) {
#if defined(QG_AVX512)
    __m512 acc[ROW_TILE];
    __m256 acc8[ROW_TILE];
    float accs[ROW_TILE];
    for (int r = 0; r < ROW_TILE; r++) { acc[r] = _mm512_setzero_ps(); acc8[r] = _mm256_setzero_ps(); accs[r] = 0.0f; }
    int64_t g = 0;
    for (; g + 2 <= a->G; g += 2) groups_avx512(qtype, row, g, a, m0, R, acc, accs);
    if (g < a->G) group_avx2(qtype, row, g, a, m0, R, acc8, accs);
    for (int r = 0; r < R; r++) {
        const __m256 lo = _mm512_castps512_ps256(acc[r]);
        const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1));
        out[r] = hsum8(_mm256_add_ps(_mm256_add_ps(lo, hi), acc8[r])) + accs[r];
    }
#elif defined(QG_AVX2)
    __m256 acc[ROW_TILE];
    float accs[ROW_TILE];
    for (int r = 0; r < ROW_TILE; r++) { acc[r] = _mm256_setzero_ps(); accs[r] = 0.0f; }
    for (int64_t g = 0; g < a->G; g++) group_avx2(qtype, row, g, a, m0, R, acc, accs);
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]) + accs[r];
#else
    rows_portable(qtype, row, a, m0, R, out);
#endif
}

/* Rows n0..n1 of y for every m, one format (a constant, so each instance is specialised). */
AI void task_rows(int qtype, const uint8_t* w, int64_t rb, const act_q* a, int64_t n0, int64_t n1, int64_t M, void* y,
                  int y_bf16, int64_t ldy) {
    for (int64_t m0 = 0; m0 < M; m0 += ROW_TILE) {
        const int R = (int)(M - m0 < ROW_TILE ? M - m0 : ROW_TILE);
        for (int64_t n = n0; n < n1; n++) {
            float out[ROW_TILE];
            if (R == ROW_TILE) rows_dot(qtype, w + n * rb, a, m0, ROW_TILE, out);
            else if (R == 1) rows_dot(qtype, w + n * rb, a, m0, 1, out);
            else rows_dot(qtype, w + n * rb, a, m0, R, out);
            for (int r = 0; r < R; r++) store_out(y, y_bf16, (m0 + r) * ldy + n, out[r]);
        }
    }
}

#define DEFINE_TASK(NAME, QT) \
    static void NAME(const uint8_t* w, int64_t rb, const act_q* a, int64_t n0, int64_t n1, int64_t M, void* y, \
                     int y_bf16, int64_t ldy) { task_rows(QT, w, rb, a, n0, n1, M, y, y_bf16, ldy); }
DEFINE_TASK(task_q4_0, Q4_0)
DEFINE_TASK(task_q4_1, Q4_1)
DEFINE_TASK(task_q8_0, Q8_0)
DEFINE_TASK(task_q4_k, Q4_K)
DEFINE_TASK(task_q6_k, Q6_K)
DEFINE_TASK(task_q5_0, Q5_0)
DEFINE_TASK(task_q5_1, Q5_1)
DEFINE_TASK(task_q5_k, Q5_K)
DEFINE_TASK(task_q2_k, Q2_K)
DEFINE_TASK(task_q3_k, Q3_K)
DEFINE_TASK(task_iq4_nl, IQ4_NL)
DEFINE_TASK(task_iq4_xs, IQ4_XS)

/* ---------------------------------------------------------------- tiled layout (Q4_0, Q4_1, Q8_0)
 *
 * qg_repack rewrites a Q4_0, Q4_1 or Q8_0 weight, once at load, into the same number of bytes: rows
 * n < N - N % TP in tiles of TP = 16 rows, the rest (the tail) as stored. Tile t (rows 16t..16t+15)
 * is G tile-groups of 16 * block bytes, group g of all 16 rows together:
 *   scales  16 x fp16 D, row p at 2p                                          (32 bytes)
 *   mins    16 x fp16 m (Q4_1 only)                                           (32 bytes)
 *   codes   4-bit: 4 chunks of 64 bytes; chunk j, bytes 4p..4p+3 hold row p's codes k = 4j..4j+3 in
 *           their low nibbles and k = 16+4j..16+4j+3 in their high nibbles (the stored block's bytes
 *           4j..4j+3: a plain copy);
 *           Q8_0: 8 chunks of 64 bytes; chunk j, bytes 4p..4p+3 hold u = q + 128 (unsigned) of row p,
 *           k = 4j..4j+3.
 * So one 32-bit broadcast of 4 activations against a 64-byte chunk multiplies row p's 4 codes in lane
 * p: vpdpbusd (VNNI), or vpmaddubsw + vpmaddwd, gives the 16 rows' integer dot products of a group in
 * the lanes of one register with no horizontal sum. With w = D * (u - c) (c = 8 for Q4_0, 128 for Q8_0)
 * or w = D * u + m (Q4_1), and xs the group's sum of xq, the exact integer part of a group is
 *   I = sum_k u_k * xq_k - c * xs   (every path gets the same I; the maddubs paths sum q * xq for Q8_0)
 * and every path does the same two float steps per group, lane by lane:
 *   acc = fma((float)I, D * dx, acc)          then, Q4_1 only:   acc = fma(m, dx * xs, acc)
 * (portable C with fmaf), so every ISA path gives the same bits, and each y[m, n] depends only on row m
 * of x, the weight and N (which rows are tail rows). The AVX2 path reads each tile as two halves of 8
 * rows (the first and second 32 bytes of every 64-byte chunk). The tail rows take the row kernels above.
 */
#define QG_TILED 256 /* added to a format's type id: the tiled layout of that format */
#define TP 16        /* weight rows per tile */
#if defined(QG_AVX512)
#define TILE_M 8 /* activation rows per pass over a tile: 8 accumulators + 8 code vectors fit the 32 zmm registers */
#else
#define TILE_M 4 /* activation rows per pass over a tile (16 ymm registers on AVX2) */
#endif

/* The format of a tiled type id (Q4_0, Q4_1 or Q8_0), or 0 for any other id. */
static int tiled_base(int qtype) {
    const int b = qtype - QG_TILED;
    return b == Q4_0 || b == Q4_1 || b == Q8_0 ? b : 0;
}

AI int codes_offset(int base) { return base == Q4_1 ? 64 : 32; }

AI int32_t load_i32(const int8_t* p) { int32_t v; memcpy(&v, p, 4); return v; }

/* src: N rows of a Q4_0/Q4_1/Q8_0 weight as stored; dst: the same bytes in the tiled layout (not
 * overlapping src). Returns 0, or -1 for another format or a K that is not a whole number of groups. */
static void kt_repack(int fmt, const uint8_t* src, int64_t N, int64_t K, uint8_t* dst);
static int kt_base(int qtype);
int qg_repack(int qtype, const uint8_t* src, int64_t N, int64_t K, uint8_t* dst) {
    if (kt_base(QG_TILED + qtype)) { /* Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: qg_tiles_kq.h */
        if (K <= 0 || K % qg_block_size(qtype)) return -1;
        kt_repack(qtype, src, N, K, dst);
        return 0;
    }
    if ((qtype != Q4_0 && qtype != Q4_1 && qtype != Q8_0) || K <= 0 || K % QK) return -1;
    const int64_t G = K / QK, bb = qg_block_bytes(qtype), rb = G * bb, NT = N / TP;
    const int hdr = qtype == Q4_1 ? 4 : 2, co = codes_offset(qtype);
    for (int64_t t = 0; t < NT; t++) {
        for (int64_t g = 0; g < G; g++) {
            uint8_t* o = dst + (t * G + g) * TP * bb;
            for (int p = 0; p < TP; p++) {
                const uint8_t* blk = src + (t * TP + p) * rb + g * bb;
                memcpy(o + 2 * p, blk, 2);
                if (qtype == Q4_1) memcpy(o + 32 + 2 * p, blk + 2, 2);
                const int nq = qtype == Q8_0 ? 32 : 16;
                for (int k = 0; k < nq; k++)
                    o[co + 64 * (k / 4) + 4 * p + k % 4] = (uint8_t)(blk[hdr + k] ^ (qtype == Q8_0 ? 0x80 : 0));
            }
        }
    }
    memcpy(dst + NT * TP * rb, src + NT * TP * rb, (size_t)((N - NT * TP) * rb));
    return 0;
}

/* Row p of a tile's group g back as the stored block (into blk): the inverse of qg_repack. */
AI void untile_block(int base, const uint8_t* tg, int p, uint8_t* blk) {
    const int hdr = base == Q4_1 ? 4 : 2, co = codes_offset(base), nq = base == Q8_0 ? 32 : 16;
    memcpy(blk, tg + 2 * p, 2);
    if (base == Q4_1) memcpy(blk + 2, tg + 32 + 2 * p, 2);
    for (int j = 0; j < nq / 4; j++) { /* 4 codes at a time */
        uint32_t v;
        memcpy(&v, tg + co + 64 * j + 4 * p, 4);
        if (base == Q8_0) v ^= 0x80808080u;
        memcpy(blk + hdr + 4 * j, &v, 4);
    }
}

/* Row r of a tiled weight of N rows as float32/bf16: each block rebuilt as stored and expanded by
 * dequantize_row, so the values are the stored format's bit for bit. */
AI void dequantize_tiled_row(int base, const uint8_t* w, int64_t N, int64_t G, int64_t r, float* of, uint16_t* ob) {
    const int64_t bb = qg_block_bytes(base), rb = G * bb;
    if (r >= N / TP * TP) { dequantize_row(base, w + r * rb, G, of, ob); return; }
    const uint8_t* tile = w + (r / TP) * TP * rb;
    uint8_t blk[34];
    for (int64_t g = 0; g < G; g++) {
        untile_block(base, tile + g * TP * bb, (int)(r % TP), blk);
        dequantize_row(base, blk, 1, of ? of + g * QK : NULL, ob ? ob + g * QK : NULL);
    }
}

/* The integer offset c of the tiled products (see above); the maddubs paths use q for Q8_0 (c = 0). */
AI int tiled_offset(int base, int unsigned_q8) {
    return base == Q4_0 ? 8 : base == Q8_0 && unsigned_q8 ? 128 : 0;
}

/* acc[r][p] = y[m0 + r, 16t + p] (plain C; one tile, R <= TILE_M activation rows). */
AI void tile_portable(int base, const uint8_t* tile, const act_q* a, int64_t m0, int R, float acc[][TP]) {
    const int64_t tgb = TP * qg_block_bytes(base);
    const int c = tiled_offset(base, 1), co = codes_offset(base);
    for (int r = 0; r < R; r++) for (int p = 0; p < TP; p++) acc[r][p] = 0.0f;
    for (int64_t g = 0; g < a->G; g++) {
        const uint8_t* b = tile + g * tgb;
        int u[TP][32];
        float d[TP], mn[TP];
        for (int p = 0; p < TP; p++) {
            d[p] = half_to_f32((uint16_t)(b[2 * p] | (b[2 * p + 1] << 8)));
            mn[p] = base == Q4_1 ? half_to_f32((uint16_t)(b[32 + 2 * p] | (b[33 + 2 * p] << 8))) : 0.0f;
            for (int k = 0; k < 16; k++) {
                if (base == Q8_0) {
                    u[p][k] = b[co + 64 * (k / 4) + 4 * p + k % 4];
                    u[p][k + 16] = b[co + 64 * (k / 4 + 4) + 4 * p + k % 4];
                } else {
                    const uint8_t byte = b[co + 64 * (k / 4) + 4 * p + k % 4];
                    u[p][k] = byte & 15;
                    u[p][k + 16] = byte >> 4;
                }
            }
        }
        for (int r = 0; r < R; r++) {
            const int8_t* xq = a->q + (m0 + r) * a->K + g * QK;
            const int64_t idx = (m0 + r) * a->G + g;
            const float dx = a->d[idx], tx = a->t[idx];
            for (int p = 0; p < TP; p++) {
                int32_t I = -c * a->i[idx];
                for (int k = 0; k < 32; k++) I += u[p][k] * xq[k];
                acc[r][p] = fmaf((float)I, d[p] * dx, acc[r][p]);
                if (base == Q4_1) acc[r][p] = fmaf(mn[p], tx, acc[r][p]);
            }
        }
    }
}

/* Groups ahead that the first pass over a tile prefetches (see tile_avx512's pf). */
#define TILE_PREFETCH_GROUPS 4

#if defined(QG_AVX2) && !defined(QG_AVX512)
/* acc[r] lanes = y[m0 + r, 16t + 8h + p], p < 8: half h of a tile (AVX2: vpmaddubsw + vpmaddwd). */
AI void tile_avx2(int base, const uint8_t* tile, int h, const act_q* a, int64_t m0, int R, __m256* acc, int pf) {
    const int64_t tgb = TP * qg_block_bytes(base);
    const int c = tiled_offset(base, 0), co = codes_offset(base);
    const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(15);
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < a->G; g++) {
        const uint8_t* b = tile + g * tgb;
        if (pf) /* as tile_avx512's pf */
            for (int64_t o = 0; o < tgb; o += 64) _mm_prefetch((const char*)b + TILE_PREFETCH_GROUPS * tgb + o, _MM_HINT_T0);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + 16 * h)));
        const __m256 mn = base == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + 32 + 16 * h)))
                                       : _mm256_setzero_ps();
        const uint8_t* cs = b + co + 32 * h;
        __m256i u[8], q[8];
        if (base == Q8_0) {
            for (int j = 0; j < 8; j++) {
                q[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(cs + 64 * j)), _mm256_set1_epi8((char)0x80));
                u[j] = _mm256_abs_epi8(q[j]); /* |q| <= 128: vpmaddubsw cannot saturate */
            }
        } else {
            for (int j = 0; j < 4; j++) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(cs + 64 * j));
                u[j] = _mm256_and_si256(v, m4);
                u[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            }
        }
        for (int r = 0; r < R; r++) {
            const int8_t* xq = a->q + (m0 + r) * a->K + g * QK;
            const int64_t idx = (m0 + r) * a->G + g;
            __m256i s = _mm256_set1_epi32(-c * a->i[idx]);
            if (base == Q8_0) {
                for (int j = 0; j < 8; j++) {
                    const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(xq + 4 * j)), q[j]);
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(u[j], x), ones));
                }
            } else { /* 16-bit sums of 8 pairs of 15 * 127 stay below 32768 */
                __m256i s16 = _mm256_setzero_si256();
                for (int j = 0; j < 8; j++)
                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(u[j], _mm256_set1_epi32(load_i32(xq + 4 * j))));
                s = _mm256_add_epi32(s, _mm256_madd_epi16(s16, ones));
            }
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(a->d[idx]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r]);
            if (base == Q4_1) acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a->t[idx]), acc[r]);
        }
    }
}
#endif

#if defined(QG_AVX512)
#if defined(QG_VNNI)
/* acc + u . (the 4 signed bytes at p, broadcast). Written as one VPDPBUSD with an embedded {1to16} memory
 * broadcast: gcc emits a separate VPBROADCASTD for the intrinsic form, and the fused form made the tiled
 * products 8-12% faster at 64-256 rows on a Zen 4 (same bits: integer sums). The SIMDe-emulated test
 * builds (tests/csrc/simde_shim, no AVX-512 instructions) take the intrinsic form. */
AI __m512i dpbusd_bcast(__m512i acc, __m512i u, const int8_t* p) {
#if defined(TOKENMILL_SIMDE_SHIM_IMMINTRIN_H)
    return _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(load_i32(p)));
#else
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t*)p));
    return acc;
#endif
}
#endif
AI __m512 half16(const uint8_t* p) { /* 16 fp16 to float32 (two F16C conversions) */
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p))),
                              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16))), 1);
}

/* acc[r] lanes = y[m0 + r, 16t + p]: one tile (vpdpbusd with VNNI, else vpmaddubsw + vpmaddwd).
 * pf: prefetch the weight bytes TILE_PREFETCH_GROUPS groups ahead (they run on into the next tile, which
 * the same task or the next one reads next). The first pass over a tile of a product of 4 or more rows
 * sets it: there the weights stream from L3 or memory while several rows' products run, and the hardware
 * prefetcher alone left the stream latency-bound (a 49152 x 576 Q8_0 product at 8 rows, weights not in
 * cache: 2.19 -> 1.75 ms on a Zen 4; Q4_1 layers 10-20% faster at 8-16 rows). One row reads too little
 * per group to gain, and later passes find the tile in L1. Prefetches do not change any result. */
AI void tile_avx512(int base, const uint8_t* tile, const act_q* a, int64_t m0, int R, __m512* acc, int pf) {
    const int64_t tgb = TP * qg_block_bytes(base);
#if defined(QG_VNNI)
    const int c = tiled_offset(base, 1);
#else
    const int c = tiled_offset(base, 0);
    const __m512i ones = _mm512_set1_epi16(1);
#endif
    const int co = codes_offset(base);
    const __m512i m4 = _mm512_set1_epi8(15);
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < a->G; g++) {
        const uint8_t* b = tile + g * tgb;
        if (pf)
            for (int64_t o = 0; o < tgb; o += 64) _mm_prefetch((const char*)b + TILE_PREFETCH_GROUPS * tgb + o, _MM_HINT_T0);
        const __m512 d = half16(b);
        const __m512 mn = base == Q4_1 ? half16(b + 32) : _mm512_setzero_ps();
        const uint8_t* cs = b + co;
        __m512i u[8];
        if (base == Q8_0) {
            for (int j = 0; j < 8; j++) u[j] = _mm512_loadu_si512((const void*)(cs + 64 * j));
        } else {
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512((const void*)(cs + 64 * j));
                u[j] = _mm512_and_si512(v, m4);
                u[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            }
        }
#if !defined(QG_VNNI)
        __m512i q[8];
        if (base == Q8_0)
            for (int j = 0; j < 8; j++) {
                q[j] = _mm512_xor_si512(u[j], _mm512_set1_epi8((char)0x80));
                u[j] = _mm512_abs_epi8(q[j]);
            }
#endif
        for (int r = 0; r < R; r++) {
            const int8_t* xq = a->q + (m0 + r) * a->K + g * QK;
            const int64_t idx = (m0 + r) * a->G + g;
            __m512i s = _mm512_set1_epi32(-c * a->i[idx]);
#if defined(QG_VNNI)
            /* two independent chains of vpdpbusd (the integer sums are exact in any order): a row's
             * products do not wait on one 8-deep dependency chain when few rows run */
            __m512i s1 = _mm512_setzero_si512(), s2 = _mm512_setzero_si512(), s3 = _mm512_setzero_si512();
            for (int j = 0; j < 8; j += 4) {
                s = dpbusd_bcast(s, u[j], xq + 4 * j);
                s1 = dpbusd_bcast(s1, u[j + 1], xq + 4 * j + 4);
                s2 = dpbusd_bcast(s2, u[j + 2], xq + 4 * j + 8);
                s3 = dpbusd_bcast(s3, u[j + 3], xq + 4 * j + 12);
            }
            s = _mm512_add_epi32(_mm512_add_epi32(s, s1), _mm512_add_epi32(s2, s3));
#else
            if (base == Q8_0) {
                for (int j = 0; j < 8; j++) { /* x takes q's sign (no 512-bit vpsignb) */
                    __m512i x = _mm512_set1_epi32(load_i32(xq + 4 * j));
                    x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(q[j]), _mm512_setzero_si512(), x);
                    s = _mm512_add_epi32(s, _mm512_madd_epi16(_mm512_maddubs_epi16(u[j], x), ones));
                }
            } else {
                __m512i s16 = _mm512_setzero_si512();
                for (int j = 0; j < 8; j++)
                    s16 = _mm512_add_epi16(s16, _mm512_maddubs_epi16(u[j], _mm512_set1_epi32(load_i32(xq + 4 * j))));
                s = _mm512_add_epi32(s, _mm512_madd_epi16(s16, ones));
            }
#endif
            const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(a->d[idx]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[r]);
            if (base == Q4_1) acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a->t[idx]), acc[r]);
        }
    }
}
#endif

#if defined(QG_AMX)
/* AMX (Intel Advanced Matrix Extensions, int8 tiles), for products of AMX_MIN_ROWS or more activation
 * rows: one TDPBSUD multiplies a group's R x 32 int8 activations (tile A) by its 32 x 16 unsigned codes
 * (tile B: 8 rows of 64 bytes, each the 16 weight rows' 4 codes of one k-quad: the tiled layout's code
 * vectors as stored, nibbles split for the 4-bit formats) into R x 16 int32 sums (tile C). The sums are
 * exact integers, as vpdpbusd's, and each is then scaled by the same float instructions in the same order
 * as tile_avx512, so y gets the same bits with or without AMX (tested). Two groups are in flight at a time
 * (tiles 0-2 and 3-5). Few rows stay on VNNI: a tile product's latency, not its width, then dominates.
 * Linux hands out the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM); qg_amx() asks once. */
#define AMX_M 16        /* activation rows per pass (a tile's rows) */
#define AMX_MIN_ROWS 16 /* fewer rows run on VNNI (measured: 2-8 rows are slower on AMX) */
static int amx_state = -1; /* -1: not asked yet; 0: off (refused, or qg_set_amx(0)); 1: on */
static __thread int amx_rows = 0; /* rows of the tile configuration this thread loaded in this call (0: none) */

static int amx_request(void) {
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

AI void amx_configure(int R) {
    if (amx_rows == R) return;
    amx_config c;
    memset(&c, 0, sizeof(c));
    c.palette = 1;
    for (int t = 0; t < 6; t += 3) {
        c.rows[t] = (uint8_t)R; c.colsb[t] = 32;         /* A: R activation rows x 32 int8 */
        c.rows[t + 1] = 8; c.colsb[t + 1] = 64;          /* B: 8 k-quads x 16 weight rows x 4 codes */
        c.rows[t + 2] = (uint8_t)R; c.colsb[t + 2] = 64; /* C: R x 16 int32 */
    }
    _tile_loadconfig(&c);
    amx_rows = R;
}

/* The codes of one tile group as B's 8 rows of 64 unsigned bytes. */
AI const uint8_t* amx_codes(int base, const uint8_t* b, uint8_t* buf) {
    const uint8_t* cs = b + codes_offset(base);
    if (base == Q8_0) return cs; /* already one unsigned byte per code, k-quad by k-quad */
    const __m512i m4 = _mm512_set1_epi8(15);
    for (int j = 0; j < 4; j++) {
        const __m512i v = _mm512_loadu_si512((const void*)(cs + 64 * j));
        _mm512_storeu_si512((void*)(buf + 64 * j), _mm512_and_si512(v, m4));
        _mm512_storeu_si512((void*)(buf + 64 * (j + 4)), _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
    }
    return buf;
}

/* acc[r] += group g's contribution from its int32 sums (row r at sums + 16r): tile_avx512's epilogue. */
AI void amx_scale(int base, const uint8_t* b, const act_q* a, int64_t m0, int R, int64_t g, const int32_t* sums,
                  __m512* acc) {
    const int c = tiled_offset(base, 1);
    const __m512 d = half16(b);
    const __m512 mn = base == Q4_1 ? half16(b + 32) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) {
        const int64_t idx = (m0 + r) * a->G + g;
        const __m512i s = _mm512_add_epi32(_mm512_set1_epi32(-c * a->i[idx]),
                                           _mm512_loadu_si512((const void*)(sums + 16 * r)));
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(a->d[idx]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[r]);
        if (base == Q4_1) acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a->t[idx]), acc[r]);
    }
}

/* out[r][p] = y[m0 + r, 16t + p] for r < R (2 <= R <= AMX_M): one tile on AMX. */
AI void tile_amx(int base, const uint8_t* tile, const act_q* a, int64_t m0, int R, float out[][TP]) {
    const int64_t tgb = TP * qg_block_bytes(base);
    __m512 acc[AMX_M];
    _Alignas(64) uint8_t buf0[512], buf1[512];
    _Alignas(64) int32_t sums0[AMX_M * 16], sums1[AMX_M * 16];
    amx_configure(R);
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const int8_t* xq = a->q + m0 * a->K;
    int64_t g = 0;
    for (; g + 2 <= a->G; g += 2) {
        const uint8_t* b0 = tile + g * tgb;
        const uint8_t* b1 = b0 + tgb;
        _tile_loadd(1, amx_codes(base, b0, buf0), 64);
        _tile_loadd(0, xq + g * QK, a->K);
        _tile_zero(2);
        _tile_dpbsud(2, 0, 1);
        _tile_loadd(4, amx_codes(base, b1, buf1), 64);
        _tile_loadd(3, xq + (g + 1) * QK, a->K);
        _tile_zero(5);
        _tile_dpbsud(5, 3, 4);
        _tile_stored(2, sums0, 64);
        _tile_stored(5, sums1, 64);
        amx_scale(base, b0, a, m0, R, g, sums0, acc);
        amx_scale(base, b1, a, m0, R, g + 1, sums1, acc);
    }
    if (g < a->G) {
        const uint8_t* b0 = tile + g * tgb;
        _tile_loadd(1, amx_codes(base, b0, buf0), 64);
        _tile_loadd(0, xq + g * QK, a->K);
        _tile_zero(2);
        _tile_dpbsud(2, 0, 1);
        _tile_stored(2, sums0, 64);
        amx_scale(base, b0, a, m0, R, g, sums0, acc);
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], acc[r]);
}
#endif

int qg_amx(void);

#if defined(QG_AMX_BF16)
/* AMX bf16 products for bf16 activations (qg_linear_bf16; not batch invariant against qg_linear, so the
 * runner uses it only outside deterministic mode). Each tile group is expanded once into the bf16 weights
 * qg_dequantize gives (w = D * u + o in float32, rounded to nearest even) as the B operand of TDPBF16PS:
 * 16 rows of 64 bytes, row j holding the 16 weight rows' pairs (w[2j], w[2j + 1]). The activations are
 * the A operand as they are (16 rows of 32 bf16; the rows of a last partial block are copied into a zero-padded
 * 16-row buffer), and
 * C accumulates float32 over the whole K (no per-group float step, unlike the int8 paths): y is the
 * float32 product of the bf16 activations and the bf16-rounded weights, summed in the tile unit's order.
 * Blocking 2 x 2: tiles 0-3 are C of (2 blocks of 16 rows) x (2 weight tiles), 4-5 the two A blocks,
 * 6-7 the two B groups, so each loaded tile feeds two products. */
#define AMXB_CFG 1000 /* amx_rows while this path's configuration is loaded */

AI void amxb_configure(void) {
    if (amx_rows == AMXB_CFG) return;
    amx_config c;
    memset(&c, 0, sizeof(c));
    c.palette = 1;
    for (int t = 0; t < 8; t++) { c.rows[t] = 16; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
    amx_rows = AMXB_CFG;
}

/* Row pairs of B from two float vectors (lane p: weight row p at k = 2j and 2j + 1). */
AI void amxb_pair(uint16_t* dst, __m512 even, __m512 odd, __m512i interleave) {
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even); /* [even 0..15, odd 0..15] as bf16 */
    _mm512_storeu_si512((void*)dst, _mm512_permutexvar_epi16(interleave, both));
}

/* Group g of a tile (b: its bytes in the tiled layout) as B: 512 bf16 at dst. */
AI void amxb_group(int base, const uint8_t* b, uint16_t* dst) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512 d = half16(b);
    const __m512 m = base == Q4_1 ? half16(b + 32) : _mm512_setzero_ps();
    const uint8_t* cs = b + codes_offset(base);
    if (base == Q8_0) { /* chunk j, lane p: bytes u = q + 128 of k = 4j..4j+3 */
        const __m512i ff = _mm512_set1_epi32(255), off = _mm512_set1_epi32(128);
        for (int j = 0; j < 8; j++) {
            const __m512i v = _mm512_loadu_si512((const void*)(cs + 64 * j));
            __m512 w[4];
            for (int i = 0; i < 4; i++)
                w[i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(
                    _mm512_and_si512(_mm512_srli_epi32(v, 8 * i), ff), off)));
            amxb_pair(dst + 32 * (2 * j), w[0], w[1], interleave);
            amxb_pair(dst + 32 * (2 * j + 1), w[2], w[3], interleave);
        }
        return;
    }
    const __m512i m4 = _mm512_set1_epi32(15);
    for (int j = 0; j < 4; j++) { /* chunk j, lane p: low nibbles k = 4j..4j+3, high nibbles k = 16+4j.. */
        const __m512i v = _mm512_loadu_si512((const void*)(cs + 64 * j));
        __m512 w[8];
        for (int i = 0; i < 8; i++) {
            const __m512i u = _mm512_and_si512(_mm512_srli_epi32(v, 8 * (i & 3) + 4 * (i >> 2)), m4);
            w[i] = base == Q4_1 ? _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(u), m) /* D * u is exact: one rounding */
                                : _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(u, _mm512_set1_epi32(8))));
        }
        amxb_pair(dst + 32 * (2 * j), w[0], w[1], interleave);
        amxb_pair(dst + 32 * (2 * j + 1), w[2], w[3], interleave);
        amxb_pair(dst + 32 * (8 + 2 * j), w[4], w[5], interleave);
        amxb_pair(dst + 32 * (9 + 2 * j), w[6], w[7], interleave);
    }
}

/* y[m0 + r, n0 + p] for r < R, p < 16 from a C tile stored at c (row r at c + 16r). */
AI void amxb_store(void* y, int y_bf16, int64_t ldy, int64_t m0, int64_t n0, int R, const float* c) {
    for (int r = 0; r < R; r++) {
        const __m512 v = _mm512_loadu_ps(c + 16 * r);
        if (y_bf16) _mm256_storeu_si256((__m256i*)((uint16_t*)y + (m0 + r) * ldy + n0), bf16x16(v));
        else _mm512_storeu_ps((float*)y + (m0 + r) * ldy + n0, v);
    }
}

/* C tile `tile` (rows m0.., weight tile starting at column n0) into y, its first R rows. */
#define AMXB_OUT(tile, m0, n0, R)                                   \
    do {                                                            \
        _tile_stored(tile, c, 64);                                  \
        amxb_store(y, y_bf16, ldy, (m0), (n0), (R), c);             \
    } while (0)

/* Rows of x ([M, K] bf16) against weight tiles t0 and, when two, t0 + 1 (w1 non-NULL), expanded at w0/w1
 * (G * 512 bf16 each). Blocks of 16 rows; the last one, when M % 16 rows, read from xtail (those rows, then
 * zero rows: [16, K]). */
AI void amxb_tiles(int64_t G, const uint16_t* x, const uint16_t* xtail, int64_t K, int64_t M, void* y, int y_bf16,
                   int64_t ldy, int64_t n0, const uint16_t* w0, const uint16_t* w1) {
    const int64_t lda = 2 * K, Mp = (M + 15) / 16 * 16;
    _Alignas(64) float c[16 * 16];
    for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
        const uint16_t* xa = M - m0 >= 16 ? x + m0 * K : xtail;          /* rows m0..m0+15 */
        const uint16_t* xb = M - m0 - 16 >= 16 ? x + (m0 + 16) * K : xtail; /* rows m0+16..m0+31 */
        const int two_m = Mp - m0 >= 32;
        const int r0 = (int)(M - m0 < 16 ? M - m0 : 16), r1 = (int)(M - m0 - 16 < 16 ? M - m0 - 16 : 16);
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        if (two_m && w1) {
            for (int64_t g = 0; g < G; g++) {
                _tile_loadd(4, xa + g * QK, lda);
                _tile_loadd(6, w0 + 512 * g, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_loadd(7, w1 + 512 * g, 64);
                _tile_dpbf16ps(1, 4, 7);
                _tile_loadd(5, xb + g * QK, lda);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        } else if (two_m) {
            for (int64_t g = 0; g < G; g++) {
                _tile_loadd(6, w0 + 512 * g, 64);
                _tile_loadd(4, xa + g * QK, lda);
                _tile_dpbf16ps(0, 4, 6);
                _tile_loadd(5, xb + g * QK, lda);
                _tile_dpbf16ps(2, 5, 6);
            }
        } else if (w1) {
            for (int64_t g = 0; g < G; g++) {
                _tile_loadd(4, xa + g * QK, lda);
                _tile_loadd(6, w0 + 512 * g, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_loadd(7, w1 + 512 * g, 64);
                _tile_dpbf16ps(1, 4, 7);
            }
        } else {
            for (int64_t g = 0; g < G; g++) {
                _tile_loadd(4, xa + g * QK, lda);
                _tile_loadd(6, w0 + 512 * g, 64);
                _tile_dpbf16ps(0, 4, 6);
            }
        }
        AMXB_OUT(0, m0, n0, r0);
        if (w1) AMXB_OUT(1, m0, n0 + 16, r0);
        if (two_m && r1 > 0) {
            AMXB_OUT(2, m0 + 16, n0, r1);
            if (w1) AMXB_OUT(3, m0 + 16, n0 + 16, r1);
        }
    }
}
#endif

/* y[m, n] (row stride ldy) = x[m] . W[n] for m < M, n < N on AMX bf16 tiles, x [M, K] bf16 (contiguous):
 * the float32 product of x and W's bf16-rounded weights (see above). A Q4_0/Q4_1/Q8_0 weight in the tiled
 * layout with N a multiple of 16 only. Returns 0, or -2 where this path does not apply (not built, AMX
 * refused or off, another format, or N % 16 != 0: use qg_linear), -1 on a failed allocation. */
int qg_linear_bf16(int qtype, const uint8_t* w, int64_t N, int64_t K, const uint16_t* x, int64_t M, void* y,
                   int y_bf16, int64_t ldy, int num_threads) {
#if defined(QG_AMX_BF16)
    const int base = tiled_base(qtype);
    if (!base || N % TP != 0 || K % QK != 0 || K <= 0 || !qg_amx()) return -2;
    if (M <= 0 || N <= 0) return 0;
    const int64_t G = K / QK, NT = N / TP, tgb = TP * qg_block_bytes(base), tail = M % 16;
    const int64_t pairs = (NT + 1) / 2;
    uint16_t* xtail = NULL; /* the last M % 16 rows of x, then zero rows: one whole block of 16 */
    if (tail) {
        xtail = (uint16_t*)aligned_alloc(64, (size_t)(16 * K * 2));
        if (!xtail) return -1;
        memcpy(xtail, x + (M - tail) * K, (size_t)(tail * K * 2));
        memset(xtail + tail * K, 0, (size_t)((16 - tail) * K * 2));
    }
    if (num_threads > pairs) num_threads = (int)pairs; /* a thread without a tile pair would only configure tiles */
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        uint16_t* wbuf = (uint16_t*)aligned_alloc(64, (size_t)(2 * G * 512 * 2));
        if (!wbuf) {
#pragma omp atomic write
            failed = 1;
        }
        amx_rows = 0;
        if (wbuf) amxb_configure();
#pragma omp for schedule(static)
        for (int64_t t = 0; t < pairs; t++) {
            if (!wbuf) continue;
            const int two = 2 * t + 1 < NT;
            for (int i = 0; i < 1 + two; i++) {
                const uint8_t* tile = w + (2 * t + i) * G * tgb;
                uint16_t* dst = wbuf + i * G * 512;
                for (int64_t g = 0; g < G; g++) {
                    if (base == Q4_1) amxb_group(Q4_1, tile + g * tgb, dst + 512 * g);
                    else if (base == Q4_0) amxb_group(Q4_0, tile + g * tgb, dst + 512 * g);
                    else amxb_group(Q8_0, tile + g * tgb, dst + 512 * g);
                }
            }
            amxb_tiles(G, x, xtail, K, M, y, y_bf16, ldy, 2 * t * TP, wbuf, two ? wbuf + G * 512 : NULL);
        }
        if (amx_rows) { _tile_release(); amx_rows = 0; }
        free(wbuf);
    }
    free(xtail);
    return failed ? -1 : 0;
#else
    (void)qtype; (void)w; (void)N; (void)K; (void)x; (void)M; (void)y; (void)y_bf16; (void)ldy; (void)num_threads;
    return -2;
#endif
}

/* 1 when qg_linear_bf16 runs here (built with AMX bf16 and the tiles granted). */
int qg_amx_bf16(void) {
#if defined(QG_AMX_BF16)
    return qg_amx();
#else
    return 0;
#endif
}

/* 1 when this process multiplies AMX_MIN_ROWS or more rows on AMX tiles (asks Linux for the tile state once;
 * TOKENMILL_DISABLE_AMX=1 in the environment keeps VNNI for every row count). */
int qg_amx(void) {
#if defined(QG_AMX)
    int state = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (state < 0) { /* two threads may both ask: the request is idempotent and both store the same answer */
        const char* off = getenv("TOKENMILL_DISABLE_AMX");
        state = off && off[0] && strcmp(off, "0") != 0 ? 0 : amx_request();
        __atomic_store_n(&amx_state, state, __ATOMIC_RELEASE);
    }
    return state;
#else
    return 0;
#endif
}

/* Turn the AMX path off (0) or back on (1, where qg_amx() can); returns qg_amx(). Tests compare the paths. */
int qg_set_amx(int on) {
#if defined(QG_AMX)
    __atomic_store_n(&amx_state, on ? amx_request() : 0, __ATOMIC_RELEASE);
#else
    (void)on;
#endif
    return qg_amx();
}

/* y[m0 + r, n0 + p] for r < R, p < 16 from acc (row r at acc + r * TP). */
static inline void store_tile(void* y, int y_bf16, int64_t ldy, int64_t m0, int64_t n0, int R, const float* acc) {
    for (int r = 0; r < R; r++) {
        if (y_bf16) for (int p = 0; p < TP; p++) ((uint16_t*)y)[(m0 + r) * ldy + n0 + p] = f32_to_bf16(acc[r * TP + p]);
        else memcpy((float*)y + (m0 + r) * ldy + n0, acc + r * TP, TP * sizeof(float));
    }
}

/* Every activation row against tile t, R (a constant at each call) rows at a time. */
AI void tile_rows(int base, const uint8_t* tile, const act_q* a, int64_t m0, int R, float out[][TP], int pf) {
#if defined(QG_AVX512)
    __m512 acc[TILE_M];
    tile_avx512(base, tile, a, m0, R, acc, pf);
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], acc[r]);
#elif defined(QG_AVX2)
    __m256 acc[TILE_M];
    for (int h = 0; h < 2; h++) {
        tile_avx2(base, tile, h, a, m0, R, acc, pf && h == 0);
        for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r] + 8 * h, acc[r]);
    }
#else
    (void)pf;
    tile_portable(base, tile, a, m0, R, out);
#endif
}

AI void task_tile(int base, const uint8_t* w, const act_q* a, int64_t t, int64_t M, void* y, int y_bf16, int64_t ldy,
                  int amx) {
    const uint8_t* tile = w + t * a->G * TP * qg_block_bytes(base);
#if defined(QG_AMX)
    if (amx) { /* passes of AMX_M rows; a last single row runs below */
        int64_t m0 = 0;
        for (; M - m0 >= 2; m0 += AMX_M) {
            const int R = (int)(M - m0 < AMX_M ? M - m0 : AMX_M);
            float out[AMX_M][TP];
            tile_amx(base, tile, a, m0, R, out);
            store_tile(y, y_bf16, ldy, m0, t * TP, R, &out[0][0]);
        }
        if (m0 < M) {
            float out[1][TP];
            tile_rows(base, tile, a, m0, 1, out, 0);
            store_tile(y, y_bf16, ldy, m0, t * TP, 1, &out[0][0]);
        }
        return;
    }
#else
    (void)amx;
#endif
    for (int64_t m0 = 0; m0 < M; m0 += TILE_M) {
        const int R = (int)(M - m0 < TILE_M ? M - m0 : TILE_M), pf = m0 == 0 && M >= 4;
        float out[TILE_M][TP];
        switch (R) { /* a constant R per instance: the row loops unroll, the accumulators stay in registers */
        case TILE_M: tile_rows(base, tile, a, m0, TILE_M, out, pf); break;
        case 1: tile_rows(base, tile, a, m0, 1, out, pf); break;
        case 2: tile_rows(base, tile, a, m0, 2, out, pf); break;
#if TILE_M > 4
        case 3: tile_rows(base, tile, a, m0, 3, out, pf); break;
        case 4: tile_rows(base, tile, a, m0, 4, out, pf); break;
        case 5: tile_rows(base, tile, a, m0, 5, out, pf); break;
        case 6: tile_rows(base, tile, a, m0, 6, out, pf); break;
        default: tile_rows(base, tile, a, m0, 7, out, pf); break;
#else
        default: tile_rows(base, tile, a, m0, 3, out, pf); break;
#endif
        }
        store_tile(y, y_bf16, ldy, m0, t * TP, R, &out[0][0]);
    }
}

#include "qg_tiles_kq.h"

#define DEFINE_TILE_TASK(NAME, QT) \
    static void NAME(const uint8_t* w, const act_q* a, int64_t t, int64_t M, void* y, int y_bf16, int64_t ldy, \
                     int amx) { task_tile(QT, w, a, t, M, y, y_bf16, ldy, amx); }
DEFINE_TILE_TASK(tile_task_q4_0, Q4_0)
DEFINE_TILE_TASK(tile_task_q4_1, Q4_1)
DEFINE_TILE_TASK(tile_task_q8_0, Q8_0)

/* 1 when this build's SIMD path reads the tiled layout faster than the stored one (x86 AVX2 and AVX-512;
 * the loader repacks only then). */
int qg_tiled_preferred(void) {
#if defined(QG_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* y[m, n] (row stride ldy) = x[m] . W[n] for m < M, n < N. Returns 0, or -1 for an unknown type,
 * a K that is not a whole number of blocks, or a failed allocation. */
int qg_linear(int qtype, const uint8_t* w, int64_t N, int64_t K, const void* x, int x_bf16, int64_t M, void* y,
              int y_bf16, int64_t ldy, int num_threads) {
    const int base = tiled_base(qtype), kbase = kt_base(qtype);
    const int64_t bs = qg_block_size(base ? base : kbase ? kbase : qtype);
    if (bs == 0 || K % bs != 0 || K <= 0) return -1;
    if (M <= 0 || N <= 0) return 0;
    act_q a;
    a.K = K;
    a.G = K / QK;
    a.q = (int8_t*)malloc((size_t)(M * K) + 64);
    a.d = (float*)malloc(sizeof(float) * (size_t)(M * a.G));
    a.s = (float*)malloc(sizeof(float) * (size_t)(M * a.G * 2));
    a.t = (float*)malloc(sizeof(float) * (size_t)(M * a.G));
    a.i = (int32_t*)malloc(sizeof(int32_t) * (size_t)(M * a.G));
    a.h = (int32_t*)malloc(sizeof(int32_t) * (size_t)(M * a.G * 2));
    if (!a.q || !a.d || !a.s || !a.t || !a.i || !a.h) {
        free(a.q); free(a.d); free(a.s); free(a.t); free(a.i); free(a.h);
        return -1;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && M * K >= 32768)
    for (int64_t m = 0; m < M; m++) quantize_row(x, x_bf16, m, &a);
    const int fmt = base ? base : kbase ? kbase : qtype;
    const int64_t rb = row_bytes(fmt, K);
    void (*task)(const uint8_t*, int64_t, const act_q*, int64_t, int64_t, int64_t, void*, int, int64_t) =
        fmt == Q4_0 ? task_q4_0 : fmt == Q4_1 ? task_q4_1 : fmt == Q8_0 ? task_q8_0 :
        fmt == Q4_K ? task_q4_k : fmt == Q5_0 ? task_q5_0 : fmt == Q5_1 ? task_q5_1 : fmt == Q5_K ? task_q5_k :
        fmt == Q2_K ? task_q2_k : fmt == Q3_K ? task_q3_k : fmt == IQ4_NL ? task_iq4_nl : fmt == IQ4_XS ? task_iq4_xs :
        task_q6_k;
    const int parallel = num_threads > 1 && N * K * (M < 8 ? M : 8) >= 65536;
    if (base || kbase) { /* tiles of TP rows, then the tail rows (as stored) as one more task */
        void (*tile_task)(const uint8_t*, const act_q*, int64_t, int64_t, void*, int, int64_t, int) =
            base == Q4_0 ? tile_task_q4_0 : base == Q4_1 ? tile_task_q4_1 : base == Q8_0 ? tile_task_q8_0 :
            kbase == Q5_0 ? kt_task_q5_0 : kbase == Q5_1 ? kt_task_q5_1 : kbase == Q4_K ? kt_task_q4_k :
            kbase == Q5_K ? kt_task_q5_k : kbase == Q2_K ? kt_task_q2_k : kbase == Q3_K ? kt_task_q3_k :
            kbase == IQ4_NL ? kt_task_iq4_nl : kbase == IQ4_XS ? kt_task_iq4_xs : kt_task_q6_k;
        const int64_t NT = N / TP, tasks = NT + (N % TP != 0);
#if defined(QG_AMX)
        const int amx = base && M >= AMX_MIN_ROWS && qg_amx(); /* the K-quant tiles have no AMX path */
#else
        const int amx = 0;
#endif
#pragma omp parallel num_threads(num_threads) if (parallel)
        {
#if defined(QG_AMX)
            /* other code on this thread (torch's oneDNN kernels) loads its own tile configuration or
             * releases the tiles between our calls: configure afresh in every call, release at its end */
            amx_rows = 0;
#endif
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tasks; t++) {
                if (t < NT) tile_task(w, &a, t, M, y, y_bf16, ldy, amx);
                else task(w, rb, &a, NT * TP, N, M, y, y_bf16, ldy);
            }
#if defined(QG_AMX)
            if (amx_rows) { _tile_release(); amx_rows = 0; }
#endif
        }
    } else {
        const int64_t NB = 8; /* weight rows per task: their bytes stay in L1 while the row tiles pass */
        const int64_t tasks = (N + NB - 1) / NB;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t n1 = (t + 1) * NB < N ? (t + 1) * NB : N;
            task(w, rb, &a, t * NB, n1, M, y, y_bf16, ldy);
        }
    }
    free(a.q); free(a.d); free(a.s); free(a.t); free(a.i); free(a.h);
    return 0;
}

/* Weights of rows ids[0..n) (all N rows when ids is NULL) of an N-row weight as float32 or bf16, [n, K];
 * any format, tiled ones included (N says which rows are tail rows). */
void qg_dequantize_rows(int qtype, const uint8_t* w, int64_t N, int64_t K, const int64_t* ids, int64_t n, void* out,
                        int out_bf16, int num_threads) {
    const int base = tiled_base(qtype), kbase = kt_base(qtype), fmt = base ? base : kbase ? kbase : qtype;
    const int64_t rb = row_bytes(fmt, K), G = K / QK;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && n * K >= 65536)
    for (int64_t r = 0; r < n; r++) {
        const int64_t row_id = ids ? ids[r] : r;
        const uint8_t* row = w + row_id * rb;
        float* of = out_bf16 ? NULL : (float*)out + r * K;
        uint16_t* ob = out_bf16 ? (uint16_t*)out + r * K : NULL;
        switch (qtype) {
        case Q4_0: dequantize_row(Q4_0, row, G, of, ob); break;
        case Q4_1: dequantize_row(Q4_1, row, G, of, ob); break;
        case Q8_0: dequantize_row(Q8_0, row, G, of, ob); break;
        case Q4_K: dequantize_row(Q4_K, row, G, of, ob); break;
        case Q6_K: dequantize_row(Q6_K, row, G, of, ob); break;
        case Q5_0: dequantize_row(Q5_0, row, G, of, ob); break;
        case Q5_1: dequantize_row(Q5_1, row, G, of, ob); break;
        case Q5_K: dequantize_row(Q5_K, row, G, of, ob); break;
        case Q2_K: dequantize_row(Q2_K, row, G, of, ob); break;
        case Q3_K: dequantize_row(Q3_K, row, G, of, ob); break;
        case IQ4_NL: dequantize_row(IQ4_NL, row, G, of, ob); break;
        case IQ4_XS: dequantize_row(IQ4_XS, row, G, of, ob); break;
        case QG_TILED + Q5_0: case QG_TILED + Q5_1: case QG_TILED + Q4_K: case QG_TILED + Q5_K: case QG_TILED + Q6_K:
        case QG_TILED + Q2_K: case QG_TILED + Q3_K: case QG_TILED + IQ4_NL: case QG_TILED + IQ4_XS:
            kt_dequantize_row(kbase, w, N, G, row_id, of, ob);
            break;
        case QG_TILED + Q4_0: dequantize_tiled_row(Q4_0, w, N, G, row_id, of, ob); break;
        case QG_TILED + Q4_1: dequantize_tiled_row(Q4_1, w, N, G, row_id, of, ob); break;
        default: dequantize_tiled_row(Q8_0, w, N, G, row_id, of, ob); break;
        }
    }
}

/* The same for the stored formats only (a tiled type needs N: use qg_dequantize_rows). */
void qg_dequantize(int qtype, const uint8_t* w, int64_t K, const int64_t* ids, int64_t n, void* out, int out_bf16,
                   int num_threads) {
    if (tiled_base(qtype) || kt_base(qtype)) return;
    qg_dequantize_rows(qtype, w, 0, K, ids, n, out, out_bf16, num_threads);
}

const char* qg_isa(void) { return ISA_PATH; }

/* 1 when the AVX-512 VNNI product (vpdpbusd) is built in. */
int qg_vnni(void) {
#if defined(QG_VNNI)
    return 1;
#else
    return 0;
#endif
}
