/* gemv_fp32: the reference GEMV of the decode layer (gemv.h): int4 codes or int8 weights
 * decoded to fp32 and multiplied with the fp32 input rows by FMAs.
 *
 *   int4  a row dot is  sum_g s_g (c . x)_g + m_g sum(x)_g,  the group sums of x computed once
 *         per GEMV input (gf_group_sums)
 *   int8  scale_n (w . x)
 *
 * AVX-512 decodes 16 codes per register (the nibbles are split with one AND and one shift)
 * and multiplies in fp32 with FMAs; without it a plain C loop runs (compilers vectorize it
 * for AVX2). Exact fp32 accumulation order differs from torch's, nothing else: the result
 * equals the dequantized fp32 GEMV to rounding.
 *
 * Bytes read per call: nn weight rows (int4: K/2 code bytes + 4 K/G bytes of scale and min;
 * int8: K + 4), each once from memory for all B input rows (4 B K bytes, from L1/L2).
 */
#include <stdint.h>
#include "gemv.h"
#if defined(__AVX512F__) && !defined(KVRUN_NO_AVX512)
#include <immintrin.h>
#define KV_AVX512 1
#endif

/* -- dot products of one weight row with B input rows --------------------------------- */

/* int4 row n dotted with one input row x and its group sums xs */
static float q4_dot(const Weight *w, int n, const float *x, const float *xs)
{
    const int K = w->K, G = w->G, ng = K / G, half = G / 2;
    const uint8_t *q = w->q + (int64_t)n * (K / 2);
    const f16 *sp = w->s + (int64_t)n * ng, *mp = w->m + (int64_t)n * ng;
    float r = 0.f;
#if KV_AVX512
    /* four accumulators, rotating by group: each FMA chain advances every fourth group,
     * so the loop is bound by the nibble decode, not by FMA latency */
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const __m128i low = _mm_set1_epi8(0x0f);
    for (int g = 0; g < ng; g++) {
        const __m512 sg = _mm512_set1_ps((float)sp[g]);
        const uint8_t *qg = q + g * half;
        const float *xg = x + g * G;
        __m512 t = _mm512_setzero_ps();
        for (int j = 0; j < half; j += 16) {
            __m128i byt = _mm_loadu_si128((const __m128i *)(qg + j));
            __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(byt, low)));
            __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                _mm_and_si128(_mm_srli_epi16(byt, 4), low)));
            t = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xg + j), t);
            t = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + j + half), t);
        }
        switch (g & 3) {
        case 0: a0 = _mm512_fmadd_ps(t, sg, a0); break;
        case 1: a1 = _mm512_fmadd_ps(t, sg, a1); break;
        case 2: a2 = _mm512_fmadd_ps(t, sg, a2); break;
        default: a3 = _mm512_fmadd_ps(t, sg, a3);
        }
    }
    r = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#else
    for (int g = 0; g < ng; g++) {
        const uint8_t *qg = q + g * half;
        const float *xg = x + g * G;
        float a = 0.f;
        for (int j = 0; j < half; j++)
            a += (float)(qg[j] & 15) * xg[j] + (float)(qg[j] >> 4) * xg[j + half];
        r += (float)sp[g] * a;
    }
#endif
    for (int g = 0; g < ng; g++) r += (float)mp[g] * xs[g];
    return r;
}

/* int8 row n dotted with one input row x */
static float i8_dot(const Weight *w, int n, const float *x)
{
    const int K = w->K;
    const int8_t *q = (const int8_t *)w->q + (int64_t)n * K;
    int k = 0;
    float r = 0.f;
#if KV_AVX512
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; k + 64 <= K; k += 64) {
        __m512i c = _mm512_loadu_si512((const void *)(q + k));
        a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_castsi512_si128(c))),
                             _mm512_loadu_ps(x + k), a0);
        a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(c, 1))),
                             _mm512_loadu_ps(x + k + 16), a1);
        a2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(c, 2))),
                             _mm512_loadu_ps(x + k + 32), a2);
        a3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(c, 3))),
                             _mm512_loadu_ps(x + k + 48), a3);
    }
    r = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#endif
    for (; k < K; k++) r += (float)q[k] * x[k];
    return r * w->scale[n];
}

