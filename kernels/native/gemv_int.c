/* gemv_int: the integer GEMV of the decode layer (gemv.h) over weights repacked 16 rows to a
 * register (gemv_quant.c kvrun_gemv_repack, llama.cpp's interleaved layouts) and input rows
 * quantized to int16 blocks of 32 columns (gemv_quant.c gi_quantize).
 *
 * Per block of 16 weight rows, per 32-column block, per input row b: one int32 lane per
 * weight row r accumulates the exact dot of the block, (c_r . q_b) over 32 columns, two
 * columns per instruction with the input's two int16 codes broadcast to every lane
 * (AVX512-VNNI vpdpwssd: 16 instructions a block; AVX2 vpmaddwd + vpaddd, 8 rows per ymm,
 * both halves of the block per column pair so each broadcast serves two products;
 * plain C). Then per lane, in fp32:
 *   int4  at a group's first block  acc = fma(m_g, xs_g, acc)    (w = c s + m)
 *         every block               acc = fma(float(sum), s_g * d_j, acc)
 *         y = acc + bias
 *   int8  every block               acc = fma(float(sum), d_j, acc)
 *         y = fma(acc, scale_r, bias)
 * No horizontal sums: a register holds 16 outputs. Every weight block is decoded once per
 * tile of up to 8 input rows (AVX2: 4) and used for all of them, and the blocks are read in
 * one ascending stream (the prefetcher's; the decode step reads its weights from DRAM).
 *
 * Exactness: int4 codes <= 15 and |q| <= 32767, int8 |w| <= 128: 32 products stay far below
 * 2^31. So every build computes the same int32 sums, and each (weight row, input row) pair
 * runs the same fp32 operations in the same order on every build and in every tile shape:
 * the result depends neither on B (runtime/engine/batch.py relies on it) nor on the build.
 *
 * Bytes read per call: the repacked weight once (int4 5 bits a weight, int8 1 byte + 4
 * bytes a row), and per block the tile's quantized input rows from L1 (2.25 bytes a column).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "gemv.h"

#define INLINE static inline __attribute__((always_inline))

/* two adjacent int16 codes as one int32, the broadcast operand */
INLINE int32_t ld32(const int16_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#if GI_VNNI
enum { NBMAX = 8 };               /* input rows per tile: 8 int32 + 8 fp32 accumulators */

/* Software prefetch PF_BYTES ahead in the weight stream, in tiles of at least PF_ROWS input
 * rows: there a block's arithmetic takes longer than its bytes take to arrive, and the
 * hardware prefetcher alone leaves the loads waiting (tools/gemv_speed.py cold, 8 rows:
 * 10-20 % faster); a one-row tile streams as fast without it. */
enum { PF_BYTES = 8192, PF_ROWS = 4 };
INLINE void prefetch(const uint8_t *p, int n)
{
    for (int l = 0; l < n; l += 64) _mm_prefetch((const char *)p + PF_BYTES + l, _MM_HINT_T0);
}

/* acc + the dot of w's int16 pairs with the pair at p broadcast to every lane (an
 * embedded-broadcast operand measured no faster than this separate broadcast load) */
INLINE __m512i dpw(__m512i acc, __m512i w, const int16_t *p)
{
    return _mm512_dpwssd_epi32(acc, w, _mm512_set1_epi32(ld32(p)));
}

/* -- int4 block of 16 rows times NB quantized rows -> res[b] (16 outputs each) -- */
INLINE void q4_tile(const Weight *w, const uint8_t *p, const QRow *x, int NB, __m512 bias,
                    __m512 *res)
{
    const int nk = w->K / GI_KB, per = w->G / GI_KB;
    __m512 acc[NBMAX], s = _mm512_setzero_ps();
    for (int b = 0; b < NB; b++) acc[b] = _mm512_setzero_ps();
    for (int kb = 0; kb < nk; kb++) {
        if (kb % per == 0) {            /* a group starts: its scales, its min term */
            const int g = kb / per;
            s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
            const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32)));
            for (int b = 0; b < NB; b++) acc[b] = _mm512_fmadd_ps(m, _mm512_set1_ps(x[b].s[g]), acc[b]);
            p += 64;
        }
        if (NB >= PF_ROWS) prefetch(p, 320);
        /* two int32 chains per input row (columns 0-15, 16-31), added at the end: exact, so
         * they change no bit (four chains in one-row tiles measured no faster) */
        __m512i is[NBMAX], ih[NBMAX];
        for (int b = 0; b < NB; b++) is[b] = ih[b] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            /* -- dequantize: columns (2t, 2t+1) low nibbles, (16+2t, 17+2t) high -- */
            const __m512i z = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p + 32 * t)));
            const __m512i lo = _mm512_and_si512(z, _mm512_set1_epi16(15));
            const __m512i hi = _mm512_srli_epi16(z, 4);
            for (int b = 0; b < NB; b++) {
                const int16_t *xq = x[b].q + GI_KB * kb;
                is[b] = dpw(is[b], lo, xq + 2 * t);
                ih[b] = dpw(ih[b], hi, xq + 16 + 2 * t);
            }
        }
        p += 256;
        for (int b = 0; b < NB; b++)
            acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(is[b], ih[b])),
                                     _mm512_mul_ps(s, _mm512_set1_ps(x[b].d[kb])), acc[b]);
    }
    for (int b = 0; b < NB; b++) res[b] = _mm512_add_ps(acc[b], bias);
}

