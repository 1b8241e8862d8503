/* gemv_int: the integer GEMV of the decode layer (gemv.h), the way llama.cpp's CPU path
 * multiplies Q4_1 by Q8_1 and Q8_0 by Q8_0 (with finer input blocks: gemv_quant.c).
 *
 * Input: each GEMV input row quantized once (gemv_quant.c gi_quantize) to int8 codes q with
 * one fp32 scale d_j per block of QB columns, stored in the order the weight bytes decode in
 * with one scale per lane of 4 columns, so the inner loop does no shuffles.
 *
 * Dot products, per chunk of 64 columns (32 bytes of an int4 row, 64 of an int8 row):
 *   int4  the low nibbles of the 32 bytes, then their high nibbles: 64 unsigned codes c;
 *         y = sum_j s_g(j) d_j (c . q)_j + sum_g m_g xs_g   (w = c s + m; xs_g: the group's
 *         sum of d_j sum(q)_j, from the quantizer)
 *   int8  y = scale_n sum_j d_j (w . q)_j
 * The (c . q) sums are int32, 16 lanes of 4 columns: AVX512-VNNI vpdpbusd (unsigned x
 * signed bytes; int8 weights are made unsigned, w + 128, by one XOR per chunk shared by all
 * rows, and each lane starts at -128 sum(q) of its 4 codes, which the quantizer stored: the
 * sum stays exact and nothing is precomputed per weight row), AVX2 vpmaddubsw + vpmaddwd
 * (int8 weights: |w| x sign(q, w), no 16-bit overflow since |q| <= 127), or plain C. Then
 * per lane, in fp32, acc = fma(float(sum), s * d, acc); the min terms go into the same
 * lanes (group g into lane g % 16) and the 16 lanes are summed in one fixed tree. The int32
 * sums are exact, so the builds differ only in the fp32 rounding order.
 *
 * Tiles: one weight row x up to 8 input rows (AVX2: 2). A weight chunk is decoded once per
 * tile and used for every input row, and the tile's 8 lane sums are reduced together
 * (hsum512x8, the same tree as one row's). One weight row at a time, not several, so that each
 * load instruction walks the weights in one ascending stream: with 4 rows interleaved the
 * hardware prefetcher loses the stream, and a GEMV that reads its weights from DRAM (as the
 * decode step does) is slower although it is faster with them in cache (docs/measurements.md,
 * tools/gemv_speed.py). Every (weight row, input row) pair runs the same operations in
 * every tile shape, so a row's result does not depend on B (runtime/engine/batch.py relies
 * on it).
 *
 * Bytes read per call: nn weight rows once from memory (int4: K/2 code bytes + 4 K/G bytes
 * of scale and min; int8: K + 4 bytes), and per weight row the B quantized input rows from
 * L1/L2 (int4: 2 K bytes each, codes and lane scales; int8: 3 K, with the corrections).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "gemv.h"

#define INLINE static inline __attribute__((always_inline))

/* the weight scale of each lane of chunk i of an int4 row: with G = 32, lanes 0-3 and 8-11
 * hold group 2i's, lanes 4-7 and 12-15 group 2i+1's (a last half chunk: group 2i only) */
static inline float q4_lane_scale(const f16 *sp, int i, int G, int l, int half)
{
    if (G > 32) return (float)sp[i * 64 / G];
    return (l & 4) ? (half ? 0.f : (float)sp[2 * i + 1]) : (float)sp[2 * i];
}

/* fixed summation tree of 16 lanes: l + l+8, then + 4, + 2, + 1 (the SIMD reductions').
 * The int8 epilogue is an explicit fmaf(sum, scale, bias): left to the compiler, a * b + c is
 * fused in some inlined tile shapes and not in others, and a row would depend on B. */
static inline float sum16(const float *a)
{
    float t[4];
    for (int l = 0; l < 4; l++) t[l] = (a[l] + a[l + 8]) + (a[l + 4] + a[l + 12]);
    return (t[0] + t[2]) + (t[1] + t[3]);
}

