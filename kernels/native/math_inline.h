/* Small fp32 helpers shared by the attention kernels (decode_attention.c, ring_attention.c,
 * codebook_attention.c, kdot_int.c): one definition, inlined into each translation unit. */
#ifndef KVRUN_MATH_INLINE_H
#define KVRUN_MATH_INLINE_H

#include <math.h>
#include <stdint.h>

static inline float dot(const float *restrict a, const float *restrict b, int D) {
    float s = 0.f;
    for (int d = 0; d < D; d++) s += a[d] * b[d];
    return s;
}

/* exp for x <= 0 (logits minus the row max), vectorizable: 2^n * p(r), |rel err| < 2e-7 */
static inline float exp_neg(float x) {
    x = x < -87.f ? -87.f : x;
    float n = __builtin_roundf(x * 1.44269504f);
    float r = x - n * 0.693145752f - n * 1.42860677e-6f;
    float p = 1.f / 5040.f;
    p = p * r + 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    union { uint32_t u; float f; } s = { (uint32_t)((int32_t)n + 127) << 23 };
    return p * s.f;
}

/* The token splits of a tail of ntile 32-token tiles (the arena kernels): a function of its
 * length only, never of the thread count. The splits' partial outputs are summed in split
 * order, so a step's output is the same bits on 1 or 2 threads (and a greedy continuation
 * does not depend on the thread governor's choice): 2 to NSPLIT_MAX splits of at least
 * SPLIT_TILES tiles. */
enum { NSPLIT_MAX = 8, SPLIT_TILES = 4 };

static inline int token_splits(int64_t ntile) {
    int64_t s = ntile / SPLIT_TILES;
    return s < 2 ? 2 : s > NSPLIT_MAX ? NSPLIT_MAX : (int)s;
}

/* F(r0, NR) over rows [0, R) in blocks of 4 (8) rows, NR a compile-time constant so each
 * call specializes its register block to the rows left */
#define ROW_TAIL(r0, REM, F)                                                         \
    switch (REM) {                                                                   \
    case 3: F(r0, 3); break;                                                         \
    case 2: F(r0, 2); break;                                                         \
    case 1: F(r0, 1); break;                                                         \
    default: break;                                                                  \
    }
#define ROW_BLOCKS4(R, F) do {                                                       \
        int r0_ = 0;                                                                 \
        for (; r0_ + 4 <= (R); r0_ += 4) F(r0_, 4);                                  \
        ROW_TAIL(r0_, (R) - r0_, F)                                                  \
    } while (0)
#define ROW_BLOCKS8(R, F) do {                                                       \
        int r0_ = 0;                                                                 \
        for (; r0_ + 8 <= (R); r0_ += 8) F(r0_, 8);                                  \
        switch ((R) - r0_) {                                                         \
        case 7: F(r0_, 7); break;                                                    \
        case 6: F(r0_, 6); break;                                                    \
        case 5: F(r0_, 5); break;                                                    \
        case 4: F(r0_, 4); break;                                                    \
        default: ROW_TAIL(r0_, (R) - r0_, F)                                         \
        }                                                                            \
    } while (0)

/* tanh, vectorizable (libm's tanhf is a scalar call, ~15 ns: as much again as a kivi-4 row's
 * logits cost): (1 - e) / (1 + e), e = e^{-2|x|} by exp_neg, the sign restored; below
 * |x| = 1/8, where 1 - e cancels, its odd Taylor polynomial to x^7 (next term < 3e-10 of
 * it). |error| < 3e-7 absolute, well inside what the logits' fp32 rounding allows. */
static inline float tanh_vec(float x) {
    const float a = fabsf(x), e = exp_neg(-2.f * a), x2 = x * x;
    const float big = copysignf((1.f - e) / (1.f + e), x);
    const float small = x * (1.f + x2 * (-1.f / 3 + x2 * (2.f / 15 + x2 * (-17.f / 315))));
    return a < 0.125f ? small : big;
}

/* attention logit soft-capping (Gemma 2): the first n logits of a row s -> cap tanh(s / cap),
 * HF's order (divide, tanh, multiply); cap 0 leaves the row as it is */
static inline void softcap_row(float *s, int64_t n, float cap) {
    if (cap > 0.f)
        for (int64_t i = 0; i < n; i++) s[i] = tanh_vec(s[i] / cap) * cap;
}

/* one row of N logits in place -> probabilities over its first vis (the keys its query sees,
 * causally), zeros after: an exact two-pass softmax */
static inline void softmax_visible(float *s, int64_t vis, int64_t N) {
    float m = -INFINITY;
#pragma omp simd reduction(max : m)        /* exact in any order: vectorized */
    for (int64_t n = 0; n < vis; n++) m = s[n] > m ? s[n] : m;
    float den = 0.f;
    for (int64_t n = 0; n < vis; n++) { float e = exp_neg(s[n] - m); s[n] = e; den += e; }
    for (int64_t n = vis; n < N; n++) s[n] = 0.f;
    float inv = 1.f / den;
    for (int64_t n = 0; n < vis; n++) s[n] *= inv;
}

#endif
