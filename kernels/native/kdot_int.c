/* kdot_int: the integer q.K over KIVI's packed keys and p.V over its packed values
 * (kdot_int.h), the attention's counterpart of the integer GEMVs (gemv_int.c), on the ISA
 * int_dot.h picks.
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
 * 3-bit keys add their third bits (a second transpose of the 1-bit planes' rows) before the
 * products: one set of dot instructions still. With GFNI each tile's code is gathered from
 * the two planes by one GF(2) affine bit permutation per plane (bits 0-2 of every byte) and
 * an OR; without, shifted into bit 2 of the same words.
 *
 * p.V (kv_mix): the chan layout already holds a token's 64 channels in one row of 32 bytes,
 * so two adjacent rows interleaved byte by byte and widened give each lane a channel of
 * tokens (j, j+1) as two words, against the pair's two int16 weights broadcast: 4 vpdpwssd
 * per row and token pair where the fp32 kernel spent 8 FMAs, no transpose.
 *
 * Bytes read per call: q.K, D rows of 32 code bytes once (and D of the third bits' 32 with
 * hb), the quantized rows (2 P R D bytes) from L1; p.V, 32 rows of 32 code bytes once, the
 * weights (2 x 64 R bytes) and the R x 64 sums from L1.
 */
#include <math.h>
#include <string.h>
#include "kdot_int.h"
#include "int_dot.h"

#define INLINE static inline __attribute__((always_inline))

#if GI_VNNI
enum { PREFETCH = 256 };      /* bytes ahead in a channel row: 8 chanpack blocks */

/* acc += the int16 pair products of a and b, in place (vpdpwssd): with the intrinsic GCC 12
 * copies loop-carried accumulators between registers (kv_mix at 4 rows: ~90 ns a tile
 * against ~79 here) */
INLINE __m512i dpw(__m512i acc, __m512i a, __m512i b)
{
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

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

/* the NR query rows' dots with one tile's codes at channels d..d+3: words (d, d+2) in e0 / e1
 * and (d+1, d+3) in o0 / o1 (x0's and x1's tokens); q: row 0's words at d, rows D apart */
INLINE void ki_dot_rows(__m512i e0, __m512i e1, __m512i o0, __m512i o1, const int16_t *q, int D,
                        __m512i (*acc)[2], const int NR)
{
#pragma GCC unroll 12
    for (int r = 0; r < NR; r++) {
        int32_t w[2];                       /* the row's words (d, d+2), (d+1, d+3) */
        memcpy(w, q + r * D, 8);
        const __m512i qe = _mm512_set1_epi32(w[0]), qo = _mm512_set1_epi32(w[1]);
        acc[r][0] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(acc[r][0], e0, qe), o0, qo);
        acc[r][1] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(acc[r][1], e1, qe), o1, qo);
    }
}

#if defined(__GFNI__)
/* a GF(2) affine matrix row (_mm512_gf2p8affine_epi64_epi8): output bit j = input bit k */
INLINE uint64_t gf_pick(int j, int k) { return (uint64_t)(1u << k) << (8 * (7 - j)); }
#endif

