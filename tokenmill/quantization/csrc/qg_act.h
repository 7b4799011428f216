/* Activation quantization for qgemm.c's integer products. Part of qgemm.c's one translation unit (included
 * there after qg_formats.h; not a standalone header).
 *
 * Each row of x (float32 or bf16) is quantized per group of 32 (llama.cpp's "q8" scheme, written from its
 * description): dx = max|x| / 127, xq = round(x / dx) in int8, plus the sums of xq per half group and per
 * group in the forms the products read (act_q). The AVX2 and AVX-512 builds quantize 8 lanes at a time with
 * the scalar loop's bits, so every ISA path multiplies the same codes.
 */

typedef struct {
    int8_t* q;    /* [M, K] */
    float* d;     /* [M, G] */
    float* s;     /* [M, 2G]: dx * (sum of q per half group) */
    float* t;     /* [M, G]: dx * (sum of q over the group) */
    int32_t* i;   /* [M, G]: sum of q over the group (the tiled kernels' integer offset term) */
    int32_t* h;   /* [M, 2G]: sum of q per half group (the Q2_K/Q3_K/Q6_K tiles: a scale per half) */
    uint8_t* xb;  /* [M, K / 4, 32] or NULL: each 4 codes of q repeated 8 times (32 bytes), so a tile product
                     reads them ready to multiply a chunk's 8 rows (qg_tiles_kq.h: act_expand) */
    int64_t K, G;
} act_q;

static void act_free(act_q* a) {
    free(a->q); free(a->d); free(a->s); free(a->t); free(a->i); free(a->h); free(a->xb);
}

/* a's arrays for M rows of K weights (K a whole number of groups). Returns 0, or -1 (nothing left allocated)
 * when an allocation fails. */
static int act_alloc(act_q* a, int64_t M, int64_t K) {
    a->K = K;
    a->G = K / QK;
    a->q = (int8_t*)malloc((size_t)(M * K) + 64);
    a->d = (float*)malloc(sizeof(float) * (size_t)(M * a->G));
    a->s = (float*)malloc(sizeof(float) * (size_t)(M * a->G * 2));
    a->t = (float*)malloc(sizeof(float) * (size_t)(M * a->G));
    a->i = (int32_t*)malloc(sizeof(int32_t) * (size_t)(M * a->G));
    a->h = (int32_t*)malloc(sizeof(int32_t) * (size_t)(M * a->G * 2));
    a->xb = NULL;
    if (!a->q || !a->d || !a->s || !a->t || !a->i || !a->h) {
        act_free(a);
        return -1;
    }
    return 0;
}

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

/* Row m of x (float32, or bf16 when x_bf16) into a: its codes, scales and sums, group by group. */
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
