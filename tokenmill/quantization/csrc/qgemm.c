/* Matrix products with GGUF block-quantized weights, read as stored (never expanded to float in memory).
 *
 *   y[m, n] = sum_k x[m, k] * W[n, k]      x: [M, K] float32 or bf16, y: [M, N] float32 or bf16 (row
 *                                           stride ldy), W: N rows of K/BLOCK blocks in a GGUF format
 *
 * Formats (ggml type ids; block layouts as the GGUF file format defines them, implemented here from
 * that description): Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q2_K (10), Q3_K (11), Q4_K (12),
 * Q5_K (13), Q6_K (14), IQ4_NL (20), IQ4_XS (23), each also in a tiled layout (type id + QG_TILED, written
 * by qg_repack). Every format is read as groups of 32 weights, each group w_k = D * s_h * u_k + o_h, with
 * u_k a code (2 to 6 bits unsigned, or the signed values of Q8_0 and IQ4), s_h an integer sub-scale per
 * half group of 16 and o_h a float offset per half.
 *
 * Activations are quantized per group of 32 (llama.cpp's "q8" scheme, written from its description):
 * dx = max|x| / 127, xq = round(x / dx) in int8, plus the sum of xq per half group. A group then costs
 * one integer dot product (exact in int32) and two float multiply-adds:
 *   y += dx * D * sum_h(s_h * sum(u * xq)) + dx * sum_h(o_h * sum_h(xq)).
 * The error against float products is at most 0.5 * dx * sum|w| per group (the activation rounding).
 *
 * Each y[m, n] is computed by the same instructions whatever M, m, the other rows or the thread count
 * (threads split N; row tiles only share the decoded weight codes), so a row's result depends only on
 * its own input row: the kernel is batch invariant. ISA paths: plain C (TM_PORTABLE, or no SIMD),
 * NEON (aarch64: the portable build's bits), AVX2 (maddubs), AVX-512BW (two groups per instruction),
 * AVX-512 VNNI (vpdpbusd) when TM_VNNI is set (the loader sets it where the CPU has avx512_vnni), and AMX
 * tiles for the tiled Q4_0/Q4_1/Q8_0 at 16 or more rows when TM_AMX is (same bits as VNNI). qg_linear's
 * bf16 path has nothing bf16-specific: activations are quantized to int8 whatever their type; only
 * qg_linear_bf16 (AMX bf16 tiles, TM_AMX_BF16) multiplies in bf16.
 * Built at run time by tokenmill/quantization/qgemm.py; tests/test_quantized_weights.py holds every path
 * to a dequantize-then-float reference (the `gguf` package's dequantizer).
 *
 * One translation unit, in parts by concern. This file chooses the ISA path, includes the parts in this
 * order (each uses what the ones before it define) and holds the exported functions and the dispatch from a
 * type id to its kernels:
 *   qg_formats.h      type ids, block sizes, fp16/bf16 conversions, a group's scales and codes, dequantize_row
 *   qg_act.h          activation quantization (act_q)
 *   qg_rows.h         products on the stored layout (plain C and NEON, AVX2, AVX-512)
 *   qg_tiles.h        Q4_0/Q4_1/Q8_0 tiled layout: repacking, dequantizing, products (plain C, AVX2, AVX-512);
 *                     includes qg_tiles_amx.h (AMX int8 and bf16 products)
 *   qg_tiles_kq.h     the other formats' tiled layouts, the same way; includes qg_tiles_kq_body.h (its SIMD
 *                     product, once per vector width)
 * The build's cache key covers every header beside this file (tokenmill/csrc_build.py).
 */
#if defined(TM_AMX)
#define _GNU_SOURCE /* syscall() under -std=c11, for the AMX permission request */
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "bf16.h"

/* The ISA path, from the compiler's flags (tokenmill/csrc_build.py's ISA_FLAGS) and the TM_* macros the loader
 * adds (qgemm.py's flags_for): the QG_* macros every part tests. */
#if !defined(TM_PORTABLE) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QG_AVX2 1
#define QG_AVX512 1
#if defined(TM_VNNI) && defined(__AVX512VNNI__)
#define QG_VNNI 1
#endif
#if defined(TM_AMX) && defined(QG_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define QG_AMX 1
#if defined(TM_AMX_BF16) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define QG_AMX_BF16 1
#endif
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__AVX512BF16__)
#define ISA_PATH "avx512_bf16"
#else
#define ISA_PATH "avx512"
#endif
#elif !defined(TM_PORTABLE) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QG_AVX2 1
#define ISA_PATH "avx2"
#elif !defined(TM_PORTABLE) && defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#define QG_NEON 1
#define ISA_PATH "neon"
#else
#define ISA_PATH "portable"
#endif

