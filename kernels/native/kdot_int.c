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
 * The sums are put back in token order once per tile and row. The AVX2 path (vpmaddwd, no
 * transpose: its own comment below) and the plain C one compute the same integers.
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
#include "math_inline.h"    /* ROW_BLOCKS4 */

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
        for (int k = 0; k < 4; k++) _mm_prefetch((const char *)(row + k * ds + PREFETCH), KV_PF_HINT);
        __m512i x0, x1, y0 = _mm512_setzero_si512(), y1 = _mm512_setzero_si512();
        transpose4(row, ds, &x0, &x1);
        if (hb && hmode == KI_HY_READ) {
            y0 = _mm512_loadu_si512(hy + d * 32);
            y1 = _mm512_loadu_si512(hy + d * 32 + 64);
        } else if (hb) {
            const uint8_t *hrow = hb + d * hds;
            for (int k = 0; k < 4; k++) _mm_prefetch((const char *)(hrow + k * hds + PREFETCH), KV_PF_HINT);
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
#if GI_AVX2
/* -- AVX2: vpmaddwd + vpaddd for vpdpwssd, the query rows in channel order ------------------
 * Without VNNI the 4-channel transpose does not pay: a pair of channel rows (d, d+1),
 * 16 tokens each, interleaved byte by byte and widened gives 16 lanes of (d, d+1) words, 8
 * tokens a register, against the row's words (d, d+1) broadcast, the sums already in token
 * order. A tile is taken in two halves of 16 tokens and the rows 4 at a time (8 int32
 * accumulators in the 16 registers), so a pass reads a half of each channel row (L1 after the
 * first). On an AVX2 machine whose ymm FMA and vpmaddwd both do 8 products a cycle
 * (tools/isa_peak.c) this still beats the fp32 kernel, by the decode (no int -> float
 * conversion, one widening per 16 codes): 1.10-1.20x over 30 layers on Zen 1
 * (docs/measurements.md, "Attention and GEMV kernels"). */
enum { PREFETCH = 256 };

/* two adjacent int16 words in every int32 lane: one load-broadcast (vbroadcastss of their 4
 * bytes; the int32 set1 of a memcpy goes through a general register) */
INLINE __m256i words2(const int16_t *w)
{
    return _mm256_castps_si256(_mm256_broadcast_ss((const float *)w));
}

/* 16 codes (bits at sh of the bytes at p), one a byte: a 16-bit shift brings no bit of the
 * next byte under the mask (sh + bits <= 8) */
INLINE __m128i field16(const uint8_t *p, __m128i cnt, __m128i m)
{
    return _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)p), cnt), m);
}

/* the NR rows' dots of channels [0, D) with tokens 16 h .. 16 h + 15 of tile p: the codes'
 * field at b (cnt, m), plus, with hb, a second plane's field (hcnt, hm) shifted up by hup:
 * 3-bit keys' third bit (hm 1, hup 2), int8 keys' high nibble (b the low plane; hm 15, hup 4) */
INLINE void ki_dot_half(const uint8_t *b, int64_t ds, int D, __m128i cnt, __m128i m,
                        const uint8_t *hb, int64_t hds, __m128i hcnt, __m128i hm, __m128i hup,
                        const int16_t *q, int32_t *out, int pf, const int NR)
{
    __m256i acc[4][2];
    for (int r = 0; r < NR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int d = 0; d < D; d += 2) {
        const uint8_t *row = b + d * ds;
        if (pf) {
            _mm_prefetch((const char *)(row + PREFETCH), KV_PF_HINT);
            _mm_prefetch((const char *)(row + ds + PREFETCH), KV_PF_HINT);
        }
        __m128i x = field16(row, cnt, m), y = field16(row + ds, cnt, m);
        if (hb) {                           /* the second plane's bits above the first's */
            const uint8_t *hr = hb + d * hds;
            if (pf) {
                _mm_prefetch((const char *)(hr + PREFETCH), KV_PF_HINT);
                _mm_prefetch((const char *)(hr + hds + PREFETCH), KV_PF_HINT);
            }
            x = _mm_or_si128(x, _mm_sll_epi16(field16(hr, hcnt, hm), hup));
            y = _mm_or_si128(y, _mm_sll_epi16(field16(hr + hds, hcnt, hm), hup));
        }
        const __m256i w0 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(x, y));    /* tokens 0-7 */
        const __m256i w1 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(x, y));    /* tokens 8-15 */
        for (int r = 0; r < NR; r++) {
            const __m256i qb = words2(q + r * D + d);  /* the row's words (d, d+1) */
            acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(w0, qb));
            acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(w1, qb));
        }
    }
    for (int r = 0; r < NR; r++) {
        _mm256_storeu_si256((__m256i *)(out + r * 32), acc[r][0]);
        _mm256_storeu_si256((__m256i *)(out + r * 32 + 8), acc[r][1]);
    }
}

