/* Products on the stored layout: qgemm.c's row kernels. Part of qgemm.c's one translation unit (included there
 * after qg_act.h; not a standalone header).
 *
 * y[m, n] for R <= ROW_TILE activation rows against one weight row as stored, any format, a group of 32 at a
 * time through group_params/group_codes (qg_formats.h): plain C (rows_portable; the NEON build takes its integer
 * dot products from NEON instructions, with the same bits), AVX2 (vpmaddubsw + vpmaddwd, a group per step) and
 * AVX-512 (two groups per step; vpdpbusd with VNNI for Q4_0, Q4_1, Q8_0 and IQ4_NL). rows_dot picks the
 * build's path, task_rows runs a range of weight rows against every activation row, and task_<format> is its
 * instance per format (qg_linear picks one). On x86 the tiled layouts are faster (qg_tiles.h, qg_tiles_kq.h);
 * a tiled weight's last N % 16 rows, kept as stored, still take these kernels.
 */

#define ROW_TILE 4 /* activation rows per pass over a weight row */

/* y[idx] = v as float32 or (y_bf16) bf16. */
static inline void store_out(void* y, int y_bf16, int64_t idx, float v) {
    if (y_bf16) ((uint16_t*)y)[idx] = f32_to_bf16(v); else ((float*)y)[idx] = v;
}

/* The offset term of group g for activation row m: one product for the formats with one offset per
 * group (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K), none for the signed-code formats, two for those with one per 16 weights. */
AI float offset_term(int qtype, const group_info* gi, const float* s, const float* t, int64_t idx) {
    if (SIGNED_CODES(qtype)) return 0.0f;
    if (qtype == Q6_K || qtype == Q3_K || qtype == Q2_K) return gi->o0 * s[idx * 2] + gi->o1 * s[idx * 2 + 1];
    return gi->o0 * t[idx];
}

#if defined(QG_NEON)
/* ---------------------------------------------------------------- NEON integer parts */

/* Group g's codes as two vectors of 16 int8 (codes <= 63, or the signed values of Q8_0 and IQ4). */
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
