/* Codebook codecs (cb-2, cb-3, cb-4; kvrun.kernels.codecs.codebook), native CPU: the tile
 * reads decode_attention.c calls for a cb role, so a cb K or V pairs with any codec.
 *
 *   cb_k_tile  logits of a K tile of 32 tokens: D packed groups, one per channel; a
 *              group's 32 codes are decoded to their levels (AVX-512: two 16-entry table
 *              permutes, vpermps, per group; else a table read into a (D, 32) tile in L1),
 *              multiplied with the rows and scaled per token afterwards:
 *              q.k_t = scale_t (q . level[c_t]);
 *   cb_v_mix   p.V over a run of tokens: each token's D/32 groups decoded to levels and
 *              accumulated with weight p_t scale_t (AVX-512: 64 channels x 4 rows of
 *              accumulators held in registers over the run).
 * Layouts (cbpack.py): K codes (Hkv, S/32, D, 4 bits) — tile, channel; V codes (Hkv, S,
 * D/32, 4 bits) — token, channel group; scale (Hkv, S) fp16. A group of 32 codes: 4 bits
 * byte i = c_i | c_{i+16} << 4; 2 bits byte i = c_i | c_{i+8} << 2 | c_{i+16} << 4 |
 * c_{i+24} << 6; 3 bits = the 2-bit group of the low bits, then the high bits as one
 * little-endian 32-bit word (bit j: code j).
 *
 * Bytes read per decode step and layer: each packed group and each token's fp16 scale once.
 * The flush that writes these layouts: codebook_pack.c.
 */
#include <stdint.h>
#include <string.h>

#include "codec_desc.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { CT = 32 };                  /* tokens per tile, codes per group */

/* -- a packed group of 32 codes -------------------------------------------------------------- */

static inline int group_code(const uint8_t *g, int bits, int j) {
    if (bits == 4) return j < 16 ? g[j] & 15 : g[j - 16] >> 4;
    int c = (g[j & 7] >> (2 * (j >> 3))) & 3;
    if (bits == 3) c |= ((g[8 + (j >> 3)] >> (j & 7)) & 1) << 2;
    return c;
}

/* the 32 levels of a group, o[j * stride] */
static inline void group_levels(const uint8_t *g, int bits, const float *lv, float *o, int stride) {
    for (int j = 0; j < CT; j++) o[j * stride] = lv[group_code(g, bits, j)];
}

static inline void f16x32(const f16 *s, int64_t st, float *o) {
    for (int j = 0; j < CT; j++) o[j] = (float)s[j * st];
}

#if defined(__AVX512F__) && !defined(KVRUN_NO_AVX512)
#define CB_FAST 1
/* a group's 32 levels as two registers (codes 0-15, 16-31): shifts, masks, a permute */
static inline __attribute__((always_inline)) void group_dec(const uint8_t *g, int bits, __m512 lut,
                                                            __m512 *c0, __m512 *c1) {
    if (bits == 4) {
        __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)g));
        *c0 = _mm512_permutexvar_ps(_mm512_and_si512(w, _mm512_set1_epi32(15)), lut);
        *c1 = _mm512_permutexvar_ps(_mm512_srli_epi32(w, 4), lut);
        return;
    }
    __m128i b8 = _mm_loadl_epi64((const __m128i *)g);
    __m512i w = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(b8, b8));      /* bytes 0-7 twice */
    const __m512i s01 = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i s23 = _mm512_set_epi32(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4);
    const __m512i three = _mm512_set1_epi32(3);
    __m512i i0 = _mm512_and_si512(_mm512_srlv_epi32(w, s01), three);
    __m512i i1 = _mm512_and_si512(_mm512_srlv_epi32(w, s23), three);
    if (bits == 3) {                                   /* the high bits are the masks */
        uint32_t hw;
        memcpy(&hw, g + 8, 4);
        const __m512i four = _mm512_set1_epi32(4);
        i0 = _mm512_mask_or_epi32(i0, (__mmask16)(hw & 0xFFFF), i0, four);
        i1 = _mm512_mask_or_epi32(i1, (__mmask16)(hw >> 16), i1, four);
    }
    *c0 = _mm512_permutexvar_ps(i0, lut);
    *c1 = _mm512_permutexvar_ps(i1, lut);
}