/* P tiles x R rows: tile p's field at sh + bits p of b, plus (hb) the second plane's at
 * hsh + hstep p (mask hm) shifted up by hup; halves of 16 tokens, rows 4 at a time */
static void ki_dot_planes(const uint8_t *b, int64_t ds, int bits, int sh, const uint8_t *hb,
                          int64_t hds, int hsh, int hstep, int hm, int hup, int D, int P, int R,
                          const int16_t *qi, int32_t *out)
{
    const __m128i m = _mm_set1_epi8((char)((1 << bits) - 1)), hmv = _mm_set1_epi8((char)hm);
    const __m128i upv = _mm_cvtsi32_si128(hup);
    for (int p = 0; p < P; p++) {
        const __m128i cnt = _mm_cvtsi32_si128(sh + bits * p), hcnt = _mm_cvtsi32_si128(hsh + hstep * p);
        for (int h = 0; h < 2; h++) {
            const uint8_t *bh = b + 16 * h, *hh = hb ? hb + 16 * h : NULL;
#define KH(r0, nr) ki_dot_half(bh, ds, D, cnt, m, hh, hds, hcnt, hmv, upv, qi + (p * R + (r0)) * D, \
                               out + (p * R + (r0)) * 32 + 16 * h, !p && !h && !(r0), nr)
            ROW_BLOCKS4(R, KH);
#undef KH
        }
    }
}

void ki_dot(const uint8_t *b, int64_t ds, int D, int bits, int sh, const uint8_t *hb, int64_t hds,
            int hsh, uint8_t *hy, int hmode, int P, int R, const int16_t *qi, int32_t *out)
{
    (void)hy, (void)hmode;                  /* reads the third bits in place */
    ki_dot_planes(b, ds, bits, sh, hb, hds, hsh, 1, 1, 2, D, P, R, qi, out);
}

void ki_dot8(const uint8_t *bh, int64_t dsh, int shh, const uint8_t *bl, int64_t dsl, int shl,
             int D, int P, int R, const int16_t *qi, int32_t *out)
{
    ki_dot_planes(bl, dsl, 4, shl, bh, dsh, shh, 4, 15, 4, D, P, R, qi, out);
}

/* kv_mix's channels 32 n + 16 k + [0, 16) for NR rows: the field at sh + 4 n of tokens j,
 * j+1's 16 bytes, interleaved and widened, gives 8 lanes of (token j, token j+1) words a
 * register, against the rows' words for the pair broadcast */
INLINE void kv_mix_quarter(const uint8_t *b, int64_t pl, int64_t rs, __m128i cnt, __m128i m,
                           const int16_t *w, int ws, int32_t *out, const int NR)
{
    __m256i acc[4][2];
    for (int r = 0; r < NR; r++) {
        acc[r][0] = _mm256_loadu_si256((const __m256i *)(out + r * 64));
        acc[r][1] = _mm256_loadu_si256((const __m256i *)(out + r * 64 + 8));
    }
    for (int j = 0; j < 32; j += 2) {
        __m128i r0 = field16(b + j * rs, cnt, m), r1 = field16(b + (j + 1) * rs, cnt, m);
        if (pl) {                           /* int8: 16 x this plane's nibble + the low plane's */
            r0 = _mm_or_si128(_mm_slli_epi16(r0, 4), field16(b + pl + j * rs, cnt, m));
            r1 = _mm_or_si128(_mm_slli_epi16(r1, 4), field16(b + pl + (j + 1) * rs, cnt, m));
        }
        const __m256i v0 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(r0, r1));
        const __m256i v1 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(r0, r1));
        for (int r = 0; r < NR; r++) {
            const __m256i qb = words2(w + r * ws + j);  /* the row's words for tokens (j, j + 1) */
            acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(v0, qb));
            acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(v1, qb));
        }
    }
    for (int r = 0; r < NR; r++) {
        _mm256_storeu_si256((__m256i *)(out + r * 64), acc[r][0]);
        _mm256_storeu_si256((__m256i *)(out + r * 64 + 8), acc[r][1]);
    }
}

