/* Tiled layouts and products of Q5_0, Q5_1, Q4_K, Q5_K and Q6_K (included by qgemm.c, after its Q4_0/Q4_1/Q8_0
 * tiles, whose conventions these follow: 16 weight rows per tile, the 16 rows' codes of 4 consecutive k in
 * one 64-byte chunk so a 32-bit broadcast of 4 activations multiplies every row at once, one lane per row).
 *
 * qg_repack rewrites a weight of these formats, once at load, into the same number of bytes: rows
 * n < N - N % 16 in tiles of 16, the rest as stored. A tile is a run of tile blocks, one per stored block
 * (32 weights for Q5_0/Q5_1, a 256-weight super block for the K-quants), each 16 x the block's bytes:
 *
 *   Q5_0 (352 B)  D fp16 x 16 (row p at 2p) | hb 64 | codes 256
 *   Q5_1 (384 B)  D x 16 | M fp16 x 16 | hb 64 | codes 256
 *   Q4_K (2304 B) D x 16 | Dmin x 16 | scale planes 12 x 16 | per group j (8): codes 256
 *   Q5_K (2816 B) D x 16 | Dmin x 16 | scale planes 12 x 16 | per group j (8): hb 64, codes 256
 *   Q6_K (3360 B) D x 16 | sub-block scales 16 x 16 (int8; sub-block b, row p at 16b + p) | per group j (8):
 *                 codes 256, hb0 64, hb1 64
 *
 * codes: the 4 low bits of a group's 32 codes, 4 chunks of 64 bytes; chunk c, bytes 4p..4p+3 hold row p's
 * codes k = 4c..4c+3 in their low nibbles and k = 16+4c..16+4c+3 in their high nibbles (as Q4_0's tiles).
 * hb (5-bit formats): byte 4p+i holds the fifth bit of row p's code k = 4c+i at bit c and of k = 16+4c+i at
 * bit 4+c (c = 0..3). hb0/hb1 (Q6_K): byte 4p+i holds the two high bits of row p's code k = 4c+i (hb0) or
 * k = 16+4c+i (hb1) at bits 2c, 2c+1. Scale planes: plane b (0..11) holds the 16 rows' byte b of the
 * stored 12 packed 6-bit scale/min bytes, so a group's 16 scales and 16 mins unpack with a few 16-byte
 * operations.
 *
 * The products. With u the unsigned code, a group's weights are w = ds_h * (u - c) + dm, where
 *   Q5_0: ds = D, c = 16            Q5_1: ds = D, dm = M           Q4_K, Q5_K: ds = D * sc_j, dm = -Dmin * m_j
 *   Q6_K: ds_h = D * sc_{2j+h} per half h of 16 codes, c = 32
 * (D * sc and Dmin * m are exact in float32: an 11-bit significand times a 6- or 8-bit integer). Every path
 * computes the exact integer I = sum_k u_k * xq_k - c * xs (per half for Q6_K, whose halves have their own
 * scales) and then the same float steps, lane by lane:
 *   acc = fma((float)I_h, ds_h * dx, acc)      and, with a min:   acc = fma(dm, dx * xs, acc)
 * so the portable, AVX2, AVX-512 and VNNI builds give the same bits (as the Q4_0/Q4_1/Q8_0 tiles do), and
 * each y[m, n] depends only on row m of x. No AMX path: those products take the VNNI tiles at every M.
 */

/* The format of a tiled type id of this file's formats, or 0. */
static int kt_base(int qtype) {
    const int b = qtype - QG_TILED;
    return b == Q5_0 || b == Q5_1 || b == Q4_K || b == Q5_K || b == Q6_K ? b : 0;
}