/* ki_dot for PP tiles x NR rows, constants so the accumulators stay in registers */
INLINE void ki_dot_vnni(const uint8_t *b, int64_t ds, int D, int bits, int sh, const uint8_t *hb,
                        int64_t hds, int hsh, uint8_t *hy, int hmode, const int16_t *qi, int32_t *out,
                        const int PP, const int NR)
{
    __m512i acc[KI_ACC][2];
    for (int k = 0; k < PP * NR; k++) acc[k][0] = acc[k][1] = _mm512_setzero_si512();
    const __m512i m = _mm512_set1_epi32(((1 << bits) - 1) * 0x10001);  /* word low bits */
    __m128i cnt[4], cnt8[4];
    for (int p = 0; p < PP; p++) {
        cnt[p] = _mm_cvtsi32_si128(sh + bits * p);
        cnt8[p] = _mm_cvtsi32_si128(sh + bits * p + 8);
    }
#if !defined(__GFNI__)
    /* 3-bit keys: the third bit shifted to bit 2 of each word and merged per register */
    const __m512i m4 = _mm512_set1_epi32(4 * 0x10001);              /* word bit 2 */
    __m128i hcnt[4], hcnt6[4];
    for (int p = 0; p < PP; p++) {
        hcnt[p] = _mm_cvtsi32_si128(hsh + p);
        hcnt6[p] = _mm_cvtsi32_si128(hsh + p + 6);   /* the high byte's bit to bit 2 */
    }
#else
    /* 3-bit keys: tile p's code bits gathered into bits 0-2 of each byte by one GF(2) affine
     * per plane (low bits sh + 2p, sh + 2p + 1 of the codes; the third bit hsh + p of the
     * 1-bit planes), so a tile costs two affines, an OR and a mask or shift per register:
     * five instructions where the shifts and bit-2 merges took eight */
    __m512i gl[4], gh[4];
    if (hb)
        for (int p = 0; p < PP; p++) {
            gl[p] = _mm512_set1_epi64(gf_pick(0, sh + 2 * p) | gf_pick(1, sh + 2 * p + 1));
            gh[p] = _mm512_set1_epi64(gf_pick(2, hsh + p));
        }
    const __m512i mlo = _mm512_set1_epi32(0x00FF00FF);     /* the words' low bytes */
#endif
    for (int d = 0; d < D; d += 4) {
        const uint8_t *row = b + d * ds;
        /* 4 of the D channel streams, more than the hardware prefetcher follows */
        for (int k = 0; k < 4; k++) _mm_prefetch((const char *)(row + k * ds + PREFETCH), _MM_HINT_T0);
        __m512i x0, x1, y0 = _mm512_setzero_si512(), y1 = _mm512_setzero_si512();
        transpose4(row, ds, &x0, &x1);
        if (hb && hmode == KI_HY_READ) {
            y0 = _mm512_loadu_si512(hy + d * 32);
            y1 = _mm512_loadu_si512(hy + d * 32 + 64);
        } else if (hb) {
            const uint8_t *hrow = hb + d * hds;
            for (int k = 0; k < 4; k++) _mm_prefetch((const char *)(hrow + k * hds + PREFETCH), _MM_HINT_T0);
            transpose4(hrow, hds, &y0, &y1);
            if (hmode == KI_HY_FILL) {
                _mm512_storeu_si512(hy + d * 32, y0);
                _mm512_storeu_si512(hy + d * 32 + 64, y1);
            }
        }
#if !defined(__GFNI__)
        __m512i z0 = y0, z1 = y1;
        if (hb) {
            z0 = _mm512_slli_epi16(y0, 2);     /* bit b of a word's low byte at b + 2 */
            z1 = _mm512_slli_epi16(y1, 2);
        }
#endif
#pragma GCC unroll 8     /* whole: acc[p * NR + r] stays in registers only at constant indices */
        for (int p = 0; p < PP; p++) {
#if defined(__GFNI__)
            if (hb) {
                const __m512i c0 = _mm512_or_si512(_mm512_gf2p8affine_epi64_epi8(x0, gl[p], 0),
                                                   _mm512_gf2p8affine_epi64_epi8(y0, gh[p], 0));
                const __m512i c1 = _mm512_or_si512(_mm512_gf2p8affine_epi64_epi8(x1, gl[p], 0),
                                                   _mm512_gf2p8affine_epi64_epi8(y1, gh[p], 0));
                ki_dot_rows(_mm512_and_si512(c0, mlo), _mm512_and_si512(c1, mlo), _mm512_srli_epi16(c0, 8),
                            _mm512_srli_epi16(c1, 8), qi + p * NR * D + d, D, acc + p * NR, NR);
                continue;
            }
#endif
            /* -- the tile's codes as words: channels (d, d+2) and (d+1, d+3) of each lane -- */
            __m512i e0 = _mm512_and_si512(_mm512_srl_epi16(x0, cnt[p]), m);
            __m512i e1 = _mm512_and_si512(_mm512_srl_epi16(x1, cnt[p]), m);
            __m512i o0 = _mm512_and_si512(_mm512_srl_epi16(x0, cnt8[p]), m);
            __m512i o1 = _mm512_and_si512(_mm512_srl_epi16(x1, cnt8[p]), m);
#if !defined(__GFNI__)
            if (hb) {                       /* + 4 x the third bit: e | (bit moved to 2 & m4) */
                e0 = _mm512_ternarylogic_epi32(e0, _mm512_srl_epi16(z0, hcnt[p]), m4, 0xF8);
                e1 = _mm512_ternarylogic_epi32(e1, _mm512_srl_epi16(z1, hcnt[p]), m4, 0xF8);
                o0 = _mm512_ternarylogic_epi32(o0, _mm512_srl_epi16(y0, hcnt6[p]), m4, 0xF8);
                o1 = _mm512_ternarylogic_epi32(o1, _mm512_srl_epi16(y1, hcnt6[p]), m4, 0xF8);
            }
#endif
            ki_dot_rows(e0, e1, o0, o1, qi + p * NR * D + d, D, acc + p * NR, NR);
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

#define KI(pp, nr) ki_dot_vnni(b, ds, D, bits, sh, hb, hds, hsh, hy, hmode, qi, out, pp, nr)
#define ROWS3(pp) case 1: KI(pp, 1); break; case 2: KI(pp, 2); break; case 3: KI(pp, 3); break
#define ROWS6(pp) ROWS3(pp); case 4: KI(pp, 4); break; case 5: KI(pp, 5); break; case 6: KI(pp, 6); break

void ki_dot(const uint8_t *b, int64_t ds, int D, int bits, int sh, const uint8_t *hb, int64_t hds,
            int hsh, uint8_t *hy, int hmode, int P, int R, const int16_t *qi, int32_t *out)
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

/* kv_mix, NR rows. Tokens j, j+1 are adjacent rows of 32 bytes: their bytes interleaved
 * (byte unpacks within 128-bit lanes) and widened to words give 16 lanes of (token j,
 * token j+1) per 16 bytes, bytes 0-7 and 16-23 in x0, 8-15 and 24-31 in x1; each nibble
 * field is then a shift and a mask, and the row's weights for the pair are one broadcast
 * dword per half (channels 0-31, 32-63). Register k of a row holds channels 0-7 + 16-23,
 * 8-15 + 24-31, then + 32. SH: the field's shift (-1: given at run time). */
INLINE void kv_mix_vnni(const uint8_t *b, int64_t rs, int bits, int sh, const int16_t *wlo,
                        const int16_t *whi, int ws, int32_t *out, const int NR, const int BITS,
                        const int SH)
{
    __m512i acc[KV_ROWS][4];
    for (int r = 0; r < NR; r++)            /* out's sums into the registers' channel order */
        for (int h = 0; h < 2; h++) {
            const __m512i a = _mm512_loadu_si512(out + r * 64 + 32 * h);
            const __m512i c = _mm512_loadu_si512(out + r * 64 + 32 * h + 16);
            acc[r][2 * h] = _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(1, 0, 1, 0));
            acc[r][2 * h + 1] = _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(3, 2, 3, 2));
        }
    const __m512i m = _mm512_set1_epi16((short)((1 << BITS) - 1));
    const __m128i s0 = _mm_cvtsi32_si128(sh), s1 = _mm_cvtsi32_si128(sh + 4);
    for (int j = 0; j < 32; j += 2) {
        const __m256i r0 = _mm256_loadu_si256((const __m256i *)(b + j * rs));
        const __m256i r1 = _mm256_loadu_si256((const __m256i *)(b + (j + 1) * rs));
        const __m512i x0 = _mm512_cvtepu8_epi16(_mm256_unpacklo_epi8(r0, r1));
        const __m512i x1 = _mm512_cvtepu8_epi16(_mm256_unpackhi_epi8(r0, r1));
        __m512i v0, v1, v2, v3;
        if (BITS == 4) {                    /* words are zero-extended bytes: no mask on top */
            v0 = _mm512_and_si512(x0, m);
            v1 = _mm512_and_si512(x1, m);
            v2 = _mm512_srli_epi16(x0, 4);
            v3 = _mm512_srli_epi16(x1, 4);
        } else if (SH >= 0) {
            v0 = _mm512_and_si512(_mm512_srli_epi16(x0, SH), m);
            v1 = _mm512_and_si512(_mm512_srli_epi16(x1, SH), m);
            v2 = _mm512_and_si512(_mm512_srli_epi16(x0, SH + 4), m);
            v3 = _mm512_and_si512(_mm512_srli_epi16(x1, SH + 4), m);
        } else {
            v0 = _mm512_and_si512(_mm512_srl_epi16(x0, s0), m);
            v1 = _mm512_and_si512(_mm512_srl_epi16(x1, s0), m);
            v2 = _mm512_and_si512(_mm512_srl_epi16(x0, s1), m);
            v3 = _mm512_and_si512(_mm512_srl_epi16(x1, s1), m);
        }
        for (int r = 0; r < NR; r++) {      /* the row's words for tokens (j, j + 1) */
            int32_t wl, wh;
            memcpy(&wl, wlo + r * ws + j, 4);
            memcpy(&wh, whi + r * ws + j, 4);
            const __m512i bl = _mm512_set1_epi32(wl), bh = _mm512_set1_epi32(wh);
            acc[r][0] = dpw(acc[r][0], v0, bl);
            acc[r][1] = dpw(acc[r][1], v1, bl);
            acc[r][2] = dpw(acc[r][2], v2, bh);
            acc[r][3] = dpw(acc[r][3], v3, bh);
        }
    }
    /* -- back to channel order: 128-bit quarters (0-3, 4-7 | 16-19, 20-23) and (8-15 | 24-31);
     * the same shuffle is its own inverse -- */
    for (int r = 0; r < NR; r++)
        for (int h = 0; h < 2; h++) {
            const __m512i a = acc[r][2 * h], c = acc[r][2 * h + 1];
            _mm512_storeu_si512(out + r * 64 + 32 * h, _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(1, 0, 1, 0)));
            _mm512_storeu_si512(out + r * 64 + 32 * h + 16, _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(3, 2, 3, 2)));
        }
}

