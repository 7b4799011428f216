/* Paged prefill attention for CPU: each multi-token query (a prefill chunk) attends causally over
 * its request's paged K/V, flash-attention style: key tiles with an online softmax (Dao et al.,
 * "FlashAttention", NeurIPS 2022; Milakov & Gimelshein, "Online normalizer calculation for softmax",
 * 2018), so no [Lq, Lk] score matrix, mask or gathered copy of the context is ever built.
 *
 * Layouts (row-major, contiguous):
 *   q, out       [T, num_heads, head_dim]  (the step's flat tokens; only the spans' rows are written)
 *   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_table  [num_spans, max_blocks] int64
 *   q_start, q_len, ctx_len  [num_spans] int64: a span's first flat token, its query tokens and its
 *                context after this step; query token i sits at position ctx_len - q_len + i and sees
 *                keys 0 .. that position.
 *   window > 0   sliding-window attention (transformers' masks): the query at position p sees keys
 *                p - window < j <= p only; a tile's key loop starts at the BK-aligned tile holding its first
 *                row's first key, and keys below a row's window are masked like keys past its position.
 *   softcap > 0  Gemma 2's attention logit soft-capping: scores become softcap * tanh(score / softcap).
 *                0 turns either off.
 * Work item: (span, kv head, tile of RT query rows), a row being one of the G = H / KVH query heads
 * of one token (token-major), so a K/V row is read once for all the heads that share it. A tile keeps
 * its queries transposed and pre-scaled (Qt [D][RT]) and its scores transposed (St [BK][RT]): the
 * score micro-kernel broadcasts one key element against RT/VW query vectors, and the softmax runs
 * across lanes (one lane per query row, no horizontal reductions). The output rows O [RT][D]
 * accumulate in float32; K/V tiles of BK rows are copied to float32 first (bf16 widened). Items run
 * under OpenMP, the most expensive (longest context) first.
 *
 * Vectors are GCC generic vectors of VW floats (16 under AVX-512, 8 under AVX2, 4 otherwise, which the
 * compiler lowers to SSE2/NEON or scalar code): one source for every ISA path of csrc_build.py.
 * exp is the Cody-Waite + degree-6 polynomial of exp_poly.h, returning exactly 0 below -87 (masked
 * keys). Scores and sums are float32, as the torch reference (torch_paged.py) computes them for
 * float32; results may differ from it by float32 rounding (summation order), not more. The caller
 * (cpu_prefill.py) checks head_dim % VW == 0.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "cpu_vendor.h"
#include "exp_poly.h"
#if !defined(TM_PORTABLE) && (defined(__AVX512F__) || defined(__AVX2__))
#include <immintrin.h> /* only for the broadcasts: everything else is generic vectors */
#endif

#if defined(TM_PORTABLE)
#define ISA_PATH "portable"
#define VW 4
#define KB 4 /* keys per score micro-kernel */
#define NR 2 /* query vectors per score micro-kernel */
#define RR 2 /* rows per P.V micro-kernel */
#define DC 4 /* head_dim vectors per P.V micro-kernel */
#elif defined(__AVX512F__)
#if defined(__AVX512BF16__)
#define ISA_PATH "avx512_bf16" /* the AVX-512 path, with VDPBF16PS for bf16 (paged_prefill_bf16_dp) */
#else
#define ISA_PATH "avx512"
#endif
#define VW 16
#define KB 8
#define NR 2
#define RR 4
#define DC 4
#elif defined(__AVX2__)
#define ISA_PATH "avx2"
#define VW 8
#define KB 4
#define NR 2
#define RR 2
#define DC 4
#elif defined(__ARM_NEON)
#define ISA_PATH "neon"
#define VW 4
#define KB 4
#define NR 2
#define RR 2
#define DC 4
#else
#define ISA_PATH "portable"
#define VW 4
#define KB 4
#define NR 2
#define RR 2
#define DC 4
#endif