AI int kt_groups(int fmt) { return fmt == Q5_0 || fmt == Q5_1 ? 1 : 8; } /* groups of 32 per tile block */
AI int kt_has_min(int fmt) { return fmt == Q5_1 || fmt == Q4_K || fmt == Q5_K; }
AI int kt_offset(int fmt) { return fmt == Q5_0 ? 16 : fmt == Q6_K ? 32 : 0; }
AI int kt_five(int fmt) { return fmt == Q5_0 || fmt == Q5_1 || fmt == Q5_K; }
/* Byte offsets in a tile block: group j's code chunks, its high bits (hb, or hb0 then hb1 for Q6_K). */
AI int kt_codes_at(int fmt, int j) {
    switch (fmt) {
    case Q5_0: return 96;
    case Q5_1: return 128;
    case Q4_K: return 256 + 256 * j;
    case Q5_K: return 256 + 320 * j + 64;
    default: return 288 + 384 * j; /* Q6_K */
    }
}
AI int kt_hbits_at(int fmt, int j) {
    switch (fmt) {
    case Q5_0: return 32;
    case Q5_1: return 64;
    case Q5_K: return 256 + 320 * j;
    default: return 288 + 384 * j + 256; /* Q6_K: hb0, hb1 at +64 */
    }
}

/* Row p's group j of a tile block (tb) as group_params / group_codes give it for the stored block: the
 * same D, sub-scales and offsets, and the 32 codes. */
static group_info kt_info(int fmt, const uint8_t* tb, int j, int p) {
    group_info gi;
    gi.D = rd_half(tb + 2 * p);
    switch (fmt) {
    case Q5_0: gi.s0 = gi.s1 = 1; gi.o0 = gi.o1 = -16.0f * gi.D; break;
    case Q5_1: gi.s0 = gi.s1 = 1; gi.o0 = gi.o1 = rd_half(tb + 32 + 2 * p); break;
    case Q4_K: case Q5_K: {
        uint8_t s[12];
        for (int b = 0; b < 12; b++) s[b] = tb[64 + 16 * b + p];
        int sc, mn;
        k4_scale_min(s, j, &sc, &mn);
        gi.s0 = gi.s1 = sc;
        gi.o0 = gi.o1 = -rd_half(tb + 32 + 2 * p) * (float)mn;
        break;
    }
    default: { /* Q6_K */
        gi.s0 = (int8_t)tb[32 + 16 * (2 * j) + p];
        gi.s1 = (int8_t)tb[32 + 16 * (2 * j + 1) + p];
        gi.o0 = -32.0f * gi.D * (float)gi.s0;
        gi.o1 = -32.0f * gi.D * (float)gi.s1;
        break;
    }
    }
    return gi;
}

static void kt_codes(int fmt, const uint8_t* tb, int j, int p, int* u) {
    const uint8_t* cs = tb + kt_codes_at(fmt, j);
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < 4; i++) {
            const uint8_t v = cs[64 * c + 4 * p + i];
            u[4 * c + i] = v & 15;
            u[16 + 4 * c + i] = v >> 4;
        }
    if (fmt == Q4_K) return;
    const uint8_t* hb = tb + kt_hbits_at(fmt, j);
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < 4; i++) {
            if (fmt == Q6_K) {
                u[4 * c + i] |= ((hb[4 * p + i] >> (2 * c)) & 3) << 4;
                u[16 + 4 * c + i] |= ((hb[64 + 4 * p + i] >> (2 * c)) & 3) << 4;
            } else {
                u[4 * c + i] |= ((hb[4 * p + i] >> c) & 1) << 4;
                u[16 + 4 * c + i] |= ((hb[4 * p + i] >> (4 + c)) & 1) << 4;
            }
        }
}

