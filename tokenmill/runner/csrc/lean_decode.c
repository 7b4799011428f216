/* A Llama-family decoder stack's step in one C call: decode-only steps (one query token per sequence), and
 * mixed steps where some sequences bring a chunk of prompt tokens (chunked prefill beside decoding).
 *
 * For each layer, over the T tokens of the step, exactly the operations of the torch path
 * (tokenmill/models/llama.py, the specification), in its order and with its roundings:
 *   xn = RMSNorm(h)                                 rms_norm kernel (batch_invariant.c)
 *   qkv = xn @ Wqkv^T (+ b)                         quantized product per format segment (qgemm.c)
 *   q, k = RMSNorm per head (Qwen3's q_norm/k_norm), then rotate-half RoPE from the float32 cos|sin cache
 *   k, v -> k_cache/v_cache[slot_mapping[b]]        the layer's paged KV cache
 *   a = attention of q                              decode queries: paged decode kernel (paged_decode.c);
 *                                                   prompt chunks: paged prefill kernel (paged_prefill.c);
 *                                                   both with the layer's sliding window, if any
 *   h = (a @ Wo^T (+ b)) + h
 *   h = (silu(gate) * up) @ Wdown^T (+ b) + h       over RMSNorm(h); silu_and_mul kernel
 * OLMoE normalizes the whole q and the whole k projection instead of each head (qk_norm_whole). A layer whose
 * feed-forward is not this MLP (a mixture-of-experts block: mlp_external) ends a call of ld_step_range after
 * its attention block: the caller gets RMSNorm(h) in xn_out, runs the block (tokenmill/moe: its experts in
 * one C call of their own) and adds it to h, as the torch path's layer does, then calls again for the layers
 * after it. A MoE block with routed experts only and a softmax router (moe_in_c) runs here instead when the
 * step sets moe_c, as its module runs on CPU (moe/layer.py):
 *   logits = xn @ Wrouter^T                         the dense C GEMM (bi_linear) or a quantized product
 *   weights, ids = me_route(logits)                 softmax routing (moe_step.c)
 *   h = me_step(xn, ids, weights) + h               the fused expert step (moe_step.c)
 * and the tokens per expert are added to moe_counts (the caller records them in the expert-load metrics). A
 * float32 router (DeepSeek's) takes the normed input converted to float32 (bi_linear_f32: Router.c_logits); an
 * ungated shared expert (DeepSeek's) runs after the routed ones, its output added to theirs, as the block does.
 * DeepSeek's multi-head latent attention (ld_model.mla, models/deepseek.py) replaces the attention block of
 * every layer: see ld_mla_attention; its KV cache is one plane per layer (kv[2l] == kv[2l + 1]).
 * The kernels are the ones the torch path's layers call in default CPU mode, passed in as function
 * pointers into their own libraries (the very same machine code), and every tensor the torch path
 * holds is held here in the model dtype; the elementwise steps (bias, RoPE, residual adds) round each
 * result to the model dtype as torch's ops do (bf16: nearest even; float32: IEEE single operations,
 * no contraction: -std=c11 turns it off). So when the torch path's layers run these kernels, the two
 * paths give the same bits. The final norm and the LM head stay with the caller.
 *
 * Layouts (row-major): hidden [T, hidden] in the model dtype (in: the embeddings; out: the residual
 * stream after the last layer); the step's tokens and attention layout in an ld_batch (below);
 * kv[2 * l] / kv[2 * l + 1] the K / V cache of layer l, [num_blocks, block_size, kv_heads, head_dim] in
 * the model dtype. No SIMD here: the ISA paths are the kernels' (tokenmill/csrc_build.py).
 * Built at run time by tokenmill/runner/lean_decode.py; tests/test_lean_decode.py holds it to the torch path.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define LD_MAX_SEGMENTS 4

/* The kernels' exported signatures (qg_linear, bi_rms_norm_*, silu_and_mul_*, paged_decode_*). */
typedef int (*ld_qlinear_fn)(int qtype, const uint8_t* w, int64_t N, int64_t K, const void* x, int x_bf16, int64_t M,
                             void* y, int y_bf16, int64_t ldy, int num_threads);
typedef int (*ld_qlinear_bf16_fn)(int qtype, const uint8_t* w, int64_t N, int64_t K, const uint16_t* x, int64_t M,
                                  void* y, int y_bf16, int64_t ldy, int num_threads);
typedef void (*ld_rms_norm_fn)(const void* x, const void* w, void* y, int64_t M, int64_t H, float eps, int num_threads);
typedef void (*ld_silu_and_mul_fn)(const void* x, void* out, int64_t M, int64_t I, int num_threads);
typedef void (*ld_attention_fn)(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_table,
                                const int64_t* seq_lens, void* out, int num_seqs, int num_heads, int num_kv_heads,
                                int head_dim, int block_size, int max_blocks, float scale, int window, float softcap,
                                int num_threads);

typedef int (*ld_prefill_fn)(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_table,
                             int max_blocks, const int64_t* q_start, const int64_t* q_len, const int64_t* ctx_len,
                             int num_spans, void* out, int num_heads, int num_kv_heads, int head_dim, int block_size,
                             float scale, int window, float softcap, int num_threads);

