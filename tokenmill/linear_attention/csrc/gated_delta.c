/* Batch-invariant kernels of the Gated DeltaNet layer for deterministic mode (tokenmill/linear_attention).
 *
 * Every function computes each token (or row, or element) with one fixed sequence of float32 operations that
 * depends only on that token's own data and, for the recurrence, the state it starts from: loops run in a fixed
 * order, reductions sum in increasing index, transcendental functions are libm's scalar expf / log1pf for every
 * element, and the build disables FMA contraction (-ffp-contract=off). So a token's bits do not depend on how
 * many tokens or sequences share the call, or how a prompt is chunked. Threads (OpenMP) split sequences x heads
 * or rows, never a reduction, and only for calls with enough work (PARALLEL_WORK multiply-adds): a one-token
 * step of a few heads runs on the calling thread, with no fork/join.
 *
 * The recurrence is the gated delta rule (Yang, Kautz, Hatamizadeh 2024), per head with state S [Dk, Dv]:
 *     S <- exp(g) S;  w = beta (v - S^T k);  S <- S + k w^T;  o = S^T q
 */
#include <math.h>
#include <stdint.h>

#define PARALLEL_WORK (1 << 18)

/* q, k: [num_seqs * seq_len, H, Dk]; v, out: [num_seqs * seq_len, H, Dv]; g, beta: [num_seqs * seq_len, H];
 * state: [*, H, Dk, Dv], updated in place: sequence s (tokens s * seq_len .. (s + 1) * seq_len - 1) owns state
 * row slots[s], or row s when slots is NULL (the runner passes its whole pool and the step's slot ids). */
void gdn_recurrent_f32(const float *q, const float *k, const float *v, const float *g, const float *beta,
                       float *state, const int64_t *slots, float *out, int64_t num_seqs, int64_t seq_len,
                       int64_t heads, int64_t dk, int64_t dv) {
#pragma omp parallel for schedule(static) if (num_seqs * seq_len * heads * dk * dv >= PARALLEL_WORK)
    for (int64_t sh = 0; sh < num_seqs * heads; sh++) {
        int64_t s = sh / heads, h = sh % heads;
        float *S = state + ((slots ? slots[s] : s) * heads + h) * dk * dv;
        float pred[dv], w[dv];
        for (int64_t t = s * seq_len; t < (s + 1) * seq_len; t++) {
            const float *qt = q + (t * heads + h) * dk, *kt = k + (t * heads + h) * dk;
            const float *vt = v + (t * heads + h) * dv;
            float *ot = out + (t * heads + h) * dv;
            float decay = expf(g[t * heads + h]), b = beta[t * heads + h];
            for (int64_t i = 0; i < dk * dv; i++) S[i] *= decay;
            for (int64_t j = 0; j < dv; j++) pred[j] = 0.0f;
            for (int64_t i = 0; i < dk; i++)
                for (int64_t j = 0; j < dv; j++) pred[j] += S[i * dv + j] * kt[i];
            for (int64_t j = 0; j < dv; j++) w[j] = b * (vt[j] - pred[j]);
            for (int64_t i = 0; i < dk; i++)
                for (int64_t j = 0; j < dv; j++) S[i * dv + j] += kt[i] * w[j];
            for (int64_t j = 0; j < dv; j++) ot[j] = 0.0f;
            for (int64_t i = 0; i < dk; i++)
                for (int64_t j = 0; j < dv; j++) ot[j] += S[i * dv + j] * qt[i];
        }
    }
}

/* g = neg_a * softplus(a + dt_bias) (softplus(x) = x above 20, else log1p(exp(x)), as torch) and
 * beta = sigmoid(b), for a, b: [rows, heads]; neg_a = -exp(A_log), dt_bias: [heads]. */
void gdn_gates_f32(const float *a, const float *b, const float *neg_a, const float *dt_bias, float *g,
                   float *beta, int64_t rows, int64_t heads) {
#pragma omp parallel for schedule(static) if (rows * heads >= PARALLEL_WORK / 16)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            int64_t i = r * heads + h;
            float x = a[i] + dt_bias[h];
            float sp = x > 20.0f ? x : log1pf(expf(x));
            g[i] = neg_a[h] * sp;
            beta[i] = 1.0f / (1.0f + expf(-b[i]));
        }
}

/* out = x * sigmoid(x) (silu != 0) or sigmoid(x), elementwise over n floats. */
void gdn_sigmoid_f32(const float *x, float *out, int64_t n, int silu) {
#pragma omp parallel for schedule(static) if (n >= PARALLEL_WORK / 16)
    for (int64_t i = 0; i < n; i++) {
        float s = 1.0f / (1.0f + expf(-x[i]));
        out[i] = silu ? x[i] * s : s;
    }
}

/* scale[r] = 1 / sqrt(sum_i x[r, i]^2 / (mean ? dim : 1) + eps) for x: [rows, dim], summed in increasing i. */
void gdn_row_inv_norm_f32(const float *x, float *scale, int64_t rows, int64_t dim, float eps, int mean) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_WORK)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float acc = 0.0f;
        for (int64_t i = 0; i < dim; i++) acc += xr[i] * xr[i];
        if (mean) acc = acc / (float)dim;
        scale[r] = 1.0f / sqrtf(acc + eps);
    }
}
