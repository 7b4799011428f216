/* The routed experts of one MoE layer over a step's tokens, in one C call: the fused expert step on CPU.
 *
 * The same operations as the torch path's grouped step (tokenmill/moe/experts.py, grouped_expert_step, the
 * specification), with the same kernels and roundings:
 *   slots s = t * k + r (token t's rank-r choice), sorted by expert, token order kept within each expert
 *       (a counting sort: the stable argsort of the torch path)
 *   rows = x[slot's token]                                   gathered, grouped by expert
 *   for each active expert e over its n rows:
 *       gu = rows @ Wgate_up^T                               quantized product per format segment (qgemm.c)
 *       a  = silu(gate) * up                                 silu_and_mul kernel
 *       y  = a @ Wdown^T                                     quantized product
 *   out[t] = sum_r w[t, r] * y[slot t*k+r]                   float32, in rank order, one multiply and one add
 *                                                            per rank (no contraction: -std=c11), then
 *                                                            rounded to the model dtype
 * Each expert's weights are read once per step whatever the batch, in their stored type. Per active expert the
 * products take the path the torch path's layers take at that expert's row count n: the AMX bf16 product where
 * the plan's table says so at n, else the int8 kernel; a step where the plan puts some expert's rows on
 * dequantize + torch GEMM is refused (-3) before anything is written, and the caller runs the torch path. The
 * SiLU-and-multiply is always the C kernel (the plan may prefer torch's at a few rows, whose rounding can
 * differ in the last bit: where it does not, the result is the grouped step's bit for bit). Deterministic mode
 * (``invariant``): the int8 kernel for every expert, as its batch-invariant layers run.
 *
 * Threads: with ``expert_parallel`` the active experts are spread over the threads (one expert's whole chain
 * per thread, each product on one thread: no barrier per product, each thread streams its own experts'
 * weights; the decode steps, where an expert has a handful of rows); otherwise the experts run one after the
 * other, each product over all threads (prefill-sized groups). A row's result does not depend on which:
 * every kernel computes a row with the same instructions whatever its thread count.
 * Built at run time by tokenmill/moe/cpu_experts.py; tests/test_moe_cpu_step.py holds it to the torch path.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define ME_MAX_SEGMENTS 4
#define ME_PARALLEL_MAX_ROWS 32 /* expert_parallel 2 (auto): experts over threads when no expert has more rows */

typedef int (*me_qlinear_fn)(int qtype, const uint8_t* w, int64_t N, int64_t K, const void* x, int x_bf16, int64_t M,
                             void* y, int y_bf16, int64_t ldy, int num_threads);
typedef int (*me_qlinear_bf16_fn)(int qtype, const uint8_t* w, int64_t N, int64_t K, const uint16_t* x, int64_t M,
                                  void* y, int y_bf16, int64_t ldy, int num_threads);
typedef void (*me_silu_and_mul_fn)(const void* x, void* out, int64_t M, int64_t I, int num_threads);

typedef struct {
    int32_t num_segments;
    int32_t qtype[ME_MAX_SEGMENTS];
    int64_t rows[ME_MAX_SEGMENTS];           /* output rows of each segment, stacked in order */
    const uint8_t* data[ME_MAX_SEGMENTS];    /* [rows, row bytes] GGUF blocks (stored or tiled) */
} me_linear;

typedef struct {
    me_linear gate_up;  /* [2I, H]: gate rows then up rows */
    me_linear down;     /* [H, I] */
} me_expert;

typedef struct {
    int64_t num_experts, hidden, intermediate;
    int32_t bf16;                       /* model dtype: 1 bfloat16, 0 float32 */
    const me_expert* experts;           /* [num_experts] */
    me_qlinear_fn qlinear;
    me_qlinear_bf16_fn qlinear_bf16;    /* or NULL */
    me_silu_and_mul_fn silu_and_mul;    /* the model dtype's */
} me_model;

