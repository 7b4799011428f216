/* Cross-check of the CPU kernels' NEON path on aarch64 (run under qemu-aarch64 by
 * tests/test_aarch64_kernels.py, or natively on an ARM machine).
 *
 * Usage: aarch64_check LIBDIR KERNEL...
 *   LIBDIR holds <stem>-neon.so and <stem>-portable.so for each KERNEL (a stem in KERNELS below):
 *   the same source built with the NEON flags and with -DTM_PORTABLE. Each kernel's check runs both
 *   builds on deterministic pseudo-random inputs and special values (NaN, inf, -0, huge, subnormal).
 * Prints one line per check and a last line "verdict: PASS|FAIL (n checks, m failed)"; exits 1 on a
 * failure, 2 on a usage or loading error.
 *
 * Adding a kernel: write check_<kernel>(const struct builds*) and add a row to KERNELS (and the
 * kernel's source and flags to tests/test_aarch64_kernels.py).
 */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define NUM_THREADS 3 /* more than one, so rows/sequences split across OpenMP threads */

struct builds {
    void* neon;
    void* portable;
};

static int num_checks, num_failed;

static void* sym(void* lib, const char* name) {
    void* f = dlsym(lib, name);
    if (f == NULL) {
        fprintf(stderr, "missing symbol %s: %s\n", name, dlerror());
        exit(2);
    }
    return f;
}

static void report(int ok, const char* what) {
    num_checks++;
    num_failed += !ok;
    printf("%s %s\n", ok ? "ok  " : "FAIL", what);
}

/* ---------------------------------------------------------------- deterministic inputs */

static uint64_t rng_state;
static void rng_seed(uint64_t s) { rng_state = s; }
static uint64_t rng_next(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static float uniform(void) { return (float)(rng_next() >> 40) * (2.0f / 16777216.0f) - 1.0f; } /* [-1, 1) */
static float normalish(void) { return uniform() + uniform() + uniform(); }                     /* variance 1 */

static uint16_t* to_bf16(const float* x, size_t n) {
    uint16_t* out = malloc(n * sizeof(uint16_t));
    for (size_t i = 0; i < n; i++) out[i] = f32_to_bf16(x[i]);
    return out;
}

/* ---------------------------------------------------------------- silu_and_mul.c */

typedef void (*silu_f32_fn)(const float*, float*, int64_t, int64_t, int);
typedef void (*silu_bf16_fn)(const uint16_t*, uint16_t*, int64_t, int64_t, int);

static const float SILU_SPECIAL[] = {
    NAN, -NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1.0f, -1.5f, 2.0f, -87.0f, -88.7f, -88.8f, -89.5f, -100.0f,
    -3e38f, 3e38f, 88.7f, 89.5f, 86.9f, -86.99f, -87.01f, 1e-45f, -1e-45f, 1.2e-38f, -1.2e-38f, 5e-39f,
};
#define NUM_SILU_SPECIAL ((int64_t)(sizeof(SILU_SPECIAL) / sizeof(SILU_SPECIAL[0])))

/* Both builds on x [M, 2 * I] (float), in float32 and in bfloat16; the outputs must be bit-identical. */
static void silu_compare(const struct builds* b, const float* x, int64_t M, int64_t I, const char* what) {
    const size_t n_in = (size_t)(M * 2 * I), n_out = (size_t)(M * I);
    char line[160];
    float* out_neon = malloc(n_out * sizeof(float));
    float* out_port = malloc(n_out * sizeof(float));
    ((silu_f32_fn)sym(b->neon, "silu_and_mul_f32"))(x, out_neon, M, I, NUM_THREADS);
    ((silu_f32_fn)sym(b->portable, "silu_and_mul_f32"))(x, out_port, M, I, NUM_THREADS);
    size_t bad = 0;
    for (size_t i = 0; i < n_out; i++) bad += memcmp(&out_neon[i], &out_port[i], sizeof(float)) != 0;
    snprintf(line, sizeof line, "silu_and_mul f32 %s: %zu of %zu values differ from portable", what, bad, n_out);
    report(bad == 0, line);

    uint16_t* xb = to_bf16(x, n_in);
    uint16_t* ob_neon = malloc(n_out * sizeof(uint16_t));
    uint16_t* ob_port = malloc(n_out * sizeof(uint16_t));
    ((silu_bf16_fn)sym(b->neon, "silu_and_mul_bf16"))(xb, ob_neon, M, I, NUM_THREADS);
    ((silu_bf16_fn)sym(b->portable, "silu_and_mul_bf16"))(xb, ob_port, M, I, NUM_THREADS);
    size_t bad_bf16 = 0, bad_nan = 0;
    for (size_t i = 0; i < n_out; i++) {
        bad_bf16 += ob_neon[i] != ob_port[i];
        bad_nan += (ob_neon[i] & 0x7fff) > 0x7f80 && ob_neon[i] != 0x7fc0;
    }
    snprintf(line, sizeof line, "silu_and_mul bf16 %s: %zu of %zu values differ from portable, %zu non-canonical NaN",
             what, bad_bf16, n_out, bad_nan);
    report(bad_bf16 == 0 && bad_nan == 0, line);
    free(out_neon), free(out_port), free(xb), free(ob_neon), free(ob_port);
}

static void check_silu(const struct builds* b) {
    /* Rows at several scales (1e-38 and below give subnormal products); I = 1003 leaves a 3-column tail. */
    static const float scales[] = {1.0f, 10.0f, 40.0f, 200.0f, 1e-19f, 1e-38f, 1e-42f};
    const int64_t M = sizeof(scales) / sizeof(scales[0]), I = 1003;
    float* x = malloc(sizeof(float) * (size_t)(M * 2 * I));
    rng_seed(1);
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < 2 * I; j++) x[m * 2 * I + j] = normalish() * scales[m];
    silu_compare(b, x, M, I, "random");
    free(x);

    /* Every (gate, up) pair of special values, in one row. */
    const int64_t n = NUM_SILU_SPECIAL;
    x = malloc(sizeof(float) * (size_t)(2 * n * n));
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < n; j++) {
            x[i * n + j] = SILU_SPECIAL[i];
            x[n * n + i * n + j] = SILU_SPECIAL[j];
        }
    silu_compare(b, x, 1, n * n, "special values");
    free(x);
}

