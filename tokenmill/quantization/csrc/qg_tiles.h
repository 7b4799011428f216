/* The tiled layout of Q4_0, Q4_1 and Q8_0 and its products. Part of qgemm.c's one translation unit (included
 * there after qg_rows.h; not a standalone header). Holds the layout, the repacking into it (tiled_repack, for
 * qg_repack) and back (untile_block, dequantize_tiled_row), the tile products (plain C: tile_portable, the
 * reference; AVX2; AVX-512 with or without VNNI; AMX in qg_tiles_amx.h, included below), and task_tile, which
 * multiplies one tile by every activation row. The other formats' tiles (qg_tiles_kq.h) follow its conventions.
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
 * rows (the first and second 32 bytes of every 64-byte chunk). The tail rows take the row kernels (qg_rows.h).
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

/* src: N rows of a Q4_0/Q4_1/Q8_0 weight as stored, K a whole number of groups; dst: the same bytes in the
 * tiled layout (not overlapping src). */
static void tiled_repack(int base, const uint8_t* src, int64_t N, int64_t K, uint8_t* dst) {
    const int64_t G = K / QK, bb = qg_block_bytes(base), rb = G * bb, NT = N / TP;
    const int hdr = base == Q4_1 ? 4 : 2, co = codes_offset(base);
    for (int64_t t = 0; t < NT; t++) {
        for (int64_t g = 0; g < G; g++) {
            uint8_t* o = dst + (t * G + g) * TP * bb;
            for (int p = 0; p < TP; p++) {
                const uint8_t* blk = src + (t * TP + p) * rb + g * bb;
                memcpy(o + 2 * p, blk, 2);
                if (base == Q4_1) memcpy(o + 32 + 2 * p, blk + 2, 2);
                const int nq = base == Q8_0 ? 32 : 16;
                for (int k = 0; k < nq; k++)
                    o[co + 64 * (k / 4) + 4 * p + k % 4] = (uint8_t)(blk[hdr + k] ^ (base == Q8_0 ? 0x80 : 0));
            }
        }
    }
    memcpy(dst + NT * TP * rb, src + NT * TP * rb, (size_t)((N - NT * TP) * rb));
}

/* Row p of a tile's group g back as the stored block (into blk): the inverse of tiled_repack. */
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

/* Row r of a tiled weight, a row in a tile (r < N - N % TP: the tail rows are as stored), as float32/bf16:
 * each block rebuilt as stored and expanded by dequantize_row, so the values are the stored format's bit for
 * bit. */
