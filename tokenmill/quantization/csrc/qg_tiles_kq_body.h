/* The SIMD tile product of qg_tiles_kq.h for one vector width, included there twice: KT_W 256 (AVX2: half hs
 * of a tile, rows 8hs..8hs+7, or with hs = 2 both halves group by group) and KT_W 512 (AVX-512, all 16 rows; hs
 * is 0). See qg_tiles_kq.h for the layouts and the arithmetic, which kt_tile_portable spells out in plain C;
 * this file gives the same bits.
 *
 * acc[r] lanes = y[m0 + r, 16t + (8hs +) p]; with hs = 2, acc[r] and acc[R + r] are rows 0-7 and 8-15. pf:
 * prefetch KT_PF_BYTES ahead of each group's bytes (the first pass over a tile: later passes find it in L1).
 */
#if KT_W == 512
typedef __m512i kt_vi;
typedef __m512 kt_vf;
#define KT_FN kt_tile_avx512
#define KT_SCALES_FN kt_group_scales_avx512
#define KT_INIT_FN kt_sums_init_avx512
#define KT_FINISH_FN kt_finish_avx512
#define KT_LOAD(p) _mm512_loadu_si512((const void*)(p))
#define KT_AND _mm512_and_si512
#define KT_OR _mm512_or_si512
#define KT_SRLI16 _mm512_srli_epi16
#define KT_SLLI16 _mm512_slli_epi16
#define KT_SET8(x) _mm512_set1_epi8((char)(x))
#define KT_SET32 _mm512_set1_epi32
#define KT_SET16 _mm512_set1_epi16
#define KT_ZERO _mm512_setzero_si512
#define KT_ADD16 _mm512_add_epi16
#define KT_ADD32 _mm512_add_epi32
#define KT_MADDUBS _mm512_maddubs_epi16
#define KT_MADD _mm512_madd_epi16
#define KT_CVT _mm512_cvtepi32_ps
#define KT_FMA _mm512_fmadd_ps
#define KT_MUL _mm512_mul_ps
#define KT_SETPS _mm512_set1_ps
#define KT_ZEROPS _mm512_setzero_ps
#define KT_NEG(v) _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u)))
#define KT_HALF(p) half16(p)
#define KT_U8PS(v) kt_u8x16_ps(v)
#define KT_I8PS(v) kt_i8x16_ps(v)
#define KT_TABLE(t) _mm512_broadcast_i32x4(t)
#define KT_SHUF _mm512_shuffle_epi8
#define KT_ABS _mm512_abs_epi8
#define KT_SIGN(x, q) _mm512_mask_sub_epi8((x), _mm512_movepi8_mask(q), _mm512_setzero_si512(), (x))
#if defined(QG_VNNI)
#define KT_VNNI 1
#else
#define KT_VNNI 0
#endif
#else
typedef __m256i kt_vi;
typedef __m256 kt_vf;
#define KT_FN kt_tile_avx2
#define KT_SCALES_FN kt_group_scales_avx2
#define KT_INIT_FN kt_sums_init_avx2
#define KT_FINISH_FN kt_finish_avx2
#define KT_LOAD(p) _mm256_loadu_si256((const __m256i*)(p))
#define KT_AND _mm256_and_si256
#define KT_OR _mm256_or_si256
#define KT_SRLI16 _mm256_srli_epi16
#define KT_SLLI16 _mm256_slli_epi16
#define KT_SET8(x) _mm256_set1_epi8((char)(x))
#define KT_SET32 _mm256_set1_epi32
#define KT_SET16 _mm256_set1_epi16
#define KT_ZERO _mm256_setzero_si256
#define KT_ADD16 _mm256_add_epi16
#define KT_ADD32 _mm256_add_epi32
#define KT_MADDUBS _mm256_maddubs_epi16
#define KT_MADD _mm256_madd_epi16
#define KT_CVT _mm256_cvtepi32_ps
#define KT_FMA _mm256_fmadd_ps
#define KT_MUL _mm256_mul_ps
#define KT_SETPS _mm256_set1_ps
#define KT_ZEROPS _mm256_setzero_ps
#define KT_NEG(v) _mm256_xor_ps((v), _mm256_set1_ps(-0.0f))
#define KT_HALF(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p)))
#define KT_U8PS(v) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h ? _mm_srli_si128((v), 8) : (v)))
#define KT_I8PS(v) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h ? _mm_srli_si128((v), 8) : (v)))
#define KT_TABLE(t) _mm256_broadcastsi128_si256(t)
#define KT_SHUF _mm256_shuffle_epi8
#define KT_ABS _mm256_abs_epi8
#define KT_SIGN(x, q) _mm256_sign_epi8((x), (q))
#define KT_VNNI 0
#endif