/* ---------------------------------------------------------------- paged_decode.c */

/* ..., scale, window (0: none), softcap (0: none), num_threads */
typedef void (*decode_f32_fn)(const float*, const float*, const float*, const int64_t*, const int64_t*, float*,
                              int, int, int, int, int, int, float, int, float, int);
typedef void (*decode_bf16_fn)(const uint16_t*, const uint16_t*, const uint16_t*, const int64_t*, const int64_t*,
                               uint16_t*, int, int, int, int, int, int, float, int, float, int);

struct decode_case {
    int H, KVH, D, bf16;
    int num_seqs, block_size, max_blocks, num_blocks;
    int64_t seq_lens[8];
    int64_t* block_table; /* [num_seqs, max_blocks] */
    float *q, *k, *v;     /* float copies of the inputs (bf16-rounded for a bf16 case) */
    uint16_t *qb, *kb, *vb;
};

static void decode_run(void* lib, const struct decode_case* c, int s0, int ns, float* out) {
    const float scale = 1.0f / sqrtf((float)c->D);
    const int64_t* bt = c->block_table + (int64_t)s0 * c->max_blocks;
    const size_t qoff = (size_t)s0 * c->H * c->D, n = (size_t)ns * c->H * c->D;
    if (!c->bf16) {
        ((decode_f32_fn)sym(lib, "paged_decode_f32"))(c->q + qoff, c->k, c->v, bt, c->seq_lens + s0, out, ns, c->H,
                                                       c->KVH, c->D, c->block_size, c->max_blocks, scale, 0, 0.0f,
                                                       NUM_THREADS);
        return;
    }
    uint16_t* ob = malloc(n * sizeof(uint16_t));
    ((decode_bf16_fn)sym(lib, "paged_decode_bf16"))(c->qb + qoff, c->kb, c->vb, bt, c->seq_lens + s0, ob, ns, c->H,
                                                     c->KVH, c->D, c->block_size, c->max_blocks, scale, 0, 0.0f,
                                                     NUM_THREADS);
    for (size_t i = 0; i < n; i++) out[i] = bf16_to_f32(ob[i]);
    free(ob);
}

