/* Rows of the window and the new tokens, shared by the arena's attention kernels
 * (decode_attention.c, codebook_attention.c): fp16 / bf16 / fp32 rows to and from fp32, and
 * the (D, D) rotation of a row and its inverse, and the signed Hadamard rotation by its
 * butterfly (bit-identical to torch's). Also ring_attention.c's. One definition, inlined into each translation unit. */
#ifndef KVRUN_ROWS_INLINE_H
#define KVRUN_ROWS_INLINE_H

#include <stdint.h>
#include <string.h>

#include "codec_layout.h"
#include "math_inline.h"
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* a row's dtype, as native/decode_attention.py `_FP` numbers them */
enum { ROW_FP16 = 0, ROW_BF16 = 1, ROW_FP32 = 2 };

static inline float bf16f(uint16_t b) {
    union { uint32_t u; float f; } v = { (uint32_t)b << 16 };
    return v.f;
}

/* n fp16 values to fp32 (F16C, 8 at a time: gcc does not vectorize the plain cast) */
static inline void f16_to_f32(const f16 *restrict p, int n, float *restrict o) {
    int d = 0;
#if defined(__F16C__)
    for (; d + 8 <= n; d += 8)
        _mm256_storeu_ps(o + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + d))));
#endif
    for (; d < n; d++) o[d] = (float)p[d];
}

/* row of D values of an uncompressed tensor in dtype `kind` (0 fp16, 1 bf16, 2 fp32) */
static inline void load_row(const void *base, int64_t off, int kind, int D, float *restrict o) {
    if (kind == ROW_FP16) {
        f16_to_f32((const f16 *)base + off, D, o);
    } else if (kind == ROW_BF16) {
        const uint16_t *p = (const uint16_t *)base + off;
        for (int d = 0; d < D; d++) o[d] = bf16f(p[d]);
    } else {
        const float *p = (const float *)base + off;
        for (int d = 0; d < D; d++) o[d] = p[d];
    }
}

/* y = x @ M (M: (D, D) row-major), in place through a copy. With AVX-512 the sums of 64
 * outputs stay in four registers over the whole pass, where the plain loop (vectorized by
 * the compiler over d) stored and reloaded y for every e: one store-to-load round trip per
 * row of M. Each output is the same fma chain over e either way. */
static inline void matvec(float *restrict x, const float *restrict M, int D) {
    float y[MAXD];
#if defined(__AVX512F__) && !defined(KVRUN_NO_AVX512)
    if (D % 16 == 0) {
        for (int d0 = 0; d0 < D; d0 += 64) {
            const int nv = D - d0 < 64 ? (D - d0) / 16 : 4;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int e = 0; e < D; e++) {
                const __m512 xe = _mm512_set1_ps(x[e]);
                const float *m = M + (int64_t)e * D + d0;
                a0 = _mm512_fmadd_ps(xe, _mm512_loadu_ps(m), a0);
                if (nv > 1) a1 = _mm512_fmadd_ps(xe, _mm512_loadu_ps(m + 16), a1);
                if (nv > 2) a2 = _mm512_fmadd_ps(xe, _mm512_loadu_ps(m + 32), a2);
                if (nv > 3) a3 = _mm512_fmadd_ps(xe, _mm512_loadu_ps(m + 48), a3);
            }
            _mm512_storeu_ps(y + d0, a0);
            if (nv > 1) _mm512_storeu_ps(y + d0 + 16, a1);
            if (nv > 2) _mm512_storeu_ps(y + d0 + 32, a2);
            if (nv > 3) _mm512_storeu_ps(y + d0 + 48, a3);
        }
        memcpy(x, y, sizeof(float) * D);
        return;
    }
#elif defined(__AVX2__) && defined(__FMA__) && !defined(KVRUN_NO_AVX2)
    if (D % 8 == 0) {                     /* the same, 64 outputs in eight 8-lane registers */
        for (int d0 = 0; d0 < D; d0 += 64) {
            const int nv = D - d0 < 64 ? (D - d0) / 8 : 8;
            __m256 a[8];
            for (int k = 0; k < nv; k++) a[k] = _mm256_setzero_ps();
            for (int e = 0; e < D; e++) {
                const __m256 xe = _mm256_set1_ps(x[e]);
                const float *m = M + (int64_t)e * D + d0;
                for (int k = 0; k < nv; k++) a[k] = _mm256_fmadd_ps(xe, _mm256_loadu_ps(m + 8 * k), a[k]);
            }
            for (int k = 0; k < nv; k++) _mm256_storeu_ps(y + d0 + 8 * k, a[k]);
        }
        memcpy(x, y, sizeof(float) * D);
        return;
    }