#if GI_VNNI
enum { NBMAX = 8 };               /* input rows per tile: 8 accumulators, one decode */
INLINE float hsum512(__m512 v)
{
    const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

/* out[b] = hsum512(v[b]) for b < NB <= 8, bit for bit (the same tree: l + l+8, + 4, + 2,
 * + 1), the 8 sums reduced together: ~24 operations where 8 hsum512 take ~56. Rows past
 * NB are zeros. */
INLINE void hsum512x8(const __m512 *v, int NB, float *out)
{
    __m512 x[8], s4[4], s2[2];
    for (int b = 0; b < 8; b++) x[b] = b < NB ? v[b] : _mm512_setzero_ps();
    for (int i = 0; i < 4; i++)         /* lanes 0-7 row 2i's l + l+8, lanes 8-15 row 2i+1's */
        s4[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x44),
                              _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xee));
    for (int i = 0; i < 2; i++)         /* block k of s2[i]: row 4i + k's l + l+4 (t_0..t_3) */
        s2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], 0xdd));
    /* block k: t0 + t2, t1 + t3 of row k, then of row 4 + k */
    const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(s2[0], s2[1], 0x44),
                                   _mm512_shuffle_ps(s2[0], s2[1], 0xee));
    const __m512 r = _mm512_add_ps(z, _mm512_permute_ps(z, 0xb1));      /* lanes 4k, 4k + 2 */
    const __m512 o = _mm512_permutexvar_ps(
        _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 14, 10, 6, 2, 12, 8, 4, 0), r);
    _mm256_mask_storeu_ps(out, (__mmask8)((1u << NB) - 1), _mm512_castps512_ps256(o));
}

/* out[b] = hsum512(acc[b]) for b < NB */
INLINE void sums(const __m512 *acc, int NB, float *out)
{
    if (NB == 1) out[0] = hsum512(acc[0]);
    else hsum512x8(acc, NB, out);
}

/* -- dequantize int4 chunk -- the 64 codes of chunk i as unsigned bytes, low nibbles then
 * high; a last half chunk (16 bytes) is loaded masked */
INLINE __m512i q4_codes(const uint8_t *p, int full)
{
    const __m256i v = full ? _mm256_loadu_si256((const __m256i *)p)
                           : _mm256_maskz_loadu_epi8(0xffff, p);
    const __m512i b = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
    return _mm512_and_si512(b, _mm512_set1_epi8(0x0f));
}

/* the weight scale of each lane of chunk i (q4_lane_scale's pattern) */
INLINE __m512 q4_scales(const f16 *sp, int i, int G, int full)
{
    if (G > 32) return _mm512_set1_ps((float)sp[i * 64 / G]);
    const uint16_t *u = (const uint16_t *)sp + 2 * i;
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(full ? u[0] | (uint32_t)u[1] << 16 : u[0]));
    return _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0),
                                 _mm512_castps128_ps512(f));
}

/* acc[b] += (c . q_b) s d_b over chunk i for the quantized rows x[b], b < NB */
INLINE void q4_chunk(__m512i c, __m512 sw, const QRow *x, int i, int NB, __m512 *acc)
{
    for (int b = 0; b < NB; b++) {
        const __m512 is = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(
            _mm512_setzero_si512(), c, _mm512_loadu_si512(x[b].q + 64 * i)));
        acc[b] = _mm512_fmadd_ps(is, _mm512_mul_ps(sw, _mm512_loadu_ps(x[b].d + 16 * i)), acc[b]);
    }
}

