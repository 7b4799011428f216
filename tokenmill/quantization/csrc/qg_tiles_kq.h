/* Tiled layouts and products of Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS. Part of qgemm.c's
 * one translation unit (included there after qg_tiles.h, the Q4_0/Q4_1/Q8_0 tiles, whose conventions these
 * follow: 16 weight rows per tile, the 16 rows' codes of 4 consecutive k in one 64-byte chunk so a 32-bit
 * broadcast of 4 activations multiplies every row at once, one lane per row). Holds the layouts, the repacking
 * into them (kt_repack, for qg_repack) and back (kt_info, kt_codes, kt_dequantize_row), the plain C product
 * (kt_tile_portable) and the tasks; the SIMD products are in qg_tiles_kq_body.h (one source for AVX2 and
 * AVX-512).
 *
 * qg_repack rewrites a weight of these formats, once at load, into the same number of bytes: rows
 * n < N - N % 16 in tiles of 16, the rest as stored. A tile is a run of tile blocks, one per stored block
 * (32 weights for Q5_0/Q5_1/IQ4_NL, a 256-weight super block for the others), each 16 x the block's bytes;
 * "x 16" is one field of each of the 16 rows, row p at p (bytes) or 2p (fp16):
 *
 *   Q5_0   (352 B)  D fp16 x 16 | hb 64 | codes 256
 *   Q5_1   (384 B)  D x 16 | M fp16 x 16 | hb 64 | codes 256
 *   IQ4_NL (288 B)  D x 16 | codes 256
 *   Q2_K  (1344 B)  D x 16 | Dmin x 16 | 16 planes (the stored scale/min bytes) | per group j (8): L 128
 *   Q3_K  (1760 B)  D x 16 | 12 planes (the packed 6-bit scales) | per group j: L 128, hb 64
 *   Q4_K  (2304 B)  D x 16 | Dmin x 16 | 12 planes (the packed 6-bit scales and mins) | per group j: codes 256
 *   Q5_K  (2816 B)  as Q4_K, per group j: hb 64, codes 256
 *   Q6_K  (3360 B)  D x 16 | 16 x 16 int8 sub-block scales (sub-block b at 32 + 16b) | per group j: codes 256,
 *                   hb0 64, hb1 64
 *   IQ4_XS (2176 B) D x 16 | 6 planes (scales_h 2 bytes, scales_l 4 bytes) | per group j: codes 256
 *
 * codes: the 4 low bits of a group's 32 codes, 4 chunks of 64 bytes; chunk c, bytes 4p..4p+3 hold row p's
 * codes k = 4c..4c+3 in their low nibbles and k = 16+4c..16+4c+3 in their high nibbles (as Q4_0's tiles; for
 * IQ4 the stored nibble bytes as they are). L (2-bit formats): two 64-byte planes; byte 4p+i of the first
 * holds row p's codes k = 4c+i (c = 0..3) at bits 2c, 2c+1, the second k = 16+4c+i. hb: byte 4p+i holds the
 * fifth (Q5) or third (Q3_K) bit of row p's code k = 4c+i at bit c and of k = 16+4c+i at bit 4+c. hb0/hb1
 * (Q6_K): byte 4p+i holds the two high bits of row p's code k = 4c+i (hb0) or k = 16+4c+i (hb1) at bits 2c,
 * 2c+1. A plane holds the 16 rows' copies of one byte of the stored block's packed scales, so a group's 16
 * scales unpack with a few 16-byte operations.
 *
 * The products. With u the unsigned code (IQ4: the table value + 128), a group's weights are
 * w = ds_h * (u - c) + dm_h, where
 *   Q5_0: ds = D, c = 16        Q5_1: ds = D, dm = M        IQ4_NL: ds = D, c = 128
 *   Q4_K, Q5_K: ds = D * sc_j, dm = -Dmin * m_j             IQ4_XS: ds = D * (ls_j - 32), c = 128
 *   Q6_K: ds_h = D * sc_{2j+h}, c = 32                      Q3_K: ds_h = D * (sc_{2j+h} - 32), c = 4
 *   Q2_K: ds_h = D * sc_{2j+h}, dm_h = -Dmin * m_{2j+h}
 * (h: the half of 16 codes; formats with one scale per 16 weights take one per half). D * sc and Dmin * m
 * are exact in float32 (an 11-bit significand times an integer of at most 8 bits). Every path computes the
 * exact integers I_h = sum_k u_k * xq_k - c * xs_h (xs: the activation codes' sum; one I per group for the
 * formats with one scale per group) and then the same float steps, lane by lane:
 *   acc = fma((float)I_h, ds_h * dx, acc) per scale,  then  acc = fma(dm_h, dx * xs_h, acc) per min
 * so the portable, AVX2, AVX-512 and VNNI builds give the same bits (as the Q4_0/Q4_1/Q8_0 tiles do), and
 * each y[m, n] depends only on row m of x. Without VNNI, IQ4 multiplies |value| by the activation carrying
 * the value's sign (vpmaddubsw would saturate on value + 128): the same integer I. No AMX path: these
 * products take the VNNI tiles at every M.
 */