/* The MoE kernels (tokenmill/moe/csrc/moe_step.c's me_step and me_route) and the dense C GEMM the router's
 * Linear runs (batch_invariant.c's bi_linear_*), for MoE layers run here (ld_layer.moe_in_c). */
typedef int (*ld_moe_step_fn)(const void* model, const void* tables, const void* x, int64_t T, int64_t k,
                              const int64_t* ids, const float* w, void* out, int num_threads, int expert_parallel);
typedef int (*ld_moe_route_fn)(const void* logits, int bf16, int64_t T, int64_t E, int64_t k, int norm_topk,
                               int softmax_after_topk, float* weights, int64_t* ids);
typedef void (*ld_dense_linear_fn)(const void* x, const void* w, const void* bias, void* y, int64_t M, int64_t N,
                                   int64_t K, int num_threads);
/* batch_invariant.c's bi_linear_heads_* (MLA's absorbed per-head products) */
typedef void (*ld_linear_heads_fn)(const void* x, const void* w, void* y, int64_t H, int64_t M, int64_t N, int64_t K,
                                   int64_t w_head_stride, int num_threads);

typedef struct {
    ld_qlinear_fn qlinear;
    ld_rms_norm_fn rms_norm;            /* the model dtype's variant */
    ld_silu_and_mul_fn silu_and_mul;
    ld_attention_fn attention;
    ld_qlinear_bf16_fn qlinear_bf16;    /* qg_linear_bf16 (AMX bf16 tiles; -2 where it does not apply), or NULL */
    ld_prefill_fn prefill;              /* paged_prefill_* (the model dtype's), or NULL: no prompt chunks */
    ld_moe_step_fn moe_step;            /* or NULL (no MoE layer runs here) */
    ld_moe_route_fn moe_route;
    ld_dense_linear_fn dense_linear;    /* bi_linear_* of the model dtype */
    ld_dense_linear_fn dense_linear_f32; /* bi_linear_f32 (a float32 router: DeepSeek's), or NULL */
    ld_linear_heads_fn linear_heads;    /* bi_linear_heads_* of the model dtype (MLA layers), or NULL */
} ld_kernels;

typedef struct {
    int32_t num_segments;
    int32_t qtype[LD_MAX_SEGMENTS];
    int64_t rows[LD_MAX_SEGMENTS];           /* output rows of each segment, stacked in order */
    const uint8_t* data[LD_MAX_SEGMENTS];    /* [rows, row bytes] GGUF blocks */
    const void* bias;                        /* [sum(rows)] in the model dtype, or NULL */
} ld_linear;

typedef struct {
    const void* input_norm;  /* [hidden] model dtype */
    const void* post_norm;   /* [hidden] */
    const void* q_norm;      /* [head_dim] or NULL (Qwen3's per-head norms) */
    const void* k_norm;
    ld_linear qkv, o, gate_up, down;        /* gate_up, down: unused (empty) where mlp_external */
    int64_t sliding_window;  /* the layer's window (a query at p sees keys p - window < j <= p), or 0: none */
    int32_t qk_norm_whole;   /* q_norm [H * D] over the whole q projection, k_norm [KVH * D] over k (OLMoE) */
    int32_t mlp_external;    /* the caller runs this layer's feed-forward (see the top of the file) */
    /* An external MoE block this step may run itself (when ld_model.moe_c is set): router, routing, experts. */
    int32_t moe_in_c;
    int32_t norm_topk, softmax_after_topk;
    int64_t num_experts, top_k;
    int64_t moe_slot;        /* its row of ld_model.moe_counts */
    const void* moe_model;   /* the experts (moe_step.c's me_model) */
    ld_linear router_q;      /* the router [E, hidden] as GGUF blocks, or num_segments 0 and: */
    const void* router;      /* [E, hidden] in the model dtype (the dense C GEMM), float32 when router_f32 */
    int32_t router_f32;      /* logits = float(xn) @ Wrouter^T in float32 (DeepSeek) */
    ld_linear shared_gate_up, shared_down; /* an ungated shared expert beside the routed ones, or num_segments 0 */
    /* multi-head latent attention (ld_model.mla): qkv holds q_proj (or q_b_proj after q_a) */
    ld_linear q_a, kv_a;     /* q_a_proj (num_segments 0: none, V2-Lite), kv_a_proj_with_mqa [r + rope, hidden] */
    const void* q_a_norm;    /* [q_lora_rank] */
    const void* kv_a_norm;   /* [r] */
    const void* w_uk_t;      /* W_UK^T [H, r, qk_nope] contiguous */
    const void* w_uv;        /* W_UV [H, v, r]: each head a contiguous slab, uv_stride elements apart */
    int64_t uv_stride;
} ld_layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t block_size, max_position;
    float eps, scale;
    int32_t bf16;              /* model dtype: 1 bfloat16, 0 float32 */
    const float* cos_sin;      /* [max_position, head_dim]: cos half | sin half, float32 */
    const ld_layer* layers;    /* [num_layers] */
    ld_kernels kernels;
    int32_t moe_c;             /* this step: run the moe_in_c layers' blocks here (else they end a range) */
    const void* moe_tables;    /* the experts' plan tables for me_step (moe_step.c's me_tables) */
    int64_t* moe_counts;       /* [MoE layers here, moe_counts_stride] tokens per expert of this step, added to */
    int64_t moe_counts_stride; /* >= every moe_in_c layer's num_experts */
    /* Multi-head latent attention (DeepSeek-V2/V3, models/deepseek.py), every layer: head_dim is the cached
     * vector's width r + qk_rope (one KV head; kv[2l] == kv[2l + 1], the layer's one plane), cos_sin rows are
     * qk_rope wide. */
    int32_t mla;
    int32_t rope_interleave;   /* the rope dims are (x0, x1) pairs, rotated as evens | odds */
    int64_t kv_lora_rank, qk_nope, qk_rope, v_head, q_lora_rank;
    float latent_eps;          /* q_a_layernorm's and kv_a_layernorm's eps */
} ld_model;

