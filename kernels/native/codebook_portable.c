/* Codebook codecs' tile reads (codebook_attention.c has the contract, the layouts and the
 * AVX-512 path) on builds without AVX-512: KVRUN_NATIVE=portable and machines that lack it.
 *
 * AVX2 + FMA + F16C: 16 codes a step, one per byte of a 16-byte register (the 3-bit high
 * bits spread to bytes by one shuffle and a compare), looked up with two vpshufb in the
 * tables of the levels' fp16 low and high bytes, interleaved into 16 halves and widened
 * with vcvtph2ps; cbpack.levels makes every level an fp16 value, so this is exact. Against
 * the 8-entry vpermps tables with a blend for the fourth bit this took the cb-4 p.V and
 * K-tile reads from 1.39 to 0.82 ms (cb-4/cb-4, 4096 tokens, Gemma 3's head, one thread,
 * first-generation EPYC, tools/attn_ab.py): vpermps is three micro-ops there. The lookups
 * are fused with the FMAs as on AVX-512 (K: 16 tokens x up to 4 rows of accumulators per
 * pass over the channels; V: 16 channels x up to 4 rows over a run of tokens).
 * -DKVRUN_NO_AVX2 (int_dot.h's flag too) leaves plain C: a K tile decoded into a (D, 32)
 * table in L1, V row by row.
 */
#include <stdint.h>
#include <string.h>

#include "codebook_group.h"
#if !CB_FAST
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(KVRUN_NO_AVX2)
#include <immintrin.h>

#define INLINE static inline __attribute__((always_inline))

/* The levels as vpshufb reads them: the low and the high byte of each level's fp16 bits,
 * 16 entries a table (cbpack.levels makes every level an fp16 value, so the halves are
 * exact). A code indexes both tables at once and the two bytes interleave into halves. */
typedef struct { __m128i lo, hi; } Luts;

INLINE Luts make_luts(const float *lv, int bits) {
    uint8_t lo[16] = {0}, hi[16] = {0};
    for (int i = 0; i < 1 << bits; i++) {
        const uint16_t h = _cvtss_sh(lv[i], _MM_FROUND_TO_NEAREST_INT);
        lo[i] = (uint8_t)h;
        hi[i] = (uint8_t)(h >> 8);
    }
    return (Luts){_mm_loadu_si128((const __m128i *)lo), _mm_loadu_si128((const __m128i *)hi)};
}

/* codes j0 .. j0 + 15 of a group (j0 % 16 == 0), one per byte */
INLINE __m128i codes16(const uint8_t *g, int j0, const int BITS) {
    if (BITS == 4) {            /* byte i: code i low, code i + 16 high */
        const __m128i w = _mm_loadu_si128((const __m128i *)g);
        return _mm_and_si128(j0 ? _mm_srli_epi16(w, 4) : w, _mm_set1_epi8(15));
    }
    const __m128i w = _mm_loadl_epi64((const __m128i *)g);      /* byte i: codes i + 8k, bits 2k */
    const int s = 2 * (j0 >> 3);
    __m128i x = _mm_and_si128(_mm_unpacklo_epi64(_mm_srli_epi16(w, s), _mm_srli_epi16(w, s + 2)),
                              _mm_set1_epi8(3));
    if (BITS == 3) {            /* high bit j0 + l of the word (at byte 8) to byte l's bit 2 */
        uint32_t hw;
        memcpy(&hw, g + 8, 4);
        const __m128i sel = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
        const __m128i b = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)(hw >> j0)),
                                           _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
        x = _mm_or_si128(x, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(b, sel), sel), _mm_set1_epi8(4)));
    }
    return x;
}

/* the levels of codes j0 .. j0 + 15 of a group: c0 codes j0 .. j0 + 7, c1 the next 8 */
INLINE void dec16(const uint8_t *g, int j0, const int BITS, Luts L, __m256 *c0, __m256 *c1) {
    const __m128i x = codes16(g, j0, BITS);
    const __m128i lo = _mm_shuffle_epi8(L.lo, x), hi = _mm_shuffle_epi8(L.hi, x);
    *c0 = _mm256_cvtph_ps(_mm_unpacklo_epi8(lo, hi));
    *c1 = _mm256_cvtph_ps(_mm_unpackhi_epi8(lo, hi));
}

/* a[i] = sum_k x[i * xs + k] * level(codes k, lanes j0 .. j0 + 15), k < n, NR rows: the
 * loop both reads share (K: k a channel of a tile, x = q; V: k a token, x = p.V weights) */
