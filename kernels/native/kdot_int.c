/* kdot_int: the integer q.K over KIVI's packed keys (kdot_int.h), the attention's
 * counterpart of the integer GEMVs (gemv_int.c), on the ISA int_dot.h picks.
 *
 * vpdpwssd sums 2 int16 products into one int32 lane, so a lane must hold channels of one
 * token while the chanpack layout stores 32 tokens of one channel per 32 bytes. Per 4
 * channels the 4 rows of 32 bytes are transposed in registers (two byte unpacks, two lane
 * shuffles, two word unpacks: 32 lanes of 4 channel bytes, tokens in transpose4's order), so
 * one transpose serves every tile sharing the bytes (2 at 4 bits, 4 at 2 bits) and every
 * query row; a tile's codes are then taken out of their bit fields as two words per lane,
 * channels (d, d+2) and (d+1, d+3), against the query's words in that order (ki_quantize).
 * The sums are put back in token order once per tile and row. The plain C path computes the
 * same integers.
 *
 * 3-bit keys add their third bits (a second transpose of the 1-bit planes' rows, shifted
 * into bit 2 of the same words) before the products: one set of dot instructions still.
 *
 * Bytes read per call: D rows of 32 code bytes once (and D of the third bits' 32 with
 * hb); the quantized rows (2 P R D bytes) from L1.
 */
#include <math.h>
#include <string.h>
#include "kdot_int.h"
#include "int_dot.h"

#define INLINE static inline __attribute__((always_inline))

#if GI_VNNI
enum { PREFETCH = 256 };      /* bytes ahead in a channel row: 8 chanpack blocks */

/* x0, x1: the 32 bytes of channel rows d..d+3 (ds apart) as 32 int32 lanes, byte k of a
 * lane = channel d + k; x0 holds tokens 0-3, 16-19, 8-11, 24-27, x1 tokens 4-7, 20-23,
 * 12-15, 28-31 */
INLINE void transpose4(const uint8_t *row, int64_t ds, __m512i *x0, __m512i *x1)
{
    const __m512i a = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)row)),
                                         _mm256_loadu_si256((const __m256i *)(row + 2 * ds)), 1);
    const __m512i b = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(row + ds))),
                                         _mm256_loadu_si256((const __m256i *)(row + 3 * ds)), 1);
    const __m512i lo = _mm512_unpacklo_epi8(a, b), hi = _mm512_unpackhi_epi8(a, b);
    const __m512i p01 = _mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));   /* rows d, d+1 */
    const __m512i p23 = _mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(3, 2, 3, 2));   /* rows d+2, d+3 */
    *x0 = _mm512_unpacklo_epi16(p01, p23);
    *x1 = _mm512_unpackhi_epi16(p01, p23);
}