/* Dense attention in double for sequence s: out [H, D]. */
static void decode_reference(const struct decode_case* c, int s, double* out) {
    const int G = c->H / c->KVH, L = (int)c->seq_lens[s];
    double* p = malloc(sizeof(double) * (size_t)L);
    for (int h = 0; h < c->H; h++) {
        const float* qh = c->q + ((size_t)s * c->H + h) * c->D;
        double m = -INFINITY, sum = 0;
        for (int t = 0; t < L; t++) {
            const int64_t slot = c->block_table[s * c->max_blocks + t / c->block_size] * c->block_size + t % c->block_size;
            const float* kt = c->k + (slot * c->KVH + h / G) * c->D;
            double dot = 0;
            for (int d = 0; d < c->D; d++) dot += (double)qh[d] * kt[d];
            p[t] = dot / sqrt((double)c->D);
            m = p[t] > m ? p[t] : m;
        }
        for (int t = 0; t < L; t++) sum += p[t] = exp(p[t] - m);
        for (int d = 0; d < c->D; d++) out[h * c->D + d] = 0;
        for (int t = 0; t < L; t++) {
            const int64_t slot = c->block_table[s * c->max_blocks + t / c->block_size] * c->block_size + t % c->block_size;
            const float* vt = c->v + (slot * c->KVH + h / G) * c->D;
            for (int d = 0; d < c->D; d++) out[h * c->D + d] += p[t] / sum * vt[d];
        }
    }
    free(p);
}