#define KV_R(bits_, sh_)                                                                   \
    switch (R) {                                                                           \
    case 1: kv_mix_vnni(b, rs, bits, sh, wlo, whi, ws, out, 1, bits_, sh_); break;        \
    case 2: kv_mix_vnni(b, rs, bits, sh, wlo, whi, ws, out, 2, bits_, sh_); break;        \
    case 3: kv_mix_vnni(b, rs, bits, sh, wlo, whi, ws, out, 3, bits_, sh_); break;        \
    default: kv_mix_vnni(b, rs, bits, sh, wlo, whi, ws, out, 4, bits_, sh_); break;       \
    }

void kv_mix(const uint8_t *b, int64_t rs, int bits, int sh, int R, const int16_t *wlo,
            const int16_t *whi, int ws, int32_t *out)
{
    if (bits == 4 && sh == 0) KV_R(4, 0)
    else if (bits == 2 && sh == 0) KV_R(2, 0)
    else if (bits == 2 && sh == 2) KV_R(2, 2)
    else KV_R(2, -1)
}
#undef KV_R

/* x's max |x| and x * (KI_QMAX / max) rounded to int16 (cvtps: nearest even, as rintf), the
 * words permuted by `order` (ki_quantize's pairs, or none) */
INLINE float quantize_words(const float *x, int n, int16_t *qi, const __m512i order)
{
    __m512 mx = _mm512_setzero_ps();
    for (int d = 0; d < n; d += 16) {
        const __mmask16 k = n - d >= 16 ? 0xffff : (__mmask16)((1u << (n - d)) - 1);
        mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_maskz_loadu_ps(k, x + d)));
    }
    const float amax = _mm512_reduce_max_ps(mx);
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? KI_QMAX / amax : 0.f);
    for (int d = 0; d < n; d += 16) {
        const __mmask16 k = n - d >= 16 ? 0xffff : (__mmask16)((1u << (n - d)) - 1);
        const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + d), inv));
        _mm512_mask_cvtepi32_storeu_epi16(qi + d, k, _mm512_permutexvar_epi32(order, c));
    }
    return amax / KI_QMAX;
}