#if KT_W == 256
AI __m256i kt_shift16(__m256i v, int s) { /* s > 0: left, s < 0: right (16-bit lanes; s a constant once inlined) */
    return s > 0 ? _mm256_slli_epi16(v, s) : s < 0 ? _mm256_srli_epi16(v, -s) : v;
}

/* Chunks kk and kk + 4 of group j's codes (the two nibbles of one code byte), rows 8h..8h+7 (lane = 32h), as
 * KT_FN's decode of all eight gives them; qa/qb: the signed values (IQ4 without VNNI). */
AI void kt_pair_avx2(int fmt, const uint8_t* tb, int j, int lane, int kk, int iq4_signed, __m256i* ua, __m256i* ub,
                     __m256i* qa, __m256i* qb) {
    const uint8_t* cs = tb + kt_codes_at(fmt, j) + lane;
    if (kt_two_bit(fmt)) {
        const __m256i m3 = _mm256_set1_epi8(3);
        *ua = _mm256_and_si256(kt_shift16(KT_LOAD(cs), -2 * kk), m3);
        *ub = _mm256_and_si256(kt_shift16(KT_LOAD(cs + 64), -2 * kk), m3);
        if (fmt == Q3_K) { /* the third bit: bit kk / 4 + kk of hb -> bit 2 */
            const __m256i hb = KT_LOAD(tb + kt_hbits_at(fmt, j) + lane), m4b = _mm256_set1_epi8(4);
            *ua = _mm256_or_si256(*ua, _mm256_and_si256(kt_shift16(hb, 2 - kk), m4b));
            *ub = _mm256_or_si256(*ub, _mm256_and_si256(kt_shift16(hb, -2 - kk), m4b));
        }
        return;
    }
    const __m256i m4 = _mm256_set1_epi8(15), v = KT_LOAD(cs + 64 * kk);
    *ua = _mm256_and_si256(v, m4);
    *ub = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if (kt_iq4(fmt)) { /* nibble -> table value (+ 128 for vpdpbusd) */
        const __m256i T = KT_TABLE(kt_iq4_table(!iq4_signed));
        *ua = KT_SHUF(T, *ua);
        *ub = KT_SHUF(T, *ub);
        if (iq4_signed) { *qa = *ua; *ua = KT_ABS(*qa); *qb = *ub; *ub = KT_ABS(*qb); }
    } else if (kt_five(fmt)) { /* the fifth bit: bit kk / 4 + kk of hb -> bit 4 */
        const __m256i hb = KT_LOAD(tb + kt_hbits_at(fmt, j) + lane), m16 = _mm256_set1_epi8(16);
        *ua = _mm256_or_si256(*ua, _mm256_and_si256(kt_shift16(hb, 4 - kk), m16));
        *ub = _mm256_or_si256(*ub, _mm256_and_si256(kt_shift16(hb, -kk), m16));
    } else if (fmt == Q6_K) { /* two high bits: bits 2kk of hb0 (chunk kk) / hb1 (chunk 4 + kk) -> bits 4-5 */
        const uint8_t* hp = tb + kt_hbits_at(fmt, j) + lane;
        const __m256i m48 = _mm256_set1_epi8(48);
        *ua = _mm256_or_si256(*ua, _mm256_and_si256(kt_shift16(KT_LOAD(hp), 4 - 2 * kk), m48));
        *ub = _mm256_or_si256(*ub, _mm256_and_si256(kt_shift16(KT_LOAD(hp + 64), 4 - 2 * kk), m48));
    }
}

/* A row's 16-bit sums of one chunk pair (sa: chunk kk, sb: chunk 4 + kk; xa, xb: the broadcast activations). */
AI void kt_pair_acc(__m256i ua, __m256i ub, __m256i qa, __m256i qb, __m256i xa, __m256i xb, int iq4_signed,
                    __m256i* sa, __m256i* sb) {
    *sa = KT_ADD16(*sa, KT_MADDUBS(ua, iq4_signed ? KT_SIGN(xa, qa) : xa));
    *sb = KT_ADD16(*sb, KT_MADDUBS(ub, iq4_signed ? KT_SIGN(xb, qb) : xb));
}