/* Random inputs; sequences get shuffled, disjoint blocks. */
static void decode_case_init(struct decode_case* c, int H, int KVH, int D, int bf16) {
    static const int64_t lens[] = {1, 5, 17, 64, 33};
    memset(c, 0, sizeof *c);
    c->H = H, c->KVH = KVH, c->D = D, c->bf16 = bf16;
    c->num_seqs = 5, c->block_size = 4, c->max_blocks = 16, c->num_blocks = 5 * 16;
    memcpy(c->seq_lens, lens, sizeof lens);
    rng_seed((uint64_t)(H * 1000 + D * 10 + bf16));
    int* perm = malloc(sizeof(int) * (size_t)c->num_blocks);
    for (int i = 0; i < c->num_blocks; i++) perm[i] = i;
    for (int i = c->num_blocks - 1; i > 0; i--) {
        const int j = (int)(rng_next() % (uint64_t)(i + 1)), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    c->block_table = malloc(sizeof(int64_t) * (size_t)(c->num_seqs * c->max_blocks));
    for (int i = 0; i < c->num_seqs * c->max_blocks; i++) c->block_table[i] = perm[i];
    free(perm);
    const size_t nq = (size_t)c->num_seqs * H * D, nkv = (size_t)c->num_blocks * c->block_size * KVH * D;
    c->q = malloc(nq * sizeof(float)), c->k = malloc(nkv * sizeof(float)), c->v = malloc(nkv * sizeof(float));
    for (size_t i = 0; i < nq; i++) c->q[i] = normalish();
    for (size_t i = 0; i < nkv; i++) c->k[i] = normalish(), c->v[i] = normalish();
    if (bf16) {
        c->qb = to_bf16(c->q, nq), c->kb = to_bf16(c->k, nkv), c->vb = to_bf16(c->v, nkv);
        for (size_t i = 0; i < nq; i++) c->q[i] = bf16_to_f32(c->qb[i]);
        for (size_t i = 0; i < nkv; i++) c->k[i] = bf16_to_f32(c->kb[i]), c->v[i] = bf16_to_f32(c->vb[i]);
    }
}

static void decode_case_free(struct decode_case* c) {
    free(c->block_table), free(c->q), free(c->k), free(c->v), free(c->qb), free(c->kb), free(c->vb);
}

/* One build on one case: within tolerance of the double reference (the tolerances of
 * tests/test_attention.py), and each sequence run alone gives the same bits as in the batch. */
static void decode_check_build(void* lib, const char* isa, const struct decode_case* c) {
    const size_t per_seq = (size_t)c->H * c->D;
    const double tol = c->bf16 ? 2e-2 : 1e-5;
    float* out = malloc(per_seq * (size_t)c->num_seqs * sizeof(float));
    float* alone = malloc(per_seq * sizeof(float));
    double* ref = malloc(per_seq * sizeof(double));
    decode_run(lib, c, 0, c->num_seqs, out);
    double worst = 0;
    int outside = 0, variant = 0;
    for (int s = 0; s < c->num_seqs; s++) {
        decode_reference(c, s, ref);
        for (size_t i = 0; i < per_seq; i++) {
            const double err = fabs(out[s * per_seq + i] - ref[i]);
            worst = err > worst ? err : worst;
            outside += !(err <= tol + tol * fabs(ref[i]));
        }
        decode_run(lib, c, s, 1, alone);
        variant += memcmp(alone, out + s * per_seq, per_seq * sizeof(float)) != 0;
    }
    char line[200];
    snprintf(line, sizeof line, "paged_decode %s %s H=%d KVH=%d D=%d: max error %.2g vs reference (tol %g), "
             "%d sequences differ run alone", isa, c->bf16 ? "bf16" : "f32", c->H, c->KVH, c->D, worst, tol, variant);
    report(outside == 0 && variant == 0, line);
    free(out), free(alone), free(ref);
}

/* NaN in a query, a key and a value, +inf and inf - inf in values: NEON NaN wherever portable has NaN. */
static void decode_check_nan(const struct builds* b, int D) {
    struct decode_case c;
    decode_case_init(&c, 4, 2, D, 1);
    const int bs = c.block_size;
#define KV_AT(s, t, kvh, d) ((size_t)((c.block_table[(s) * c.max_blocks + (t) / bs] * bs + (t) % bs) * c.KVH + (kvh)) * c.D + (d))
    c.qb[(size_t)0 * c.H * D + 0 * D + 1] = 0x7fc0;             /* sequence 0: NaN query, head 0 */
    c.kb[KV_AT(1, 2, 0, 7 % D)] = 0xffc1;                       /* sequence 1: NaN key (negative, payload) */
    c.vb[KV_AT(2, 1, 1, 3)] = 0x7fc0;                           /* sequence 2: NaN value */
    c.vb[KV_AT(2, 0, 0, 5 % D)] = 0x7f80;                       /* +inf value */
    c.vb[KV_AT(3, 2, 0, 6 % D)] = 0x7f80, c.vb[KV_AT(3, 1, 0, 6 % D)] = 0xff80; /* inf - inf */
#undef KV_AT
    const size_t n = (size_t)c.num_seqs * c.H * D;
    float* out_neon = malloc(n * sizeof(float));
    float* out_port = malloc(n * sizeof(float));
    decode_run(b->neon, &c, 0, c.num_seqs, out_neon);
    decode_run(b->portable, &c, 0, c.num_seqs, out_port);
    size_t nans = 0, mismatched = 0, non_canonical = 0;
    for (size_t i = 0; i < n; i++) {
        nans += isnan(out_port[i]);
        mismatched += isnan(out_neon[i]) != isnan(out_port[i]) || isinf(out_neon[i]) != isinf(out_port[i]);
        uint32_t bits;
        memcpy(&bits, &out_neon[i], sizeof bits);
        non_canonical += isnan(out_neon[i]) && bits != 0x7fc00000u;
    }
    char line[160];
    snprintf(line, sizeof line, "paged_decode bf16 NaN/inf D=%d: %zu NaN in portable, %zu positions differ, "
             "%zu non-canonical NaN", D, nans, mismatched, non_canonical);
    report(nans > 0 && mismatched == 0 && non_canonical == 0, line);
    free(out_neon), free(out_port);
    decode_case_free(&c);
}

static void check_paged_decode(const struct builds* b) {
    /* GQA and not; head_dim 64 and 128 (specialised), 24 and 8 (general NEON loop), 6 (plain C in both). */
    static const int shapes[][3] = {{4, 4, 64}, {9, 3, 64}, {8, 2, 128}, {4, 2, 24}, {2, 2, 8}, {6, 3, 8}, {3, 1, 6}};
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
        for (int bf16 = 0; bf16 <= 1; bf16++) {
            struct decode_case c;
            decode_case_init(&c, shapes[i][0], shapes[i][1], shapes[i][2], bf16);
            decode_check_build(b->neon, "neon", &c);
            decode_check_build(b->portable, "portable", &c);
            decode_case_free(&c);
        }
    decode_check_nan(b, 64);
    decode_check_nan(b, 24);
}

/* ---------------------------------------------------------------- batch_invariant.c */

typedef void (*linear_fn)(const void*, const void*, const void*, void*, int64_t, int64_t, int64_t, int);
typedef void (*rms_fn)(const void*, const void*, void*, int64_t, int64_t, float, int);

/* Both builds compute the canonical order (see the C file), so every output must be bit-identical:
 * bf16 and f32 linear with and without bias, bf16 inputs with float32 output, and RMSNorm. */
static void check_batch_invariant(const struct builds* b) {
    static const int64_t shapes[][3] = {{1, 1, 1}, {2, 15, 3}, {5, 16, 17}, {3, 31, 5}, {7, 33, 19},
                                        {4, 100, 37}, {9, 576, 64}, {2, 1000, 23}};
    static const char* linears[] = {"bi_linear_f32", "bi_linear_bf16", "bi_linear_bf16_f32out"};
    char line[200];
    rng_seed(7);
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        const int64_t M = shapes[s][0], K = shapes[s][1], N = shapes[s][2];
        float *x = malloc(sizeof(float) * (size_t)(M * K)), *w = malloc(sizeof(float) * (size_t)(N * K));
        float* bias = malloc(sizeof(float) * (size_t)N);
        for (int64_t i = 0; i < M * K; i++) x[i] = normalish();
        for (int64_t i = 0; i < N * K; i++) w[i] = normalish() / sqrtf((float)K);
        for (int64_t i = 0; i < N; i++) bias[i] = normalish();
        if (M * K > 3) x[3] = s % 2 ? NAN : INFINITY; /* special values travel through every path */
        uint16_t *xb = to_bf16(x, (size_t)(M * K)), *wb = to_bf16(w, (size_t)(N * K)), *bb = to_bf16(bias, (size_t)N);
        for (int kind = 0; kind < 3; kind++)
            for (int with_bias = 0; with_bias <= 1; with_bias++) {
                const int in_bf16 = kind > 0, out_f32 = kind != 1;
                const size_t out_bytes = (size_t)(M * N) * (out_f32 ? 4 : 2);
                void *y_neon = calloc(1, out_bytes), *y_port = calloc(1, out_bytes);
                const void *xi = in_bf16 ? (const void*)xb : (const void*)x, *wi = in_bf16 ? (const void*)wb : (const void*)w;
                const void* bi = with_bias ? (in_bf16 ? (const void*)bb : (const void*)bias) : NULL;
                ((linear_fn)sym(b->neon, linears[kind]))(xi, wi, bi, y_neon, M, N, K, NUM_THREADS);
                ((linear_fn)sym(b->portable, linears[kind]))(xi, wi, bi, y_port, M, N, K, NUM_THREADS);
                int same = memcmp(y_neon, y_port, out_bytes) == 0;
                snprintf(line, sizeof line, "batch_invariant %s M=%ld K=%ld N=%ld bias=%d: bits %s", linears[kind],
                         (long)M, (long)K, (long)N, with_bias, same ? "equal" : "DIFFER");
                report(same, line);
                free(y_neon), free(y_port);
            }
        free(x), free(w), free(bias), free(xb), free(wb), free(bb);
    }
    static const int64_t widths[] = {1, 15, 16, 17, 576, 1000};
    for (size_t i = 0; i < sizeof(widths) / sizeof(widths[0]); i++)
        for (int bf16 = 0; bf16 <= 1; bf16++) {
            const int64_t M = 5, H = widths[i];
            float *x = malloc(sizeof(float) * (size_t)(M * H)), *g = malloc(sizeof(float) * (size_t)H);
            for (int64_t j = 0; j < M * H; j++) x[j] = 2.0f * normalish();
            for (int64_t j = 0; j < H; j++) g[j] = 1.0f + 0.5f * normalish();
            uint16_t *xb = to_bf16(x, (size_t)(M * H)), *gb = to_bf16(g, (size_t)H);
            const size_t bytes = (size_t)(M * H) * (bf16 ? 2 : 4);
            void *y_neon = malloc(bytes), *y_port = malloc(bytes);
            const char* name = bf16 ? "bi_rms_norm_bf16" : "bi_rms_norm_f32";
            const void *xi = bf16 ? (const void*)xb : (const void*)x, *gi = bf16 ? (const void*)gb : (const void*)g;
            ((rms_fn)sym(b->neon, name))(xi, gi, y_neon, M, H, 1e-5f, NUM_THREADS);
            ((rms_fn)sym(b->portable, name))(xi, gi, y_port, M, H, 1e-5f, NUM_THREADS);
            int same = memcmp(y_neon, y_port, bytes) == 0;
            snprintf(line, sizeof line, "batch_invariant %s H=%ld: bits %s", name, (long)H, same ? "equal" : "DIFFER");
            report(same, line);
            free(x), free(g), free(xb), free(gb), free(y_neon), free(y_port);
        }
}