/* -- int8 block of 16 rows times NB quantized rows -- */
INLINE void i8_tile(const Weight *w, const uint8_t *p, const QRow *x, int NB, __m512 bias,
                    __m512 *res)
{
    const int nk = pad32(w->K) / GI_KB;
    const __m512 sc = _mm512_loadu_ps((const float *)p);
    __m512 acc[NBMAX];
    for (int b = 0; b < NB; b++) acc[b] = _mm512_setzero_ps();
    p += 64;
    for (int kb = 0; kb < nk; kb++, p += 512) {
        if (NB >= PF_ROWS) prefetch(p, 512);
        __m512i is[NBMAX], ih[NBMAX];
        for (int b = 0; b < NB; b++) is[b] = ih[b] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {       /* columns (2t, 2t+1) and (16+2t, 17+2t) */
            const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p + 32 * t)));
            const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p + 256 + 32 * t)));
            for (int b = 0; b < NB; b++) {
                const int16_t *xq = x[b].q + GI_KB * kb;
                is[b] = dpw(is[b], w0, xq + 2 * t);
                ih[b] = dpw(ih[b], w1, xq + 16 + 2 * t);
            }
        }
        for (int b = 0; b < NB; b++)
            acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(is[b], ih[b])),
                                     _mm512_set1_ps(x[b].d[kb]), acc[b]);
    }
    for (int b = 0; b < NB; b++) res[b] = _mm512_fmadd_ps(acc[b], sc, bias);
}

#define TILE(NB) (w->kind == W_INT4 ? q4_tile(w, blk, x, NB, bias, res) \
                                    : i8_tile(w, blk, x, NB, bias, res))

void gi_rows(const Weight *w, int n0, int nn, int B, const uint8_t *xq, int64_t ldq, float *out,
             int ldo)
{
    const uint8_t *blk = w->rp + (int64_t)(n0 / GI_RB) * gi_block_bytes(w);
    const __mmask16 live = (__mmask16)((1u << nn) - 1);
    const __m512 bias = w->bias ? _mm512_maskz_loadu_ps(live, w->bias + n0) : _mm512_setzero_ps();
    for (int b0 = 0; b0 < B; b0 += NBMAX) {
        const int NB = B - b0 < NBMAX ? B - b0 : NBMAX;
        QRow x[NBMAX];
        __m512 res[NBMAX];
        for (int b = 0; b < NB; b++) x[b] = qrow(xq + (b0 + b) * ldq, w->K);
        switch (NB) {                   /* constant shapes, unrolled */
        case 1: TILE(1); break;
        case 2: TILE(2); break;
        case 3: TILE(3); break;
        case 4: TILE(4); break;
        case 5: TILE(5); break;
        case 6: TILE(6); break;
        case 7: TILE(7); break;
        default: TILE(8);
        }
        for (int b = 0; b < NB; b++) {
            float r[GI_RB];
            _mm512_storeu_ps(r, res[b]);
            for (int j = 0; j < nn; j++) out[(int64_t)j * ldo + b0 + b] = r[j];
        }
    }
}

int kvrun_gemv_isa(void) { return 2; }