float ki_quantize(const float *x, int n, int16_t *qi)
{
    /* within each 4 channels: d, d+2, d+1, d+3 (the words ki_dot_vnni pairs) */
    return quantize_words(x, n, qi, _mm512_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15));
}

float kv_quantize(const float *x, int n, int16_t *qi)
{
    return quantize_words(x, n, qi, _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
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
            int hsh, uint8_t *hy, int hmode, int P, int R, const int16_t *qi, int32_t *out)
{
    (void)hy, (void)hmode;                  /* reads the third bits in place */
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
void kv_mix(const uint8_t *b, int64_t rs, int bits, int sh, int R, const int16_t *wlo,
            const int16_t *whi, int ws, int32_t *out)
{
    const int mask = (1 << bits) - 1;
    for (int j = 0; j < 32; j++) {
        const uint8_t *row = b + j * rs;
        for (int r = 0; r < R; r++) {
            const int32_t wl = wlo[r * ws + j], wh = whi[r * ws + j];
            for (int c = 0; c < 32; c++) {
                out[r * 64 + c] += wl * ((row[c] >> sh) & mask);
                out[r * 64 + 32 + c] += wh * ((row[c] >> (sh + 4)) & mask);
            }
        }
    }
}

float kv_quantize(const float *x, int n, int16_t *qi) { return ki_quantize(x, n, qi); }
#endif