AI void dequantize_tiled_row(int base, const uint8_t* w, int64_t G, int64_t r, float* of, uint16_t* ob) {
    const int64_t bb = qg_block_bytes(base), rb = G * bb;
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
        if (base == Q8_0) { /* chunk by chunk, every row per chunk: q and |q| of one chunk live at a time (all
                             * eight of both took every ymm register, and the spills halved the speed) */
            __m256i s[TILE_M];
            for (int r = 0; r < R; r++) s[r] = _mm256_setzero_si256(); /* c = 0: the maddubs paths sum q * xq */
            for (int j = 0; j < 8; j++) {
                const __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(cs + 64 * j)),
                                                   _mm256_set1_epi8((char)0x80));
                const __m256i u = _mm256_abs_epi8(q); /* |q| <= 128: vpmaddubsw cannot saturate */
                for (int r = 0; r < R; r++) {
                    const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(a->q + (m0 + r) * a->K + g * QK + 4 * j)), q);
                    s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones));
                }
            }
            for (int r = 0; r < R; r++) {
                const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(a->d[(m0 + r) * a->G + g]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), scale, acc[r]);
            }
            continue;
        }
        __m256i u[8];
        for (int j = 0; j < 4; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(cs + 64 * j));
            u[j] = _mm256_and_si256(v, m4);
            u[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        }
        for (int r = 0; r < R; r++) {
            const int8_t* xq = a->q + (m0 + r) * a->K + g * QK;
            const int64_t idx = (m0 + r) * a->G + g;
            __m256i s = _mm256_set1_epi32(-c * a->i[idx]);
            { /* 16-bit sums of 8 pairs of 15 * 127 stay below 32768 */
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

/* One or two activation rows: both halves of the tile in one pass (tile_avx2 takes a pass per half), so each
 * weight line is read once from memory and each activation broadcast serves 16 weight rows. The same integer
 * sums (in another order: exact) and the same float steps per lane as tile_avx2: the same bits. lo/hi: the
 * tile's rows 0-7 / 8-15. A Zen 1 EPYC (2 threads, one activation row, 16384 x 2048 weights not in cache):
 * Q8_0 3.6 -> 3.0 ms a product, Q4_0 1.98 -> 1.54 ms. For Q8_0, tile_avx2 kept all eight chunks' q and |q| live
 * before and spilled: one thread, in cache, 0.72 ms -> 0.50 (chunk by chunk there) -> 0.38 ms here. */
AI void tile_avx2_rows12(int base, const uint8_t* tile, const act_q* a, int64_t m0, int R, __m256* lo, __m256* hi,
                         int pf) {
    const int64_t tgb = TP * qg_block_bytes(base);
    const int c = tiled_offset(base, 0);
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80), m4 = _mm256_set1_epi8(15);
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < a->G; g++) {
        const uint8_t* b = tile + g * tgb;
        if (pf)
            for (int64_t o = 0; o < tgb; o += 64) _mm_prefetch((const char*)b + TILE_PREFETCH_GROUPS * tgb + o, _MM_HINT_T0);
        const uint8_t* cs = b + codes_offset(base);
        __m256i s0[2], s1[2];
        if (base == Q8_0) {
            for (int r = 0; r < R; r++) s0[r] = s1[r] = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                const __m256i q0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(cs + 64 * j)), flip);
                const __m256i q1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(cs + 64 * j + 32)), flip);
                const __m256i u0 = _mm256_abs_epi8(q0), u1 = _mm256_abs_epi8(q1); /* |q| <= 128: no saturation */
                for (int r = 0; r < R; r++) {
                    const __m256i x = _mm256_set1_epi32(load_i32(a->q + (m0 + r) * a->K + g * QK + 4 * j));
                    s0[r] = _mm256_add_epi32(s0[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u0, _mm256_sign_epi8(x, q0)), ones));
                    s1[r] = _mm256_add_epi32(s1[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u1, _mm256_sign_epi8(x, q1)), ones));
                }
            }
        } else { /* 16-bit sums of 8 pairs of 15 * 127 stay below 32768 */
            for (int r = 0; r < R; r++) s0[r] = s1[r] = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                const __m256i v0 = _mm256_loadu_si256((const __m256i*)(cs + 64 * j));
                const __m256i v1 = _mm256_loadu_si256((const __m256i*)(cs + 64 * j + 32));
                const __m256i l0 = _mm256_and_si256(v0, m4), h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4);
                const __m256i l1 = _mm256_and_si256(v1, m4), h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4);
                for (int r = 0; r < R; r++) {
                    const int8_t* xq = a->q + (m0 + r) * a->K + g * QK;
                    const __m256i xl = _mm256_set1_epi32(load_i32(xq + 4 * j));
                    const __m256i xh = _mm256_set1_epi32(load_i32(xq + 16 + 4 * j));
                    s0[r] = _mm256_add_epi16(s0[r], _mm256_add_epi16(_mm256_maddubs_epi16(l0, xl), _mm256_maddubs_epi16(h0, xh)));
                    s1[r] = _mm256_add_epi16(s1[r], _mm256_add_epi16(_mm256_maddubs_epi16(l1, xl), _mm256_maddubs_epi16(h1, xh)));
                }
            }
            for (int r = 0; r < R; r++) {
                const __m256i off = _mm256_set1_epi32(-c * a->i[(m0 + r) * a->G + g]);
                s0[r] = _mm256_add_epi32(off, _mm256_madd_epi16(s0[r], ones));
                s1[r] = _mm256_add_epi32(off, _mm256_madd_epi16(s1[r], ones));
            }
        }
        const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)b));
        const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + 16)));
        for (int r = 0; r < R; r++) {
            const int64_t idx = (m0 + r) * a->G + g;
            const __m256 dx = _mm256_set1_ps(a->d[idx]);
            lo[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0[r]), _mm256_mul_ps(d0, dx), lo[r]);
            hi[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1[r]), _mm256_mul_ps(d1, dx), hi[r]);
            if (base == Q4_1) {
                const __m256 t = _mm256_set1_ps(a->t[idx]);
                lo[r] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + 32))), t, lo[r]);
                hi[r] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + 48))), t, hi[r]);
            }
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

/* acc[r] lanes = y[m0 + r, 16t + p]: one tile (vpdpbusd with VNNI, else vpmaddubsw + vpmaddwd).
 * pf: prefetch the weight bytes TILE_PREFETCH_GROUPS groups ahead (they run on into the next tile, which
 * the same task or the next one reads next). The first pass over a tile sets it, at every row count: the
 * weights stream from L3 or memory while the rows' products run, and the hardware prefetcher alone left the
 * stream latency-bound (a 49152 x 576 Q8_0 product at 8 rows, weights not in cache: 2.19 -> 1.75 ms on a
 * Zen 4; Q4_1 layers 10-20% faster at 8-16 rows; at one row on a Zen 1 EPYC, 16384 x 2048 not in cache,
 * 2 threads, alternated in one process: Q8_0 3.4 -> 2.3 ms, Q4_0 1.8 -> 1.3 ms). Later passes find the tile
 * in L1. Prefetches do not change any result. */
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

#include "qg_tiles_amx.h" /* tile_amx (QG_AMX builds), for task_tile; the AMX bf16 product of qg_linear_bf16 */

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
    if (R <= 2) {
        __m256 lo[2], hi[2];
        tile_avx2_rows12(base, tile, a, m0, R, lo, hi, pf);
        for (int r = 0; r < R; r++) {
            _mm256_storeu_ps(out[r], lo[r]);
            _mm256_storeu_ps(out[r] + 8, hi[r]);
        }
        return;
    }
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

/* Columns 16t..16t+15 of y, every activation row against tile t: on AMX when amx is set (passes of AMX_M rows),
 * else TILE_M rows at a time. */
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
        const int R = (int)(M - m0 < TILE_M ? M - m0 : TILE_M), pf = m0 == 0;
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

#define DEFINE_TILE_TASK(NAME, QT) \
    static void NAME(const uint8_t* w, const act_q* a, int64_t t, int64_t M, void* y, int y_bf16, int64_t ldy, \
                     int amx) { task_tile(QT, w, a, t, M, y, y_bf16, ldy, amx); }
DEFINE_TILE_TASK(tile_task_q4_0, Q4_0)
DEFINE_TILE_TASK(tile_task_q4_1, Q4_1)
DEFINE_TILE_TASK(tile_task_q8_0, Q8_0)