#if KV_AVX512
/* Row blocks: weight row n dotted with NB (<= 4) input rows at once. The codes are decoded
 * once per block and used for every row; each row's arithmetic is exactly q4_dot's / i8_dot's
 * (same accumulators, same order), so a row's result does not depend on the batch it is in
 * (runtime/engine/batch.py relies on it: a sequence decodes bit-identically alone or batched). */
#define Q4_GROUP(ACC, NB)                                                                   \
    {                                                                                       \
        const __m512 sg = _mm512_set1_ps((float)sp[g]);                                     \
        const uint8_t *qg = q + g * half;                                                   \
        __m512 t[NB];                                                                       \
        for (int b = 0; b < NB; b++) t[b] = _mm512_setzero_ps();                            \
        for (int j = 0; j < half; j += 16) {                                                \
            __m128i byt = _mm_loadu_si128((const __m128i *)(qg + j));                       \
            __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(byt, low)));  \
            __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(                            \
                _mm_and_si128(_mm_srli_epi16(byt, 4), low)));                               \
            for (int b = 0; b < NB; b++) {                                                  \
                const float *xg = x + (int64_t)b * ldx + g * G;                             \
                t[b] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xg + j), t[b]);                  \
                t[b] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + j + half), t[b]);           \
            }                                                                               \
        }                                                                                   \
        for (int b = 0; b < NB; b++) ACC[b] = _mm512_fmadd_ps(t[b], sg, ACC[b]);            \
        g++;                                                                                \
    }

#define DEFINE_Q4_ROWS(NB)                                                                  \
static void q4_rows##NB(const Weight *w, int n, const float *x, int ldx, const float *xs,   \
                        int ldxs, float *out)                                               \
{                                                                                           \
    const int K = w->K, G = w->G, ng = K / G, half = G / 2;                                 \
    const uint8_t *q = w->q + (int64_t)n * (K / 2);                                         \
    const f16 *sp = w->s + (int64_t)n * ng, *mp = w->m + (int64_t)n * ng;                   \
    const __m128i low = _mm_set1_epi8(0x0f);                                                \
    __m512 a0[NB], a1[NB], a2[NB], a3[NB];                                                  \
    for (int b = 0; b < NB; b++)                                                            \
        a0[b] = a1[b] = a2[b] = a3[b] = _mm512_setzero_ps();                                \
    int g = 0;                                                                              \
    while (g + 4 <= ng) { Q4_GROUP(a0, NB) Q4_GROUP(a1, NB) Q4_GROUP(a2, NB) Q4_GROUP(a3, NB) } \
    if (g < ng) Q4_GROUP(a0, NB)                                                            \
    if (g < ng) Q4_GROUP(a1, NB)                                                            \
    if (g < ng) Q4_GROUP(a2, NB)                                                            \
    for (int b = 0; b < NB; b++) {                                                          \
        float r = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0[b], a1[b]),           \
                                                     _mm512_add_ps(a2[b], a3[b])));         \
        const float *xsb = xs + (int64_t)b * ldxs;                                          \
        for (int gg = 0; gg < ng; gg++) r += (float)mp[gg] * xsb[gg];                       \
        out[b] = r;                                                                         \
    }                                                                                       \
}