/* ki_dot for PP tiles x NR rows, constants so the accumulators stay in registers */
INLINE void ki_dot_vnni(const uint8_t *b, int64_t ds, int D, int bits, int sh, const uint8_t *hb,
                        int64_t hds, int hsh, const int16_t *qi, int32_t *out, const int PP, const int NR)
{
    __m512i acc[KI_ACC][2];
    for (int k = 0; k < PP * NR; k++) acc[k][0] = acc[k][1] = _mm512_setzero_si512();
    const __m512i m = _mm512_set1_epi32(((1 << bits) - 1) * 0x10001);  /* word low bits */
    const __m512i m4 = _mm512_set1_epi32(4 * 0x10001);              /* word bit 2 */
    __m128i cnt[4], cnt8[4], hcnt[4], hcnt6[4];
    for (int p = 0; p < PP; p++) {
        cnt[p] = _mm_cvtsi32_si128(sh + bits * p);
        cnt8[p] = _mm_cvtsi32_si128(sh + bits * p + 8);
        hcnt[p] = _mm_cvtsi32_si128(hsh + p);
        hcnt6[p] = _mm_cvtsi32_si128(hsh + p + 6);   /* the high byte's bit to bit 2 */
    }
    for (int d = 0; d < D; d += 4) {
        const uint8_t *row = b + d * ds;
        /* 4 of the D channel streams, more than the hardware prefetcher follows */
        for (int k = 0; k < 4; k++) _mm_prefetch((const char *)(row + k * ds + PREFETCH), _MM_HINT_T0);
        __m512i x0, x1, y0 = _mm512_setzero_si512(), y1 = _mm512_setzero_si512(), z0 = y0, z1 = y1;
        transpose4(row, ds, &x0, &x1);
        if (hb) {
            const uint8_t *hrow = hb + d * hds;
            for (int k = 0; k < 4; k++) _mm_prefetch((const char *)(hrow + k * hds + PREFETCH), _MM_HINT_T0);
            transpose4(hrow, hds, &y0, &y1);
            z0 = _mm512_slli_epi16(y0, 2);     /* bit b of a word's low byte at b + 2 */
            z1 = _mm512_slli_epi16(y1, 2);
        }
        for (int p = 0; p < PP; p++) {
            /* -- the tile's codes as words: channels (d, d+2) and (d+1, d+3) of each lane -- */
            __m512i e0 = _mm512_and_si512(_mm512_srl_epi16(x0, cnt[p]), m);
            __m512i e1 = _mm512_and_si512(_mm512_srl_epi16(x1, cnt[p]), m);
            __m512i o0 = _mm512_and_si512(_mm512_srl_epi16(x0, cnt8[p]), m);
            __m512i o1 = _mm512_and_si512(_mm512_srl_epi16(x1, cnt8[p]), m);
            if (hb) {                       /* + 4 x the third bit: e | (bit moved to 2 & m4) */
                e0 = _mm512_ternarylogic_epi32(e0, _mm512_srl_epi16(z0, hcnt[p]), m4, 0xF8);
                e1 = _mm512_ternarylogic_epi32(e1, _mm512_srl_epi16(z1, hcnt[p]), m4, 0xF8);
                o0 = _mm512_ternarylogic_epi32(o0, _mm512_srl_epi16(y0, hcnt6[p]), m4, 0xF8);
                o1 = _mm512_ternarylogic_epi32(o1, _mm512_srl_epi16(y1, hcnt6[p]), m4, 0xF8);
            }
            for (int r = 0; r < NR; r++) {
                int32_t w[2];                   /* the row's words (d, d+2), (d+1, d+3) */
                memcpy(w, qi + (p * NR + r) * D + d, 8);
                const __m512i qe = _mm512_set1_epi32(w[0]), qo = _mm512_set1_epi32(w[1]);
                __m512i *a = acc[p * NR + r];
                a[0] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(a[0], e0, qe), o0, qo);
                a[1] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(a[1], e1, qe), o1, qo);
            }
        }
    }
    /* -- back to token order: lanes of x0 / x1 (transpose4) -- */
    const __m512i t0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    const __m512i t1 = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int k = 0; k < PP * NR; k++) {
        _mm512_storeu_si512(out + k * 32, _mm512_permutex2var_epi32(acc[k][0], t0, acc[k][1]));
        _mm512_storeu_si512(out + k * 32 + 16, _mm512_permutex2var_epi32(acc[k][0], t1, acc[k][1]));
    }
}

#define KI(pp, nr) ki_dot_vnni(b, ds, D, bits, sh, hb, hds, hsh, qi, out, pp, nr)
#define ROWS3(pp) case 1: KI(pp, 1); break; case 2: KI(pp, 2); break; case 3: KI(pp, 3); break
#define ROWS6(pp) ROWS3(pp); case 4: KI(pp, 4); break; case 5: KI(pp, 5); break; case 6: KI(pp, 6); break

void ki_dot(const uint8_t *b, int64_t ds, int D, int bits, int sh, const uint8_t *hb, int64_t hds,
            int hsh, int P, int R, const int16_t *qi, int32_t *out)
{
    switch (P) {
    case 1:
        switch (R) {
        ROWS6(1); case 7: KI(1, 7); break; case 8: KI(1, 8); break; case 9: KI(1, 9); break;
        case 10: KI(1, 10); break; case 11: KI(1, 11); break; default: KI(1, 12);
        }
        break;
    case 2: switch (R) { ROWS6(2); } break;
    case 3: switch (R) { ROWS3(3); default: KI(3, 4); } break;
    default: switch (R) { ROWS3(4); } break;
    }
}
#undef ROWS6
#undef ROWS3
#undef KI

