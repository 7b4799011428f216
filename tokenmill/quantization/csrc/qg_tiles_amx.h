/* AMX products on the Q4_0/Q4_1/Q8_0 tiled layout (qg_tiles.h). Part of qgemm.c's one translation unit
 * (included by qg_tiles.h after its AVX-512 tile product; not a standalone header); empty unless the build has
 * AMX (QG_AMX, set by qgemm.c from TM_AMX and the compiler's flags). Two paths:
 *   tile_amx   int8 tiles, for qg_linear's products of AMX_MIN_ROWS or more rows: tile_avx512's bits
 *   amxb_*     bf16 tiles, for qg_linear_bf16 (QG_AMX_BF16 builds): bf16 activations times bf16-rounded weights
 * Both share the tile configuration record and amx_rows (what this thread has loaded); qgemm.c's qg_amx asks
 * Linux for the tile state once (amx_state, amx_request).
 */

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

#if defined(QG_AMX_BF16)
/* AMX bf16 products for bf16 activations (qg_linear_bf16; not batch invariant against qg_linear, so the
 * runner uses it only outside deterministic mode). Each tile group is expanded once into the bf16 weights
 * qg_dequantize gives (w = D * u + o in float32, rounded to nearest even) as the B operand of TDPBF16PS:
 * 16 rows of 64 bytes, row j holding the 16 weight rows' pairs (w[2j], w[2j + 1]). The activations are
 * the A operand as they are (16 rows of 32 bf16; the rows of a last partial block are copied into a
 * zero-padded 16-row buffer), and C accumulates float32 over the whole K (no per-group float step, unlike
 * the int8 paths): y is the float32 product of the bf16 activations and the bf16-rounded weights, summed in
 * the tile unit's order.
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