/* src: N rows of a weight as stored; dst: the tiled layout above (same size). */
static void kt_repack(int fmt, const uint8_t* src, int64_t N, int64_t K, uint8_t* dst) {
    const int64_t bb = qg_block_bytes(fmt), NBk = K / qg_block_size(fmt), rb = NBk * bb, NT = N / TP;
    const int gpb = kt_groups(fmt);
    for (int64_t t = 0; t < NT; t++)
        for (int64_t b = 0; b < NBk; b++) {
            uint8_t* tb = dst + (t * NBk + b) * TP * bb;
            memset(tb, 0, (size_t)(TP * bb));
            for (int p = 0; p < TP; p++) {
                const uint8_t* blk = src + (t * TP + p) * rb + b * bb;
                if (fmt == Q6_K) {
                    memcpy(tb + 2 * p, blk + 208, 2);
                    for (int sb = 0; sb < 16; sb++) tb[32 + 16 * sb + p] = blk[192 + sb];
                } else {
                    memcpy(tb + 2 * p, blk, 2);
                    if (fmt != Q5_0) memcpy(tb + 32 + 2 * p, blk + 2, 2); /* M, or Dmin */
                    if (fmt == Q4_K || fmt == Q5_K)
                        for (int s = 0; s < 12; s++) tb[64 + 16 * s + p] = blk[4 + s];
                }
                for (int j = 0; j < gpb; j++) {
                    int u[32];
                    group_codes(fmt, blk, j, u);
                    uint8_t* cs = tb + kt_codes_at(fmt, j);
                    for (int c = 0; c < 4; c++)
                        for (int i = 0; i < 4; i++) {
                            const int lo = u[4 * c + i], hi = u[16 + 4 * c + i];
                            cs[64 * c + 4 * p + i] = (uint8_t)((lo & 15) | ((hi & 15) << 4));
                            if (fmt == Q4_K) continue;
                            uint8_t* hb = tb + kt_hbits_at(fmt, j);
                            if (fmt == Q6_K) {
                                hb[4 * p + i] |= (uint8_t)(((lo >> 4) & 3) << (2 * c));
                                hb[64 + 4 * p + i] |= (uint8_t)(((hi >> 4) & 3) << (2 * c));
                            } else {
                                hb[4 * p + i] |= (uint8_t)(((lo >> 4) & 1) << c);
                                hb[4 * p + i] |= (uint8_t)(((hi >> 4) & 1) << (4 + c));
                            }
                        }
                }
            }
        }
    memcpy(dst + NT * TP * rb, src + NT * TP * rb, (size_t)((N - NT * TP) * rb));
}

/* Row r of a tiled weight of N rows as float32/bf16, the stored format's values bit for bit (the same
 * group_info and codes through the same expression as dequantize_row). */
static void kt_dequantize_row(int fmt, const uint8_t* w, int64_t N, int64_t G, int64_t r, float* of, uint16_t* ob) {
    const int64_t bb = qg_block_bytes(fmt), gpb = kt_groups(fmt), rb = G / gpb * bb;
    if (r >= N / TP * TP) {
        switch (fmt) { /* a constant format per call of dequantize_row */
        case Q5_0: dequantize_row(Q5_0, w + r * rb, G, of, ob); break;
        case Q5_1: dequantize_row(Q5_1, w + r * rb, G, of, ob); break;
        case Q4_K: dequantize_row(Q4_K, w + r * rb, G, of, ob); break;
        case Q5_K: dequantize_row(Q5_K, w + r * rb, G, of, ob); break;
        default: dequantize_row(Q6_K, w + r * rb, G, of, ob); break;
        }
        return;
    }
    const uint8_t* tile = w + (r / TP) * TP * rb;
    const int p = (int)(r % TP);
    for (int64_t g = 0; g < G; g++) {
        const uint8_t* tb = tile + (g / gpb) * TP * bb;
        const group_info gi = kt_info(fmt, tb, (int)(g % gpb), p);
        int u[32];
        kt_codes(fmt, tb, (int)(g % gpb), p, u);
        for (int i = 0; i < 32; i++) {
            const float v = i < 16 ? gi.D * (float)(gi.s0 * u[i]) + gi.o0 : gi.D * (float)(gi.s1 * u[i]) + gi.o1;
            if (of) of[g * QK + i] = v; else ob[g * QK + i] = f32_to_bf16(v);
        }
    }
}

