/* GGUF block formats as qgemm.c reads them. Part of qgemm.c's one translation unit (included there after the
 * ISA selection, before the other parts; not a standalone header).
 *
 * Holds the ggml type ids of the formats (block layouts as the GGUF file format defines them, implemented here
 * from that description) and their block sizes (qg_block_size and qg_block_bytes are exported), fp16 and bf16
 * conversions, the unpacking of the K-quants' and IQ4_XS's packed sub-scales, and the two accessors every
 * product and repacking is written against, for group g (32 weights) of a stored row:
 *   group_params   D, integer half scales s0/s1 and float half offsets o0/o1 (w = D * s_h * u + o_h)
 *   group_codes    the 32 codes u (plain C)
 * and dequantize_row: a stored row as float32 or bf16 through the same w = D * (s_h * u) + o_h.
 */

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
       IQ4_NL = 20, IQ4_XS = 23 };
/* IQ4_NL / IQ4_XS: a 4-bit code indexes this table of int8 values (the GGUF format's non-linear grid). */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* Formats whose stored-layout codes are signed (the value itself: Q8_0's q, IQ4's table value). */
#define SIGNED_CODES(qt) ((qt) == Q8_0 || (qt) == IQ4_NL || (qt) == IQ4_XS)
#define QK 32    /* weights per group */
#define QKK 256  /* weights per K-quant super block */

/* ---------------------------------------------------------------- fp16 and bf16 */

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

#if defined(__F16C__) && !defined(TM_PORTABLE)
AI float rd_half(const uint8_t* p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }
#else
static inline float rd_half(const uint8_t* p) { return half_to_f32((uint16_t)(p[0] | (p[1] << 8))); }
#endif

#if defined(QG_AVX512)
AI __m512 half16(const uint8_t* p) { /* 16 fp16 to float32 (two F16C conversions) */
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p))),
                              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16))), 1);
}
/* 16 floats to bf16 bits, rounded to nearest even, any NaN the canonical 0x7fc0 (as f32_to_bf16). */
AI __m256i bf16x16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
}
#endif

/* ---------------------------------------------------------------- block sizes and packed scales */

/* Weights per block of format qtype, and bytes per block (exported; 0 for an id that is not a format read here). */
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

/* Bytes of a stored row of K weights (K a whole number of blocks). */
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

/* ---------------------------------------------------------------- a group's parameters and codes */

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

/* The 32 codes of group g (plain C): unsigned 2- to 6-bit codes, or the signed values of Q8_0 (q) and IQ4 (the
 * table's); the signed formats' offset is 0. */
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

/* ---------------------------------------------------------------- dequantizing a stored row */

/* One row of K weights as float32 (of) or bf16 (ob): w = D * (s_h * u) + o_h per element. qtype is a
 * constant at each call (qg_dequantize_rows' switch, dequantize_tiled_row's callers), so the format's switch
 * folds away and the element loops vectorise. */
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