/* The plan's per-row-count tables (entry min(n, len - 1); len 0: the default), as the torch path reads them. */
typedef struct {
    const uint8_t* dequantize; int64_t dequantize_len;  /* 1: dequantize + torch GEMM at that n (refused here) */
    const uint8_t* amx;        int64_t amx_len;         /* 1: the AMX bf16 product at that n */
    int32_t invariant;                                  /* deterministic mode: int8 kernel and C SiLU everywhere */
    int64_t product_rows;  /* > 0: the products' tables are read at this row count instead of each expert's n
                            * (gguf_weight.dispatch_rows: a speculative verify step) */
} me_tables;

static inline int me_lookup(const uint8_t* table, int64_t len, int64_t n) {
    return len > 0 && table[n < len - 1 ? n : len - 1];
}

static int64_t me_linear_out(const me_linear* L) {
    int64_t n = 0;
    for (int s = 0; s < L->num_segments; s++) n += L->rows[s];
    return n;
}

/* y [M, N] = x [M, K] @ W^T, each segment into its column range (GGUFWeight.matmul's order and kernels). */
static int me_linear_run(const me_model* m, const me_linear* L, const void* x, int64_t M, int64_t K, void* y,
                         int num_threads, int amx) {
    const size_t elt = m->bf16 ? 2 : 4;
    const int64_t N = me_linear_out(L);
    int64_t col = 0;
    for (int s = 0; s < L->num_segments; s++) {
        int rc = -2;
        if (amx && m->bf16 && m->qlinear_bf16)
            rc = m->qlinear_bf16(L->qtype[s], L->data[s], L->rows[s], K, (const uint16_t*)x, M,
                                 (char*)y + col * elt, m->bf16, N, num_threads);
        if (rc == -2)
            rc = m->qlinear(L->qtype[s], L->data[s], L->rows[s], K, x, m->bf16, M, (char*)y + col * elt, m->bf16, N,
                            num_threads);
        if (rc != 0) return rc;
        col += L->rows[s];
    }
    return 0;
}

/* One expert's chain over its n gathered rows: y [n, H] = down(silu_and_mul(gate_up(rows))). gu [n, 2I] and
 * act [n, I] are scratch. */
static int me_expert_run(const me_model* m, const me_expert* E, const void* rows, int64_t n, void* y, void* gu,
                         void* act, int num_threads, int amx) {
    int rc = me_linear_run(m, &E->gate_up, rows, n, m->hidden, gu, num_threads, amx);
    if (rc) return rc;
    m->silu_and_mul(gu, act, n, m->intermediate, num_threads);
    return me_linear_run(m, &E->down, act, n, m->intermediate, y, num_threads, amx);
}

/* Whether the torch path would run an expert's n rows on the products this file calls. */
static int me_supported(const me_tables* t, int64_t n) {
    if (t->invariant) return 1;
    const int64_t pn = t->product_rows > 0 ? t->product_rows : n;
    return !me_lookup(t->dequantize, t->dequantize_len, pn);
}

/* Whether the products of an expert's n rows run on AMX bf16 tiles. */
static int me_amx(const me_tables* t, int64_t n) {
    return !t->invariant && me_lookup(t->amx, t->amx_len, t->product_rows > 0 ? t->product_rows : n);
}

/* x [T, H] (model dtype), ids [T, k] int64, w [T, k] float32 -> out [T, H] (model dtype; may not alias x).
 * expert_parallel: 1 experts over threads, 0 products over threads (the top of the file), 2 the first when
 * no active expert has more than ME_PARALLEL_MAX_ROWS rows. Returns 0; -1 for a
 * bad argument (an expert id outside [0, E), a layer of the wrong shape); -2 when memory cannot be
 * allocated; -3 when the plan puts an active expert's rows on a path not run here (the caller runs the
 * torch path). Nothing is written to out unless 0 is returned. */
