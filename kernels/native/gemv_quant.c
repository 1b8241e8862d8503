/* gemv_quant: the integer GEMV's input (gemv.h, gemv_int.c): one GEMV input row x (K,)
 * quantized once, before the GEMV, for every weight row that reads it (q/k/v share one
 * input, gate and up share one).
 *
 * Per block j of QB = 4 columns: d_j = max|x| / 127 and q = rint(x * (127 / max|x|)) in
 * [-127, 127] (ties to even); a block whose max|x| is below TINY gets d_j = 0 and zero
 * codes. For int4 weights the sums d_j sum(q)_j are added up per weight group g into xs_g,
 * the input of the min term m_g xs_g, as llama.cpp's Q8_1 blocks carry their sum.
 *
 * Blocks of 4, where llama.cpp's Q8_0/Q8_1 take 32: the dot loop applies one scale per
 * lane of 4 codes anyway (gemv_int.c), so finer blocks cost it nothing, and an outlier then
 * coarsens the codes of 3 neighbours instead of 31 (KL divergence of the next-token
 * distribution against the fp32 GEMVs ~8x lower than blocks of 32: docs/measurements.md).
 *
 * The row (QRow, gi_row_bytes) holds the codes in the order the weight's bytes decode in,
 * per chunk of 64 columns: int8 weights column order; int4 the columns of the chunk's 32
 * bytes' low nibbles, then of their high nibbles. Beside them each lane's block scale and,
 * for the VNNI int8 dot, -128 x the lane's code sum (gemv_int.c).
 *
 * Bytes: reads K floats, writes ~3.1 K bytes; with AVX-512 16 columns per step.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "gemv.h"

/* blocks whose max |x| is below this quantize to zeros: 127 / max|x| would overflow */
#define TINY 1e-30f

#if GI_VNNI
/* codes nat (Kp,), block scales dj and code sums sj of x (K,), 16 columns at a time: each
 * lane ends up holding its block's max (and sum) by max (add) with its neighbours at
 * distance 1, 2, ... QB/2; the first lane of each block is stored */
static void quantize_blocks(const float *x, int K, int8_t *nat, float *dj, int32_t *sj)
{
    const __mmask16 first = QB == 4 ? 0x1111 : QB == 8 ? 0x0101 : 0x0001;
    for (int k = 0; k < K; k += 16) {
        const __mmask16 in = K - k >= 16 ? 0xffff : (__mmask16)((1u << (K - k)) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(in, x + k);
        __m512 m = _mm512_abs_ps(v);
        m = _mm512_max_ps(m, _mm512_permute_ps(m, 0xb1));
        m = _mm512_max_ps(m, _mm512_permute_ps(m, 0x4e));
        if (QB >= 8) m = _mm512_max_ps(m, _mm512_shuffle_f32x4(m, m, 0xb1));
        if (QB >= 16) m = _mm512_max_ps(m, _mm512_shuffle_f32x4(m, m, 0x4e));
        const __mmask16 live = _mm512_cmp_ps_mask(m, _mm512_set1_ps(TINY), _CMP_GE_OQ);
        const __m512 id = _mm512_maskz_div_ps(live, _mm512_set1_ps(127.f), m);
        const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v, id));      /* ties to even */
        _mm_storeu_si128((__m128i *)(nat + k), _mm512_cvtsepi32_epi8(qi));
        __m512i t = _mm512_add_epi32(qi, _mm512_shuffle_epi32(qi, 0xb1));
        t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, 0x4e));
        if (QB >= 8) t = _mm512_add_epi32(t, _mm512_shuffle_i32x4(t, t, 0xb1));
        if (QB >= 16) t = _mm512_add_epi32(t, _mm512_shuffle_i32x4(t, t, 0x4e));
        /* compress in registers, then a plain 4-lane store (compress-to-memory is slow on
         * Zen 4); the lanes past this chunk's blocks are overwritten by the next chunk or
         * land in the arrays' slack */
        const __m512 dv = _mm512_maskz_div_ps(live, m, _mm512_set1_ps(127.f));
        _mm_storeu_ps(dj + k / QB, _mm512_castps512_ps128(_mm512_maskz_compress_ps(first, dv)));
        _mm_storeu_si128((__m128i *)(sj + k / QB),
                         _mm512_castsi512_si128(_mm512_maskz_compress_epi32(first, t)));
    }
}
#else
static void quantize_blocks(const float *x, int K, int8_t *nat, float *dj, int32_t *sj)
{
    for (int j = 0; j < (K + QB - 1) / QB; j++) {
        const int k0 = j * QB, n = k0 + QB < K ? QB : K - k0;
        uint32_t m = 0;         /* max |x| as the largest bit pattern of |x|: an integer max
                                 * the compiler vectorizes, where fmaxf's NaN rules stop it */
        for (int k = k0; k < k0 + n; k++) {
            uint32_t u;
            memcpy(&u, x + k, 4);
            u &= 0x7fffffffu;
            m = u > m ? u : m;
        }
        float amax;
        memcpy(&amax, &m, 4);
        const int live = amax >= TINY;
        const float id = live ? 127.f / amax : 0.f;
        int32_t sum = 0;
        for (int k = k0; k < k0 + n; k++) {
            const int v = (int)rintf(x[k] * id);
            nat[k] = (int8_t)v;
            sum += v;
        }
        dj[j] = live ? amax / 127.f : 0.f;
        sj[j] = sum;
    }
}
#endif