#define AI static inline __attribute__((always_inline)) /* the parts' small helpers */

#include "qg_formats.h"
#include "qg_act.h"
#include "qg_rows.h"
#include "qg_tiles.h"
#include "qg_tiles_kq.h"

/* ---------------------------------------------------------------- the build */

const char* qg_isa(void) { return ISA_PATH; }

/* 1 when the AVX-512 VNNI product (vpdpbusd) is built in. */
int qg_vnni(void) {
#if defined(QG_VNNI)
    return 1;
#else
    return 0;
#endif
}

/* 1 when this build's SIMD path reads the tiled layout faster than the stored one (x86 AVX2 and AVX-512;
 * the loader repacks only then). */
int qg_tiled_preferred(void) {
#if defined(QG_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* 1 when this process multiplies AMX_MIN_ROWS or more rows on AMX tiles (asks Linux for the tile state once;
 * TOKENMILL_DISABLE_AMX=1 in the environment keeps VNNI for every row count). */
int qg_amx(void) {
#if defined(QG_AMX)
    int state = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (state < 0) { /* two threads may both ask: the request is idempotent and both store the same answer */
        const char* off = getenv("TOKENMILL_DISABLE_AMX");
        state = off && off[0] && strcmp(off, "0") != 0 ? 0 : amx_request();
        __atomic_store_n(&amx_state, state, __ATOMIC_RELEASE);
    }
    return state;
#else
    return 0;
#endif
}

/* Turn the AMX path off (0) or back on (1, where qg_amx() can); returns qg_amx(). Tests compare the paths. */
int qg_set_amx(int on) {
#if defined(QG_AMX)
    __atomic_store_n(&amx_state, on ? amx_request() : 0, __ATOMIC_RELEASE);
#else
    (void)on;
#endif
    return qg_amx();
}

/* 1 when qg_linear_bf16 runs here (built with AMX bf16 and the tiles granted). */
int qg_amx_bf16(void) {
#if defined(QG_AMX_BF16)
    return qg_amx();
#else
    return 0;
#endif
}

/* ---------------------------------------------------------------- repacking, products, dequantizing */

/* src: N rows of a weight as stored; dst: the same bytes in the format's tiled layout (qg_tiles.h,
 * qg_tiles_kq.h; not overlapping src). Returns 0, or -1 for a format without one or a K that is not a
 * whole number of blocks. */
int qg_repack(int qtype, const uint8_t* src, int64_t N, int64_t K, uint8_t* dst) {
    const int base = tiled_base(QG_TILED + qtype), kbase = kt_base(QG_TILED + qtype);
    if ((!base && !kbase) || K <= 0 || K % qg_block_size(qtype)) return -1;
    if (base) tiled_repack(base, src, N, K, dst);
    else kt_repack(kbase, src, N, K, dst);
    return 0;
}

/* y[m, n] (row stride ldy) = x[m] . W[n] for m < M, n < N. Returns 0, or -1 for an unknown type,
 * a K that is not a whole number of blocks, or a failed allocation. */