/* sc[i * N + j] = scale_j * sum_d q[i * D + d] level(d, j), j < 32, i < NR: one K tile */
static inline __attribute__((always_inline)) void ktile_rows(const Codec *c, const uint8_t *tile,
        const float *q, int D, __m512 lut, __m512 s0, __m512 s1, float *sc, int64_t N, const int NR) {
    __m512 a[8][2];
    for (int i = 0; i < NR; i++) a[i][0] = a[i][1] = _mm512_setzero_ps();
    for (int d = 0; d < D; d++) {
        __m512 c0, c1;
        group_dec(tile + d * c->cs[2], c->bits, lut, &c0, &c1);
        for (int i = 0; i < NR; i++) {
            __m512 qb = _mm512_set1_ps(q[i * D + d]);
            a[i][0] = _mm512_fmadd_ps(qb, c0, a[i][0]);
            a[i][1] = _mm512_fmadd_ps(qb, c1, a[i][1]);
        }
    }
    for (int i = 0; i < NR; i++) {
        _mm512_storeu_ps(sc + i * N, _mm512_mul_ps(a[i][0], s0));
        _mm512_storeu_ps(sc + i * N + 16, _mm512_mul_ps(a[i][1], s1));
    }
}

void cb_k_tile(const Codec *c, int h, int64_t t0, const float *q, int R, int D,
                          float *sc, int64_t N) {
    const uint8_t *tile = c->codes + h * c->cs[0] + (t0 / CT) * c->cs[1];
    __m512 lut = _mm512_loadu_ps(c->lv);
    const f16 *s = c->scale + h * c->ss[0] + t0 * c->ss[1];
    float sf[CT];
    f16x32(s, c->ss[1], sf);
    __m512 s0 = _mm512_loadu_ps(sf), s1 = _mm512_loadu_ps(sf + 16);
    int r0 = 0;
    for (; r0 + 8 <= R; r0 += 8) ktile_rows(c, tile, q + r0 * D, D, lut, s0, s1, sc + r0 * N, N, 8);
    switch (R - r0) {
    case 7: ktile_rows(c, tile, q + r0 * D, D, lut, s0, s1, sc + r0 * N, N, 7); break;
    case 6: ktile_rows(c, tile, q + r0 * D, D, lut, s0, s1, sc + r0 * N, N, 6); break;
    case 5: ktile_rows(c, tile, q + r0 * D, D, lut, s0, s1, sc + r0 * N, N, 5); break;
    case 4: ktile_rows(c, tile, q + r0 * D, D, lut, s0, s1, sc + r0 * N, N, 4); break;
    case 3: ktile_rows(c, tile, q + r0 * D, D, lut, s0, s1, sc + r0 * N, N, 3); break;
    case 2: ktile_rows(c, tile, q + r0 * D, D, lut, s0, s1, sc + r0 * N, N, 2); break;
    case 1: ktile_rows(c, tile, q + r0 * D, D, lut, s0, s1, sc + r0 * N, N, 1); break;
    default: break;
    }
}

/* acc[i * D + cb0 .. + 32 * ng] += sum_t p[i * N + t] scale_t level(t, channel), tokens
 * [t0, t1), rows i < NR, ng (1 or 2) channel groups from group g0: the accumulators stay
 * in registers over the whole run of tokens */