/* A step's T tokens and how they attend (the runner's AttentionMetadata, vLLM's vocabulary): Bd decode
 * queries (one token each) and P prompt chunks (spans of consecutive tokens). Every token is one decode
 * query or in one span. */
typedef struct {
    int64_t num_tokens;                 /* T */
    const int64_t* positions;           /* [T] each token's position in its sequence */
    const int64_t* slot_mapping;        /* [T] where its K/V go: block_id * block_size + offset */
    int64_t num_decodes;                /* Bd */
    const int64_t* decode_idx;          /* [Bd] token index of each decode query; NULL: query b is token b
                                         * (or Bd == 0) */
    const int64_t* block_table;         /* [Bd, max_blocks] the decode queries' block ids */
    int64_t max_blocks;
    const int64_t* seq_lens;            /* [Bd] keys each decode query attends to */
    int64_t num_prefills;               /* P */
    const int64_t* q_start;             /* [P] first token of each span */
    const int64_t* q_len;               /* [P] its query tokens */
    const int64_t* ctx_len;             /* [P] its keys after this step (cached prefix + the chunk) */
    const int64_t* prefill_table;       /* [P, prefill_max_blocks] the spans' block ids */
    int64_t prefill_max_blocks;
    int64_t num_blocks;                 /* blocks in each layer's K/V cache: every id used is below it */
} ld_batch;

/* A float as the model dtype holds it (bf16: round to nearest even; float32: unchanged). */
static inline float rnd(float x, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(x)) : x; }
static inline float ld_load(const void* p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}
static inline void ld_store(void* p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t*)p)[i] = f32_to_bf16(v); else ((float*)p)[i] = v;
}

static int64_t ld_linear_out(const ld_linear* L) {
    int64_t n = 0;
    for (int s = 0; s < L->num_segments; s++) n += L->rows[s];
    return n;
}

/* y [M, N] (model dtype) = x [M, K] @ W^T (+ bias): each segment into its column range, as
 * GGUFWeight.matmul does (on AMX bf16 tiles when amx is set and the model is bf16, a segment the bf16
 * product does not take on the int8 kernel), then y += bias rounded to the dtype. Returns qg_linear's code. */
static int ld_linear_run(const ld_model* m, const ld_linear* L, const void* x, int64_t M, int64_t K, void* y,
                         int num_threads, int amx) {
    const int bf16 = m->bf16;
    const size_t elt = bf16 ? 2 : 4;
    const int64_t N = ld_linear_out(L);
    int64_t col = 0;
    for (int s = 0; s < L->num_segments; s++) {
        int rc = -2;
        if (amx && bf16 && m->kernels.qlinear_bf16)
            rc = m->kernels.qlinear_bf16(L->qtype[s], L->data[s], L->rows[s], K, (const uint16_t*)x, M,
                                         (char*)y + col * elt, bf16, N, num_threads);
        if (rc == -2)
            rc = m->kernels.qlinear(L->qtype[s], L->data[s], L->rows[s], K, x, bf16, M, (char*)y + col * elt,
                                    bf16, N, num_threads);
        if (rc != 0) return rc;
        col += L->rows[s];
    }
    if (L->bias)
        for (int64_t i = 0; i < M; i++)
            for (int64_t n = 0; n < N; n++)
                ld_store(y, i * N + n, ld_load(y, i * N + n, bf16) + ld_load(L->bias, n, bf16), bf16);
    return 0;
}

/* In-place rotate-half RoPE of n_heads heads [n_heads, D] (model dtype) at the cache row cs (cos | sin,
 * float32), as layers/rotary_embedding.py: cos/sin cast to the dtype, then [x1 c - x2 s, x2 c + x1 s]
 * with every product and sum rounded to the dtype. */
static void ld_rope(void* x, int64_t n_heads, int64_t D, const float* cs, int bf16) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < n_heads; h++)
        for (int64_t i = 0; i < half; i++) {
            const int64_t i1 = h * D + i, i2 = i1 + half;
            const float c = rnd(cs[i], bf16), s = rnd(cs[half + i], bf16);
            const float x1 = ld_load(x, i1, bf16), x2 = ld_load(x, i2, bf16);
            const float a = rnd(x1 * c, bf16), b = rnd(x2 * s, bf16);
            const float e = rnd(x2 * c, bf16), f = rnd(x1 * s, bf16);
            ld_store(x, i1, a - b, bf16);
            ld_store(x, i2, e + f, bf16);
        }
}