INLINE void fma16(const uint8_t *base, int64_t stride, int j0, int n, const float *x, int64_t xs,
                  Luts L, __m256 a[4][2], const int NR, const int BITS) {
    for (int i = 0; i < NR; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
    for (int k = 0; k < n; k++) {
        __m256 c0, c1;
        dec16(base + k * stride, j0, BITS, L, &c0, &c1);
        for (int i = 0; i < NR; i++) {
            const __m256 xb = _mm256_broadcast_ss(x + i * xs + k);
            a[i][0] = _mm256_fmadd_ps(xb, c0, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(xb, c1, a[i][1]);
        }
    }
}

/* sc[i * N + j0 ..+16] = scale * (q_i . level), tokens j0 .. j0 + 15 of a K tile, NR rows */
INLINE void ktile_avx2(const uint8_t *tile, int64_t gs, int j0, const float *q, int D, Luts L,
                        const float *sf, float *sc, int64_t N, const int NR, const int BITS) {
    __m256 a[4][2];
    fma16(tile, gs, j0, D, q, D, L, a, NR, BITS);
    for (int i = 0; i < NR; i++)
        for (int k = 0; k < 2; k++)
            _mm256_storeu_ps(sc + i * N + j0 + 8 * k, _mm256_mul_ps(a[i][k], _mm256_loadu_ps(sf + j0 + 8 * k)));
}

void cb_k_tile(const Codec *c, int h, int64_t t0, const float *q, int R, int D,
               float *sc, int64_t N) {
    const uint8_t *tile = c->codes + h * c->cs[0] + (t0 / CT) * c->cs[1];
    const Luts L = make_luts(c->lv, c->bits);
    float sf[CT];
    f16x32(c->scale + h * c->ss[0] + t0 * c->ss[1], c->ss[1], sf);
    for (int j0 = 0; j0 < CT; j0 += 16)
        for (int r0 = 0; r0 < R; r0 += 4) {
#define KA(nr, b) ktile_avx2(tile, c->cs[2], j0, q + r0 * D, D, L, sf, sc + r0 * N, N, nr, b)
#define KB(b) switch (R - r0 < 4 ? R - r0 : 4) { case 4: KA(4, b); break; case 3: KA(3, b); break; \
              case 2: KA(2, b); break; default: KA(1, b); }
            if (c->bits == 4) { KB(4) } else if (c->bits == 3) { KB(3) } else { KB(2) }
#undef KB
#undef KA
        }
}

/* acc[i * D + ch ..+16] += sum_t w[i][t] level(t, ch ..), 16 channels from ch (a half group) */
INLINE void vmix_avx2(const uint8_t *rows, int64_t rs, int j0, int n, const float *w, Luts L,
                       float *acc, int D, const int NR, const int BITS) {
    __m256 a[4][2];
    fma16(rows, rs, j0, n, w, VRUN, L, a, NR, BITS);
    for (int i = 0; i < NR; i++)
        for (int k = 0; k < 2; k++)
            _mm256_storeu_ps(acc + i * D + 8 * k, _mm256_add_ps(_mm256_loadu_ps(acc + i * D + 8 * k), a[i][k]));
}

void cb_v_mix(const Codec *c, int h, int64_t t0, int64_t t1, const float *p, int64_t N,
              int R, int D, float *acc) {
    const Luts L = make_luts(c->lv, c->bits);
    float sf[VRUN], w[4 * VRUN];
    for (int64_t u0 = t0; u0 < t1; u0 += VRUN) {
        const int n = t1 - u0 < VRUN ? (int)(t1 - u0) : VRUN;
        const uint8_t *rows = c->codes + h * c->cs[0] + u0 * c->cs[1];
        for (int j = 0; j < n; j++) sf[j] = (float)c->scale[h * c->ss[0] + (u0 + j) * c->ss[1]];
        for (int r0 = 0; r0 < R; r0 += 4) {
            const int nr = R - r0 < 4 ? R - r0 : 4;
            for (int i = 0; i < nr; i++)
                for (int j = 0; j < n; j++) w[i * VRUN + j] = p[(int64_t)(r0 + i) * N + u0 + j] * sf[j];
            for (int ch = 0; ch < D; ch += 16) {
                const uint8_t *g = rows + (ch / CT) * c->cs[2];
                float *ar = acc + (int64_t)r0 * D + ch;
#define VA(nr_, b) vmix_avx2(g, c->cs[1], ch % CT, n, w, L, ar, D, nr_, b)
#define VB(b) switch (nr) { case 4: VA(4, b); break; case 3: VA(3, b); break; \
              case 2: VA(2, b); break; default: VA(1, b); }
                if (c->bits == 4) { VB(4) } else if (c->bits == 3) { VB(3) } else { VB(2) }
#undef VB
#undef VA
            }
        }
    }
}
#else
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
#endif