#define RT 32 /* query rows per tile (a multiple of VW * NR and of RR) */
#define BK 64 /* keys per tile (a multiple of KB) */
#define NVR (RT / VW)
#define MAX_DP_DIM 256 /* head_dim bound of the AVX512_BF16 path */

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4))); /* unaligned loads and stores */

static inline vf vload(const float* p) { return *(const vfu*)p; }
static inline void vstore(float* p, vf v) { *(vfu*)p = v; }
#if VW == 16 && defined(__AVX512F__)
static inline vf vset1(float x) { return (vf)_mm512_set1_ps(x); }
#elif VW == 8 && defined(__AVX__)
static inline vf vset1(float x) { return (vf)_mm256_set1_ps(x); }
#else
static inline vf vset1(float x) { return (vf){0} + x; }
#endif
static inline vf vselect(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); } /* m ? a : b */
static inline vf vmax(vf a, vf b) { return vselect(a > b, a, b); }

/* exp(x) for x <= 0; exactly 0 for x < -87 (and for -inf: masked keys). */
static inline vf vexp(vf x) {
    const vi keep = x >= -87.0f;
    x = vselect(keep, x, vset1(-87.0f));
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const vf n = (x * LOG2E + magic) - magic;
    vf r = x - n * LN2_HI;
    r = r - n * LN2_LO;
    vf p = vset1(EXP_C6);
    p = p * r + EXP_C5;
    p = p * r + EXP_C4;
    p = p * r + EXP_C3;
    p = p * r + EXP_C2;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const vi e = (__builtin_convertvector(n, vi) + 127) << 23; /* 2^n, n in [-126, 0] */
    return (vf)((vi)(p * (vf)e) & keep);
}

/* One thread's scratch: a tile's transposed queries and scores, output rows, softmax state, K/V rows. */
typedef struct {
    float* qt;   /* [D][RT] */
    float* st;   /* [BK][RT] */
    float* o;    /* [RT][D] */
    float* kbuf; /* [BK][D] */
    float* vbuf; /* [BK][D] */
    float m[RT], l[RT], corr[RT];
    int64_t qpos[RT];
} Scratch;

/* St[j][*] = K[j] . Qt for the BK keys of the tile (kbuf rows; rows past the tile's end are zeros). */
static inline __attribute__((always_inline)) void scores_tile(const Scratch* s, int D) {
    for (int j0 = 0; j0 < BK; j0 += KB) {
        for (int v0 = 0; v0 < NVR; v0 += NR) {
            vf acc[KB][NR];
            for (int a = 0; a < KB; a++)
                for (int i = 0; i < NR; i++) acc[a][i] = vset1(0.0f);
            for (int d = 0; d < D; d++) {
                vf qv[NR];
                for (int i = 0; i < NR; i++) qv[i] = vload(s->qt + (int64_t)d * RT + (v0 + i) * VW);
                for (int a = 0; a < KB; a++) {
                    const vf b = vset1(s->kbuf[(int64_t)(j0 + a) * D + d]);
                    for (int i = 0; i < NR; i++) acc[a][i] += b * qv[i];
                }
            }
            for (int a = 0; a < KB; a++)
                for (int i = 0; i < NR; i++) vstore(s->st + (j0 + a) * RT + (v0 + i) * VW, acc[a][i]);
        }
    }
}