/* How far ahead of the group it reads a first pass over a tile prefetches, at every row count (as the
 * Q4_0/Q4_1/Q8_0 tiles do), per path. 16384 x 2048 weights not in cache, one row, 2 threads:
 * - AVX-512, an AMX Xeon: none -> 1 KB ahead, Q4_K 18.8 -> 20.7 GB/s, Q6_K 18.3 -> 20.8 GB/s (768 bytes about the
 *   same, 1536 or 4+ groups slower);
 * - AVX2, the Zen 1 EPYC (1 KB and 3 KB alternated 3 times): Q4_K 1.22-1.28 -> 1.11-1.14 ms, Q6_K 1.73-1.86 ->
 *   1.66-1.75, Q5_0 1.56-1.59 -> 1.45-1.52, Q5_K 1.62-1.69 -> 1.55-1.64; 2 and 8 rows within 2%. */
#if defined(QG_AVX512)
#define KT_PF_BYTES 1024
#else
#define KT_PF_BYTES 3072
#endif

/* Activation rows per pass over a tile: 8 on every path. The AVX2 products spill some of the 8 rows' sums
 * beside the 8 code vectors, and still gain over 4 rows (the Q4_0/Q4_1/Q8_0 tiles' TILE_M there): each decoded
 * group serves twice the rows. 2048 x 2048, 32 rows, one thread of the Zen 1 EPYC, 4 -> 8 rows: Q4_K 23.1 ->
 * 24.7, Q6_K 18.4 -> 21.0, Q5_K 18.9 -> 23.3, Q5_0 23.6 -> 25.4 G multiply-adds a second (the same bits). */
#define KT_TILE_M 8

/* The AVX2 multi-row products of the formats below read each 4 activation codes already repeated across a
 * vector (act_q.xb) instead of broadcasting them per row, chunk and half: the broadcasts were a fifth of the
 * vector operations of an 8-row pass. N = 2048, one thread of the Zen 1 EPYC, G multiply-adds a second, broadcast
 * -> expanded (benchmarks/RESULTS.md): Q4_K 24.7 -> 27.1-27.6 at 32 rows and K 2048, 24.0 -> 26.5-27.0 at 8 rows
 * and K 8192; Q5_K 23.2 -> 24.3-24.7, Q2_K 20.8 -> 21.8-22.0, Q3_K 21.8 -> 21.5-22.6; Q6_K was 6% slower and Q5_0
 * 2% faster (both keep the broadcasts), one and two rows take other loops. The same codes, so the same bits.
 * From KT_XB_MIN_ROWS rows while the expanded codes (8 bytes per activation) stay within KT_XB_MAX_BYTES: a
 * tile re-reads them all. */
#define KT_XB_MIN_ROWS 8
#define KT_XB_MAX_BYTES (4 << 20)
AI int kt_xb_format(int fmt) { return fmt == Q4_K || fmt == Q5_K || fmt == Q3_K || fmt == Q2_K; }
static int kt_expands(int fmt, int64_t M, int64_t K) {
#if defined(QG_AVX2) && !defined(QG_AVX512)
    return kt_xb_format(fmt) && M >= KT_XB_MIN_ROWS && M * K * 8 <= KT_XB_MAX_BYTES;
#else
    (void)fmt; (void)M; (void)K;
    return 0;
#endif
}

/* a->xb for M rows of a->q (kt_expands said so): row m's codes 4i..4i+3 repeated 8 times at (m K / 4 + i) * 32.
 * Returns 0, or -1 when the allocation fails (a->xb stays NULL: the products broadcast as before). */