float ki_quantize(const float *x, int n, int16_t *qi)
{
    /* within each 4 channels: d, d+2, d+1, d+3 (the words ki_dot_vnni pairs) */
    const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
    __m512 mx = _mm512_setzero_ps();
    for (int d = 0; d < n; d += 16) {
        const __mmask16 k = n - d >= 16 ? 0xffff : (__mmask16)((1u << (n - d)) - 1);
        mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_maskz_loadu_ps(k, x + d)));
    }
    const float amax = _mm512_reduce_max_ps(mx);
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? KI_QMAX / amax : 0.f);
    for (int d = 0; d < n; d += 16) {       /* cvtps: the rounding mode, nearest even (rintf) */
        const __mmask16 k = n - d >= 16 ? 0xffff : (__mmask16)((1u << (n - d)) - 1);
        const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + d), inv));
        _mm512_mask_cvtepi32_storeu_epi16(qi + d, k, _mm512_permutexvar_epi32(order, c));
    }
    return amax / KI_QMAX;
}

float ki_fold_quantize(const float *q, const float *s, const float *z, int n, int16_t *qi,
                       float *bias)
{
    const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
    __m512 x[16], mx = _mm512_setzero_ps(), bz = _mm512_setzero_ps();
    const int nv = (n + 15) / 16;
    for (int i = 0; i < nv; i++) {
        const __mmask16 k = n - 16 * i >= 16 ? 0xffff : (__mmask16)((1u << (n - 16 * i)) - 1);
        const __m512 qv = _mm512_maskz_loadu_ps(k, q + 16 * i);
        x[i] = _mm512_mul_ps(qv, _mm512_maskz_loadu_ps(k, s + 16 * i));
        mx = _mm512_max_ps(mx, _mm512_abs_ps(x[i]));
        bz = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(k, z + 16 * i), bz);
    }
    const float amax = _mm512_reduce_max_ps(mx);
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? KI_QMAX / amax : 0.f);
    for (int i = 0; i < nv; i++) {
        const __mmask16 k = n - 16 * i >= 16 ? 0xffff : (__mmask16)((1u << (n - 16 * i)) - 1);
        const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(x[i], inv));
        _mm512_mask_cvtepi32_storeu_epi16(qi + 16 * i, k, _mm512_permutexvar_epi32(order, c));
    }
    *bias = _mm512_reduce_add_ps(bz);
    return amax / KI_QMAX;
}

#else
void ki_dot(const uint8_t *b, int64_t ds, int D, int bits, int sh, const uint8_t *hb, int64_t hds,
            int hsh, int P, int R, const int16_t *qi, int32_t *out)
{
    const int mask = (1 << bits) - 1;
    int32_t acc[KI_ACC][32] = {{0}};
    for (int d = 0; d < D; d++) {           /* a channel's codes taken out once per tile */
        const uint8_t *row = b + d * ds;
        for (int p = 0; p < P; p++) {
            int32_t c[32];
            for (int j = 0; j < 32; j++) c[j] = (row[j] >> (sh + bits * p)) & mask;
            if (hb)
                for (int j = 0; j < 32; j++) c[j] |= ((hb[d * hds + j] >> (hsh + p)) & 1) << 2;
            for (int r = 0; r < R; r++) {
                const int32_t w = qi[(p * R + r) * D + d];
                for (int j = 0; j < 32; j++) acc[p * R + r][j] += w * c[j];
            }
        }
    }
    memcpy(out, acc, sizeof(int32_t) * 32 * P * R);
}

float ki_quantize(const float *x, int n, int16_t *qi)
{
    float amax = 0.f;
    for (int d = 0; d < n; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
    const float inv = amax > 0.f ? KI_QMAX / amax : 0.f;
    for (int d = 0; d < n; d++) qi[d] = (int16_t)rintf(x[d] * inv);     /* channel order */
    return amax / KI_QMAX;
}

float ki_fold_quantize(const float *q, const float *s, const float *z, int n, int16_t *qi,
                       float *bias)
{
    float x[256], bz = 0.f;
    for (int d = 0; d < n; d++) {
        x[d] = q[d] * s[d];
        bz += q[d] * z[d];
    }
    *bias = bz;
    return ki_quantize(x, n, qi);
}
#endif