#elif GI_AVX2
enum { NBMAX = 4 };               /* input rows per tile; rows 0-7 and 8-15 side by side per t */

/* two adjacent int16 codes broadcast to every int32 lane: one load-broadcast instruction
 * (vbroadcastss of the same 4 bytes), where the int32 set1 went through a general register */
INLINE __m256i bc32(const int16_t *p)
{
    return _mm256_castps_si256(_mm256_broadcast_ss((const float *)p));
}

static inline __m256i ld128w(const uint8_t *p, int sign)     /* 16 bytes -> 16 int16 */
{
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    return sign ? _mm256_cvtepi8_epi16(v) : _mm256_cvtepu8_epi16(v);
}

/* a block of 16 rows (int4 or int8) times NB quantized rows: acc[b][h] rows 8h..8h+7 */
INLINE void tile(const Weight *w, const uint8_t *p, const QRow *x, int NB, const float *bias,
                 float (*res)[GI_RB])
{
    const int int4 = w->kind == W_INT4, nk = pad32(w->K) / GI_KB, per = int4 ? w->G / GI_KB : 1;
    __m256 acc[NBMAX][2], s[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, sc[2];
    for (int b = 0; b < NB; b++) acc[b][0] = acc[b][1] = _mm256_setzero_ps();
    if (!int4) {
        sc[0] = _mm256_loadu_ps((const float *)p);
        sc[1] = _mm256_loadu_ps((const float *)p + 8);
        p += 64;
    }
    for (int kb = 0; kb < nk; kb++) {
        if (int4 && kb % per == 0) {
            const int g = kb / per;
            for (int h = 0; h < 2; h++) {
                s[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * h)));
                const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 32 + 16 * h)));
                for (int b = 0; b < NB; b++)
                    acc[b][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(x[b].s[g]), acc[b][h]);
            }
            p += 64;
        }
        if (int4) {                     /* both halves per t: each broadcast used twice */
            __m256i is[NBMAX][2];
            for (int b = 0; b < NB; b++) is[b][0] = is[b][1] = _mm256_setzero_si256();
            for (int t = 0; t < 8; t++) {
                const __m256i z0 = ld128w(p + 32 * t, 0), z1 = ld128w(p + 32 * t + 16, 0);
                const __m256i m = _mm256_set1_epi16(15);
                const __m256i lo0 = _mm256_and_si256(z0, m), hi0 = _mm256_srli_epi16(z0, 4);
                const __m256i lo1 = _mm256_and_si256(z1, m), hi1 = _mm256_srli_epi16(z1, 4);
                for (int b = 0; b < NB; b++) {
                    const int16_t *xq = x[b].q + GI_KB * kb;
                    const __m256i ql = bc32(xq + 2 * t), qh = bc32(xq + 16 + 2 * t);
                    is[b][0] = _mm256_add_epi32(is[b][0], _mm256_madd_epi16(lo0, ql));
                    is[b][1] = _mm256_add_epi32(is[b][1], _mm256_madd_epi16(lo1, ql));
                    is[b][0] = _mm256_add_epi32(is[b][0], _mm256_madd_epi16(hi0, qh));
                    is[b][1] = _mm256_add_epi32(is[b][1], _mm256_madd_epi16(hi1, qh));
                }
            }
            for (int h = 0; h < 2; h++)
                for (int b = 0; b < NB; b++) {
                    const __m256 d = _mm256_set1_ps(x[b].d[kb]);
                    acc[b][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[b][h]), _mm256_mul_ps(s[h], d), acc[b][h]);
                }
        }
        else {
            __m256i is[NBMAX][2];
            for (int b = 0; b < NB; b++) is[b][0] = is[b][1] = _mm256_setzero_si256();
            for (int t = 0; t < 16; t++) {
                const __m256i w0 = ld128w(p + 32 * t, 1), w1 = ld128w(p + 32 * t + 16, 1);
                for (int b = 0; b < NB; b++) {
                    const __m256i q = bc32(x[b].q + GI_KB * kb + 2 * t);
                    is[b][0] = _mm256_add_epi32(is[b][0], _mm256_madd_epi16(w0, q));
                    is[b][1] = _mm256_add_epi32(is[b][1], _mm256_madd_epi16(w1, q));
                }
            }
            for (int h = 0; h < 2; h++)
                for (int b = 0; b < NB; b++)
                    acc[b][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[b][h]), _mm256_set1_ps(x[b].d[kb]), acc[b][h]);
        }
        p += int4 ? 256 : 512;
    }
    for (int b = 0; b < NB; b++)
        for (int h = 0; h < 2; h++) {
            const __m256 bv = _mm256_loadu_ps(bias + 8 * h);
            _mm256_storeu_ps(res[b] + 8 * h, int4 ? _mm256_add_ps(acc[b][h], bv)
                                                  : _mm256_fmadd_ps(acc[b][h], sc[h], bv));
        }
}