void gi_quantize(const Weight *w, const float *x, uint8_t *row)
{
    const int K = w->K, Kp = pad64(K);
    int8_t *q = (int8_t *)row, nat[Kp];                 /* nat: the codes in column order */
    float *d = (float *)(row + Kp), *s = (float *)(row + 3 * Kp), dj[Kp / QB + 4];
    int32_t *c = (int32_t *)(row + 2 * Kp), sj[Kp / QB + 4];
    quantize_blocks(x, K, nat, dj, sj);
    memset(nat + K, 0, Kp - K);
    memset(d, 0, Kp);                                   /* lanes past the row: scale 0 */
    if (w->kind == W_INT4) {
        /* weight byte p of group g (offset r = p - g G/2) holds columns g G + r (low nibble)
         * and g G + r + G/2 (high), decoded to byte p % 32 and 32 + p % 32 of chunk p / 32;
         * runs of 16 bytes hold 16 consecutive columns (G/2 >= 16) */
        memset(q, 0, Kp);
        const int h = w->G / 2;
        for (int p = 0, g = 0, r = 0; p < K / 2; p += 16) {
            int8_t *o = q + 64 * (p / 32) + p % 32;
            float *dl = d + 16 * (p / 32) + (p % 32) / 4;
            const int lo = g * w->G + r, hi = lo + h;
            memcpy(o, nat + lo, 16);
            memcpy(o + 32, nat + hi, 16);
            for (int l = 0; l < 4; l++) {       /* lane l: 4 columns from lo + 4 l */
                dl[l] = dj[(lo + 4 * l) / QB];
                dl[8 + l] = dj[(hi + 4 * l) / QB];
            }
            if ((r += 16) == h) r = 0, g++;
        }
        for (int g = 0; g < K / w->G; g++) {
            float a = 0.f;
            for (int j = g * (w->G / QB); j < (g + 1) * (w->G / QB); j++) a += dj[j] * (float)sj[j];
            s[g] = a;
        }
    } else {
        memcpy(q, nat, Kp);
        for (int l = 0; 4 * l < K; l++) d[l] = dj[4 * l / QB];   /* lane l: columns 4l..4l+3 */
    }
    for (int l = 0; l < Kp / 4; l++)        /* the VNNI int8 dot's start: -128 sum(q) per lane */
        c[l] = -128 * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
}