static int act_expand(act_q* a, int64_t M, int num_threads) {
#if defined(QG_AVX2) && !defined(QG_AVX512)
    const int64_t quads = M * a->K / 4;
    uint8_t* xb = (uint8_t*)aligned_alloc(32, (size_t)(quads * 32));
    if (!xb) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && quads >= 16384)
    for (int64_t i = 0; i < quads; i++)
        _mm256_store_si256((__m256i*)(xb + 32 * i), _mm256_set1_epi32(load_i32(a->q + 4 * i)));
    a->xb = xb;
    return 0;
#else
    (void)a; (void)M; (void)num_threads;
    return -1;
#endif
}

/* The format of a tiled type id of this file's formats, or 0. */
static int kt_base(int qtype) {
    const int b = qtype - QG_TILED;
    switch (b) {
    case Q5_0: case Q5_1: case Q2_K: case Q3_K: case Q4_K: case Q5_K: case Q6_K: case IQ4_NL: case IQ4_XS: return b;
    default: return 0;
    }
}

AI int kt_groups(int fmt) { return fmt == Q5_0 || fmt == Q5_1 || fmt == IQ4_NL ? 1 : 8; } /* groups per tile block */
AI int kt_halves(int fmt) { return fmt == Q6_K || fmt == Q3_K || fmt == Q2_K; } /* a scale per 16 weights */
AI int kt_has_min(int fmt) { return fmt == Q5_1 || fmt == Q4_K || fmt == Q5_K; } /* a min per group (Q2_K: per half) */
AI int kt_iq4(int fmt) { return fmt == IQ4_NL || fmt == IQ4_XS; }
AI int kt_two_bit(int fmt) { return fmt == Q2_K || fmt == Q3_K; }
AI int kt_offset(int fmt) {
    switch (fmt) {
    case Q5_0: return 16;
    case Q6_K: return 32;
    case Q3_K: return 4;
    case IQ4_NL: case IQ4_XS: return 128;
    default: return 0;
    }
}
AI int kt_five(int fmt) { return fmt == Q5_0 || fmt == Q5_1 || fmt == Q5_K; }
/* Byte offsets in a tile block: group j's code chunks (the 2-bit planes for Q2_K/Q3_K), its high-bit
 * planes (hb; hb0 then hb1 for Q6_K), and the scale planes. */
AI int kt_codes_at(int fmt, int j) {
    switch (fmt) {
    case Q5_0: return 96;
    case Q5_1: return 128;
    case IQ4_NL: return 32;
    case Q2_K: return 320 + 128 * j;
    case Q3_K: return 224 + 192 * j;
    case Q4_K: return 256 + 256 * j;
    case Q5_K: return 256 + 320 * j + 64;
    case IQ4_XS: return 128 + 256 * j;
    default: return 288 + 384 * j; /* Q6_K */
    }
}
AI int kt_hbits_at(int fmt, int j) {
    switch (fmt) {
    case Q5_0: return 32;
    case Q5_1: return 64;
    case Q3_K: return 224 + 192 * j + 128;
    case Q5_K: return 256 + 320 * j;
    default: return 288 + 384 * j + 256; /* Q6_K: hb0, hb1 at +64 */
    }
}
AI int kt_planes_at(int fmt) { return fmt == Q4_K || fmt == Q5_K || fmt == Q2_K ? 64 : 32; }

/* Row p's group j of a tile block (tb) as group_params / group_codes give it for the stored block: the
 * same D, sub-scales and offsets (IQ4: as for the codes u = value + 128 that kt_codes gives). */