int me_step(const me_model* m, const me_tables* tables, const void* x, int64_t T, int64_t k, const int64_t* ids,
            const float* w, void* out, int num_threads, int expert_parallel) {
    const int bf16 = m->bf16;
    const size_t elt = bf16 ? 2 : 4;
    const int64_t E = m->num_experts, H = m->hidden, I = m->intermediate, S = T * k;
    if (T < 1 || k < 1 || E < 1) return T == 0 ? 0 : -1;
    for (int64_t e = 0; e < E; e++)
        if (me_linear_out(&m->experts[e].gate_up) != 2 * I || me_linear_out(&m->experts[e].down) != H) return -1;
    for (int64_t s = 0; s < S; s++)
        if (ids[s] < 0 || ids[s] >= E) return -1;
    int64_t* count = calloc((size_t)E, sizeof(int64_t));
    int64_t* start = malloc(sizeof(int64_t) * (size_t)(E + 1));
    int64_t* slot_of = malloc(sizeof(int64_t) * (size_t)S);  /* grouped position -> slot */
    int64_t* pos_of = malloc(sizeof(int64_t) * (size_t)S);   /* slot -> grouped position */
    int64_t* active = malloc(sizeof(int64_t) * (size_t)E);
    char* rows = malloc(elt * (size_t)(S * H));
    char* grouped = malloc(elt * (size_t)(S * H));
    int rc = 0;
    if (!count || !start || !slot_of || !pos_of || !active || !rows || !grouped) { rc = -2; goto done; }
    for (int64_t s = 0; s < S; s++) count[ids[s]]++;
    int64_t num_active = 0, max_n = 0;
    start[0] = 0;
    for (int64_t e = 0; e < E; e++) {
        start[e + 1] = start[e] + count[e];
        if (count[e]) {
            if (!me_supported(tables, count[e])) { rc = -3; goto done; }
            active[num_active++] = e;
            if (count[e] > max_n) max_n = count[e];
        }
    }
    {   /* the counting sort: slots in order, each placed after the earlier slots of its expert */
        int64_t* fill = malloc(sizeof(int64_t) * (size_t)E);
        if (!fill) { rc = -2; goto done; }
        memcpy(fill, start, sizeof(int64_t) * (size_t)E);
        for (int64_t s = 0; s < S; s++) {
            const int64_t p = fill[ids[s]]++;
            slot_of[p] = s;
            pos_of[s] = p;
        }
        free(fill);
    }
    for (int64_t p = 0; p < S; p++)
        memcpy(rows + elt * (size_t)(p * H), (const char*)x + elt * (size_t)((slot_of[p] / k) * H), elt * (size_t)H);
    const int par = expert_parallel == 2 ? max_n <= ME_PARALLEL_MAX_ROWS : expert_parallel != 0;
    if (par && num_threads > 1 && num_active > 1) {
        int failed = 0;
#pragma omp parallel num_threads(num_threads)
        {
            char* gu = malloc(elt * (size_t)(max_n * 2 * I));
            char* act = malloc(elt * (size_t)(max_n * I));
            int mine = (!gu || !act) ? -2 : 0;
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < num_active; i++) {
                const int64_t e = active[i], n = count[e];
                const int amx = me_amx(tables, n);
                if (mine == 0)
                    mine = me_expert_run(m, &m->experts[e], rows + elt * (size_t)(start[e] * H), n,
                                         grouped + elt * (size_t)(start[e] * H), gu, act, 1, amx);
            }
            if (mine) {
#pragma omp atomic write
                failed = mine;
            }
            free(gu);
            free(act);
        }
        rc = failed;
    } else {
        char* gu = malloc(elt * (size_t)(max_n * 2 * I));
        char* act = malloc(elt * (size_t)(max_n * I));
        if (!gu || !act) rc = -2;
        for (int64_t i = 0; i < num_active && rc == 0; i++) {
            const int64_t e = active[i], n = count[e];
            const int amx = me_amx(tables, n);
            rc = me_expert_run(m, &m->experts[e], rows + elt * (size_t)(start[e] * H), n,
                               grouped + elt * (size_t)(start[e] * H), gu, act, num_threads, amx);
        }
        free(gu);
        free(act);
    }
    if (rc != 0) { rc = rc == -1 ? -2 : rc; goto done; } /* a product refused: only its allocation can fail */
    /* the combine, in rank order (experts.combine_in_rank_order) */
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && T * H >= 65536)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < H; h++) {
            float acc = 0.0f;
            for (int64_t r = 0; r < k; r++) {
                const int64_t idx = pos_of[t * k + r] * H + h;
                const float v = bf16 ? bf16_to_f32(((const uint16_t*)grouped)[idx]) : ((const float*)grouped)[idx];
                const float p = v * w[t * k + r];
                acc = r == 0 ? p : acc + p;
            }
            if (bf16) ((uint16_t*)out)[t * H + h] = f32_to_bf16(acc);
            else ((float*)out)[t * H + h] = acc;
        }
    }