/* int4 weight row n times NB quantized rows */
INLINE void q4_tile(const Weight *w, int n, const uint8_t *xq, int64_t ldq, int NB, float *out)
{
    const int K = w->K, G = w->G, ng = K / G, nc = pad64(K) / 64, full = K / 64;
    const uint8_t *wr = w->q + (int64_t)n * (K / 2);
    const f16 *sp = w->s + (int64_t)n * ng, *mp = w->m + (int64_t)n * ng;
    QRow x[NBMAX];
    __m512 acc[NBMAX];
    for (int b = 0; b < NB; b++) {
        x[b] = qrow(xq + b * ldq, K);
        acc[b] = _mm512_setzero_ps();
    }
    /* whole chunks, the group size's scale pattern hoisted out of the loop; a half chunk */
    if (G == 32)
        for (int i = 0; i < full; i++)
            q4_chunk(q4_codes(wr + 32 * i, 1), q4_scales(sp, i, 32, 1), x, i, NB, acc);
    else
        for (int i = 0; i < full; i++)
            q4_chunk(q4_codes(wr + 32 * i, 1), _mm512_set1_ps((float)sp[i * 64 / G]), x, i, NB, acc);
    if (full < nc)
        q4_chunk(q4_codes(wr + 32 * full, 0), q4_scales(sp, full, G, 0), x, full, NB, acc);
    /* -- min terms, 16 groups at a time -- */
    for (int g = 0; g < ng; g += 16) {
        const __mmask16 k = ng - g >= 16 ? 0xffff : (__mmask16)((1u << (ng - g)) - 1);
        const __m512 m = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mp + g));
        for (int b = 0; b < NB; b++)
            acc[b] = _mm512_fmadd_ps(m, _mm512_maskz_loadu_ps(k, x[b].s + g), acc[b]);
    }
    sums(acc, NB, out);
    if (w->bias)
        for (int b = 0; b < NB; b++) out[b] += w->bias[n];
}

/* int8 weight row n times NB quantized rows */
INLINE void i8_tile(const Weight *w, int n, const uint8_t *xq, int64_t ldq, int NB, float *out)
{
    const int K = w->K, nc = pad64(K) / 64;
    const uint8_t *wr = w->q + (int64_t)n * K;
    QRow x[NBMAX];
    __m512 acc[NBMAX];
    for (int b = 0; b < NB; b++) {
        x[b] = qrow(xq + b * ldq, K);
        acc[b] = _mm512_setzero_ps();
    }
    for (int i = 0; i < nc; i++) {
        const int left = K - 64 * i;
        /* w + 128 as unsigned bytes (past the row: 0, times a zero code); a whole chunk by a
         * plain load, which streams from memory faster than a masked one */
        const __m512i wv = left >= 64 ? _mm512_loadu_si512(wr + 64 * i)
                                      : _mm512_maskz_loadu_epi8((1ULL << left) - 1, wr + 64 * i);
        const __m512i u = _mm512_xor_si512(wv, _mm512_set1_epi8((char)0x80));
        for (int b = 0; b < NB; b++) {
            const __m512i is = _mm512_dpbusd_epi32(_mm512_loadu_si512(x[b].c + 16 * i), u,
                                                   _mm512_loadu_si512(x[b].q + 64 * i));
            acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_loadu_ps(x[b].d + 16 * i), acc[b]);
        }
    }
    sums(acc, NB, out);
    for (int b = 0; b < NB; b++)
        out[b] = fmaf(out[b], w->scale[n], w->bias ? w->bias[n] : 0.f);
}

#define TILE(NB) (w->kind == W_INT4 ? q4_tile(w, n, xb, ldq, NB, o) : i8_tile(w, n, xb, ldq, NB, o))

/* weight row n times NB (1 to NBMAX) input rows: constant shapes, unrolled */
static void tile(const Weight *w, int n, const uint8_t *xb, int64_t ldq, int NB, float *o)
{
    switch (NB) {
    case 1: TILE(1); break;
    case 2: TILE(2); break;
    case 3: TILE(3); break;
    case 4: TILE(4); break;
    case 5: TILE(5); break;
    case 6: TILE(6); break;
    case 7: TILE(7); break;
    default: TILE(8);
    }
}

void gi_rows(const Weight *w, int n0, int nn, int B, const uint8_t *xq, int64_t ldq, float *out,
             int ldo)
{
    for (int j = 0; j < nn; j++)
        for (int b0 = 0; b0 < B; b0 += NBMAX)
            tile(w, n0 + j, xq + b0 * ldq, ldq, B - b0 < NBMAX ? B - b0 : NBMAX,
                 out + (int64_t)j * ldo + b0);
}

int kvrun_gemv_isa(void) { return 2; }

#elif GI_AVX2
static inline __m256i ld256(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* int32 sums of 4 adjacent products of unsigned bytes a and signed bytes b: 8 lanes */
static inline __m256i dot4(__m256i a, __m256i b)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
}