int qg_linear(int qtype, const uint8_t* w, int64_t N, int64_t K, const void* x, int x_bf16, int64_t M, void* y,
              int y_bf16, int64_t ldy, int num_threads) {
    const int base = tiled_base(qtype), kbase = kt_base(qtype);
    const int64_t bs = qg_block_size(base ? base : kbase ? kbase : qtype);
    if (bs == 0 || K % bs != 0 || K <= 0) return -1;
    if (M <= 0 || N <= 0) return 0;
    act_q a;
    if (act_alloc(&a, M, K)) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && M * K >= 32768)
    for (int64_t m = 0; m < M; m++) quantize_row(x, x_bf16, m, &a);
    if (kbase && kt_expands(kbase, M, K)) act_expand(&a, M, num_threads); /* else (or failed) the tiles broadcast */
    const int fmt = base ? base : kbase ? kbase : qtype;
    const int64_t rb = row_bytes(fmt, K);
    void (*task)(const uint8_t*, int64_t, const act_q*, int64_t, int64_t, int64_t, void*, int, int64_t) =
        fmt == Q4_0 ? task_q4_0 : fmt == Q4_1 ? task_q4_1 : fmt == Q8_0 ? task_q8_0 :
        fmt == Q4_K ? task_q4_k : fmt == Q5_0 ? task_q5_0 : fmt == Q5_1 ? task_q5_1 : fmt == Q5_K ? task_q5_k :
        fmt == Q2_K ? task_q2_k : fmt == Q3_K ? task_q3_k : fmt == IQ4_NL ? task_iq4_nl : fmt == IQ4_XS ? task_iq4_xs :
        task_q6_k;
    const int parallel = num_threads > 1 && N * K * (M < 8 ? M : 8) >= 65536;
    if (base || kbase) { /* tiles of TP rows, then the tail rows (as stored) as one more task */
        void (*tile_task)(const uint8_t*, const act_q*, int64_t, int64_t, void*, int, int64_t, int) =
            base == Q4_0 ? tile_task_q4_0 : base == Q4_1 ? tile_task_q4_1 : base == Q8_0 ? tile_task_q8_0 :
            kbase == Q5_0 ? kt_task_q5_0 : kbase == Q5_1 ? kt_task_q5_1 : kbase == Q4_K ? kt_task_q4_k :
            kbase == Q5_K ? kt_task_q5_k : kbase == Q2_K ? kt_task_q2_k : kbase == Q3_K ? kt_task_q3_k :
            kbase == IQ4_NL ? kt_task_iq4_nl : kbase == IQ4_XS ? kt_task_iq4_xs : kt_task_q6_k;
        const int64_t NT = N / TP, tasks = NT + (N % TP != 0);
#if defined(QG_AMX)
        const int amx = base && M >= AMX_MIN_ROWS && qg_amx(); /* the K-quant tiles have no AMX path */
#else
        const int amx = 0;
#endif
#pragma omp parallel num_threads(num_threads) if (parallel)
        {
#if defined(QG_AMX)
            /* other code on this thread (torch's oneDNN kernels) loads its own tile configuration or
             * releases the tiles between our calls: configure afresh in every call, release at its end */
            amx_rows = 0;
#endif
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tasks; t++) {
                if (t < NT) tile_task(w, &a, t, M, y, y_bf16, ldy, amx);
                else task(w, rb, &a, NT * TP, N, M, y, y_bf16, ldy);
            }
#if defined(QG_AMX)
            if (amx_rows) { _tile_release(); amx_rows = 0; }
#endif
        }
    } else {
        const int64_t NB = 8; /* weight rows per task: their bytes stay in L1 while the row tiles pass */
        const int64_t tasks = (N + NB - 1) / NB;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t n1 = (t + 1) * NB < N ? (t + 1) * NB : N;
            task(w, rb, &a, t * NB, n1, M, y, y_bf16, ldy);
        }
    }
    act_free(&a);
    return 0;
}

/* y[m, n] (row stride ldy) = x[m] . W[n] for m < M, n < N on AMX bf16 tiles, x [M, K] bf16 (contiguous):
 * the float32 product of x and W's bf16-rounded weights (qg_tiles_amx.h). A Q4_0/Q4_1/Q8_0 weight in the tiled
 * layout with N a multiple of 16 only. Returns 0, or -2 where this path does not apply (not built, AMX
 * refused or off, another format, or N % 16 != 0: use qg_linear), -1 on a failed allocation. */
int qg_linear_bf16(int qtype, const uint8_t* w, int64_t N, int64_t K, const uint16_t* x, int64_t M, void* y,
                   int y_bf16, int64_t ldy, int num_threads) {
#if defined(QG_AMX_BF16)
    const int base = tiled_base(qtype);
    if (!base || N % TP != 0 || K % QK != 0 || K <= 0 || !qg_amx()) return -2;
    if (M <= 0 || N <= 0) return 0;
    const int64_t G = K / QK, NT = N / TP, tgb = TP * qg_block_bytes(base), tail = M % 16;
    const int64_t pairs = (NT + 1) / 2;
    uint16_t* xtail = NULL; /* the last M % 16 rows of x, then zero rows: one whole block of 16 */
    if (tail) {
        xtail = (uint16_t*)aligned_alloc(64, (size_t)(16 * K * 2));
        if (!xtail) return -1;
        memcpy(xtail, x + (M - tail) * K, (size_t)(tail * K * 2));
        memset(xtail + tail * K, 0, (size_t)((16 - tail) * K * 2));
    }
    if (num_threads > pairs) num_threads = (int)pairs; /* a thread without a tile pair would only configure tiles */
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        uint16_t* wbuf = (uint16_t*)aligned_alloc(64, (size_t)(2 * G * 512 * 2));
        if (!wbuf) {
#pragma omp atomic write
            failed = 1;
        }
        amx_rows = 0;
        if (wbuf) amxb_configure();
#pragma omp for schedule(static)
        for (int64_t t = 0; t < pairs; t++) {
            if (!wbuf) continue;
            const int two = 2 * t + 1 < NT;
            for (int i = 0; i < 1 + two; i++) {
                const uint8_t* tile = w + (2 * t + i) * G * tgb;
                uint16_t* dst = wbuf + i * G * 512;
                for (int64_t g = 0; g < G; g++) {
                    if (base == Q4_1) amxb_group(Q4_1, tile + g * tgb, dst + 512 * g);
                    else if (base == Q4_0) amxb_group(Q4_0, tile + g * tgb, dst + 512 * g);
                    else amxb_group(Q8_0, tile + g * tgb, dst + 512 * g);
                }
            }
            amxb_tiles(G, x, xtail, K, M, y, y_bf16, ldy, 2 * t * TP, wbuf, two ? wbuf + G * 512 : NULL);
        }
        if (amx_rows) { _tile_release(); amx_rows = 0; }
        free(wbuf);
    }
    free(xtail);
    return failed ? -1 : 0;