/* ---------------------------------------------------------------- qgemm.c (GGUF quantized weights) */

typedef int (*qg_linear_fn)(int, const uint8_t*, int64_t, int64_t, const void*, int, int64_t, void*, int, int64_t,
                            int);
typedef void (*qg_dequantize_fn)(int, const uint8_t*, int64_t, const int64_t*, int64_t, void*, int, int);

/* Random blocks of a format (ggml type, weights and bytes per block, offsets of its float16 fields):
 * every code and sub-scale byte random, the float16 scales small normal values. */
static uint8_t* random_blocks(int bytes_per_block, const int* half_offsets, int n_half, int64_t n_blocks) {
    uint8_t* raw = malloc((size_t)(n_blocks * bytes_per_block));
    for (int64_t i = 0; i < n_blocks * bytes_per_block; i++) raw[i] = (uint8_t)(rng_next() >> 56);
    for (int64_t blk = 0; blk < n_blocks; blk++)
        for (int h = 0; h < n_half; h++) {
            const _Float16 v = (_Float16)(0.01f * normalish());
            memcpy(raw + blk * bytes_per_block + half_offsets[h], &v, 2);
        }
    return raw;
}

/* The NEON build's integer dot products are exact and its float code is the portable build's: every
 * product and dequantized row must be bit-identical, float32 and bf16 activations, several row counts. */