#define DEFINE_I8_ROWS(NB)                                                                  \
static void i8_rows##NB(const Weight *w, int n, const float *x, int ldx, float *out)       \
{                                                                                           \
    const int K = w->K;                                                                     \
    const int8_t *q = (const int8_t *)w->q + (int64_t)n * K;                                \
    __m512 a0[NB], a1[NB], a2[NB], a3[NB];                                                  \
    for (int b = 0; b < NB; b++)                                                            \
        a0[b] = a1[b] = a2[b] = a3[b] = _mm512_setzero_ps();                                \
    int k = 0;                                                                              \
    for (; k + 64 <= K; k += 64) {                                                          \
        __m512i c = _mm512_loadu_si512((const void *)(q + k));                              \
        __m512 c0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_castsi512_si128(c)));    \
        __m512 c1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(c, 1))); \
        __m512 c2 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(c, 2))); \
        __m512 c3 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(c, 3))); \
        for (int b = 0; b < NB; b++) {                                                      \
            const float *xb = x + (int64_t)b * ldx + k;                                     \
            a0[b] = _mm512_fmadd_ps(c0, _mm512_loadu_ps(xb), a0[b]);                        \
            a1[b] = _mm512_fmadd_ps(c1, _mm512_loadu_ps(xb + 16), a1[b]);                   \
            a2[b] = _mm512_fmadd_ps(c2, _mm512_loadu_ps(xb + 32), a2[b]);                   \
            a3[b] = _mm512_fmadd_ps(c3, _mm512_loadu_ps(xb + 48), a3[b]);                   \
        }                                                                                   \
    }                                                                                       \
    for (int b = 0; b < NB; b++) {                                                          \
        const float *xb = x + (int64_t)b * ldx;                                             \
        float r = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0[b], a1[b]),           \
                                                     _mm512_add_ps(a2[b], a3[b])));         \
        for (int kk = k; kk < K; kk++) r += (float)q[kk] * xb[kk];                          \
        out[b] = r * w->scale[n];                                                           \
    }                                                                                       \
}

DEFINE_Q4_ROWS(2) DEFINE_Q4_ROWS(3) DEFINE_Q4_ROWS(4)
DEFINE_I8_ROWS(2) DEFINE_I8_ROWS(3) DEFINE_I8_ROWS(4)
#endif

#if KV_AVX512
/* B >= 2 rows in blocks of 4 that share one decode of the codes (a last lone row: q4_dot /
 * i8_dot; tests/engine/test_batch.py checks the blocks equal them bit for bit). Out of line, so
 * that row_dot, inlined into every GEMV loop, costs a lone row (one sequence) nothing. */
__attribute__((noinline)) static void row_blocks(const Weight *w, int n, int B, const float *x,
                                                 int ldx, const float *xs, int ldxs, float *out)
{
    for (int b0 = 0; b0 < B; b0 += 4) {
        const float *xb = x + (int64_t)b0 * ldx, *xsb = xs + (int64_t)b0 * ldxs;
        float *o = out + b0;
        if (w->kind == W_INT4) {
            switch (B - b0) {
            case 1: o[0] = q4_dot(w, n, xb, xsb); break;
            case 2: q4_rows2(w, n, xb, ldx, xsb, ldxs, o); break;
            case 3: q4_rows3(w, n, xb, ldx, xsb, ldxs, o); break;
            default: q4_rows4(w, n, xb, ldx, xsb, ldxs, o);
            }
        } else {
            switch (B - b0) {
            case 1: o[0] = i8_dot(w, n, xb); break;
            case 2: i8_rows2(w, n, xb, ldx, o); break;
            case 3: i8_rows3(w, n, xb, ldx, o); break;
            default: i8_rows4(w, n, xb, ldx, o);
            }
        }
    }
}
#endif

/* weight row n dotted with B input rows x[b] (row stride ldx; int4: group sums xs[b],
 * stride ldxs), plus the bias. */
static void row_dot(const Weight *w, int n, int B, const float *x, int ldx, const float *xs,
                    int ldxs, float *out)
{
#if KV_AVX512
    if (B > 1)
        row_blocks(w, n, B, x, ldx, xs, ldxs, out);
    else
#endif
    for (int b = 0; b < B; b++)
        out[b] = w->kind == W_INT4 ? q4_dot(w, n, x + (int64_t)b * ldx, xs + (int64_t)b * ldxs)
                                   : i8_dot(w, n, x + (int64_t)b * ldx);
    if (w->bias)
        for (int b = 0; b < B; b++) out[b] += w->bias[n];
}

void gf_group_sums(const Weight *w, const float *x, float *out)
{
    if (w->kind != W_INT4) return;
    const int G = w->G;
    for (int g = 0; g < w->K / G; g++) {
        float a = 0.f;
        for (int j = 0; j < G; j++) a += x[g * G + j];
        out[g] = a;
    }
}

void gf_rows(const Weight *w, int n0, int nn, int B, const float *x, int ldx, const float *xs,
             int ldxs, float *out, int ldo)
{
    for (int j = 0; j < nn; j++) row_dot(w, n0 + j, B, x, ldx, xs, ldxs, out + (int64_t)j * ldo);
}