static group_info kt_info(int fmt, const uint8_t* tb, int j, int p) {
    group_info gi;
    const uint8_t* pl = tb + kt_planes_at(fmt);
    gi.D = rd_half(tb + 2 * p);
    switch (fmt) {
    case Q5_0: gi.s0 = gi.s1 = 1; gi.o0 = gi.o1 = -16.0f * gi.D; break;
    case Q5_1: gi.s0 = gi.s1 = 1; gi.o0 = gi.o1 = rd_half(tb + 32 + 2 * p); break;
    case IQ4_NL: gi.s0 = gi.s1 = 1; gi.o0 = gi.o1 = -128.0f * gi.D; break;
    case IQ4_XS: {
        uint8_t b[8] = {0};
        for (int i = 0; i < 6; i++) b[2 + i] = pl[16 * i + p];
        gi.s0 = gi.s1 = iq4xs_scale(b, j);
        gi.o0 = gi.o1 = -128.0f * gi.D * (float)gi.s0;
        break;
    }
    case Q2_K: {
        const float dmin = rd_half(tb + 32 + 2 * p);
        gi.s0 = pl[16 * (2 * j) + p] & 15;
        gi.s1 = pl[16 * (2 * j + 1) + p] & 15;
        gi.o0 = -dmin * (float)(pl[16 * (2 * j) + p] >> 4);
        gi.o1 = -dmin * (float)(pl[16 * (2 * j + 1) + p] >> 4);
        break;
    }
    case Q3_K: {
        uint8_t s[12];
        for (int b = 0; b < 12; b++) s[b] = pl[16 * b + p];
        gi.s0 = q3k_scale(s, 2 * j);
        gi.s1 = q3k_scale(s, 2 * j + 1);
        gi.o0 = -4.0f * gi.D * (float)gi.s0;
        gi.o1 = -4.0f * gi.D * (float)gi.s1;
        break;
    }
    case Q4_K: case Q5_K: {
        uint8_t s[12];
        for (int b = 0; b < 12; b++) s[b] = pl[16 * b + p];
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

/* Row p's 32 unsigned codes of group j (IQ4: the table value + 128). */
static void kt_codes(int fmt, const uint8_t* tb, int j, int p, int* u) {
    const uint8_t* cs = tb + kt_codes_at(fmt, j);
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < 4; i++) {
            if (kt_two_bit(fmt)) {
                u[4 * c + i] = (cs[4 * p + i] >> (2 * c)) & 3;
                u[16 + 4 * c + i] = (cs[64 + 4 * p + i] >> (2 * c)) & 3;
                continue;
            }
            const uint8_t v = cs[64 * c + 4 * p + i];
            u[4 * c + i] = v & 15;
            u[16 + 4 * c + i] = v >> 4;
            if (kt_iq4(fmt)) {
                u[4 * c + i] = IQ4_VALUES[v & 15] + 128;
                u[16 + 4 * c + i] = IQ4_VALUES[v >> 4] + 128;
            }
        }
    if (fmt == Q4_K || fmt == Q2_K || kt_iq4(fmt)) return;
    const uint8_t* hb = tb + kt_hbits_at(fmt, j);
    const int at = fmt == Q3_K ? 2 : 4; /* where the high bits go in the code */
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < 4; i++) {
            if (fmt == Q6_K) {
                u[4 * c + i] |= ((hb[4 * p + i] >> (2 * c)) & 3) << 4;
                u[16 + 4 * c + i] |= ((hb[64 + 4 * p + i] >> (2 * c)) & 3) << 4;
            } else {
                u[4 * c + i] |= ((hb[4 * p + i] >> c) & 1) << at;
                u[16 + 4 * c + i] |= ((hb[4 * p + i] >> (4 + c)) & 1) << at;
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
            uint8_t* pl = tb + kt_planes_at(fmt);
            memset(tb, 0, (size_t)(TP * bb));
            for (int p = 0; p < TP; p++) {
                const uint8_t* blk = src + (t * TP + p) * rb + b * bb;
                switch (fmt) { /* scales (D at 2p, a second fp16 at 32 + 2p) and scale planes */
                case Q6_K:
                    memcpy(tb + 2 * p, blk + 208, 2);
                    for (int sb = 0; sb < 16; sb++) tb[32 + 16 * sb + p] = blk[192 + sb];
                    break;
                case Q2_K:
                    memcpy(tb + 2 * p, blk + 80, 2);
                    memcpy(tb + 32 + 2 * p, blk + 82, 2);
                    for (int i = 0; i < 16; i++) pl[16 * i + p] = blk[i];
                    break;
                case Q3_K:
                    memcpy(tb + 2 * p, blk + 108, 2);
                    for (int i = 0; i < 12; i++) pl[16 * i + p] = blk[96 + i];
                    break;
                case IQ4_XS:
                    memcpy(tb + 2 * p, blk, 2);
                    for (int i = 0; i < 6; i++) pl[16 * i + p] = blk[2 + i];
                    break;
                default: /* Q5_0, Q5_1, IQ4_NL, Q4_K, Q5_K */
                    memcpy(tb + 2 * p, blk, 2);
                    if (fmt == Q5_1 || fmt == Q4_K || fmt == Q5_K) memcpy(tb + 32 + 2 * p, blk + 2, 2); /* M, or Dmin */
                    if (fmt == Q4_K || fmt == Q5_K)
                        for (int i = 0; i < 12; i++) pl[16 * i + p] = blk[4 + i];
                    break;
                }
                for (int j = 0; j < gpb; j++) {
                    uint8_t* cs = tb + kt_codes_at(fmt, j);
                    if (kt_iq4(fmt)) { /* the stored nibble bytes as they are (Q4_0's pairing) */
                        const uint8_t* qs = fmt == IQ4_NL ? blk + 2 : blk + 8 + 16 * j;
                        for (int c = 0; c < 4; c++)
                            for (int i = 0; i < 4; i++) cs[64 * c + 4 * p + i] = qs[4 * c + i];
                        continue;
                    }
                    int u[32];
                    group_codes(fmt, blk, j, u);
                    uint8_t* hb = fmt == Q4_K || fmt == Q2_K ? NULL : tb + kt_hbits_at(fmt, j);
                    for (int c = 0; c < 4; c++)
                        for (int i = 0; i < 4; i++) {
                            const int lo = u[4 * c + i], hi = u[16 + 4 * c + i];
                            if (kt_two_bit(fmt)) {
                                cs[4 * p + i] |= (uint8_t)((lo & 3) << (2 * c));
                                cs[64 + 4 * p + i] |= (uint8_t)((hi & 3) << (2 * c));
                            } else {
                                cs[64 * c + 4 * p + i] = (uint8_t)((lo & 15) | ((hi & 15) << 4));
                            }
                            if (!hb) continue;
                            if (fmt == Q6_K) {
                                hb[4 * p + i] |= (uint8_t)(((lo >> 4) & 3) << (2 * c));
                                hb[64 + 4 * p + i] |= (uint8_t)(((hi >> 4) & 3) << (2 * c));
                            } else {
                                const int at = fmt == Q3_K ? 2 : 4;
                                hb[4 * p + i] |= (uint8_t)(((lo >> at) & 1) << c);
                                hb[4 * p + i] |= (uint8_t)(((hi >> at) & 1) << (4 + c));
                            }
                        }
                }
            }
        }
    memcpy(dst + NT * TP * rb, src + NT * TP * rb, (size_t)((N - NT * TP) * rb));
}

/* Row r of a tiled weight, a row in a tile (r < N - N % 16: the tail rows are as stored), as float32/bf16:
 * the stored format's values bit for bit (the same group_info and codes through the same expression as
 * dequantize_row). */
static void kt_dequantize_row(int fmt, const uint8_t* w, int64_t G, int64_t r, float* of, uint16_t* ob) {
    const int64_t bb = qg_block_bytes(fmt), gpb = kt_groups(fmt), rb = G / gpb * bb;
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

/* acc[r][p] = y[m0 + r, 16t + p] (plain C; one tile, R <= KT_TILE_M activation rows): the reference the SIMD
 * paths below reproduce bit for bit (the same integers, the same float operations in the same order). */
AI void kt_tile_portable(int fmt, const uint8_t* tile, const act_q* a, int64_t m0, int R, float acc[][TP]) {
    const int gpb = kt_groups(fmt), c = kt_offset(fmt);
    const int64_t tbb = TP * qg_block_bytes(fmt);
    for (int r = 0; r < R; r++) for (int p = 0; p < TP; p++) acc[r][p] = 0.0f;
    for (int64_t g = 0; g < a->G; g++) {
        const uint8_t* tb = tile + (g / gpb) * tbb;
        const int j = (int)(g % gpb);
        int u[TP][32];
        float ds0[TP], ds1[TP], dm0[TP], dm1[TP];
        for (int p = 0; p < TP; p++) {
            const group_info gi = kt_info(fmt, tb, j, p);
            kt_codes(fmt, tb, j, p, u[p]);
            ds0[p] = gi.D * (float)gi.s0;
            ds1[p] = gi.D * (float)gi.s1;
            dm0[p] = gi.o0;
            dm1[p] = gi.o1;
        }
        for (int r = 0; r < R; r++) {
            const int8_t* xq = a->q + (m0 + r) * a->K + g * QK;
            const int64_t idx = (m0 + r) * a->G + g;
            const float dx = a->d[idx], tx = a->t[idx];
            for (int p = 0; p < TP; p++) {
                if (kt_halves(fmt)) {
                    int32_t I0 = -c * a->h[2 * idx], I1 = -c * a->h[2 * idx + 1];
                    for (int k = 0; k < 16; k++) { I0 += u[p][k] * xq[k]; I1 += u[p][k + 16] * xq[k + 16]; }
                    acc[r][p] = fmaf((float)I0, ds0[p] * dx, acc[r][p]);
                    acc[r][p] = fmaf((float)I1, ds1[p] * dx, acc[r][p]);
                    if (fmt == Q2_K) {
                        acc[r][p] = fmaf(dm0[p], a->s[2 * idx], acc[r][p]);
                        acc[r][p] = fmaf(dm1[p], a->s[2 * idx + 1], acc[r][p]);
                    }
                } else {
                    int32_t I = -c * a->i[idx];
                    for (int k = 0; k < 32; k++) I += u[p][k] * xq[k];
                    acc[r][p] = fmaf((float)I, ds0[p] * dx, acc[r][p]);
                    if (kt_has_min(fmt)) acc[r][p] = fmaf(dm0[p], tx, acc[r][p]);
                }
            }
        }
    }
}

/* The SIMD paths share this shape, in vectors of V = 8 (AVX2: half h of a tile; at one or two activation
 * rows both halves, one after the other within each group) or 16 (AVX-512) lanes:
 *   per tile block: D, the second fp16 vector (M, Dmin) and the scale planes;
 *   per group: the lane scales ds0/ds1 and mins dm0/dm1, the 8 code chunks u[] (IQ4 without VNNI: |value|
 *   in u[] and the value in q[], whose sign moves onto the activations);
 *   per activation row: the integer sums of the halves (s0: chunks 0-3, s1: chunks 4-7), then the float steps.
 * Q2_K/Q3_K scales: 16-byte operations on the planes (kt_scales_*). */

#if defined(QG_AVX2)
#if defined(QG_AVX512)
/* 16 bytes as 16 floats, unsigned or signed (widened via 16 bits: the SIMDe test shim has no vpmovzxbd). */
AI __m512 kt_u8x16_ps(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm256_cvtepu8_epi16(v))); }
AI __m512 kt_i8x16_ps(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm256_cvtepi8_epi16(v))); }
#endif