/* acc[r][p] = y[m0 + r, 16t + p] (plain C; one tile, R <= TILE_M activation rows). */
AI void kt_tile_portable(int fmt, const uint8_t* tile, const act_q* a, int64_t m0, int R, float acc[][TP]) {
    const int gpb = kt_groups(fmt), c = kt_offset(fmt);
    const int64_t tbb = TP * qg_block_bytes(fmt);
    for (int r = 0; r < R; r++) for (int p = 0; p < TP; p++) acc[r][p] = 0.0f;
    for (int64_t g = 0; g < a->G; g++) {
        const uint8_t* tb = tile + (g / gpb) * tbb;
        const int j = (int)(g % gpb);
        int u[TP][32];
        float ds0[TP], ds1[TP], dm[TP];
        for (int p = 0; p < TP; p++) {
            const group_info gi = kt_info(fmt, tb, j, p);
            kt_codes(fmt, tb, j, p, u[p]);
            ds0[p] = gi.D * (float)gi.s0;
            ds1[p] = gi.D * (float)gi.s1;
            dm[p] = gi.o0;
        }
        for (int r = 0; r < R; r++) {
            const int8_t* xq = a->q + (m0 + r) * a->K + g * QK;
            const int64_t idx = (m0 + r) * a->G + g;
            const float dx = a->d[idx], tx = a->t[idx];
            for (int p = 0; p < TP; p++) {
                if (fmt == Q6_K) {
                    int32_t I0 = -c * a->h[2 * idx], I1 = -c * a->h[2 * idx + 1];
                    for (int k = 0; k < 16; k++) { I0 += u[p][k] * xq[k]; I1 += u[p][k + 16] * xq[k + 16]; }
                    acc[r][p] = fmaf((float)I0, ds0[p] * dx, acc[r][p]);
                    acc[r][p] = fmaf((float)I1, ds1[p] * dx, acc[r][p]);
                } else {
                    int32_t I = -c * a->i[idx];
                    for (int k = 0; k < 32; k++) I += u[p][k] * xq[k];
                    acc[r][p] = fmaf((float)I, ds0[p] * dx, acc[r][p]);
                    if (kt_has_min(fmt)) acc[r][p] = fmaf(dm[p], tx, acc[r][p]);
                }
            }
        }
    }
}

#if defined(QG_AVX2) && !defined(QG_AVX512)
/* Lanes 0-7 of a 16-byte vector's bytes 8h..8h+7 as 8 floats (unsigned, or signed for Q6_K's scales). */
AI __m256 kt_u8_ps(__m128i v, int h) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h ? _mm_srli_si128(v, 8) : v)); }
AI __m256 kt_i8_ps(__m128i v, int h) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h ? _mm_srli_si128(v, 8) : v)); }