done:
    free(count); free(start); free(slot_of); free(pos_of); free(active); free(rows); free(grouped);
    return rc;
}

/* Softmax routing of T tokens over E experts (moe/routing.py's select_experts for a softmax router without
 * groups, bias or scaling): logits [T, E] in the model dtype (bf16: 1) -> weights [T, k] float32 and ids [T, k],
 * in rank order (descending, exact ties to the lowest index). softmax_after_topk 0: softmax over all E in
 * float32 (max subtracted, expf, the sum in index order, one division each), the k best probabilities;
 * 1: the k best logits, softmax over them. norm_topk: the k weights divided by their sum (rank order).
 * The CPU torch path routes a block through this function whenever its experts run in the fused step, so the
 * lean decode step (which calls it too) and the torch path choose the same experts with the same weights.
 * Returns 0, or -1 for bad sizes or -2 when memory cannot be allocated. */
int me_route(const void* logits, int bf16, int64_t T, int64_t E, int64_t k, int norm_topk, int softmax_after_topk,
             float* weights, int64_t* ids) {
    if (T < 0 || E < 1 || k < 1 || k > E) return -1;
    float* p = malloc(sizeof(float) * (size_t)E);
    unsigned char* taken = malloc((size_t)E);
    if (!p || !taken) { free(p); free(taken); return -2; }
    for (int64_t t = 0; t < T; t++) {
        for (int64_t e = 0; e < E; e++)
            p[e] = bf16 ? bf16_to_f32(((const uint16_t*)logits)[t * E + e]) : ((const float*)logits)[t * E + e];
        if (!softmax_after_topk) {
            float mx = p[0];
            for (int64_t e = 1; e < E; e++) if (p[e] > mx) mx = p[e];
            float sum = 0.0f;
            for (int64_t e = 0; e < E; e++) { p[e] = expf(p[e] - mx); sum += p[e]; }
            for (int64_t e = 0; e < E; e++) p[e] = p[e] / sum;
        }
        memset(taken, 0, (size_t)E);
        float* w = weights + t * k;
        int64_t* id = ids + t * k;
        for (int64_t r = 0; r < k; r++) { /* the best not yet taken; a strict > keeps the lowest index on ties */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
            taken[best] = 1;
            id[r] = best;
            w[r] = p[best];
        }
        if (softmax_after_topk) { /* softmax over the k chosen logits (w[0] is their max) */
            const float mx = w[0];
            float sum = 0.0f;
            for (int64_t r = 0; r < k; r++) { w[r] = expf(w[r] - mx); sum += w[r]; }
            for (int64_t r = 0; r < k; r++) w[r] = w[r] / sum;
        }
        if (norm_topk) {
            float sum = 0.0f;
            for (int64_t r = 0; r < k; r++) sum += w[r];
            for (int64_t r = 0; r < k; r++) w[r] = w[r] / sum;
        }
    }
    free(p);
    free(taken);
    return 0;
}