/* Row lanes' scale bytes of group j (Q4_K/Q5_K: 6-bit scale and min), of half i = 2j + h (Q3_K: 6-bit - 32,
 * Q2_K: low/high nibble) or of group j (IQ4_XS: 6-bit - 32), from the 16-byte planes P. */
AI void kt_scales_k4(const __m128i* P, int j, __m128i* sc, __m128i* mn) {
    const __m128i m63 = _mm_set1_epi8(63), m15 = _mm_set1_epi8(15), m48 = _mm_set1_epi8(48);
    if (j < 4) { *sc = _mm_and_si128(P[j], m63); *mn = _mm_and_si128(P[j + 4], m63); }
    else {
        *sc = _mm_or_si128(_mm_and_si128(P[j + 4], m15), _mm_and_si128(_mm_srli_epi16(P[j - 4], 2), m48));
        *mn = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(P[j + 4], 4), m15), _mm_and_si128(_mm_srli_epi16(P[j], 2), m48));
    }
}
AI __m128i kt_scale_q3k(const __m128i* P, int i) {
    const __m128i lo = _mm_and_si128(i < 8 ? P[i] : _mm_srli_epi16(P[i - 8], 4), _mm_set1_epi8(15));
    const __m128i hi = _mm_and_si128(_mm_srl_epi16(P[8 + i % 4], _mm_cvtsi32_si128(2 * (i / 4))), _mm_set1_epi8(3));
    return _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
}
AI __m128i kt_scale_iq4xs(const __m128i* P, int j) {
    const __m128i lo = _mm_and_si128(_mm_srl_epi16(P[2 + j / 2], _mm_cvtsi32_si128(4 * (j % 2))), _mm_set1_epi8(15));
    const __m128i hi = _mm_and_si128(_mm_srl_epi16(P[j / 4], _mm_cvtsi32_si128(2 * (j % 4))), _mm_set1_epi8(3));
    return _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
}
/* The IQ4 table as 16 bytes: the values (signed) or the values + 128 (unsigned, for vpdpbusd). */
AI __m128i kt_iq4_table(int plus128) {
    int8_t t[16];
    for (int i = 0; i < 16; i++) t[i] = (int8_t)(IQ4_VALUES[i] + (plus128 ? 128 : 0));
    return _mm_loadu_si128((const __m128i*)t);
}