/* acc[r] lanes = y[m0 + r, 16t + 8h + p], p < 8: half h of a tile (vpmaddubsw + vpmaddwd). */
AI void kt_tile_avx2(int fmt, const uint8_t* tile, int h, const act_q* a, int64_t m0, int R, __m256* acc, int pf) {
    const int gpb = kt_groups(fmt), c = kt_offset(fmt);
    const int64_t tbb = TP * qg_block_bytes(fmt);
    const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(15);
    /* chunks summed in 16 bits before widening: 8 * 2 * 15 * 127, 4 * 2 * 31 * 127, 2 * 2 * 63 * 127 < 32768 */
    const int run = fmt == Q6_K ? 2 : kt_five(fmt) ? 4 : 8;
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->G / gpb; b++) {
        const uint8_t* tb = tile + b * tbb;
        if (pf) for (int64_t o = 0; o < tbb; o += 64) _mm_prefetch((const char*)tb + tbb + o, _MM_HINT_T0);
        const __m256 D = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(tb + 16 * h)));
        const __m256 M = fmt == Q5_0 || fmt == Q6_K ? _mm256_setzero_ps()
                                                    : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(tb + 32 + 16 * h)));
        __m128i P[12];
        if (fmt == Q4_K || fmt == Q5_K)
            for (int s = 0; s < 12; s++) P[s] = _mm_loadu_si128((const __m128i*)(tb + 64 + 16 * s));
        for (int j = 0; j < gpb; j++) {
            const int64_t g = b * gpb + j;
            __m256 ds0 = D, ds1 = D, dm = M;
            if (fmt == Q4_K || fmt == Q5_K) {
                const __m128i m63 = _mm_set1_epi8(63), m15 = _mm_set1_epi8(15), m48 = _mm_set1_epi8(48);
                __m128i sc, mn;
                if (j < 4) { sc = _mm_and_si128(P[j], m63); mn = _mm_and_si128(P[j + 4], m63); }
                else {
                    sc = _mm_or_si128(_mm_and_si128(P[j + 4], m15), _mm_and_si128(_mm_srli_epi16(P[j - 4], 2), m48));
                    mn = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(P[j + 4], 4), m15), _mm_and_si128(_mm_srli_epi16(P[j], 2), m48));
                }
                ds0 = ds1 = _mm256_mul_ps(D, kt_u8_ps(sc, h));
                dm = _mm256_mul_ps(_mm256_xor_ps(M, _mm256_set1_ps(-0.0f)), kt_u8_ps(mn, h));
            } else if (fmt == Q6_K) {
                ds0 = _mm256_mul_ps(D, kt_i8_ps(_mm_loadu_si128((const __m128i*)(tb + 32 + 16 * (2 * j))), h));
                ds1 = _mm256_mul_ps(D, kt_i8_ps(_mm_loadu_si128((const __m128i*)(tb + 32 + 16 * (2 * j + 1))), h));
            }
            const uint8_t* cs = tb + kt_codes_at(fmt, j) + 32 * h;
            __m256i u[8];
            for (int k = 0; k < 4; k++) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(cs + 64 * k));
                u[k] = _mm256_and_si256(v, m4);
                u[k + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            }
            if (kt_five(fmt)) {
                const __m256i hb = _mm256_loadu_si256((const __m256i*)(tb + kt_hbits_at(fmt, j) + 32 * h));
                const __m256i m16 = _mm256_set1_epi8(16);
                u[0] = _mm256_or_si256(u[0], _mm256_and_si256(_mm256_slli_epi16(hb, 4), m16));
                u[1] = _mm256_or_si256(u[1], _mm256_and_si256(_mm256_slli_epi16(hb, 3), m16));
                u[2] = _mm256_or_si256(u[2], _mm256_and_si256(_mm256_slli_epi16(hb, 2), m16));
                u[3] = _mm256_or_si256(u[3], _mm256_and_si256(_mm256_slli_epi16(hb, 1), m16));
                u[4] = _mm256_or_si256(u[4], _mm256_and_si256(hb, m16));
                u[5] = _mm256_or_si256(u[5], _mm256_and_si256(_mm256_srli_epi16(hb, 1), m16));
                u[6] = _mm256_or_si256(u[6], _mm256_and_si256(_mm256_srli_epi16(hb, 2), m16));
                u[7] = _mm256_or_si256(u[7], _mm256_and_si256(_mm256_srli_epi16(hb, 3), m16));
            } else if (fmt == Q6_K) {
                const uint8_t* hp = tb + kt_hbits_at(fmt, j) + 32 * h;
                const __m256i m48 = _mm256_set1_epi8(48);
                for (int hh = 0; hh < 2; hh++) {
                    const __m256i hb = _mm256_loadu_si256((const __m256i*)(hp + 64 * hh));
                    u[4 * hh + 0] = _mm256_or_si256(u[4 * hh + 0], _mm256_and_si256(_mm256_slli_epi16(hb, 4), m48));
                    u[4 * hh + 1] = _mm256_or_si256(u[4 * hh + 1], _mm256_and_si256(_mm256_slli_epi16(hb, 2), m48));
                    u[4 * hh + 2] = _mm256_or_si256(u[4 * hh + 2], _mm256_and_si256(hb, m48));
                    u[4 * hh + 3] = _mm256_or_si256(u[4 * hh + 3], _mm256_and_si256(_mm256_srli_epi16(hb, 2), m48));
                }
            }
            for (int r = 0; r < R; r++) {
                const int8_t* xq = a->q + (m0 + r) * a->K + g * QK;
                const int64_t idx = (m0 + r) * a->G + g;
                const __m256 dx = _mm256_set1_ps(a->d[idx]);
                __m256i s[2];
                if (fmt == Q6_K) { s[0] = _mm256_set1_epi32(-c * a->h[2 * idx]); s[1] = _mm256_set1_epi32(-c * a->h[2 * idx + 1]); }
                else s[0] = s[1] = _mm256_set1_epi32(-c * a->i[idx]);
                for (int k0 = 0; k0 < 8; k0 += run) {
                    __m256i s16 = _mm256_setzero_si256();
                    for (int k = k0; k < k0 + run; k++)
                        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(u[k], _mm256_set1_epi32(load_i32(xq + 4 * k))));
                    const int half = fmt == Q6_K && k0 >= 4;
                    s[half] = _mm256_add_epi32(s[half], _mm256_madd_epi16(s16, ones));
                }
                if (fmt == Q6_K) {
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[0]), _mm256_mul_ps(ds0, dx), acc[r]);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[1]), _mm256_mul_ps(ds1, dx), acc[r]);
                } else {
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[0]), _mm256_mul_ps(ds0, dx), acc[r]);
                    if (kt_has_min(fmt)) acc[r] = _mm256_fmadd_ps(dm, _mm256_set1_ps(a->t[idx]), acc[r]);
                }
            }
        }
    }
}
#endif

