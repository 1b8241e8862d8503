/* Codebook codecs' tile reads (codebook_attention.c has the contract, the layouts and the
 * AVX-512 path) on builds without AVX-512: KVRUN_NATIVE=portable and machines that lack it.
 *
 * AVX2 + FMA: 8 codes per register, looked up in 8-entry tables with vpermps (3 index bits)
 * and, where a code has a fourth bit (4 bits) or a separate high bit (3 bits), two tables
 * chosen by a blend on the lane's sign bit; the lookups are fused with the FMAs as on
 * AVX-512 (K: 16 tokens x up to 4 rows of accumulators per pass over the channels; V: 16
 * channels x up to 4 rows over a run of tokens). -DKVRUN_NO_AVX2 (int_dot.h's flag too)
 * leaves plain C: a K tile decoded into a (D, 32) table in L1, V row by row.
 */
#include <stdint.h>
#include <string.h>

#include "codebook_group.h"
#if !CB_FAST
#if defined(__AVX2__) && defined(__FMA__) && !defined(KVRUN_NO_AVX2)
#include <immintrin.h>

#define INLINE static inline __attribute__((always_inline))

typedef struct { __m256 a, b; } Luts;

INLINE Luts make_luts(const float *lv, int bits) {
    if (bits == 4) return (Luts){_mm256_loadu_ps(lv), _mm256_loadu_ps(lv + 8)};
    const __m256i lo = _mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3);      /* level[x & 3] */
    const __m256 t = _mm256_loadu_ps(lv);
    return (Luts){_mm256_permutevar8x32_ps(t, lo),
                  _mm256_permutevar8x32_ps(t, _mm256_add_epi32(lo, _mm256_set1_epi32(4)))};
}

/* the levels of codes j0 .. j0 + 7 of a group (j0 % 8 == 0) */
INLINE __m256 dec8(const uint8_t *g, int j0, const int BITS, Luts L) {
    if (BITS == 4) {             /* bytes j0 % 16.., low or high nibble; bit 3 to the sign */
        const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(g + (j0 & 15))));
        const __m256i x = j0 >= 16 ? _mm256_srli_epi32(w, 4) : w;
        return _mm256_blendv_ps(_mm256_permutevar8x32_ps(L.a, x), _mm256_permutevar8x32_ps(L.b, x),
                                _mm256_castsi256_ps(_mm256_slli_epi32(x, 28)));
    }
    const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)g));
    const __m256i x = _mm256_srli_epi32(w, 2 * (j0 >> 3));
    if (BITS == 2) return _mm256_permutevar8x32_ps(L.a, x);
    uint32_t hw;                 /* 3 bits: high bit j0 + l of the word to lane l's sign */
    memcpy(&hw, g + 8, 4);
    const __m256i hs = _mm256_sllv_epi32(_mm256_set1_epi32((int32_t)(hw >> j0)),
                                         _mm256_setr_epi32(31, 30, 29, 28, 27, 26, 25, 24));
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(L.a, x), _mm256_permutevar8x32_ps(L.b, x),
                            _mm256_castsi256_ps(hs));
}

/* a[i] = sum_k x[i * xs + k] * level(codes k, lanes j0 .. j0 + 15), k < n, NR rows: the
 * loop both reads share (K: k a channel of a tile, x = q; V: k a token, x = p.V weights) */
INLINE void fma16(const uint8_t *base, int64_t stride, int j0, int n, const float *x, int64_t xs,
                  Luts L, __m256 a[4][2], const int NR, const int BITS) {
    for (int i = 0; i < NR; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
    for (int k = 0; k < n; k++) {
        const __m256 c0 = dec8(base + k * stride, j0, BITS, L), c1 = dec8(base + k * stride, j0 + 8, BITS, L);
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