/* lanes 0-7 in lo, 8-15 in hi: sum16's tree */
INLINE float hsum2x256(__m256 lo, __m256 hi)
{
    const __m256 a = _mm256_add_ps(lo, hi);
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

/* int4 weight row n times NB (1-2) quantized rows */
INLINE void q4_tile(const Weight *w, int n, const uint8_t *xq, int64_t ldq, int NB, float *out)
{
    const int K = w->K, G = w->G, ng = K / G, nc = pad64(K) / 64, full = K / 64;
    const uint8_t *wr = w->q + (int64_t)n * (K / 2);
    const f16 *sp = w->s + (int64_t)n * ng, *mp = w->m + (int64_t)n * ng;
    const __m256i m0f = _mm256_set1_epi8(0x0f);
    QRow x[2];
    __m256 lo[2], hi[2];
    for (int b = 0; b < NB; b++) {
        x[b] = qrow(xq + b * ldq, K);
        lo[b] = hi[b] = _mm256_setzero_ps();
    }
    for (int i = 0; i < nc; i++) {
        /* -- dequantize int4 chunk: low nibbles (lanes 0-7), high nibbles (8-15) -- */
        const __m256i v = i < full ? ld256(wr + 32 * i) : _mm256_zextsi128_si256(
                                         _mm_loadu_si128((const __m128i *)(wr + 32 * i)));
        const __m256i clo = _mm256_and_si256(v, m0f);
        const __m256i chi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m0f);
        __m256 sw;
        if (G > 32) {
            sw = _mm256_set1_ps((float)sp[i * 64 / G]);
        } else {
            const uint16_t *u = (const uint16_t *)sp + 2 * i;
            const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(i < full ? u[0] | (uint32_t)u[1] << 16
                                                                     : u[0]));
            sw = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(f),
                                          _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0));
        }
        for (int b = 0; b < NB; b++) {
            const int8_t *xb = x[b].q + 64 * i;
            const float *db = x[b].d + 16 * i;
            const __m256 slo = _mm256_cvtepi32_ps(dot4(clo, ld256(xb)));
            const __m256 shi = _mm256_cvtepi32_ps(dot4(chi, ld256(xb + 32)));
            lo[b] = _mm256_fmadd_ps(slo, _mm256_mul_ps(sw, _mm256_loadu_ps(db)), lo[b]);
            hi[b] = _mm256_fmadd_ps(shi, _mm256_mul_ps(sw, _mm256_loadu_ps(db + 8)), hi[b]);
        }
    }
    /* -- min terms: group g into lane g % 16 -- */
    for (int g = 0; g < ng; g += 8) {
        float mb[8] = {0}, xs[2][8] = {{0}};
        const int n8 = ng - g < 8 ? ng - g : 8;
        for (int j = 0; j < n8; j++) mb[j] = (float)mp[g + j];
        for (int b = 0; b < NB; b++) memcpy(xs[b], x[b].s + g, sizeof(float) * n8);
        const __m256 m = _mm256_loadu_ps(mb);
        for (int b = 0; b < NB; b++) {
            __m256 *a = g % 16 ? &hi[b] : &lo[b];
            *a = _mm256_fmadd_ps(m, _mm256_loadu_ps(xs[b]), *a);
        }
    }
    for (int b = 0; b < NB; b++)
        out[b] = hsum2x256(lo[b], hi[b]) + (w->bias ? w->bias[n] : 0.f);
}

