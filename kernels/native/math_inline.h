/* Small fp32 helpers shared by the attention kernels (decode_attention.c, ring_attention.c):
 * one definition, inlined into each translation unit. */
#ifndef KVRUN_MATH_INLINE_H
#define KVRUN_MATH_INLINE_H

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

#endif