void gi_rows(const Weight *w, int n0, int nn, int B, const uint8_t *xq, int64_t ldq, float *out,
             int ldo)
{
    const uint8_t *blk = w->rp + (int64_t)(n0 / GI_RB) * gi_block_bytes(w);
    float bias[GI_RB] = {0};
    if (w->bias) memcpy(bias, w->bias + n0, sizeof(float) * nn);
    for (int b0 = 0; b0 < B; b0 += NBMAX) {
        const int NB = B - b0 < NBMAX ? B - b0 : NBMAX;
        QRow x[NBMAX];
        float res[NBMAX][GI_RB];
        for (int b = 0; b < NB; b++) x[b] = qrow(xq + (b0 + b) * ldq, w->K);
        switch (NB) {
        case 1: tile(w, blk, x, 1, bias, res); break;
        case 2: tile(w, blk, x, 2, bias, res); break;
        case 3: tile(w, blk, x, 3, bias, res); break;
        default: tile(w, blk, x, 4, bias, res);
        }
        for (int b = 0; b < NB; b++)
            for (int j = 0; j < nn; j++) out[(int64_t)j * ldo + b0 + b] = res[b][j];
    }
}

int kvrun_gemv_isa(void) { return 1; }

#else
/* plain C: one input row at a time over the block, the SIMD paths' operations per lane */
void gi_rows(const Weight *w, int n0, int nn, int B, const uint8_t *xq, int64_t ldq, float *out,
             int ldo)
{
    const int int4 = w->kind == W_INT4, K = w->K, nk = pad32(K) / GI_KB;
    const int per = int4 ? w->G / GI_KB : 1;
    const uint8_t *blk = w->rp + (int64_t)(n0 / GI_RB) * gi_block_bytes(w);
    for (int b = 0; b < B; b++) {
        const QRow x = qrow(xq + b * ldq, K);
        const uint8_t *p = blk;
        float acc[GI_RB] = {0}, sc[GI_RB];
        f16 s[GI_RB] = {0}, m[GI_RB];
        if (!int4) {
            memcpy(sc, p, sizeof sc);
            p += sizeof sc;
        }
        for (int kb = 0; kb < nk; kb++) {
            const int16_t *q = x.q + GI_KB * kb;
            int32_t is[GI_RB] = {0};
            if (int4 && kb % per == 0) {
                memcpy(s, p, sizeof s);
                memcpy(m, p + sizeof s, sizeof m);
                for (int r = 0; r < GI_RB; r++) acc[r] = fmaf((float)m[r], x.s[kb / per], acc[r]);
                p += sizeof s + sizeof m;
            }
            if (int4) {
                for (int t = 0; t < 8; t++)
                    for (int r = 0; r < GI_RB; r++)
                        for (int e = 0; e < 2; e++) {
                            const int v = p[32 * t + 2 * r + e];
                            is[r] += (v & 15) * q[2 * t + e] + (v >> 4) * q[16 + 2 * t + e];
                        }
                p += 256;
            } else {
                for (int t = 0; t < 16; t++)
                    for (int r = 0; r < GI_RB; r++)
                        for (int e = 0; e < 2; e++) is[r] += (int8_t)p[32 * t + 2 * r + e] * q[2 * t + e];
                p += 512;
            }
            for (int r = 0; r < GI_RB; r++)
                acc[r] = fmaf((float)is[r], int4 ? (float)s[r] * x.d[kb] : x.d[kb], acc[r]);
        }
        for (int j = 0; j < nn; j++) {
            const float bias = w->bias ? w->bias[n0 + j] : 0.f;
            out[(int64_t)j * ldo + b] = int4 ? acc[j] + bias : fmaf(acc[j], sc[j], bias);
        }
    }
}

int kvrun_gemv_isa(void) { return 0; }
#endif