/* kv_mix (pl 0) and kv_mix8 (the low plane pl bytes after b) */
static void kv_mix_planes(const uint8_t *b, int64_t pl, int64_t rs, int bits, int sh, int R,
                          const int16_t *wlo, const int16_t *whi, int ws, int32_t *out)
{
    const __m128i m = _mm_set1_epi8((char)((1 << bits) - 1));
    for (int n = 0; n < 2; n++) {           /* the low fields (channels 0-31), the high ones */
        const __m128i cnt = _mm_cvtsi32_si128(sh + 4 * n);
        for (int k = 0; k < 2; k++) {
            const uint8_t *bk = b + 16 * k;
            int32_t *o = out + 32 * n + 16 * k;
#define KQ(r0, nr) kv_mix_quarter(bk, pl, rs, cnt, m, (n ? whi : wlo) + (r0) * ws, ws, o + (r0) * 64, nr)
            ROW_BLOCKS4(R, KQ);             /* R <= KV_ROWS: one block */
#undef KQ
        }
    }
}

void kv_mix(const uint8_t *b, int64_t rs, int bits, int sh, int R, const int16_t *wlo,
            const int16_t *whi, int ws, int32_t *out)
{
    kv_mix_planes(b, 0, rs, bits, sh, R, wlo, whi, ws, out);
}

void kv_mix8(const uint8_t *b, int64_t pl, int64_t rs, int R, const int16_t *wlo,
             const int16_t *whi, int ws, int32_t *out)
{
    kv_mix_planes(b, pl, rs, 4, 0, R, wlo, whi, ws, out);
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
#endif

#if GI_AVX2
/* x's max |x| and x * (KI_QMAX / max) rounded to int16 in channel order (cvtps: nearest
 * even, as rintf): the plain C loop's integers, 8 lanes at a time */
float ki_quantize(const float *x, int n, int16_t *qi)
{
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 mx = _mm256_setzero_ps();
    int d = 0;
    for (; d + 8 <= n; d += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + d)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    float amax = _mm_cvtss_f32(m4);
    for (; d < n; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
    const float inv = amax > 0.f ? KI_QMAX / amax : 0.f;
    const __m256 iv = _mm256_set1_ps(inv);
    for (d = 0; d + 16 <= n; d += 16) {
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + d), iv));
        const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + d + 8), iv));
        /* packs works per 128-bit lane: a0-3 b0-3 a4-7 b4-7, put back in order */
        _mm256_storeu_si256((__m256i *)(qi + d), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
    }
    for (; d < n; d++) qi[d] = (int16_t)rintf(x[d] * inv);
    return amax / KI_QMAX;
}
#else
float ki_quantize(const float *x, int n, int16_t *qi)
{
    float amax = 0.f;
    for (int d = 0; d < n; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
    const float inv = amax > 0.f ? KI_QMAX / amax : 0.f;
    for (int d = 0; d < n; d++) qi[d] = (int16_t)rintf(x[d] * inv);     /* channel order */
    return amax / KI_QMAX;
}
#endif

float ki_fold_quantize(const float *q, const float *s, const float *z, int n, int16_t *qi,
                       float *bias)
{
    float x[256], bz = 0.f;
#pragma omp simd reduction(+ : bz)      /* q . z in fp32 in any order: vectorized */
    for (int d = 0; d < n; d++) {
        x[d] = q[d] * s[d];
        bz += q[d] * z[d];
    }
    *bias = bz;
    return ki_quantize(x, n, qi);
}

float kv_quantize(const float *x, int n, int16_t *qi) { return ki_quantize(x, n, qi); }
#endif

#if !GI_AVX2
/* the two-plane entries as two calls, one per plane, where a call's dot instructions take a
 * plane's 4-bit codes (VNNI's transposed words, the plain C loop) */
void ki_dot8(const uint8_t *bh, int64_t dsh, int shh, const uint8_t *bl, int64_t dsl, int shl,
             int D, int P, int R, const int16_t *qi, int32_t *out)
{
    int32_t lo[KI_ACC * 32];
    ki_dot(bh, dsh, D, 4, shh, NULL, 0, 0, NULL, 0, P, R, qi, out);
    ki_dot(bl, dsl, D, 4, shl, NULL, 0, 0, NULL, 0, P, R, qi, lo);
    for (int k = 0; k < 32 * P * R; k++) out[k] = 16 * out[k] + lo[k];
}

void kv_mix8(const uint8_t *b, int64_t pl, int64_t rs, int R, const int16_t *wlo,
             const int16_t *whi, int ws, int32_t *out)
{
    int32_t hi[KV_ROWS * 64] = {0}, lo[KV_ROWS * 64] = {0};
    kv_mix(b, rs, 4, 0, R, wlo, whi, ws, hi);
    kv_mix(b + pl, rs, 4, 0, R, wlo, whi, ws, lo);
    for (int k = 0; k < 64 * R; k++) out[k] += 16 * hi[k] + lo[k];
}
#endif