#endif
    for (int d = 0; d < D; d++) y[d] = 0.f;
    for (int e = 0; e < D; e++) {
        float xe = x[e];
        const float *m = M + (int64_t)e * D;
        for (int d = 0; d < D; d++) y[d] += xe * m[d];
    }
    memcpy(x, y, sizeof(float) * D);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(KVRUN_NO_AVX2)
/* lane i of the result = sum of the 8 lanes of v[i] */
static inline __m256 hsum8x8(const __m256 v[8]) {
    const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 t0 = _mm256_hadd_ps(s01, s23), t1 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}
#endif

/* y = x @ M^T (M: (D, D) row-major), in place: a rotated row back (x R R^T = x). Output d
 * is dot(x, row d of M); with AVX2 the dots of 8 rows run in 8-lane registers and are
 * reduced together (hsum8x8), where the plain loop reduces each on its own. */
static inline void matvec_t(float *restrict x, const float *restrict M, int D) {
    float y[MAXD];
#if defined(__AVX2__) && defined(__FMA__) && !defined(KVRUN_NO_AVX2)
    if (D % 8 == 0) {
        for (int d0 = 0; d0 < D; d0 += 8) {
            __m256 v[8];
            for (int i = 0; i < 8; i++) v[i] = _mm256_setzero_ps();
            for (int e = 0; e < D; e += 8) {
                const __m256 xe = _mm256_loadu_ps(x + e);
                for (int i = 0; i < 8; i++)
                    v[i] = _mm256_fmadd_ps(xe, _mm256_loadu_ps(M + (int64_t)(d0 + i) * D + e), v[i]);
            }
            _mm256_storeu_ps(y + d0, hsum8x8(v));
        }
        memcpy(x, y, sizeof(float) * D);
        return;
    }
#endif
    for (int d = 0; d < D; d++) y[d] = dot(x, M + (int64_t)d * D, D);
    memcpy(x, y, sizeof(float) * D);
}

/* x <- x blockdiag(H_n) / sqrt(n) in place, n = D & -D (the largest power of two dividing
 * D): stages h = 1, 2, ..., n/2, each pair (i, i + h) of a 2h-run becoming (a + b, a - b),
 * then one multiply by fp32(1/sqrt(n)). Every value is one IEEE operation on two others in
 * this fixed order, the order kernels/hadamard.py's `fwht` runs in torch, so a row rotated
 * here equals torch's bit for bit on every CPU and build (a matrix product's sum order is
 * the BLAS library's). The stages are loops over memory, so -fassociative-math has no
 * chain to re-associate. */
static inline void hadamard_stages(float *restrict x, int D) {
    const int n = D & -D;
    for (int h = 1; h < n; h *= 2)
        for (int j = 0; j < D; j += 2 * h)
            for (int t = j; t < j + h; t++) {
                const float a = x[t], b = x[t + h];
                x[t] = a + b;
                x[t + h] = a - b;
            }
    const float inv = (float)(1.0 / sqrt((double)n));
    for (int d = 0; d < D; d++) x[d] *= inv;
}

/* x <- x R, R = diag(s) blockdiag(H_n)/sqrt(n) (hadamard.Hadamard, `fwht`): the signs s (D,),
 * then the stages */
static inline void hadamard_rotate(float *restrict x, const float *restrict s, int D) {
    for (int d = 0; d < D; d++) x[d] *= s[d];
    hadamard_stages(x, D);
}

/* x <- x R^T (`fwht_t`): the stages, then the signs */
static inline void hadamard_unrotate(float *restrict x, const float *restrict s, int D) {
    hadamard_stages(x, D);
    for (int d = 0; d < D; d++) x[d] *= s[d];
}

/* store a row rounded to dtype `kind` (fp16 and bf16 round to nearest even) */
static inline void store_row(void *base, int64_t off, int kind, int D, const float *restrict x) {
    if (kind == ROW_FP16) {
        f16 *p = (f16 *)base + off;
        int d = 0;
#if defined(__F16C__)       /* 8 at a time, the same rounding (gcc does not vectorize the cast) */
        for (; d + 8 <= D; d += 8)
            _mm_storeu_si128((__m128i *)(p + d), _mm256_cvtps_ph(_mm256_loadu_ps(x + d), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; d < D; d++) p[d] = (f16)x[d];
    } else if (kind == ROW_BF16) {
        uint16_t *p = (uint16_t *)base + off;
        for (int d = 0; d < D; d++) {
            union { float f; uint32_t u; } v = { x[d] };
            p[d] = (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
        }
    } else {
        memcpy((float *)base + off, x, sizeof(float) * D);
    }
}

#endif