/* O[r][dv0 * VW ..] += sum_j P[j][r] V[j][..] for ND vectors of head_dim, RR rows at a time. */
#define DEFINE_PV(NAME, ND)                                                                              \
static inline __attribute__((always_inline)) void NAME(const Scratch* s, int D, int n, int dv0) {        \
    for (int r0 = 0; r0 < RT; r0 += RR) {                                                                \
        vf acc[RR][ND];                                                                                  \
        for (int r = 0; r < RR; r++)                                                                     \
            for (int c = 0; c < ND; c++) acc[r][c] = vload(s->o + (int64_t)(r0 + r) * D + (dv0 + c) * VW); \
        for (int j = 0; j < n; j++) {                                                                    \
            vf vv[ND];                                                                                   \
            for (int c = 0; c < ND; c++) vv[c] = vload(s->vbuf + (int64_t)j * D + (dv0 + c) * VW);       \
            for (int r = 0; r < RR; r++) {                                                               \
                const vf p = vset1(s->st[j * RT + r0 + r]);                                              \
                for (int c = 0; c < ND; c++) acc[r][c] += p * vv[c];                                     \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < RR; r++)                                                                     \
            for (int c = 0; c < ND; c++) vstore(s->o + (int64_t)(r0 + r) * D + (dv0 + c) * VW, acc[r][c]); \
    }                                                                                                    \
}
DEFINE_PV(pv_chunk, DC)
DEFINE_PV(pv_one, 1)

/* Online softmax over a tile's scores st [BK][RT] (transposed: lanes are query rows), in place to the
 * numerators; soft-caps the n real keys' scores (softcap > 0), then masks keys past each row's position (key
 * k0 + j, j < n) and, under a window, keys below each row's window, when the tile reaches past the smallest
 * position or below the largest window's start; updates the rows' max m, sum l and correction corr, and
 * rescales the output rows o. A row whose every key in the tile is masked keeps m = -inf, l = 0 and o = 0
 * (exp of the NaN m - m is 0 here), exactly as if the tile had not run: its bits never depend on the tiles
 * below its window that its item's other rows need. */
static inline void online_softmax(float* st, float* o, float* m, float* l, float* corr, const int64_t* qpos,
                                  int64_t k0, int n, int D, int window, float softcap) {
    if (softcap > 0.0f)
        for (int j = 0; j < n; j++)
            for (int r = 0; r < RT; r++) st[j * RT + r] = tanhf(st[j * RT + r] / softcap) * softcap;
    int64_t min_pos = qpos[0], max_pos = qpos[0];
    for (int r = 1; r < RT; r++) {
        min_pos = qpos[r] < min_pos ? qpos[r] : min_pos;
        max_pos = qpos[r] > max_pos ? qpos[r] : max_pos;
    }
    const int below = window > 0 && k0 <= max_pos - window; /* some key of the tile below some row's window */
    if (k0 + BK - 1 > min_pos || n < BK || below) {
        for (int j = 0; j < BK; j++) {
            float* row = st + j * RT;
            for (int r = 0; r < RT; r++)
                if (j >= n || k0 + j > qpos[r] || (below && k0 + j <= qpos[r] - window)) row[r] = -INFINITY;
        }
    }
    for (int i = 0; i < NVR; i++) {
        const vf m_old = vload(m + i * VW);
        vf mt = m_old;
        for (int j = 0; j < n; j++) mt = vmax(mt, vload(st + j * RT + i * VW));
        const vf c = vexp(m_old - mt);
        vf sum = vset1(0.0f);
        for (int j = 0; j < n; j++) {
            const vf p = vexp(vload(st + j * RT + i * VW) - mt);
            vstore(st + j * RT + i * VW, p);
            sum += p;
        }
        vstore(m + i * VW, mt);
        vstore(l + i * VW, vload(l + i * VW) * c + sum);
        vstore(corr + i * VW, c);
    }
    for (int r = 0; r < RT; r++) {
        const float c = corr[r];
        if (c == 1.0f) continue;
        const vf cv = vset1(c);
        float* orow = o + (int64_t)r * D;
        for (int d = 0; d < D; d += VW) vstore(orow + d, vload(orow + d) * cv);
    }
}

static inline void softmax_tile(Scratch* s, int64_t k0, int n, int D, int window, float softcap) {
    online_softmax(s->st, s->o, s->m, s->l, s->corr, s->qpos, k0, n, D, window, softcap);
}

typedef struct {
    int span, kvh, row0; /* first query row of the tile (row = token * G + head in group) */
    int64_t k_start;     /* the first key tile: 0, or under a window the BK-aligned tile of its first row's first key */
    int64_t keys;        /* keys the tile's last token sees (the key loop's end) */
} Item;

/* The first key tile a row at position pos needs: 0, or under a window the BK-aligned tile holding key
 * pos - window + 1 (tiles start at multiples of BK whatever the chunk, so a row's bits do not depend on it). */
static inline int64_t first_tile(int64_t pos, int window) {
    const int64_t first = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
    return first / BK * BK;
}

static int by_cost_desc(const void* a, const void* b) {
    const Item *ia = (const Item*)a, *ib = (const Item*)b;
    const int64_t ka = ia->keys - ia->k_start, kb = ib->keys - ib->k_start; /* keys read: the item's cost */
    return ka < kb ? 1 : ka > kb ? -1 : 0;
}

#if defined(__AVX512BF16__) && VW == 16
/* AVX512_BF16 path for bf16 queries and caches, head_dim a multiple of 32: the two products run as
 * VDPBF16PS on bf16 pairs, half the float FMAs' instructions, and K/V are read as stored (no widening).
 * Scores: a tile's queries are kept as their own bf16 values (unscaled), transposed into dim pairs
 * (qp [D/2][RT] 32-bit words: lanes are query rows); each key's dim pair is broadcast against them and the
 * float32 sums are times scale (as torch's bf16 SDPA scales q.k after its bf16 GEMM). The online softmax is
 * the float one above. P.V: the numerators are rounded to bf16 (as torch's CPU flash attention rounds them
 * before its P.V GEMM) and paired over keys (pt [BK/2][RT]); value rows are interleaved in pairs by
 * VPUNPCK{L,H}WD (vp [BK/2][2D]), so the output rows hold their dims permuted inside each 128-bit lane (the
 * same order as paged_decode.c's seq_dp_bf16) until they are written. A row's result depends only on its
 * query and its keys: the key tiles start at multiples of BK whatever the chunk, as above. */
#define DP_PREFILL 1
#include "bf16_pairs.h"
static inline __m512bh bcast_pair(const uint16_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return (__m512bh)_mm512_set1_epi32(v);
}
typedef struct {
    uint32_t* qp;  /* [D/2][RT] query dim pairs */
    float* st;     /* [BK][RT] scores, then numerators */
    uint32_t* pt;  /* [BK/2][RT] numerator pairs (bf16) */
    float* o;      /* [RT][D] output rows, dims permuted */
    uint16_t* vp;  /* [BK/2][2D] interleaved value-row pairs */
    const uint16_t* kp[BK]; /* the tile's key rows (a zero row past its end) */
    float m[RT], l[RT], corr[RT];
    int64_t qpos[RT];
} ScratchDP;

static inline __attribute__((always_inline)) void scores_tile_dp(ScratchDP* s, int D, float scale) {
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int j0 = 0; j0 < BK; j0 += KB) {
        for (int v0 = 0; v0 < NVR; v0 += NR) {
            __m512 acc[KB][NR];
            for (int a = 0; a < KB; a++)
                for (int i = 0; i < NR; i++) acc[a][i] = _mm512_setzero_ps();
            for (int dp = 0; dp < D / 2; dp++) {
                __m512bh qv[NR];
                for (int i = 0; i < NR; i++) qv[i] = tm_load_bh(s->qp + (int64_t)dp * RT + (v0 + i) * VW);
                for (int a = 0; a < KB; a++) {
                    const __m512bh b = bcast_pair(s->kp[j0 + a] + 2 * dp);
                    for (int i = 0; i < NR; i++) acc[a][i] = _mm512_dpbf16_ps(acc[a][i], b, qv[i]);
                }
            }
            for (int a = 0; a < KB; a++)
                for (int i = 0; i < NR; i++)
                    _mm512_storeu_ps(s->st + (j0 + a) * RT + (v0 + i) * VW, _mm512_mul_ps(acc[a][i], vscale));
        }
    }
}

