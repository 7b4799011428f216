/* Rotate-half rotary position embedding (RoPE) of a flat batch, in one pass over the rows.
 *
 * out[t, h, j]         = x1 * cos[t, j] - x2 * sin[t, j]
 * out[t, h, j + D / 2] = x2 * cos[t, j] + x1 * sin[t, j]      (x1 = x[t, h, j], x2 = x[t, h, j + D / 2])
 *
 * Layout: x row t starts at x + t * ldx and holds H heads of D contiguous elements (a column slice
 * of the fused QKV projection's output); cos and sin rows start at cos + t * ldc and sin + t * ldc
 * (D / 2 elements each); out is [T, H, D] contiguous. float32 or bfloat16 (bits as uint16).
 *
 * Same bits as torch's `torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)`: every product and
 * sum is one IEEE operation in that order (built with -ffp-contract=off, so no FMA fuses them), and in
 * bf16 each of the six results is rounded to bf16 as torch rounds each elementwise op's output. Rows
 * are split over the threads; an element's value depends on nothing but its inputs. Plain C that the
 * compiler vectorises for each ISA path of csrc_build.py.
 */
#include <stdint.h>

#include "bf16.h"

static inline float rb(float v) { return bf16_to_f32(f32_to_bf16(v)); } /* round to bf16, as a float */

void rope_f32(const float* x, int64_t ldx, const float* cos, const float* sin, int64_t ldc, float* out,
              int64_t T, int64_t H, int64_t D, int threads) {
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T > 1)
    for (int64_t t = 0; t < T; t++) {
        const float* c = cos + t * ldc;
        const float* s = sin + t * ldc;
        for (int64_t h = 0; h < H; h++) {
            const float* a = x + t * ldx + h * D;
            float* o = out + (t * H + h) * D;
            for (int64_t j = 0; j < half; j++) {
                const float x1 = a[j], x2 = a[j + half];
                o[j] = x1 * c[j] - x2 * s[j];
                o[j + half] = x2 * c[j] + x1 * s[j];
            }
        }
    }
}

void rope_bf16(const uint16_t* x, int64_t ldx, const uint16_t* cos, const uint16_t* sin, int64_t ldc,
               uint16_t* out, int64_t T, int64_t H, int64_t D, int threads) {
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T > 1)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t* c = cos + t * ldc;
        const uint16_t* s = sin + t * ldc;
        for (int64_t h = 0; h < H; h++) {
            const uint16_t* a = x + t * ldx + h * D;
            uint16_t* o = out + (t * H + h) * D;
            for (int64_t j = 0; j < half; j++) {
                const float x1 = bf16_to_f32(a[j]), x2 = bf16_to_f32(a[j + half]);
                const float cj = bf16_to_f32(c[j]), sj = bf16_to_f32(s[j]);
                o[j] = f32_to_bf16(rb(x1 * cj) - rb(x2 * sj));
                o[j + half] = f32_to_bf16(rb(x2 * cj) + rb(x1 * sj));
            }
        }
    }
}