/* h[i] = h[i] + y[i] (h.add_ of the torch path: y + h rounded to the dtype). */
static void ld_residual(void* h, const void* y, int64_t n, int bf16) {
    for (int64_t i = 0; i < n; i++) ld_store(h, i, ld_load(y, i, bf16) + ld_load(h, i, bf16), bf16);
}

/* Whether block ids [0, used) of a table row are inside the pool. */
static int ld_blocks_ok(const int64_t* row, int64_t used, int64_t num_blocks) {
    for (int64_t i = 0; i < used; i++)
        if (row[i] < 0 || row[i] >= num_blocks) return 0;
    return 1;
}

/* Whether a step's layout is one ld_step takes: positions inside the RoPE cache, slots and the block ids
 * the step reads inside the pool, decode queries within their block tables, spans inside the step and
 * their tables, and every token a decode query or in a span exactly once. */
static int ld_batch_ok(const ld_model* m, const ld_batch* s) {
    const int64_t T = s->num_tokens, bs = m->block_size;
    if (T < 1 || s->num_decodes < 0 || s->num_prefills < 0 || s->num_blocks < 1) return 0;
    for (int64_t t = 0; t < T; t++)
        if (s->positions[t] < 0 || s->positions[t] >= m->max_position || s->slot_mapping[t] < 0 ||
            s->slot_mapping[t] >= s->num_blocks * bs) return 0;
    if (s->decode_idx == NULL && s->num_decodes != T && s->num_decodes != 0) return 0;
    if (s->num_prefills && !m->kernels.prefill) return 0;
    for (int64_t b = 0; b < s->num_decodes; b++) {
        if (s->seq_lens[b] < 1 || s->seq_lens[b] > s->max_blocks * bs) return 0;
        if (s->decode_idx && (s->decode_idx[b] < 0 || s->decode_idx[b] >= T)) return 0;
        if (!ld_blocks_ok(s->block_table + b * s->max_blocks, (s->seq_lens[b] + bs - 1) / bs, s->num_blocks)) return 0;
    }
    for (int64_t p = 0; p < s->num_prefills; p++) {
        if (s->q_len[p] < 1 || s->q_start[p] < 0 || s->q_start[p] + s->q_len[p] > T || s->ctx_len[p] < s->q_len[p] ||
            s->ctx_len[p] > s->prefill_max_blocks * bs) return 0;
        if (!ld_blocks_ok(s->prefill_table + p * s->prefill_max_blocks, (s->ctx_len[p] + bs - 1) / bs, s->num_blocks))
            return 0;
    }
    if (s->decode_idx == NULL && s->num_prefills == 0) return 1; /* decode-only: query b is token b */
    unsigned char* seen = calloc((size_t)T, 1);
    int ok = seen != NULL;
    for (int64_t b = 0; ok && b < s->num_decodes; b++) ok = seen[s->decode_idx ? s->decode_idx[b] : b]++ == 0;
    for (int64_t p = 0; ok && p < s->num_prefills; p++)
        for (int64_t t = s->q_start[p]; ok && t < s->q_start[p] + s->q_len[p]; t++) ok = seen[t]++ == 0;
    for (int64_t t = 0; ok && t < T; t++) ok = seen[t] == 1;
    free(seen);
    return ok;
}

/* The decode queries' and prompt spans' attention of one layer: q [T, H * D] (the step's tokens in order) ->
 * out [T, H * D], the decode queries through the paged decode kernel (gathered into dq [2 * Bd, H * D] first
 * unless they are the step's tokens in order), the spans through the paged prefill kernel. Returns 0, or -1 when
 * the prefill kernel refuses its shapes. */
static int ld_attend(const ld_model* m, const ld_batch* s, const char* q, const void* k_cache, const void* v_cache,
                     char* out, char* dq, int64_t H, int64_t KVH, int64_t D, int window, int num_threads) {
    const size_t elt = m->bf16 ? 2 : 4;
    const int64_t Bd = s->num_decodes, q_size = H * D;
    const ld_kernels* k = &m->kernels;
    if (Bd > 0 && s->decode_idx == NULL) {
        k->attention(q, k_cache, v_cache, s->block_table, s->seq_lens, out, (int)Bd, (int)H, (int)KVH, (int)D,
                     (int)m->block_size, (int)s->max_blocks, m->scale, window, 0.0f, num_threads);
    } else if (Bd > 0) {
        char* dout = dq + elt * (size_t)(Bd * q_size);
        for (int64_t b = 0; b < Bd; b++)
            memcpy(dq + elt * (size_t)(b * q_size), q + elt * (size_t)(s->decode_idx[b] * q_size), elt * (size_t)q_size);
        k->attention(dq, k_cache, v_cache, s->block_table, s->seq_lens, dout, (int)Bd, (int)H, (int)KVH, (int)D,
                     (int)m->block_size, (int)s->max_blocks, m->scale, window, 0.0f, num_threads);
        for (int64_t b = 0; b < Bd; b++)
            memcpy(out + elt * (size_t)(s->decode_idx[b] * q_size), dout + elt * (size_t)(b * q_size),
                   elt * (size_t)q_size);
    }
    if (s->num_prefills > 0 &&
        k->prefill(q, k_cache, v_cache, s->prefill_table, (int)s->prefill_max_blocks, s->q_start, s->q_len, s->ctx_len,
                   (int)s->num_prefills, out, (int)H, (int)KVH, (int)D, (int)m->block_size, m->scale, window, 0.0f,
                   num_threads) != 0) return -1;
    return 0;
}