/* A row's 16-bit sums into its 32-bit sums of each half of the group (s0, s1), then cleared. whole: the group's
 * 8 chunks share one scale and their 16-bit sums all fit (run 8: Q4_K), so sa + sb widen once into s0 (the same
 * integer, one vpmaddwd fewer). */
AI void kt_pair_flush(__m256i ones, int whole, __m256i* s0, __m256i* s1, __m256i* sa, __m256i* sb) {
    if (whole) {
        *s0 = KT_ADD32(*s0, KT_MADD(KT_ADD16(*sa, *sb), ones));
    } else {
        *s0 = KT_ADD32(*s0, KT_MADD(*sa, ones));
        *s1 = KT_ADD32(*s1, KT_MADD(*sb, ones));
    }
    *sa = *sb = KT_ZERO();
}
#endif

/* The lane scales (ds0, ds1: D times each row's scale of the group's halves) and mins (dm0, dm1) of group j; h
 * (AVX2: the half whose rows the lanes are) picks the bytes of per-row scales in a 16-row run. */
#define KT_GROUP_SCALES(fmt, tb, P, j, D, Ms, sc4, mn4, ds0, ds1, dm0, dm1) \
    KT_SCALES_FN(fmt, tb, P, j, h, D, Ms, sc4, mn4, ds0, ds1, dm0, dm1)
AI void KT_SCALES_FN(int fmt, const uint8_t* tb, const __m128i* P, int j, int h, kt_vf D, kt_vf Ms, __m128i sc4,
                     __m128i mn4, kt_vf* ds0, kt_vf* ds1, kt_vf* dm0, kt_vf* dm1) {
    (void)h;
    *ds0 = *ds1 = D;
    *dm0 = *dm1 = Ms;
    if (fmt == Q4_K || fmt == Q5_K) {
        *ds0 = *ds1 = KT_MUL(D, KT_U8PS(sc4));
        *dm0 = *dm1 = KT_MUL(Ms, KT_U8PS(mn4));
    } else if (fmt == Q6_K) {
        *ds0 = KT_MUL(D, KT_I8PS(_mm_loadu_si128((const __m128i*)(tb + 32 + 16 * (2 * j)))));
        *ds1 = KT_MUL(D, KT_I8PS(_mm_loadu_si128((const __m128i*)(tb + 32 + 16 * (2 * j + 1)))));
    } else if (fmt == Q3_K) {
        *ds0 = KT_MUL(D, KT_I8PS(kt_scale_q3k(P, 2 * j)));
        *ds1 = KT_MUL(D, KT_I8PS(kt_scale_q3k(P, 2 * j + 1)));
    } else if (fmt == Q2_K) {
        const __m128i m15 = _mm_set1_epi8(15);
        *ds0 = KT_MUL(D, KT_U8PS(_mm_and_si128(P[2 * j], m15)));
        *ds1 = KT_MUL(D, KT_U8PS(_mm_and_si128(P[2 * j + 1], m15)));
        *dm0 = KT_MUL(Ms, KT_U8PS(_mm_and_si128(_mm_srli_epi16(P[2 * j], 4), m15)));
        *dm1 = KT_MUL(Ms, KT_U8PS(_mm_and_si128(_mm_srli_epi16(P[2 * j + 1], 4), m15)));
    } else if (fmt == IQ4_XS) {
        *ds0 = *ds1 = KT_MUL(D, KT_I8PS(kt_scale_iq4xs(P, j)));
    }
}

/* A row's integer sums of group g start at the exact offset term: -c * sum(xq) of each half of the group
 * (s0, s1) for the formats with a scale per 16 weights, of the whole group (s0; s1 = 0) otherwise. */
AI void KT_INIT_FN(int fmt, const act_q* a, int64_t idx, int c, kt_vi* s0, kt_vi* s1) {
    if (kt_halves(fmt)) { *s0 = KT_SET32(-c * a->h[2 * idx]); *s1 = KT_SET32(-c * a->h[2 * idx + 1]); }
    else { *s0 = KT_SET32(-c * a->i[idx]); *s1 = KT_ZERO(); }
}

/* Add a row's group (integer sums s0, s1; lane scales and mins; activation scale dx) into its lanes *ac, in
 * the one order every path keeps (the bits of the tiled products depend on it). */