#if defined(QG_AVX512)
/* 16 bytes as 16 floats, unsigned or signed (widened via 16 bits: the SIMDe test shim has no vpmovzxbd). */
AI __m512 kt_u8x16_ps(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm256_cvtepu8_epi16(v))); }
AI __m512 kt_i8x16_ps(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm256_cvtepi8_epi16(v))); }

/* acc[r] lanes = y[m0 + r, 16t + p]: one tile (vpdpbusd with VNNI, else vpmaddubsw + vpmaddwd); pf as
 * tile_avx512's (here the next tile block is prefetched while this one is read). */
AI void kt_tile_avx512(int fmt, const uint8_t* tile, const act_q* a, int64_t m0, int R, __m512* acc, int pf) {
    const int gpb = kt_groups(fmt), c = kt_offset(fmt);
    const int64_t tbb = TP * qg_block_bytes(fmt);
    const __m512i m4 = _mm512_set1_epi8(15);
#if !defined(QG_VNNI)
    const __m512i ones = _mm512_set1_epi16(1);
    const int run = fmt == Q6_K ? 2 : kt_five(fmt) ? 4 : 8; /* as kt_tile_avx2 */
#endif
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a->G / gpb; b++) {
        const uint8_t* tb = tile + b * tbb;
        const __m512 D = half16(tb);
        const __m512 M = fmt == Q5_0 || fmt == Q6_K ? _mm512_setzero_ps() : half16(tb + 32);
        __m128i P[12];
        if (fmt == Q4_K || fmt == Q5_K)
            for (int s = 0; s < 12; s++) P[s] = _mm_loadu_si128((const __m128i*)(tb + 64 + 16 * s));
        for (int j = 0; j < gpb; j++) {
            const int64_t g = b * gpb + j;
            if (pf) { /* this group's share of the tile block TILE_PREFETCH_GROUPS groups ahead */
                const int64_t gb = tbb / gpb, ahead = TILE_PREFETCH_GROUPS * gb;
                for (int64_t o = 0; o < gb; o += 64) _mm_prefetch((const char*)tb + j * gb + ahead + o, _MM_HINT_T0);
            }
            __m512 ds0 = D, ds1 = D, dm = M;
            if (fmt == Q4_K || fmt == Q5_K) {
                const __m128i m63 = _mm_set1_epi8(63), m15 = _mm_set1_epi8(15), m48 = _mm_set1_epi8(48);
                __m128i sc, mn;
                if (j < 4) { sc = _mm_and_si128(P[j], m63); mn = _mm_and_si128(P[j + 4], m63); }
                else {
                    sc = _mm_or_si128(_mm_and_si128(P[j + 4], m15), _mm_and_si128(_mm_srli_epi16(P[j - 4], 2), m48));
                    mn = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(P[j + 4], 4), m15), _mm_and_si128(_mm_srli_epi16(P[j], 2), m48));
                }
                ds0 = ds1 = _mm512_mul_ps(D, kt_u8x16_ps(sc));
                dm = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(M), _mm512_set1_epi32((int)0x80000000u))),
                                   kt_u8x16_ps(mn));
            } else if (fmt == Q6_K) {
                ds0 = _mm512_mul_ps(D, kt_i8x16_ps(_mm_loadu_si128((const __m128i*)(tb + 32 + 16 * (2 * j)))));
                ds1 = _mm512_mul_ps(D, kt_i8x16_ps(_mm_loadu_si128((const __m128i*)(tb + 32 + 16 * (2 * j + 1)))));
            }
            const uint8_t* cs = tb + kt_codes_at(fmt, j);
            __m512i u[8];
            for (int k = 0; k < 4; k++) {
                const __m512i v = _mm512_loadu_si512((const void*)(cs + 64 * k));
                u[k] = _mm512_and_si512(v, m4);
                u[k + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            }
            if (kt_five(fmt)) {
                const __m512i hb = _mm512_loadu_si512((const void*)(tb + kt_hbits_at(fmt, j)));
                const __m512i m16 = _mm512_set1_epi8(16);
                u[0] = _mm512_or_si512(u[0], _mm512_and_si512(_mm512_slli_epi16(hb, 4), m16));
                u[1] = _mm512_or_si512(u[1], _mm512_and_si512(_mm512_slli_epi16(hb, 3), m16));
                u[2] = _mm512_or_si512(u[2], _mm512_and_si512(_mm512_slli_epi16(hb, 2), m16));
                u[3] = _mm512_or_si512(u[3], _mm512_and_si512(_mm512_slli_epi16(hb, 1), m16));
                u[4] = _mm512_or_si512(u[4], _mm512_and_si512(hb, m16));
                u[5] = _mm512_or_si512(u[5], _mm512_and_si512(_mm512_srli_epi16(hb, 1), m16));
                u[6] = _mm512_or_si512(u[6], _mm512_and_si512(_mm512_srli_epi16(hb, 2), m16));
                u[7] = _mm512_or_si512(u[7], _mm512_and_si512(_mm512_srli_epi16(hb, 3), m16));
            } else if (fmt == Q6_K) {
                const uint8_t* hp = tb + kt_hbits_at(fmt, j);
                const __m512i m48 = _mm512_set1_epi8(48);
                for (int hh = 0; hh < 2; hh++) {
                    const __m512i hb = _mm512_loadu_si512((const void*)(hp + 64 * hh));
                    u[4 * hh + 0] = _mm512_or_si512(u[4 * hh + 0], _mm512_and_si512(_mm512_slli_epi16(hb, 4), m48));
                    u[4 * hh + 1] = _mm512_or_si512(u[4 * hh + 1], _mm512_and_si512(_mm512_slli_epi16(hb, 2), m48));
                    u[4 * hh + 2] = _mm512_or_si512(u[4 * hh + 2], _mm512_and_si512(hb, m48));
                    u[4 * hh + 3] = _mm512_or_si512(u[4 * hh + 3], _mm512_and_si512(_mm512_srli_epi16(hb, 2), m48));
                }
            }
            for (int r = 0; r < R; r++) {
                const int8_t* xq = a->q + (m0 + r) * a->K + g * QK;
                const int64_t idx = (m0 + r) * a->G + g;
                const __m512 dx = _mm512_set1_ps(a->d[idx]);
                __m512i s0, s1;
                if (fmt == Q6_K) { s0 = _mm512_set1_epi32(-c * a->h[2 * idx]); s1 = _mm512_set1_epi32(-c * a->h[2 * idx + 1]); }
                else { s0 = _mm512_set1_epi32(-c * a->i[idx]); s1 = _mm512_setzero_si512(); }
#if defined(QG_VNNI)
                /* four chains (integer sums: any order gives the same I); for Q6_K chains 0-1 are half 0 */
                __m512i t0 = _mm512_setzero_si512(), t1 = _mm512_setzero_si512();
                __m512i q0 = s0, q1 = _mm512_setzero_si512();
                q0 = dpbusd_bcast(q0, u[0], xq);
                q1 = dpbusd_bcast(q1, u[1], xq + 4);
                q0 = dpbusd_bcast(q0, u[2], xq + 8);
                q1 = dpbusd_bcast(q1, u[3], xq + 12);
                t0 = dpbusd_bcast(s1, u[4], xq + 16);
                t1 = dpbusd_bcast(t1, u[5], xq + 20);
                t0 = dpbusd_bcast(t0, u[6], xq + 24);
                t1 = dpbusd_bcast(t1, u[7], xq + 28);
                s0 = _mm512_add_epi32(q0, q1);
                s1 = _mm512_add_epi32(t0, t1);
#else
                for (int k0 = 0; k0 < 8; k0 += run) {
                    __m512i s16 = _mm512_setzero_si512();
                    for (int k = k0; k < k0 + run; k++)
                        s16 = _mm512_add_epi16(s16, _mm512_maddubs_epi16(u[k], _mm512_set1_epi32(load_i32(xq + 4 * k))));
                    if (k0 < 4) s0 = _mm512_add_epi32(s0, _mm512_madd_epi16(s16, ones));
                    else s1 = _mm512_add_epi32(s1, _mm512_madd_epi16(s16, ones));
                }
#endif
                if (fmt == Q6_K) {
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(ds0, dx), acc[r]);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(ds1, dx), acc[r]);
                } else {
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_mul_ps(ds0, dx), acc[r]);
                    if (kt_has_min(fmt)) acc[r] = _mm512_fmadd_ps(dm, _mm512_set1_ps(a->t[idx]), acc[r]);
                }
            }
        }
    }
}
#endif