/* int8 weight row n times NB (1-2) quantized rows: |w| x sign(q, w) */
INLINE void i8_tile(const Weight *w, int n, const uint8_t *xq, int64_t ldq, int NB, float *out)
{
    const int K = w->K, nc = pad64(K) / 64;
    const int8_t *wr = (const int8_t *)w->q + (int64_t)n * K;
    QRow x[2];
    __m256 lo[2], hi[2];
    for (int b = 0; b < NB; b++) {
        x[b] = qrow(xq + b * ldq, K);
        lo[b] = hi[b] = _mm256_setzero_ps();
    }
    for (int i = 0; i < nc; i++) {
        int8_t tail[64];
        const int8_t *p = wr + 64 * i;
        if (K - 64 * i < 64) {               /* a last partial chunk, zero-filled */
            memset(tail, 0, 64);
            memcpy(tail, p, K - 64 * i);
            p = tail;
        }
        const __m256i wlo = ld256(p), whi = ld256(p + 32);
        const __m256i alo = _mm256_sign_epi8(wlo, wlo), ahi = _mm256_sign_epi8(whi, whi);
        for (int b = 0; b < NB; b++) {
            const int8_t *xb = x[b].q + 64 * i;
            const float *db = x[b].d + 16 * i;
            const __m256i slo = dot4(alo, _mm256_sign_epi8(ld256(xb), wlo));
            const __m256i shi = dot4(ahi, _mm256_sign_epi8(ld256(xb + 32), whi));
            lo[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(slo), _mm256_loadu_ps(db), lo[b]);
            hi[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(shi), _mm256_loadu_ps(db + 8), hi[b]);
        }
    }
    for (int b = 0; b < NB; b++)
        out[b] = fmaf(hsum2x256(lo[b], hi[b]), w->scale[n], w->bias ? w->bias[n] : 0.f);
}

void gi_rows(const Weight *w, int n0, int nn, int B, const uint8_t *xq, int64_t ldq, float *out,
             int ldo)
{
    for (int j = 0; j < nn; j++)
        for (int b0 = 0; b0 < B; b0 += 2) {
            const uint8_t *xb = xq + b0 * ldq;
            float *o = out + (int64_t)j * ldo + b0;
            const int two = B - b0 >= 2;
            if (w->kind == W_INT4) {
                if (two) q4_tile(w, n0 + j, xb, ldq, 2, o); else q4_tile(w, n0 + j, xb, ldq, 1, o);
            } else {
                if (two) i8_tile(w, n0 + j, xb, ldq, 2, o); else i8_tile(w, n0 + j, xb, ldq, 1, o);
            }
        }
}

int kvrun_gemv_isa(void) { return 1; }

#else
void gi_rows(const Weight *w, int n0, int nn, int B, const uint8_t *xq, int64_t ldq, float *out,
             int ldo)
{
    const int K = w->K, G = w->G, nc = pad64(K) / 64, full = K / 64, int4 = w->kind == W_INT4;
    const int ng = int4 ? K / G : 0;
    for (int j = 0; j < nn; j++) {
        const int n = n0 + j;
        float acc[MAXB][16];
        memset(acc, 0, sizeof(float) * 16 * B);
        for (int i = 0; i < nc; i++) {
            int cw[64];                     /* the chunk's 64 weight codes, decode order */
            float sw[16];
            if (int4) {
                const uint8_t *p = w->q + (int64_t)n * (K / 2) + 32 * i;
                for (int t = 0; t < 32; t++) {
                    const int v = i < full || t < 16 ? p[t] : 0;
                    cw[t] = v & 15;
                    cw[t + 32] = v >> 4;
                }
                for (int l = 0; l < 16; l++)
                    sw[l] = q4_lane_scale(w->s + (int64_t)n * ng, i, G, l, i >= full);
            } else {
                const int8_t *p = (const int8_t *)w->q + (int64_t)n * K + 64 * i;
                for (int t = 0; t < 64; t++) cw[t] = 64 * i + t < K ? p[t] : 0;
                for (int l = 0; l < 16; l++) sw[l] = 1.f;
            }
            for (int b = 0; b < B; b++) {
                const QRow x = qrow(xq + b * ldq, K);
                for (int l = 0; l < 16; l++) {
                    int32_t s = 0;
                    for (int u = 4 * l; u < 4 * l + 4; u++) s += cw[u] * x.q[64 * i + u];
                    acc[b][l] = fmaf((float)s, sw[l] * x.d[16 * i + l], acc[b][l]);
                }
            }
        }
        for (int b = 0; b < B; b++) {
            const QRow x = qrow(xq + b * ldq, K);
            for (int g = 0; g < ng; g++)
                acc[b][g % 16] = fmaf((float)w->m[(int64_t)n * ng + g], x.s[g], acc[b][g % 16]);
            const float r = sum16(acc[b]);
            const float bias = w->bias ? w->bias[n] : 0.f;
            out[(int64_t)j * ldo + b] = int4 ? r + bias : fmaf(r, w->scale[n], bias);
        }
    }
}

int kvrun_gemv_isa(void) { return 0; }
#endif
