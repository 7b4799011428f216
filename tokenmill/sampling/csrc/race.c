/* Random sampling's exponential race over a step's probabilities, with its noise drawn here.
 *
 * out[b] = argmax_i probs[b, i] / E[b, i] with E[b, i] ~ Exp(1) independent: a draw from the row's
 * distribution (the race of exponential clocks: the token whose clock, of rate probs[b, i], rings
 * first). E = -log(1 - w) of a uniform w in (0, 1) that is a hash of the row's 64-bit seed and the
 * token index (counter-based, as Philox is for GPUs: Salmon et al., "Parallel random numbers: as easy
 * as 1, 2, 3", SC 2011), so a row's draw depends on its seed and probabilities only, never on the rest
 * of the batch, the thread count or the ISA path.
 *
 * The hash: two rounds of Wellons' "lowbias32" 32-bit integer mixer (hash-prospector, 2020), keyed by
 * the low and high halves of the seed; w = (h >> 1 + 1/2) 2^-31, in [2^-32, 1 - 2^-24] after rounding
 * to float32: never 0 (a noise of 0 would make its token win whatever its probability) and never 1.
 *
 * Only the tokens that can still win take a logarithm: -log(1 - w) >= w, so probs / E <= probs / w,
 * and a token with probs <= best * w cannot beat the best score so far. A block of 256 tokens first
 * computes its uniforms and that bound (a loop the compiler vectorises for each ISA path), and only
 * flagged tokens compute the exact score p / E, E = -log1p(-w) in double rounded to float32 (what the torch
 * fallback, sampler.race_noise_torch, computes from the same hash: the two paths draw the same tokens). On a
 * [64, 49152] step this replaces torch's drawing of 3 M float64 uniforms (one at a time), a float64
 * buffer and three elementwise passes.
 *
 * Ties go to the first index (torch.argmax's rule); a row holding a NaN gives its first NaN's index
 * (torch.argmax ranks NaN above every number); tokens of probability 0 never win unless all are 0 (then
 * token 0; rows are probabilities: no negative values). Seeds must already be mixed (position_seed's
 * SplitMix64 output): two raw seeds whose low halves differ by a multiple of 0x9E3779B9 give shifted
 * copies of one noise. The smallest noise is 2^-32, so a token below ~2^-33 of the leader's probability
 * is almost never drawn (total variation at most ~V 2^-33; torch's float64 uniforms reached ~1e-16).
 * Pruning stops where best * w could be subnormal (best < 2^-94), whose rounding the margin does not
 * cover. Rows run in parallel (OpenMP).
 */
#include <math.h>
#include <stdint.h>

#if !defined(TM_PORTABLE) && defined(__AVX512F__)
#define ISA_PATH "avx512"
#elif !defined(TM_PORTABLE) && defined(__AVX2__)
#define ISA_PATH "avx2"
#else
#define ISA_PATH "portable"
#endif

#define RACE_BLOCK 256

/* lowbias32: a bijective 32-bit mixer (Wellons, hash-prospector). */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

/* The uniform of token i in the stream keyed by (k1, k2): in [2^-32, 1 - 2^-24]. */
static inline float race_uniform(uint32_t k1, uint32_t k2, uint32_t i) {
    const uint32_t h = mix32(mix32(i * 0x9E3779B9U + k1) ^ k2);
    const float w = (float)(int32_t)(h >> 1) * 0x1p-31f + 0x1p-32f;
    return w < 0x1.fffffep-1f ? w : 0x1.fffffep-1f;
}

/* noise[i] = the E of token i < n under ``seed`` (what race_row compares against; tests). */
static inline float race_exp(float w) { return (float)-log1p(-(double)w); }

void race_noise(uint64_t seed, int64_t n, float* noise) {
    for (int64_t i = 0; i < n; i++) noise[i] = race_exp(race_uniform((uint32_t)seed, (uint32_t)(seed >> 32), (uint32_t)i));
}

static int64_t race_row(const float* p, int64_t n, uint64_t seed) {
    const uint32_t k1 = (uint32_t)seed, k2 = (uint32_t)(seed >> 32);
    /* below this fraction of the bound a token is skipped: covers float32 rounding of w * best and of E */
    const float margin = 1.0f - 0x1p-20f;
    float best = 0.0f;
    int64_t arg = 0;
    float w[RACE_BLOCK];
    for (int64_t i0 = 0; i0 < n; i0 += RACE_BLOCK) {
        const int m = n - i0 < RACE_BLOCK ? (int)(n - i0) : RACE_BLOCK;
        const float* pb = p + i0;
        const float thr = best >= 0x1p-94f ? best * margin : 0.0f;
        int any = 0;
        for (int j = 0; j < m; j++) {
            w[j] = race_uniform(k1, k2, (uint32_t)(i0 + j));
            any |= !(pb[j] <= thr * w[j]); /* true also for a NaN */
        }
        if (!any) continue;
        for (int j = 0; j < m; j++) {
            const float v = pb[j];
            if (v <= (best >= 0x1p-94f ? best * margin : 0.0f) * w[j]) continue;
            if (isnan(v)) return i0 + j; /* the row's first NaN: earlier blocks held none */
            const float s = v / race_exp(w[j]);
            if (s > best) { best = s; arg = i0 + j; }
        }
    }
    return arg;
}

/* out[b] = the race's winner in probs[b * ld .. b * ld + n) under seeds[b], for b < B. Returns 0, or -1
 * when n is not in [1, 2^31) or ld < n. */
int race_rows_f32(const float* probs, int64_t B, int64_t n, int64_t ld, const uint64_t* seeds, int64_t* out,
                  int num_threads) {
    if (n <= 0 || n >= ((int64_t)1 << 31) || ld < n) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (num_threads > 1 && B > 1 && B * n >= 65536)
    for (int64_t b = 0; b < B; b++) out[b] = race_row(probs + b * ld, n, seeds[b]);
    return 0;
}

const char* race_isa(void) { return ISA_PATH; }
