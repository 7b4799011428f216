/* AVX512_BF16 helpers shared by the attention kernels' VDPBF16PS paths (paged_decode.c, paged_prefill.c).
 * Include only where __AVX512BF16__ is defined (real or SIMDe-emulated builds).
 *
 * Pair layout: VDPBF16PS multiplies bf16 pairs, so a P.V product pairs two keys' value rows. VPUNPCKLWD /
 * VPUNPCKHWD of rows x and y interleave them inside each 128-bit lane: for the 32 dims 32j..32j+31 (one
 * 512-bit vector of each row), the "lo" result's 16 float lanes accumulate dims 32j + 8l + e and the "hi"
 * result's dims 32j + 8l + 4 + e (lane 4l + e, l and e in 0..3). An accumulator row of D floats laid out
 * as [lo, hi] per 32 dims holds dim tm_pair_dim(i) at index i. */
#ifndef TOKENMILL_BF16_PAIRS_H
#define TOKENMILL_BF16_PAIRS_H

#include <immintrin.h>
#include <stdint.h>

/* 32 bf16 values from any address, typed as VDPBF16PS's operand (a cast of _mm512_loadu_si512's result
 * made gcc 12 bounce every load through the stack). */
typedef short tm_bh_unaligned __attribute__((vector_size(64), aligned(2), may_alias));
static inline __m512bh tm_load_bh(const void* p) { return (__m512bh)(*(const tm_bh_unaligned*)p); }

/* 16 floats rounded to bf16 as f32_to_bf16 (bf16.h) rounds them (nearest even; NaN -> 0x7fc0), each in the
 * low 16 bits of its 32-bit lane. */
static inline __m512i tm_round_bf16_lanes(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc0));
}

/* The dim that index i of a pair-layout accumulator row holds (see above). */
static inline int tm_pair_dim(int i) {
    const int w = i & 31;
    return (i & ~31) + 8 * ((w & 15) >> 2) + 4 * (w >> 4) + (w & 3);
}

#endif /* TOKENMILL_BF16_PAIRS_H */