static inline __attribute__((always_inline)) void vmix_rows(const Codec *c, int h, int64_t t0,
        int64_t t1, const float *p, int64_t N, int D, int g0, int ng, __m512 lut, float *acc,
        const int NR) {
    __m512 a[4][4];
    for (int i = 0; i < NR; i++)
        for (int k = 0; k < 2 * ng; k++) a[i][k] = _mm512_loadu_ps(acc + i * D + g0 * CT + 16 * k);
    const uint8_t *base = c->codes + h * c->cs[0] + g0 * c->cs[2];
    const f16 *sp = c->scale + h * c->ss[0];
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *row = base + t * c->cs[1];
        float s = (float)sp[t * c->ss[1]];
        __m512 v[4];
        group_dec(row, c->bits, lut, &v[0], &v[1]);
        if (ng == 2) group_dec(row + c->cs[2], c->bits, lut, &v[2], &v[3]);
        for (int i = 0; i < NR; i++) {
            __m512 w = _mm512_set1_ps(p[i * N + t] * s);
            for (int k = 0; k < 2 * ng; k++) a[i][k] = _mm512_fmadd_ps(w, v[k], a[i][k]);
        }
    }
    for (int i = 0; i < NR; i++)
        for (int k = 0; k < 2 * ng; k++) _mm512_storeu_ps(acc + i * D + g0 * CT + 16 * k, a[i][k]);
}

void cb_v_mix(const Codec *c, int h, int64_t t0, int64_t t1, const float *p, int64_t N,
                  int R, int D, float *acc) {
    __m512 lut = _mm512_loadu_ps(c->lv);
    for (int g0 = 0; g0 < D / CT; g0 += 2) {
        int ng = D / CT - g0 >= 2 ? 2 : 1;
        int r0 = 0;
        for (; r0 + 4 <= R; r0 += 4)
            vmix_rows(c, h, t0, t1, p + r0 * N, N, D, g0, ng, lut, acc + r0 * D, 4);
        switch (R - r0) {
        case 3: vmix_rows(c, h, t0, t1, p + r0 * N, N, D, g0, ng, lut, acc + r0 * D, 3); break;
        case 2: vmix_rows(c, h, t0, t1, p + r0 * N, N, D, g0, ng, lut, acc + r0 * D, 2); break;
        case 1: vmix_rows(c, h, t0, t1, p + r0 * N, N, D, g0, ng, lut, acc + r0 * D, 1); break;
        default: break;
        }
    }
}
#else
#define CB_FAST 0
/* portable: a K tile's levels into kt[D][32] (L1), one GEMM-like pass per row */
void cb_k_tile(const Codec *c, int h, int64_t t0, const float *q, int R, int D,
                          float *sc, int64_t N) {
    const uint8_t *tile = c->codes + h * c->cs[0] + (t0 / CT) * c->cs[1];
    float kt[MAXD * CT], sf[CT];
    for (int d = 0; d < D; d++) group_levels(tile + d * c->cs[2], c->bits, c->lv, kt + d * CT, 1);
    f16x32(c->scale + h * c->ss[0] + t0 * c->ss[1], c->ss[1], sf);
    for (int r = 0; r < R; r++) {
        float acc[CT] = {0};
        for (int d = 0; d < D; d++) {
            float qd = q[r * D + d];
            for (int j = 0; j < CT; j++) acc[j] += qd * kt[d * CT + j];
        }
        for (int j = 0; j < CT; j++) sc[r * N + j] = acc[j] * sf[j];
    }
}

/* portable: each token's row of levels, accumulated with weight p_t scale_t */
void cb_v_mix(const Codec *c, int h, int64_t t0, int64_t t1, const float *p, int64_t N,
                  int R, int D, float *acc) {
    float row[MAXD];
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *g = c->codes + h * c->cs[0] + t * c->cs[1];
        for (int k = 0; k < D / CT; k++) group_levels(g + k * c->cs[2], c->bits, c->lv, row + k * CT, 1);
        float s = (float)c->scale[h * c->ss[0] + t * c->ss[1]];
        for (int r = 0; r < R; r++) {
            float w = p[r * N + t] * s;
            float *o = acc + r * D;
            for (int d = 0; d < D; d++) o[d] += w * row[d];
        }
    }
}
#endif
