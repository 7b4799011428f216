/* bfloat16 <-> float32 conversions shared by the CPU kernels (bf16 passed as its uint16 bits).
 * f32_to_bf16 rounds to nearest even as torch does (c10's round_to_nearest_even); any NaN becomes
 * the canonical quiet NaN 0x7fc0, whatever its sign or payload. */
#ifndef TOKENMILL_BF16_H
#define TOKENMILL_BF16_H

#include <stdint.h>

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    uint32_t u = v.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u; /* checked on the bits: -ffast-math cannot drop it */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#endif /* TOKENMILL_BF16_H */