#endif /* QG_AVX2 */

/* One implementation for both widths: VEC/the intrinsic macros below are defined per width and the body is
 * included twice. */
#if defined(QG_AVX2) && !defined(QG_AVX512)
#define KT_W 256
#include "qg_tiles_kq_body.h"
#undef KT_W
#endif
#if defined(QG_AVX512)
#define KT_W 512
#include "qg_tiles_kq_body.h"
#undef KT_W
#endif

/* Every activation row against tile t, R (a constant at each call) rows at a time. */
AI void kt_tile_rows(int fmt, const uint8_t* tile, const act_q* a, int64_t m0, int R, float out[][TP], int pf) {
#if defined(QG_AVX512)
    __m512 acc[KT_TILE_M];
    kt_tile_avx512(fmt, tile, 0, a, m0, R, acc, pf, 0);
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], acc[r]);
#elif defined(QG_AVX2)
    __m256 acc[KT_TILE_M];
    if (R <= 2) { /* both halves group by group: each group's bytes streamed once while its products run (two
                   * passes leave the memory idle during the second) */
        kt_tile_avx2(fmt, tile, 2, a, m0, R, acc, pf, 0);
        for (int r = 0; r < R; r++) {
            _mm256_storeu_ps(out[r], acc[r]);
            _mm256_storeu_ps(out[r] + 8, acc[R + r]);
        }
        return;
    }
    for (int h = 0; h < 2; h++) {
        /* kt_xb_format folds at compile time: only those formats get a second, expanded-codes copy */
        if (kt_xb_format(fmt) && a->xb) kt_tile_avx2(fmt, tile, h, a, m0, R, acc, pf && h == 0, 1);
        else kt_tile_avx2(fmt, tile, h, a, m0, R, acc, pf && h == 0, 0);
        for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r] + 8 * h, acc[r]);
    }