/* n rope parts (R wide, src_stride elements apart) roped at the cache row cs into dst (dst_stride apart), as
 * models/deepseek.py's LatentAttention._rope: interleaved pairs first taken apart into evens | odds, then the
 * rotate-half RoPE of ld_rope. */
static void ld_rope_parts(const char* src, int64_t src_stride, char* dst, int64_t dst_stride, int64_t n, int64_t R,
                          const float* cs, int interleave, int bf16) {
    const size_t elt = bf16 ? 2 : 4;
    for (int64_t i = 0; i < n; i++) {
        const char* a = src + elt * (size_t)(i * src_stride);
        char* d = dst + elt * (size_t)(i * dst_stride);
        if (interleave) {
            for (int64_t j = 0; j < R / 2; j++) {
                memcpy(d + elt * (size_t)j, a + elt * (size_t)(2 * j), elt);
                memcpy(d + elt * (size_t)(R / 2 + j), a + elt * (size_t)(2 * j + 1), elt);
            }
        } else {
            memmove(d, a, elt * (size_t)R);
        }
        ld_rope(d, 1, R, cs, bf16);
    }
}

#define LD_PREFILL_REFUSED (-1000) /* the prefill kernel refused its shapes (not a product's code) */

/* Scratch of an MLA layer (ld_mla_attention), sized for the step's tokens. */
typedef struct {
    char *qa, *qan, *q, *lat, *qn, *qabs, *qbuf, *aout, *ol, *vals, *oin;
} ld_mla_scratch;

/* Multi-head latent attention of one layer (models/deepseek.py's LatentAttention.forward, in its order and with
 * its roundings) over xn = RMSNorm(h) [T, hidden]:
 *   q = q_proj(xn), or q_b_proj(RMSNorm(q_a_proj(xn)))                    [T, H, nope + rope]
 *   c_kv | k_pe = kv_a_proj_with_mqa(xn); c_kv = RMSNorm(c_kv)             [T, r], [T, rope]
 *   the plane's slot of each token = c_kv | RoPE(k_pe)
 *   query = (q_nope · W_UK per head, bi_linear_heads) | RoPE(q_pe)         [T, H, r + rope]
 *   a = attention of query over the plane (one KV head, D = r + rope)      [T, H, r + rope]
 *   values = a[..., :r] · W_UV^T per head (bi_linear_heads)                -> x.oin [T, H * v]
 * Returns 0, a product's code, or LD_PREFILL_REFUSED. */
static int ld_mla_attention(const ld_model* m, const ld_layer* L, const ld_batch* s, char* plane, const char* xn,
                            const ld_mla_scratch* x, char* dq, int num_threads, int amx) {
    const int bf16 = m->bf16;
    const size_t elt = bf16 ? 2 : 4;
    const int64_t B = s->num_tokens, Hd = m->hidden, H = m->num_heads, r = m->kv_lora_rank, R = m->qk_rope;
    const int64_t nope = m->qk_nope, qh = nope + R, D = r + R, v = m->v_head;
    const ld_kernels* k = &m->kernels;
    int rc;
    if (L->q_a.num_segments) {
        if ((rc = ld_linear_run(m, &L->q_a, xn, B, Hd, x->qa, num_threads, amx))) return rc;
        k->rms_norm(x->qa, L->q_a_norm, x->qan, B, m->q_lora_rank, m->latent_eps, num_threads);
        if ((rc = ld_linear_run(m, &L->qkv, x->qan, B, m->q_lora_rank, x->q, num_threads, amx))) return rc;
    } else if ((rc = ld_linear_run(m, &L->qkv, xn, B, Hd, x->q, num_threads, amx))) {
        return rc;
    }
    if ((rc = ld_linear_run(m, &L->kv_a, xn, B, Hd, x->lat, num_threads, amx))) return rc;
    for (int64_t b = 0; b < B; b++) {
        const float* cs = m->cos_sin + s->positions[b] * R;
        char* slot = plane + elt * (size_t)(s->slot_mapping[b] * D);
        const char* lat = x->lat + elt * (size_t)(b * D);
        k->rms_norm(lat, L->kv_a_norm, slot, 1, r, m->latent_eps, num_threads);
        ld_rope_parts(lat + elt * (size_t)r, 0, slot + elt * (size_t)r, 0, 1, R, cs, m->rope_interleave, bf16);
        const char* qb = x->q + elt * (size_t)(b * H * qh);
        ld_rope_parts(qb + elt * (size_t)nope, qh, x->qbuf + elt * (size_t)(b * H * D + r), D, H, R, cs,
                      m->rope_interleave, bf16);
        for (int64_t h = 0; h < H; h++) /* q_nope by head: [H, T, nope] */
            memcpy(x->qn + elt * (size_t)((h * B + b) * nope), qb + elt * (size_t)(h * qh), elt * (size_t)nope);
    }
    k->linear_heads(x->qn, L->w_uk_t, x->qabs, H, B, r, nope, r * nope, num_threads); /* [H, T, r] */
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            memcpy(x->qbuf + elt * (size_t)((b * H + h) * D), x->qabs + elt * (size_t)((h * B + b) * r),
                   elt * (size_t)r);
    if (ld_attend(m, s, x->qbuf, plane, plane, x->aout, dq, H, 1, D, 0, num_threads)) return LD_PREFILL_REFUSED;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            memcpy(x->ol + elt * (size_t)((h * B + b) * r), x->aout + elt * (size_t)((b * H + h) * D), elt * (size_t)r);
    k->linear_heads(x->ol, L->w_uv, x->vals, H, B, v, r, L->uv_stride, num_threads); /* [H, T, v] */
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            memcpy(x->oin + elt * (size_t)((b * H + h) * v), x->vals + elt * (size_t)((h * B + b) * v),
                   elt * (size_t)v);
    return 0;
}