AI void KT_FINISH_FN(int fmt, const act_q* a, int64_t idx, kt_vi s0, kt_vi s1, kt_vf ds0, kt_vf ds1, kt_vf dm0,
                     kt_vf dm1, kt_vf dx, kt_vf* ac) {
    if (kt_halves(fmt)) {
        *ac = KT_FMA(KT_CVT(s0), KT_MUL(ds0, dx), *ac);
        *ac = KT_FMA(KT_CVT(s1), KT_MUL(ds1, dx), *ac);
        if (fmt == Q2_K) {
            *ac = KT_FMA(dm0, KT_SETPS(a->s[2 * idx]), *ac);
            *ac = KT_FMA(dm1, KT_SETPS(a->s[2 * idx + 1]), *ac);
        }
    } else {
        *ac = KT_FMA(KT_CVT(KT_ADD32(s0, s1)), KT_MUL(ds0, dx), *ac);
        if (kt_has_min(fmt)) *ac = KT_FMA(dm0, KT_SETPS(a->t[idx]), *ac);
    }
}

/* xb (a constant at each call): the activation codes come expanded (act_q.xb, AVX2 only), not broadcast. */
AI void KT_FN(int fmt, const uint8_t* tile, int hs, const act_q* a, int64_t m0, int R, kt_vf* acc, int pf, int xb) {
    const int gpb = kt_groups(fmt);
    const int64_t tbb = TP * qg_block_bytes(fmt), gb = tbb / gpb;
    const int h0 = hs == 2 ? 0 : hs, h1 = hs == 2 ? 1 : hs; /* the halves this call computes */
    /* IQ4 without VNNI multiplies |value| by the activation carrying the value's sign (vpmaddubsw cannot take
     * value + 128 without saturating): the integer sum is sum(value * xq), the same I as sum((value + 128) * xq) -
     * 128 * sum(xq), so no offset */
    const int iq4_signed = !KT_VNNI && kt_iq4(fmt);
    const int c = iq4_signed ? 0 : kt_offset(fmt);
    /* chunks summed in 16 bits before widening: 8 * 2 * 15 * 127, 4 * 2 * 31 * 127, 2 * 2 * 63 * 127 < 32768 */
    const int run = iq4_signed ? 1 : fmt == Q6_K ? 2 : kt_five(fmt) || kt_halves(fmt) ? 4 : 8;
    const int nplanes = fmt == Q2_K ? 16 : fmt == IQ4_XS ? 6 : fmt == Q3_K || fmt == Q4_K || fmt == Q5_K ? 12 : 0;
    const kt_vi m4 = KT_SET8(15);
#if KT_VNNI
    (void)run;
#else
    const kt_vi ones = KT_SET16(1);
#endif
    for (int r = 0; r < (h1 - h0 + 1) * R; r++) acc[r] = KT_ZEROPS();
    for (int64_t b = 0; b < a->G / gpb; b++) {
        const uint8_t* tb = tile + b * tbb;
        __m128i P[16];
        for (int i = 0; i < nplanes; i++) P[i] = _mm_loadu_si128((const __m128i*)(tb + kt_planes_at(fmt) + 16 * i));
        const int second = fmt == Q5_1 || fmt == Q4_K || fmt == Q5_K || fmt == Q2_K; /* M, or Dmin */
        kt_vf Dh[2], Mh[2]; /* D, and M (Q5_1) or -Dmin (Q4_K, Q5_K, Q2_K), of the halves this call computes */
        for (int h = h0; h <= h1; h++) {
            const int halfs = KT_W == 512 ? 0 : 16 * h; /* this half's rows in an fp16 run */
            Dh[h - h0] = KT_HALF(tb + halfs);
            Mh[h - h0] = !second ? KT_ZEROPS() : fmt == Q5_1 ? KT_HALF(tb + 32 + halfs) : KT_NEG(KT_HALF(tb + 32 + halfs));
        }
        for (int j = 0; j < gpb; j++) {
            const int64_t g = b * gpb + j;
            if (pf)
                for (int64_t o = 0; o < gb; o += 64)
                    _mm_prefetch((const char*)tb + j * gb + KT_PF_BYTES + o, _MM_HINT_T0);
            __m128i sc4 = _mm_setzero_si128(), mn4 = sc4; /* Q4_K/Q5_K: every row's 6-bit scale and min of group j */
            if (fmt == Q4_K || fmt == Q5_K) kt_scales_k4(P, j, &sc4, &mn4);
#if KT_W == 256 && !KT_VNNI
            if (hs == 2 && R == 1) { /* one activation row, both halves: each broadcast of 4 activations serves
                                      * the two halves' chunks (the loop below broadcasts them once per half) */
                const int8_t* xq = a->q + m0 * a->K + g * QK;
                const int64_t idx = m0 * a->G + g;
                const int prun = run < 4 ? run : 4; /* chunks kk < 4 and 4 + kk are summed apart */
                kt_vi s0[2], s1[2], sa[2], sb[2];
                for (int h = 0; h < 2; h++) {
                    KT_INIT_FN(fmt, a, idx, c, &s0[h], &s1[h]);
                    sa[h] = sb[h] = KT_ZERO();
                }
#pragma GCC unroll 4
                for (int kk = 0; kk < 4; kk++) {
                    const kt_vi xa = KT_SET32(load_i32(xq + 4 * kk)), xb = KT_SET32(load_i32(xq + 16 + 4 * kk));
                    for (int h = 0; h < 2; h++) {
                        kt_vi ua, ub, qa = KT_ZERO(), qb = KT_ZERO();
                        kt_pair_avx2(fmt, tb, j, 32 * h, kk, iq4_signed, &ua, &ub, &qa, &qb);
                        kt_pair_acc(ua, ub, qa, qb, xa, xb, iq4_signed, &sa[h], &sb[h]);
                    }
                    if ((kk + 1) % prun == 0)
                        for (int h = 0; h < 2; h++) kt_pair_flush(ones, run == 8, &s0[h], &s1[h], &sa[h], &sb[h]);
                }
                const kt_vf dx = KT_SETPS(a->d[idx]);
                for (int h = 0; h < 2; h++) {
                    kt_vf ds0, ds1, dm0, dm1;
                    KT_GROUP_SCALES(fmt, tb, P, j, Dh[h], Mh[h], sc4, mn4, &ds0, &ds1, &dm0, &dm1);
                    KT_FINISH_FN(fmt, a, idx, s0[h], s1[h], ds0, ds1, dm0, dm1, dx, acc + h);
                }
                continue;
            }
            if (hs == 2 && R == 2) { /* two rows, both halves: per half, chunk pairs decoded as they are used (the
                                      * 8 chunks decoded up front do not fit the 16 registers beside 2 rows' sums) */
                for (int h = 0; h < 2; h++) {
                    kt_vi s0[2], s1[2], sa[2], sb[2];
                    for (int r = 0; r < 2; r++) {
                        const int64_t idx = (m0 + r) * a->G + g;
                        KT_INIT_FN(fmt, a, idx, c, &s0[r], &s1[r]);
                        sa[r] = sb[r] = KT_ZERO();
                    }
                    const int prun = run < 4 ? run : 4;
#pragma GCC unroll 4
                    for (int kk = 0; kk < 4; kk++) {
                        kt_vi ua, ub, qa = KT_ZERO(), qb = KT_ZERO();
                        kt_pair_avx2(fmt, tb, j, 32 * h, kk, iq4_signed, &ua, &ub, &qa, &qb);
                        for (int r = 0; r < 2; r++) {
                            const int8_t* xq = a->q + (m0 + r) * a->K + g * QK;
                            const kt_vi xa = KT_SET32(load_i32(xq + 4 * kk)), xb = KT_SET32(load_i32(xq + 16 + 4 * kk));
                            kt_pair_acc(ua, ub, qa, qb, xa, xb, iq4_signed, &sa[r], &sb[r]);
                        }
                        if ((kk + 1) % prun == 0)
                            for (int r = 0; r < 2; r++) kt_pair_flush(ones, run == 8, &s0[r], &s1[r], &sa[r], &sb[r]);
                    }
                    kt_vf ds0, ds1, dm0, dm1;
                    KT_GROUP_SCALES(fmt, tb, P, j, Dh[h], Mh[h], sc4, mn4, &ds0, &ds1, &dm0, &dm1);
                    for (int r = 0; r < 2; r++) {
                        const int64_t idx = (m0 + r) * a->G + g;
                        const kt_vf dx = KT_SETPS(a->d[idx]);
                        KT_FINISH_FN(fmt, a, idx, s0[r], s1[r], ds0, ds1, dm0, dm1, dx, acc + h * R + r);
                    }
                }
                continue;
            }
#endif
            for (int h = h0; h <= h1; h++) { /* one half, or (hs = 2) both: each group's bytes read in one pass */
                kt_vf* const ac = acc + (h - h0) * R;
                const int lane = KT_W == 512 ? 0 : 32 * h; /* this half's rows in a chunk */
                const kt_vf D = Dh[h - h0], Ms = Mh[h - h0];
                kt_vf ds0, ds1, dm0, dm1; /* lane scales and mins of this group */
                KT_GROUP_SCALES(fmt, tb, P, j, D, Ms, sc4, mn4, &ds0, &ds1, &dm0, &dm1);
                /* the 8 code chunks (chunk k: codes 4k..4k+3 of every row; chunks 4-7 the second half) */
                const uint8_t* cs = tb + kt_codes_at(fmt, j) + lane;
                kt_vi u[8], q[8];
                if (kt_two_bit(fmt)) {
                    const kt_vi m3 = KT_SET8(3), L0 = KT_LOAD(cs), L1 = KT_LOAD(cs + 64);
                    u[0] = KT_AND(L0, m3);
                    u[1] = KT_AND(KT_SRLI16(L0, 2), m3);
                    u[2] = KT_AND(KT_SRLI16(L0, 4), m3);
                    u[3] = KT_AND(KT_SRLI16(L0, 6), m3);
                    u[4] = KT_AND(L1, m3);
                    u[5] = KT_AND(KT_SRLI16(L1, 2), m3);
                    u[6] = KT_AND(KT_SRLI16(L1, 4), m3);
                    u[7] = KT_AND(KT_SRLI16(L1, 6), m3);
                    if (fmt == Q3_K) { /* the third bit: bit k (chunks 0-3) or 4 + k (chunks 4-7) of hb -> bit 2 */
                        const kt_vi hb = KT_LOAD(tb + kt_hbits_at(fmt, j) + lane), m4b = KT_SET8(4);
                        u[0] = KT_OR(u[0], KT_AND(KT_SLLI16(hb, 2), m4b));
                        u[1] = KT_OR(u[1], KT_AND(KT_SLLI16(hb, 1), m4b));
                        u[2] = KT_OR(u[2], KT_AND(hb, m4b));
                        u[3] = KT_OR(u[3], KT_AND(KT_SRLI16(hb, 1), m4b));
                        u[4] = KT_OR(u[4], KT_AND(KT_SRLI16(hb, 2), m4b));
                        u[5] = KT_OR(u[5], KT_AND(KT_SRLI16(hb, 3), m4b));
                        u[6] = KT_OR(u[6], KT_AND(KT_SRLI16(hb, 4), m4b));
                        u[7] = KT_OR(u[7], KT_AND(KT_SRLI16(hb, 5), m4b));
                    }
                } else {
                    for (int k = 0; k < 4; k++) {
                        const kt_vi v = KT_LOAD(cs + 64 * k);
                        u[k] = KT_AND(v, m4);
                        u[k + 4] = KT_AND(KT_SRLI16(v, 4), m4);
                    }
                    if (kt_iq4(fmt)) { /* nibble -> table value (+ 128 for vpdpbusd) */
                        const kt_vi T = KT_TABLE(kt_iq4_table(!iq4_signed));
                        for (int k = 0; k < 8; k++) {
                            u[k] = KT_SHUF(T, u[k]);
                            if (iq4_signed) { q[k] = u[k]; u[k] = KT_ABS(q[k]); }
                        }
                    } else if (kt_five(fmt)) { /* the fifth bit: bit k or 4 + k of hb -> bit 4 */
                        const kt_vi hb = KT_LOAD(tb + kt_hbits_at(fmt, j) + lane), m16 = KT_SET8(16);
                        u[0] = KT_OR(u[0], KT_AND(KT_SLLI16(hb, 4), m16));
                        u[1] = KT_OR(u[1], KT_AND(KT_SLLI16(hb, 3), m16));
                        u[2] = KT_OR(u[2], KT_AND(KT_SLLI16(hb, 2), m16));
                        u[3] = KT_OR(u[3], KT_AND(KT_SLLI16(hb, 1), m16));
                        u[4] = KT_OR(u[4], KT_AND(hb, m16));
                        u[5] = KT_OR(u[5], KT_AND(KT_SRLI16(hb, 1), m16));
                        u[6] = KT_OR(u[6], KT_AND(KT_SRLI16(hb, 2), m16));
                        u[7] = KT_OR(u[7], KT_AND(KT_SRLI16(hb, 3), m16));
                    } else if (fmt == Q6_K) { /* two high bits: bits 2k of hb0 (chunks 0-3) / hb1 (4-7) -> bits 4-5 */
                        const uint8_t* hp = tb + kt_hbits_at(fmt, j) + lane;
                        const kt_vi m48 = KT_SET8(48);
                        for (int hh = 0; hh < 2; hh++) {
                            const kt_vi hb = KT_LOAD(hp + 64 * hh);
                            u[4 * hh + 0] = KT_OR(u[4 * hh + 0], KT_AND(KT_SLLI16(hb, 4), m48));
                            u[4 * hh + 1] = KT_OR(u[4 * hh + 1], KT_AND(KT_SLLI16(hb, 2), m48));
                            u[4 * hh + 2] = KT_OR(u[4 * hh + 2], KT_AND(hb, m48));
                            u[4 * hh + 3] = KT_OR(u[4 * hh + 3], KT_AND(KT_SRLI16(hb, 2), m48));
                        }
                    }
                }
                (void)q;
                for (int r = 0; r < R; r++) {
                    const int8_t* xq = a->q + (m0 + r) * a->K + g * QK;
                    const int64_t idx = (m0 + r) * a->G + g;
                    const kt_vf dx = KT_SETPS(a->d[idx]);
                    kt_vi s0, s1;
                    KT_INIT_FN(fmt, a, idx, c, &s0, &s1);
    #if KT_VNNI
                    /* four chains (integer sums: any order gives the same I); chains 0-1 are the first half */
                    kt_vi q0 = s0, q1 = KT_ZERO(), t0 = s1, t1 = KT_ZERO();
                    q0 = dpbusd_bcast(q0, u[0], xq);
                    q1 = dpbusd_bcast(q1, u[1], xq + 4);
                    q0 = dpbusd_bcast(q0, u[2], xq + 8);
                    q1 = dpbusd_bcast(q1, u[3], xq + 12);
                    t0 = dpbusd_bcast(t0, u[4], xq + 16);
                    t1 = dpbusd_bcast(t1, u[5], xq + 20);
                    t0 = dpbusd_bcast(t0, u[6], xq + 24);
                    t1 = dpbusd_bcast(t1, u[7], xq + 28);
                    s0 = KT_ADD32(q0, q1);
                    s1 = KT_ADD32(t0, t1);
    #else
                    /* the codes already repeated across a vector (act_expand), or broadcast here */
                    const uint8_t* xbr = xb ? a->xb + ((m0 + r) * (a->K / 4) + g * 8) * 32 : NULL;
                    for (int k0 = 0; k0 < 8; k0 += run) {
                        kt_vi s16 = KT_ZERO();
                        for (int k = k0; k < k0 + run; k++) {
                            kt_vi x = xb ? KT_LOAD(xbr + 32 * k) : KT_SET32(load_i32(xq + 4 * k));
                            if (iq4_signed) x = KT_SIGN(x, q[k]);
                            s16 = KT_ADD16(s16, KT_MADDUBS(u[k], x));
                        }
                        if (k0 < 4) s0 = KT_ADD32(s0, KT_MADD(s16, ones));
                        else s1 = KT_ADD32(s1, KT_MADD(s16, ones));
                    }
    #endif
                    KT_FINISH_FN(fmt, a, idx, s0, s1, ds0, ds1, dm0, dm1, dx, ac + r);
                }
            }
        }
    }
}

#undef KT_FN
#undef KT_SCALES_FN
#undef KT_INIT_FN
#undef KT_FINISH_FN
#undef KT_GROUP_SCALES
#undef KT_LOAD
#undef KT_AND
#undef KT_OR
#undef KT_SRLI16
#undef KT_SLLI16
#undef KT_SET8
#undef KT_SET32
#undef KT_SET16
#undef KT_ZERO
#undef KT_ADD16
#undef KT_ADD32
#undef KT_MADDUBS
#undef KT_MADD
#undef KT_CVT
#undef KT_FMA
#undef KT_MUL
#undef KT_SETPS
#undef KT_ZEROPS
#undef KT_NEG
#undef KT_HALF
#undef KT_U8PS
#undef KT_I8PS
#undef KT_TABLE
#undef KT_SHUF
#undef KT_ABS
#undef KT_SIGN
#undef KT_VNNI