static void check_qgemm(const struct builds* b) {
    static const struct { int qtype, block, bytes, n_half, half[2]; int64_t K; } formats[] = {
        {2, 32, 18, 1, {0, 0}, 544}, {3, 32, 20, 2, {0, 2}, 96}, {8, 32, 34, 1, {0, 0}, 544},
        {12, 256, 144, 2, {0, 2}, 768}, {14, 256, 210, 1, {208, 0}, 768},
        {6, 32, 22, 1, {0, 0}, 544}, {7, 32, 24, 2, {0, 2}, 96}, {20, 32, 18, 1, {0, 0}, 544},
        {10, 256, 84, 2, {80, 82}, 768}, {11, 256, 110, 1, {108, 0}, 768}, {13, 256, 176, 2, {0, 2}, 768},
        {23, 256, 136, 1, {0, 0}, 768},
    };
    static const int64_t rows[] = {1, 7, 33};
    const int64_t N = 37;
    char line[200];
    rng_seed(11);
    for (size_t f = 0; f < sizeof(formats) / sizeof(formats[0]); f++) {
        const int64_t K = formats[f].K, nb = N * (K / formats[f].block);
        uint8_t* w = random_blocks(formats[f].bytes, formats[f].half, formats[f].n_half, nb);
        float* x = malloc(sizeof(float) * (size_t)(33 * K));
        for (int64_t i = 0; i < 33 * K; i++) x[i] = normalish();
        uint16_t* xb = to_bf16(x, (size_t)(33 * K));
        for (size_t r = 0; r < sizeof(rows) / sizeof(rows[0]); r++)
            for (int bf16 = 0; bf16 <= 1; bf16++) {
                const int64_t M = rows[r];
                float *y_neon = calloc((size_t)(M * N), 4), *y_port = calloc((size_t)(M * N), 4);
                const void* xi = bf16 ? (const void*)xb : (const void*)x;
                int rc = ((qg_linear_fn)sym(b->neon, "qg_linear"))(formats[f].qtype, w, N, K, xi, bf16, M, y_neon, 0, N,
                                                                   NUM_THREADS);
                rc |= ((qg_linear_fn)sym(b->portable, "qg_linear"))(formats[f].qtype, w, N, K, xi, bf16, M, y_port, 0,
                                                                    N, NUM_THREADS);
                const int same = rc == 0 && memcmp(y_neon, y_port, sizeof(float) * (size_t)(M * N)) == 0;
                snprintf(line, sizeof line, "qgemm type %d M=%ld K=%ld N=%ld %s: bits %s", formats[f].qtype, (long)M,
                         (long)K, (long)N, bf16 ? "bf16" : "f32", same ? "equal" : "DIFFER");
                report(same, line);
                free(y_neon), free(y_port);
            }
        float *d_neon = malloc(sizeof(float) * (size_t)(N * K)), *d_port = malloc(sizeof(float) * (size_t)(N * K));
        ((qg_dequantize_fn)sym(b->neon, "qg_dequantize"))(formats[f].qtype, w, K, NULL, N, d_neon, 0, NUM_THREADS);
        ((qg_dequantize_fn)sym(b->portable, "qg_dequantize"))(formats[f].qtype, w, K, NULL, N, d_port, 0, NUM_THREADS);
        const int same = memcmp(d_neon, d_port, sizeof(float) * (size_t)(N * K)) == 0;
        snprintf(line, sizeof line, "qgemm dequantize type %d: bits %s", formats[f].qtype, same ? "equal" : "DIFFER");
        report(same, line);
        free(w), free(x), free(xb), free(d_neon), free(d_port);
    }
}