#else
    (void)qtype; (void)w; (void)N; (void)K; (void)x; (void)M; (void)y; (void)y_bf16; (void)ldy; (void)num_threads;
    return -2;
#endif
}

/* Weights of rows ids[0..n) (all N rows when ids is NULL) of an N-row weight as float32 or bf16, [n, K];
 * any format, tiled ones included (N says which rows are tail rows, stored as they are). */
void qg_dequantize_rows(int qtype, const uint8_t* w, int64_t N, int64_t K, const int64_t* ids, int64_t n, void* out,
                        int out_bf16, int num_threads) {
    const int base = tiled_base(qtype), kbase = kt_base(qtype), fmt = base ? base : kbase ? kbase : qtype;
    const int64_t rb = row_bytes(fmt, K), G = K / QK;
    const int64_t tiled_rows = base || kbase ? N / TP * TP : 0; /* the rows in tiles; the others are as stored */
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && n * K >= 65536)
    for (int64_t r = 0; r < n; r++) {
        const int64_t row_id = ids ? ids[r] : r;
        float* of = out_bf16 ? NULL : (float*)out + r * K;
        uint16_t* ob = out_bf16 ? (uint16_t*)out + r * K : NULL;
        if (row_id < tiled_rows) {
            if (kbase) kt_dequantize_row(kbase, w, G, row_id, of, ob);
            else if (base == Q4_0) dequantize_tiled_row(Q4_0, w, G, row_id, of, ob);
            else if (base == Q4_1) dequantize_tiled_row(Q4_1, w, G, row_id, of, ob);
            else dequantize_tiled_row(Q8_0, w, G, row_id, of, ob);
            continue;
        }
        const uint8_t* row = w + row_id * rb;
        switch (fmt) { /* a constant format per call of dequantize_row */
        case Q4_0: dequantize_row(Q4_0, row, G, of, ob); break;
        case Q4_1: dequantize_row(Q4_1, row, G, of, ob); break;
        case Q8_0: dequantize_row(Q8_0, row, G, of, ob); break;
        case Q4_K: dequantize_row(Q4_K, row, G, of, ob); break;
        case Q5_0: dequantize_row(Q5_0, row, G, of, ob); break;
        case Q5_1: dequantize_row(Q5_1, row, G, of, ob); break;
        case Q5_K: dequantize_row(Q5_K, row, G, of, ob); break;
        case Q2_K: dequantize_row(Q2_K, row, G, of, ob); break;
        case Q3_K: dequantize_row(Q3_K, row, G, of, ob); break;
        case IQ4_NL: dequantize_row(IQ4_NL, row, G, of, ob); break;
        case IQ4_XS: dequantize_row(IQ4_XS, row, G, of, ob); break;
        default: dequantize_row(Q6_K, row, G, of, ob); break;
        }
    }
}

/* The same for the stored formats only (a tiled type needs N: use qg_dequantize_rows). */
void qg_dequantize(int qtype, const uint8_t* w, int64_t K, const int64_t* ids, int64_t n, void* out, int out_bf16,
                   int num_threads) {
    if (tiled_base(qtype) || kt_base(qtype)) return;
    qg_dequantize_rows(qtype, w, 0, K, ids, n, out, out_bf16, num_threads);
}