/* Whether the MoE kernels a moe_in_c layer needs are there. */
static int k_ok(const ld_model* m) {
    return m->kernels.moe_step && m->kernels.moe_route && m->kernels.dense_linear && m->moe_tables && m->moe_counts;
}

/* One step of layers [first, last) for the T tokens of ``s`` (see the top of the file). Every layer but the
 * last must run its own MLP; when the last one is mlp_external, its post-attention RMSNorm(h) goes to xn_out
 * [T, hidden] and its MLP block is left to the caller. Returns 0; -1 for a bad argument (a layout ld_batch_ok
 * refuses, an odd head_dim, a layer of the wrong shape, a range that does not end where it must, no xn_out
 * for an external MLP), checked before anything is written, or the prefill kernel refusing its shapes
 * (head_dim not a multiple of its vector width: the layer's KV rows are then written, with the values the
 * torch path writes); -2 when memory cannot be allocated (here, or inside a product: the KV rows of the layers
 * before may then hold this step's values); -3 when a MoE layer's experts would take another path in the plan
 * (the caller runs the step on the torch path, which rewrites the KV rows with the same values). */
int ld_step_range(const ld_model* m, const ld_batch* s, void* const* kv, void* hidden, void* xn_out, int64_t first,
                  int64_t last, int num_threads, int amx_bf16) {
    const int bf16 = m->bf16;
    const size_t elt = bf16 ? 2 : 4;
    const int64_t Hd = m->hidden, H = m->num_heads, KVH = m->num_kv_heads, D = m->head_dim, I = m->intermediate;
    const int64_t q_size = H * D, kv_size = KVH * D, nqkv = q_size + 2 * kv_size;
    const int64_t B = s->num_tokens, Bd = s->num_decodes;
    if (D % 2 || first < 0 || last > m->num_layers || first >= last || !ld_batch_ok(m, s)) return -1;
    int64_t max_e = 0, max_k = 0; /* the widest MoE layer run here: routing scratch */
    const int64_t qh = m->qk_nope + m->qk_rope; /* MLA: a head's query before absorption */
    if (m->mla && (KVH != 1 || D != m->kv_lora_rank + m->qk_rope || m->qk_rope % 2 || m->qk_nope < 1 ||
                   m->kv_lora_rank < 1 || m->v_head < 1 || !m->kernels.linear_heads)) return -1;
    int64_t inter = I; /* the widest MLP run here (a shared expert's included): gate_up / act scratch */
    for (int64_t l = first; l < last; l++) {
        const ld_layer* L = &m->layers[l];
        if (m->mla ? (ld_linear_out(&L->qkv) != H * qh || ld_linear_out(&L->kv_a) != D ||
                      ld_linear_out(&L->o) != Hd || L->sliding_window != 0 || !L->kv_a_norm || !L->w_uk_t ||
                      !L->w_uv || L->uv_stride < m->v_head * m->kv_lora_rank ||
                      (m->q_lora_rank > 0) != (L->q_a.num_segments > 0) ||
                      (L->q_a.num_segments && (ld_linear_out(&L->q_a) != m->q_lora_rank || !L->q_a_norm)))
                   : (ld_linear_out(&L->qkv) != nqkv || ld_linear_out(&L->o) != Hd || L->sliding_window < 0 ||
                      L->sliding_window > INT32_MAX)) return -1;
        const int in_c = L->mlp_external && L->moe_in_c && m->moe_c;
        if (in_c ? (L->top_k < 1 || L->top_k > L->num_experts || L->num_experts > m->moe_counts_stride || !k_ok(m) ||
                    (L->router_q.num_segments ? ld_linear_out(&L->router_q) != L->num_experts : L->router == NULL) ||
                    (L->router_f32 && (L->router_q.num_segments || !m->kernels.dense_linear_f32)) ||
                    (L->shared_gate_up.num_segments &&
                     (ld_linear_out(&L->shared_gate_up) % 2 || ld_linear_out(&L->shared_down) != Hd)))
                 : L->mlp_external ? (l != last - 1 || xn_out == NULL)
                                   : (ld_linear_out(&L->gate_up) != 2 * I || ld_linear_out(&L->down) != Hd)) return -1;
        if (in_c) {
            if (L->num_experts > max_e) max_e = L->num_experts;
            if (L->top_k > max_k) max_k = L->top_k;
            if (L->shared_gate_up.num_segments && ld_linear_out(&L->shared_gate_up) / 2 > inter)
                inter = ld_linear_out(&L->shared_gate_up) / 2;
        }
    }
    /* decode queries gathered into rows of their own (and their outputs scattered back) unless they are
     * the step's tokens in order */
    const int gather = s->decode_idx != NULL && Bd > 0;
    /* (MLA layers use xn for the normed input only, qkv for a shared expert's output, and their own scratch) */
    const int64_t wide = m->mla ? Hd : Hd > q_size ? Hd : q_size;
    char* xn = malloc(elt * (size_t)(B * wide));            /* normed input / attention output */
    char* qkv = malloc(elt * (size_t)(B * (m->mla ? Hd : nqkv > Hd ? nqkv : Hd))); /* also a shared expert's output */
    char* q = malloc(elt * (size_t)(m->mla ? 1 : B * (q_size + kv_size))); /* q | k per row (norms, RoPE) */
    char* attn = malloc(elt * (size_t)(m->mla ? 1 : B * q_size));
    char* out = malloc(elt * (size_t)(B * Hd));
    char* gu = malloc(elt * (size_t)(B * 2 * inter));
    char* act = malloc(elt * (size_t)(B * inter));
    char* dq = gather ? malloc(elt * (size_t)(2 * Bd * q_size)) : NULL; /* gathered decode queries | outputs */
    char* logits = max_e ? malloc(4 * (size_t)(B * max_e)) : NULL;   /* MoE routing (float32 at most) */
    float* rw = max_e ? malloc(sizeof(float) * (size_t)(B * max_k)) : NULL;
    int64_t* rid = max_e ? malloc(sizeof(int64_t) * (size_t)(B * max_k)) : NULL;
    float* xf = max_e ? malloc(sizeof(float) * (size_t)(B * Hd)) : NULL; /* float32 router input */
    ld_mla_scratch mx = {0};
    char* mla_buf = NULL;
    if (m->mla) { /* one allocation, carved up */
        const int64_t r = m->kv_lora_rank, ql = m->q_lora_rank > 0 ? m->q_lora_rank : 0, v = m->v_head;
        const int64_t sizes[11] = {B * ql, B * ql, B * H * qh, B * D, H * B * m->qk_nope, H * B * r, B * H * D,
                                   B * H * D, H * B * r, H * B * v, B * H * v};
        char** slots[11] = {&mx.qa, &mx.qan, &mx.q, &mx.lat, &mx.qn, &mx.qabs, &mx.qbuf, &mx.aout, &mx.ol, &mx.vals,
                            &mx.oin};
        size_t total = 0;
        for (int i = 0; i < 11; i++) total += (elt * (size_t)sizes[i] + 63) / 64 * 64;
        mla_buf = malloc(total);
        if (mla_buf) {
            size_t at = 0;
            for (int i = 0; i < 11; i++) {
                *slots[i] = mla_buf + at;
                at += (elt * (size_t)sizes[i] + 63) / 64 * 64;
            }
        }
    }
    int rc = 0;
    if (!xn || !qkv || !q || !attn || !out || !gu || !act || (gather && !dq) ||
        (max_e && (!logits || !rw || !rid || !xf)) || (m->mla && !mla_buf)) {
        rc = -2;
        goto done;
    }
    const ld_kernels* k = &m->kernels;
    for (int64_t l = first; l < last && rc == 0; l++) {
        const ld_layer* L = &m->layers[l];
        char* k_cache = kv[2 * l];
        char* v_cache = kv[2 * l + 1];
        const int window = (int)L->sliding_window;
        /* attention block */
        k->rms_norm(hidden, L->input_norm, xn, B, Hd, m->eps, num_threads);
        if (m->mla) { /* latent attention: the plane is kv[2l] (== kv[2l + 1]) */
            if ((rc = ld_mla_attention(m, L, s, k_cache, xn, &mx, dq, num_threads, amx_bf16))) {
                if (rc == LD_PREFILL_REFUSED) { rc = -1; goto done; }
                break;
            }
            if ((rc = ld_linear_run(m, &L->o, mx.oin, B, H * m->v_head, out, num_threads, amx_bf16))) break;
            ld_residual(hidden, out, B * Hd, bf16);
            goto mlp;
        }
        if ((rc = ld_linear_run(m, &L->qkv, xn, B, Hd, qkv, num_threads, amx_bf16))) break;
        for (int64_t b = 0; b < B; b++) { /* q | k of row b, contiguous: [H + KVH, D] */
            char* src = qkv + elt * (size_t)(b * nqkv);
            char* qb = q + elt * (size_t)(b * (q_size + kv_size));
            if (L->q_norm && L->qk_norm_whole) { /* OLMoE: one RMSNorm over all of q, one over all of k */
                k->rms_norm(src, L->q_norm, qb, 1, q_size, m->eps, num_threads);
                k->rms_norm(src + elt * (size_t)q_size, L->k_norm, qb + elt * (size_t)q_size, 1, kv_size, m->eps,
                            num_threads);
            } else if (L->q_norm) { /* Qwen3: RMSNorm over head_dim, per q head and per k head */
                k->rms_norm(src, L->q_norm, qb, H, D, m->eps, num_threads);
                k->rms_norm(src + elt * (size_t)q_size, L->k_norm, qb + elt * (size_t)q_size, KVH, D, m->eps,
                            num_threads);
            } else {
                memcpy(qb, src, elt * (size_t)(q_size + kv_size));
            }
        }
        for (int64_t b = 0; b < B; b++) {
            char* qb = q + elt * (size_t)(b * (q_size + kv_size));
            ld_rope(qb, H + KVH, D, m->cos_sin + s->positions[b] * D, bf16);
            memcpy(attn + elt * (size_t)(b * q_size), qb, elt * (size_t)q_size); /* rotated q, for attention */
            const size_t slot = elt * (size_t)(s->slot_mapping[b] * kv_size);
            memcpy(k_cache + slot, qb + elt * (size_t)q_size, elt * (size_t)kv_size);
            memcpy(v_cache + slot, qkv + elt * (size_t)(b * nqkv + q_size + kv_size), elt * (size_t)kv_size);
        }
        /* attention: xn [T, q_size] */
        if (ld_attend(m, s, attn, k_cache, v_cache, xn, dq, H, KVH, D, window, num_threads)) { rc = -1; goto done; }
        if ((rc = ld_linear_run(m, &L->o, xn, B, q_size, out, num_threads, amx_bf16))) break;
        ld_residual(hidden, out, B * Hd, bf16);
    mlp: /* MLP block */
        if (L->mlp_external && L->moe_in_c && m->moe_c) { /* the MoE block, as its module runs it */
            const int64_t E = L->num_experts, K = L->top_k;
            k->rms_norm(hidden, L->post_norm, xn, B, Hd, m->eps, num_threads);
            if (L->router_q.num_segments) {
                if ((rc = ld_linear_run(m, &L->router_q, xn, B, Hd, logits, num_threads, amx_bf16))) break;
            } else if (L->router_f32) { /* float32 logits of float32 inputs (exact conversion) */
                for (int64_t i = 0; i < B * Hd; i++) xf[i] = ld_load(xn, i, bf16);
                k->dense_linear_f32(xf, L->router, NULL, logits, B, E, Hd, num_threads);
            } else {
                k->dense_linear(xn, L->router, NULL, logits, B, E, Hd, num_threads);
            }
            if ((rc = k->moe_route(logits, bf16 && !L->router_f32, B, E, K, L->norm_topk, L->softmax_after_topk, rw,
                                   rid))) break;
            for (int64_t i = 0; i < B * K; i++) m->moe_counts[L->moe_slot * m->moe_counts_stride + rid[i]]++;
            rc = k->moe_step(L->moe_model, m->moe_tables, xn, B, K, rid, rw, out, num_threads, 2);
            if (rc == -3) goto done; /* the plan puts some expert's rows on the torch path: the caller's */
            if (rc) break;
            if (L->shared_gate_up.num_segments) { /* out = out + shared_expert(xn), as the block adds it */
                const int64_t Is = ld_linear_out(&L->shared_gate_up) / 2;
                if ((rc = ld_linear_run(m, &L->shared_gate_up, xn, B, Hd, gu, num_threads, amx_bf16))) break;
                k->silu_and_mul(gu, act, B, Is, num_threads);
                if ((rc = ld_linear_run(m, &L->shared_down, act, B, Is, qkv, num_threads, amx_bf16))) break;
                ld_residual(out, qkv, B * Hd, bf16);
            }
            ld_residual(hidden, out, B * Hd, bf16);
            continue;
        }
        if (L->mlp_external) { /* the caller's: its input, RMSNorm(h) */
            k->rms_norm(hidden, L->post_norm, xn_out, B, Hd, m->eps, num_threads);
            break;
        }
        k->rms_norm(hidden, L->post_norm, xn, B, Hd, m->eps, num_threads);
        if ((rc = ld_linear_run(m, &L->gate_up, xn, B, Hd, gu, num_threads, amx_bf16))) break;
        k->silu_and_mul(gu, act, B, I, num_threads);
        if ((rc = ld_linear_run(m, &L->down, act, B, I, out, num_threads, amx_bf16))) break;
        ld_residual(hidden, out, B * Hd, bf16);
    }
    if (rc != 0) rc = -2; /* a product refused: only an allocation inside the kernel can fail here */
done:
    free(xn); free(qkv); free(q); free(attn); free(out); free(gu); free(act); free(dq);
    free(logits); free(rw); free(rid); free(xf); free(mla_buf);
    return rc;
}

/* Every layer in one call (models whose layers all run their own MLP): ld_step_range over [0, num_layers). */
int ld_step(const ld_model* m, const ld_batch* s, void* const* kv, void* hidden, int num_threads, int amx_bf16) {
    return ld_step_range(m, s, kv, hidden, NULL, 0, m->num_layers, num_threads, amx_bf16);
}