/* ---------------------------------------------------------------- the kernels */

static const struct kernel {
    const char* stem;       /* <stem>-neon.so, <stem>-portable.so */
    const char* isa_symbol; /* const char* f(void): the path the build compiled */
    void (*check)(const struct builds*);
} KERNELS[] = {
    {"silu_and_mul", "silu_and_mul_isa", check_silu},
    {"paged_decode", "paged_decode_isa", check_paged_decode},
    {"batch_invariant", "bi_isa", check_batch_invariant},
    {"qgemm", "qg_isa", check_qgemm},
};

static void* open_build(const char* dir, const char* stem, const char* isa, const char* isa_symbol) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s-%s.so", dir, stem, isa);
    void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        fprintf(stderr, "cannot load %s: %s\n", path, dlerror());
        exit(2);
    }
    const char* compiled = ((const char* (*)(void))sym(lib, isa_symbol))();
    char line[160];
    snprintf(line, sizeof line, "%s %s build reports the %s path", stem, isa, compiled);
    report(strcmp(compiled, isa) == 0, line);
    return lib;
}

int main(int argc, char** argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s LIBDIR KERNEL...\n", argv[0]);
        return 2;
    }
    for (int a = 2; a < argc; a++) {
        const struct kernel* k = NULL;
        for (size_t i = 0; i < sizeof(KERNELS) / sizeof(KERNELS[0]); i++)
            if (strcmp(KERNELS[i].stem, argv[a]) == 0) k = &KERNELS[i];
        if (k == NULL) {
            fprintf(stderr, "unknown kernel %s\n", argv[a]);
            return 2;
        }
        struct builds b = {open_build(argv[1], k->stem, "neon", k->isa_symbol),
                           open_build(argv[1], k->stem, "portable", k->isa_symbol)};
        k->check(&b);
    }
    printf("verdict: %s (%d checks, %d failed)\n", num_failed ? "FAIL" : "PASS", num_checks, num_failed);
    return num_failed ? 1 : 0;
}