#else
    (void)pf;
    kt_tile_portable(fmt, tile, a, m0, R, out);
#endif
}

AI void kt_task_tile(int fmt, const uint8_t* w, const act_q* a, int64_t t, int64_t M, void* y, int y_bf16, int64_t ldy) {
    const uint8_t* tile = w + t * (a->G / kt_groups(fmt)) * TP * qg_block_bytes(fmt);
    for (int64_t m0 = 0; m0 < M; m0 += KT_TILE_M) {
        const int R = (int)(M - m0 < KT_TILE_M ? M - m0 : KT_TILE_M), pf = m0 == 0;
        float out[KT_TILE_M][TP];
        switch (R) { /* R a constant in each call, so every row loop unrolls */
        case 1: kt_tile_rows(fmt, tile, a, m0, 1, out, pf); break;
        case 2: kt_tile_rows(fmt, tile, a, m0, 2, out, pf); break;
        case 3: kt_tile_rows(fmt, tile, a, m0, 3, out, pf); break;
        case 4: kt_tile_rows(fmt, tile, a, m0, 4, out, pf); break;
        case 5: kt_tile_rows(fmt, tile, a, m0, 5, out, pf); break;
        case 6: kt_tile_rows(fmt, tile, a, m0, 6, out, pf); break;
        case 7: kt_tile_rows(fmt, tile, a, m0, 7, out, pf); break;
        default: kt_tile_rows(fmt, tile, a, m0, KT_TILE_M, out, pf); break;
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
DEFINE_KT_TASK(kt_task_q2_k, Q2_K)
DEFINE_KT_TASK(kt_task_q3_k, Q3_K)
DEFINE_KT_TASK(kt_task_iq4_nl, IQ4_NL)
DEFINE_KT_TASK(kt_task_iq4_xs, IQ4_XS)