/* Every activation row against tile t, R (a constant at each call) rows at a time. */
AI void kt_tile_rows(int fmt, const uint8_t* tile, const act_q* a, int64_t m0, int R, float out[][TP], int pf) {
#if defined(QG_AVX512)
    __m512 acc[TILE_M];
    kt_tile_avx512(fmt, tile, a, m0, R, acc, pf);
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], acc[r]);
#elif defined(QG_AVX2)
    __m256 acc[TILE_M];
    for (int h = 0; h < 2; h++) {
        kt_tile_avx2(fmt, tile, h, a, m0, R, acc, pf && h == 0);
        for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r] + 8 * h, acc[r]);
    }
#else
    (void)pf;
    kt_tile_portable(fmt, tile, a, m0, R, out);
#endif
}

AI void kt_task_tile(int fmt, const uint8_t* w, const act_q* a, int64_t t, int64_t M, void* y, int y_bf16, int64_t ldy) {
    const uint8_t* tile = w + t * (a->G / kt_groups(fmt)) * TP * qg_block_bytes(fmt);
    for (int64_t m0 = 0; m0 < M; m0 += TILE_M) {
        const int R = (int)(M - m0 < TILE_M ? M - m0 : TILE_M), pf = m0 == 0 && M >= 4;
        float out[TILE_M][TP];
        switch (R) {
        case TILE_M: kt_tile_rows(fmt, tile, a, m0, TILE_M, out, pf); break;
        case 1: kt_tile_rows(fmt, tile, a, m0, 1, out, pf); break;
        case 2: kt_tile_rows(fmt, tile, a, m0, 2, out, pf); break;
#if TILE_M > 4
        case 3: kt_tile_rows(fmt, tile, a, m0, 3, out, pf); break;
        case 4: kt_tile_rows(fmt, tile, a, m0, 4, out, pf); break;
        case 5: kt_tile_rows(fmt, tile, a, m0, 5, out, pf); break;
        case 6: kt_tile_rows(fmt, tile, a, m0, 6, out, pf); break;
        default: kt_tile_rows(fmt, tile, a, m0, 7, out, pf); break;
#else
        default: kt_tile_rows(fmt, tile, a, m0, 3, out, pf); break;
#endif
        }
        store_tile(y, y_bf16, ldy, m0, t * TP, R, &out[0][0]);
    }
}

#define DEFINE_KT_TASK(NAME, QT) \
    static void NAME(const uint8_t* w, const act_q* a, int64_t t, int64_t M, void* y, int y_bf16, int64_t ldy, \
                     int amx) { (void)amx; kt_task_tile(QT, w, a, t, M, y, y_bf16, ldy); }
DEFINE_KT_TASK(kt_task_q5_0, Q5_0)
DEFINE_KT_TASK(kt_task_q5_1, Q5_1)
DEFINE_KT_TASK(kt_task_q4_k, Q4_K)
DEFINE_KT_TASK(kt_task_q5_k, Q5_K)
DEFINE_KT_TASK(kt_task_q6_k, Q6_K)