/* O[r][c-th interleaved vector ...] += sum over key pairs of P pair . V pair, ND vectors (16 dims each) from
 * interleaved vector dv0, RR rows at a time; np key pairs. */
#define DEFINE_PV_DP(NAME, ND)                                                                           \
static inline __attribute__((always_inline)) void NAME(const ScratchDP* s, int D, int np, int dv0) {     \
    for (int r0 = 0; r0 < RT; r0 += RR) {                                                                \
        __m512 acc[RR][ND];                                                                              \
        for (int r = 0; r < RR; r++)                                                                     \
            for (int c = 0; c < ND; c++) acc[r][c] = _mm512_loadu_ps(s->o + (int64_t)(r0 + r) * D + (dv0 + c) * VW); \
        for (int jp = 0; jp < np; jp++) {                                                                \
            __m512bh vv[ND];                                                                             \
            for (int c = 0; c < ND; c++) vv[c] = tm_load_bh(s->vp + (int64_t)jp * 2 * D + (dv0 + c) * 32);  \
            for (int r = 0; r < RR; r++) {                                                               \
                const __m512bh p = (__m512bh)_mm512_set1_epi32((int)s->pt[jp * RT + r0 + r]);            \
                for (int c = 0; c < ND; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vv[c], p);          \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < RR; r++)                                                                     \
            for (int c = 0; c < ND; c++) _mm512_storeu_ps(s->o + (int64_t)(r0 + r) * D + (dv0 + c) * VW, acc[r][c]); \
    }                                                                                                    \
}
DEFINE_PV_DP(pv_dp_chunk, DC)
DEFINE_PV_DP(pv_dp_one, 1)

/* The online softmax on ScratchDP, then the numerator pairs. */
static inline void softmax_tile_dp(ScratchDP* s, int64_t k0, int n, int D, int window, float softcap) {
    online_softmax(s->st, s->o, s->m, s->l, s->corr, s->qpos, k0, n, D, window, softcap);
    for (int jp = 0; jp < (n + 1) / 2; jp++) /* an odd last key pairs with weight 0 */
        for (int i = 0; i < NVR; i++) {
            const __m512i lo = tm_round_bf16_lanes(_mm512_loadu_ps(s->st + 2 * jp * RT + i * VW));
            const __m512i hi = 2 * jp + 1 < n ? tm_round_bf16_lanes(_mm512_loadu_ps(s->st + (2 * jp + 1) * RT + i * VW))
                                              : _mm512_setzero_si512();
            _mm512_storeu_si512(s->pt + jp * RT + i * VW, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
}

static int paged_prefill_bf16_dp(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                                 const int64_t* block_table, int max_blocks, const int64_t* q_start, const int64_t* q_len,
                                 const int64_t* ctx_len, const Item* items, int num_items, uint16_t* out, int H, int KVH,
                                 int D, int block_size, float scale, int window, float softcap, int num_threads) {
    const int G = H / KVH;
    const int64_t kv_row = (int64_t)KVH * D, q_row = (int64_t)H * D;
    static const uint16_t zero_row[MAX_DP_DIM] __attribute__((aligned(64)));
    _Pragma("omp parallel num_threads(num_threads)")
    {
        ScratchDP sc;
        char* mem = (char*)aligned_alloc(64, sizeof(uint32_t) * (size_t)D / 2 * RT + sizeof(float) * (size_t)BK * RT
                                             + sizeof(uint32_t) * (size_t)BK / 2 * RT + sizeof(float) * (size_t)RT * D
                                             + sizeof(uint16_t) * (size_t)BK * D + 64);
        sc.qp = (uint32_t*)mem;
        sc.st = (float*)(sc.qp + (size_t)D / 2 * RT);
        sc.pt = (uint32_t*)(sc.st + (size_t)BK * RT);
        sc.o = (float*)(sc.pt + (size_t)BK / 2 * RT);
        sc.vp = (uint16_t*)(sc.o + (size_t)RT * D);
        _Pragma("omp for schedule(dynamic, 1)")
        for (int it = 0; it < num_items; it++) {
            const Item item = items[it];
            const int64_t qs = q_start[item.span], ql = q_len[item.span], ctx = ctx_len[item.span];
            const int64_t* bt = block_table + (int64_t)item.span * max_blocks;
            const int64_t rows = ql * G, first_pos = ctx - ql;
            for (int r = 0; r < RT; r++) {
                const int64_t row = item.row0 + r;
                const int real = row < rows;
                const int64_t tok = (real ? row : rows - 1) / G;
                const int head = item.kvh * G + (int)((real ? row : rows - 1) % G);
                sc.qpos[r] = first_pos + tok;
                const uint16_t* qr = q + (qs + tok) * q_row + (int64_t)head * D;
                for (int dp = 0; dp < D / 2; dp++) {
                    uint32_t w = 0;
                    if (real) memcpy(&w, qr + 2 * dp, 4);
                    sc.qp[(int64_t)dp * RT + r] = w;
                }
                sc.m[r] = -INFINITY;
                sc.l[r] = 0.0f;
            }
            memset(sc.o, 0, sizeof(float) * (size_t)RT * D);
            for (int64_t k0 = item.k_start; k0 < item.keys; k0 += BK) {
                const int n = (int)(item.keys - k0 < BK ? item.keys - k0 : BK), np = (n + 1) / 2;
                for (int j = 0; j < BK; j++) {
                    const int64_t t = k0 + j;
                    sc.kp[j] = j < n ? k_cache + (bt[t / block_size] * block_size + t % block_size) * kv_row
                                           + (int64_t)item.kvh * D
                                     : zero_row;
                }
                for (int jp = 0; jp < np; jp++) {
                    const uint16_t* x = v_cache + (sc.kp[2 * jp] - k_cache);
                    const int has_y = 2 * jp + 1 < n;
                    const uint16_t* y = has_y ? v_cache + (sc.kp[2 * jp + 1] - k_cache) : zero_row;
                    for (int d = 0; d < D; d += 32) {
                        const __m512i xv = _mm512_loadu_si512(x + d), yv = _mm512_loadu_si512(y + d);
                        _mm512_storeu_si512(sc.vp + (int64_t)jp * 2 * D + 2 * d, _mm512_unpacklo_epi16(xv, yv));
                        _mm512_storeu_si512(sc.vp + (int64_t)jp * 2 * D + 2 * d + 32, _mm512_unpackhi_epi16(xv, yv));
                    }
                }
                if (D == 64) scores_tile_dp(&sc, 64, scale);
                else if (D == 128) scores_tile_dp(&sc, 128, scale);
                else scores_tile_dp(&sc, D, scale);
                softmax_tile_dp(&sc, k0, n, D, window, softcap);
                int dv = 0;
                for (; dv + DC <= D / VW; dv += DC) pv_dp_chunk(&sc, D, np, dv);
                for (; dv < D / VW; dv++) pv_dp_one(&sc, D, np, dv);
            }
            for (int r = 0; r < RT && item.row0 + r < rows; r++) {
                const int64_t row = item.row0 + r;
                const int head = item.kvh * G + (int)(row % G);
                uint16_t* op = out + (qs + row / G) * q_row + (int64_t)head * D;
                const float inv = 1.0f / sc.l[r];
                const float* orow = sc.o + (int64_t)r * D;
                for (int i = 0; i < D; i++) op[tm_pair_dim(i)] = f32_to_bf16(orow[i] * inv); /* bf16_pairs.h */
            }
        }
        free(mem);
    }
    return 0;
}
#else
#define DP_PREFILL 0
#define paged_prefill_bf16_dp(...) 0
#endif

/* Whether bf16 prefill takes the AVX512_BF16 path: dp_mode -1 auto (on AMD CPUs: 1.6x the float kernel on a Zen 4, where
 * VDPBF16PS does twice an FMA's work in one slot; on an Intel Xeon, with two FMA ports, a VDPBF16PS variant
 * measured slower than the FMAs earlier), 0 off, 1 on (tests). */
static int dp_mode = -1;

/* Set the AVX512_BF16 path's use for bf16: -1 auto (by CPU vendor), 0 off, 1 on. Returns whether bf16
 * prefill now takes it (always 0 in a build without it). */
int paged_prefill_set_dp(int mode) {
    tm_amd_path_set(&dp_mode, mode);
    return DP_PREFILL && tm_amd_path_on(&dp_mode);
}

#define DEFINE_PAGED_PREFILL(NAME, T, LOAD, STORE, DP)                                                       \
int NAME(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_table, int max_blocks,     \
         const int64_t* q_start, const int64_t* q_len, const int64_t* ctx_len, int num_spans, T* out,    \
         int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int window,         \
         float softcap, int num_threads) {                                                               \
    const int H = num_heads, KVH = num_kv_heads, D = head_dim, G = H / KVH;                              \
    if (D % VW || H % KVH) return -1;                                                                    \
    int num_items = 0;                                                                                   \
    for (int s = 0; s < num_spans; s++) num_items += KVH * (int)((q_len[s] * G + RT - 1) / RT);          \
    Item* items = (Item*)malloc(sizeof(Item) * (size_t)(num_items > 0 ? num_items : 1));                 \
    for (int s = 0, it = 0; s < num_spans; s++) {                                                        \
        const int64_t rows = q_len[s] * G;                                                               \
        for (int h = 0; h < KVH; h++)                                                                    \
            for (int64_t r0 = 0; r0 < rows; r0 += RT) {                                                  \
                const int64_t last = (r0 + RT < rows ? r0 + RT : rows) - 1;                              \
                items[it++] = (Item){s, h, (int)r0, first_tile(ctx_len[s] - q_len[s] + r0 / G, window),  \
                                     ctx_len[s] - q_len[s] + last / G + 1};                              \
            }                                                                                            \
    }                                                                                                    \
    qsort(items, (size_t)num_items, sizeof(Item), by_cost_desc);                                         \
    if (DP && D % 32 == 0 && D <= MAX_DP_DIM && tm_amd_path_on(&dp_mode)) {                           \
        const int rc = paged_prefill_bf16_dp((const uint16_t*)q, (const uint16_t*)k_cache, (const uint16_t*)v_cache, \
                                             block_table, max_blocks, q_start, q_len, ctx_len, items, num_items, \
                                             (uint16_t*)out, H, KVH, D, block_size, scale, window, softcap, \
                                             num_threads);                                               \
        free(items);                                                                                     \
        return rc;                                                                                       \
    }                                                                                                    \
    const int64_t kv_row = (int64_t)KVH * D, q_row = (int64_t)H * D;                                     \
    _Pragma("omp parallel num_threads(num_threads)")                                                     \
    {                                                                                                    \
        Scratch sc;                                                                                      \
        float* mem = (float*)malloc(sizeof(float) * ((size_t)D * RT * 2 + (size_t)BK * RT + (size_t)BK * D * 2)); \
        sc.qt = mem;                                                                                     \
        sc.o = sc.qt + (size_t)D * RT;                                                                   \
        sc.st = sc.o + (size_t)D * RT;                                                                   \
        sc.kbuf = sc.st + (size_t)BK * RT;                                                               \
        sc.vbuf = sc.kbuf + (size_t)BK * D;                                                              \
        _Pragma("omp for schedule(dynamic, 1)")                                                          \
        for (int it = 0; it < num_items; it++) {                                                         \
            const Item item = items[it];                                                                 \
            const int64_t qs = q_start[item.span], ql = q_len[item.span], ctx = ctx_len[item.span];      \
            const int64_t* bt = block_table + (int64_t)item.span * max_blocks;                           \
            const int64_t rows = ql * G, first_pos = ctx - ql;                                           \
            for (int r = 0; r < RT; r++) {                                                               \
                const int64_t row = item.row0 + r;                                                       \
                const int real = row < rows;                                                             \
                const int64_t tok = (real ? row : rows - 1) / G;                                         \
                const int head = item.kvh * G + (int)((real ? row : rows - 1) % G);                      \
                sc.qpos[r] = first_pos + tok;                                                            \
                const T* qp = q + (qs + tok) * q_row + (int64_t)head * D;                                \
                for (int d = 0; d < D; d++) sc.qt[(int64_t)d * RT + r] = real ? LOAD(qp[d]) * scale : 0.0f; \
                sc.m[r] = -INFINITY;                                                                     \
                sc.l[r] = 0.0f;                                                                          \
            }                                                                                            \
            memset(sc.o, 0, sizeof(float) * (size_t)RT * D);                                             \
            for (int64_t k0 = item.k_start; k0 < item.keys; k0 += BK) {                                  \
                const int n = (int)(item.keys - k0 < BK ? item.keys - k0 : BK);                          \
                for (int j = 0; j < n; j++) {                                                            \
                    const int64_t t = k0 + j;                                                            \
                    const int64_t off = (bt[t / block_size] * block_size + t % block_size) * kv_row       \
                                        + (int64_t)item.kvh * D;                                         \
                    const T* kp = k_cache + off;                                                         \
                    const T* vp = v_cache + off;                                                         \
                    float* kb = sc.kbuf + (int64_t)j * D;                                                \
                    float* vb = sc.vbuf + (int64_t)j * D;                                                \
                    for (int d = 0; d < D; d++) { kb[d] = LOAD(kp[d]); vb[d] = LOAD(vp[d]); }            \
                }                                                                                        \
                if (n < BK) memset(sc.kbuf + (int64_t)n * D, 0, sizeof(float) * (size_t)(BK - n) * D);  \
                if (D == 64) scores_tile(&sc, 64);                                                       \
                else if (D == 128) scores_tile(&sc, 128);                                                \
                else scores_tile(&sc, D);                                                                \
                softmax_tile(&sc, k0, n, D, window, softcap);                                            \
                int dv = 0;                                                                              \
                for (; dv + DC <= D / VW; dv += DC) pv_chunk(&sc, D, n, dv);                             \
                for (; dv < D / VW; dv++) pv_one(&sc, D, n, dv);                                         \
            }                                                                                            \
            for (int r = 0; r < RT && item.row0 + r < rows; r++) {                                       \
                const int64_t row = item.row0 + r;                                                       \
                const int head = item.kvh * G + (int)(row % G);                                          \
                T* op = out + (qs + row / G) * q_row + (int64_t)head * D;                                \
                const float inv = 1.0f / sc.l[r];                                                        \
                for (int d = 0; d < D; d++) op[d] = STORE(sc.o[(int64_t)r * D + d] * inv);               \
            }                                                                                            \
        }                                                                                                \
        free(mem);                                                                                       \
    }                                                                                                    \
    free(items);                                                                                         \
    return 0;                                                                                            \
}

static inline float f32_id(float x) { return x; }

/* Which path this build compiled ("portable", "avx2", "avx512", "avx512_bf16", "neon") and its vector width. */
const char* paged_prefill_isa(void) { return ISA_PATH; }
int paged_prefill_vector_width(void) { return VW; }

DEFINE_PAGED_PREFILL(paged_prefill_f32, float, f32_id, f32_id, 0)
DEFINE_PAGED_PREFILL(paged_prefill_bf16, uint16_t, bf16_to_f32, f32_to_bf16, DP_PREFILL)
