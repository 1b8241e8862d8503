/* Codebook codecs (cb-2, cb-3, cb-4; kvrun.kernels.codecs.codebook), native CPU: the tile
 * reads decode_attention.c calls for a cb role, so a cb K or V pairs with any codec. Both
 * work in the rotated space (q rotated once before, the output un-rotated once after, by
 * decode_attention.c), so a code only needs its level: a table lookup, never a dequantized
 * row.
 *
 *   cb_k_tile  logits of a K tile of 32 tokens: D packed groups, one per channel, each
 *              group's codes turned into levels in registers and multiplied with the rows,
 *              the per-token scale applied to the 32 logits afterwards:
 *              q.k_t = scale_t (q . level[c_t]);
 *   cb_v_mix   p.V over a run of tokens: the weights p_t scale_t of the run computed in
 *              vectors first, then every token's row of levels accumulated with them into
 *              registers that stay for the whole run.
 *
 * AVX-512 (with BW and BMI2: every AVX-512 CPU kvrun targets): the lookup is vpermps, whose
 * index lane reads its low 4 bits only, so the tables repeat over the bits above a code and
 * the codes need no mask (make_luts). 4 bits: one widening of 16 bytes and one shift per 32
 * codes. 2 and 3 bits: the bytes of two groups (two channels of a K tile, or two channel
 * groups of a V row) are interleaved and widened once, so 64 codes cost one widening and
 * three shifts (pair_dec); the 3-bit high bits of both groups interleave into four mask
 * registers with two bit deposits (pdep) and pick the upper half of the table by a masked
 * vpermps. A K lane then holds one parity of channels, so each row's (q_d, q_d+1) is one
 * 64-bit broadcast and the two parities are added per token at the end; a V register holds
 * channels out of order and is put back once per run. Builds without AVX-512:
 * codebook_portable.c (the same functions with AVX2, or plain C).
 *
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

#include "codebook_group.h"
#if CB_FAST
#include <immintrin.h>

#define INLINE static inline __attribute__((always_inline))
/* F(r0, nr) over rows [0, R) in blocks of 8 (4), nr a constant in each call */
#define ROWS_TAIL3(r0, REM, F) switch (REM) { case 3: F(r0, 3); break; case 2: F(r0, 2); break; \
    case 1: F(r0, 1); break; default: break; }
#define ROWS_TAIL7(r0, REM, F) switch (REM) { case 7: F(r0, 7); break; case 6: F(r0, 6); break; \
    case 5: F(r0, 5); break; case 4: F(r0, 4); break; default: ROWS_TAIL3(r0, REM, F) }
#define ROWS8(R, F) do { int r0_ = 0; for (; r0_ + 8 <= (R); r0_ += 8) F(r0_, 8); ROWS_TAIL7(r0_, (R) - r0_, F) } while (0)
#define ROWS4(R, F) do { int r0_ = 0; for (; r0_ + 4 <= (R); r0_ += 4) F(r0_, 4); ROWS_TAIL3(r0_, (R) - r0_, F) } while (0)

/* The level tables as vpermps reads them: an index lane's low 4 bits pick the entry, so a
 * code needs no mask when its table repeats over the bits above it. 4 bits: lo = the 16
 * levels; 2 bits: lo[x] = level[x & 3]; 3 bits: lo[x] = level[x & 3], hi[x] = level[4 + (x & 3)]
 * (the high bit picks the table through a mask register). */
typedef struct { __m512 lo, hi; } Luts;

INLINE Luts make_luts(const float *lv, int bits) {
    const __m512 t = _mm512_loadu_ps(lv);
    if (bits == 4) return (Luts){t, t};
    const __m512i lo = _mm512_and_si512(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                        _mm512_set1_epi32(3));
    return (Luts){_mm512_permutexvar_ps(lo, t),
                  _mm512_permutexvar_ps(_mm512_add_epi32(lo, _mm512_set1_epi32(4)), t)};
}

INLINE uint32_t hibits(const uint8_t *g) {          /* 3 bits: the group's high-bit word */
    uint32_t w;
    memcpy(&w, g + 8, 4);
    return w;
}

/* one group's 32 levels in code order: c0 = codes 0-15, c1 = codes 16-31 */
INLINE void group_dec(const uint8_t *g, const int BITS, Luts L, __m512 *c0, __m512 *c1) {
    if (BITS == 4) {
        const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)g));
        *c0 = _mm512_permutexvar_ps(w, L.lo);                      /* low nibble: bits 0-3 */
        *c1 = _mm512_permutexvar_ps(_mm512_srli_epi32(w, 4), L.lo);
        return;
    }
    int64_t b8;
    memcpy(&b8, g, 8);
    const __m512i w = _mm512_cvtepu8_epi32(_mm_set1_epi64x(b8));       /* bytes 0-7 twice */
    const __m512i s01 = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i s23 = _mm512_set_epi32(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4);
    const __m512i i0 = _mm512_srlv_epi32(w, s01), i1 = _mm512_srlv_epi32(w, s23);
    *c0 = _mm512_permutexvar_ps(i0, L.lo);
    *c1 = _mm512_permutexvar_ps(i1, L.lo);
    if (BITS == 3) {
        const uint32_t hw = hibits(g);
        *c0 = _mm512_mask_permutexvar_ps(*c0, (__mmask16)hw, i0, L.hi);
        *c1 = _mm512_mask_permutexvar_ps(*c1, (__mmask16)(hw >> 16), i1, L.hi);
    }
}

/* two groups of 2 or 3 bits, their bytes interleaved: v[s] lane l = the level of code
 * (l >> 1) + 8 s of group l & 1. One byte widening serves 64 codes, and for 3 bits the two
 * high-bit words interleave into the four masks with two bit deposits. */
INLINE void pair_dec(const uint8_t *g0, const uint8_t *g1, const int BITS, Luts L, __m512 v[4]) {
    const __m128i b = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)g0),
                                        _mm_loadl_epi64((const __m128i *)g1));
    const __m512i w = _mm512_cvtepu8_epi32(b);
    uint64_t k = 0;
    if (BITS == 3)          /* bit l + 16 s: high bit of code (l >> 1) + 8 s of group l & 1 */
        k = _pdep_u64(hibits(g0), 0x5555555555555555ull) | _pdep_u64(hibits(g1), 0xAAAAAAAAAAAAAAAAull);
    for (int s = 0; s < 4; s++) {
        const __m512i x = s ? _mm512_srli_epi32(w, 2 * s) : w;
        v[s] = _mm512_permutexvar_ps(x, L.lo);
        if (BITS == 3) v[s] = _mm512_mask_permutexvar_ps(v[s], (__mmask16)(k >> (16 * s)), x, L.hi);
    }
}

/* a pair-decoded register pair (lanes: code (l >> 1) + 8 s of group l & 1, s = 0, 1) back to
 * code order: the even lanes (group 0's codes 0-15) or the odd ones (group 1's) */
static const int32_t EVEN[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
INLINE __m512 evens(__m512 a, __m512 b) {
    return _mm512_permutex2var_ps(a, _mm512_loadu_si512(EVEN), b);
}
INLINE __m512 odds(__m512 a, __m512 b) {
    return _mm512_permutex2var_ps(a, _mm512_add_epi32(_mm512_loadu_si512(EVEN), _mm512_set1_epi32(1)), b);
}

/* acc + v * (*w broadcast), the broadcast folded into the FMA's memory operand: gcc hoists a
 * broadcast shared by several FMAs into a register of its own, one more vector op each */
INLINE __m512 fma_bcast(__m512 acc, __m512 v, const float *w) {
    __asm__("vfmadd231ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(v), "m"(*w));
    return acc;
}

/* token scales of [t0, t0 + n) as fp32 */
static void scales_f32(const Codec *c, int h, int64_t t0, int n, float *o) {
    const f16 *s = c->scale + h * c->ss[0] + t0 * c->ss[1];
    int j = 0;
    if (c->ss[1] == 1)
        for (; j + 16 <= n; j += 16)
            _mm512_storeu_ps(o + j, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + j))));
    for (; j < n; j++) o[j] = (float)s[j * c->ss[1]];
}

/* -- q.K: one tile of 32 tokens, NR rows ------------------------------------------------------ */

/* 4 bits: a channel at a time, its 32 levels dotted with the rows' broadcast q_d */
INLINE void ktile4(const uint8_t *tile, int64_t gs, const float *q, int D, Luts L, __m512 s0,
                   __m512 s1, float *sc, int64_t N, const int NR) {
    __m512 a[8][2];
    for (int i = 0; i < NR; i++) a[i][0] = a[i][1] = _mm512_setzero_ps();
    for (int d = 0; d < D; d++) {
        __m512 c0, c1;
        group_dec(tile + d * gs, 4, L, &c0, &c1);
        for (int i = 0; i < NR; i++) {
            const __m512 qb = _mm512_set1_ps(q[i * D + d]);
            a[i][0] = _mm512_fmadd_ps(qb, c0, a[i][0]);
            a[i][1] = _mm512_fmadd_ps(qb, c1, a[i][1]);
        }
    }
    for (int i = 0; i < NR; i++) {
        _mm512_storeu_ps(sc + i * N, _mm512_mul_ps(a[i][0], s0));
        _mm512_storeu_ps(sc + i * N + 16, _mm512_mul_ps(a[i][1], s1));
    }
}

/* 2 / 3 bits: channels d, d + 1 at a time (pair_dec), each lane against (q_d, q_d+1)
 * broadcast as one 64-bit pair; a lane sums one parity of channels, and the two parities of
 * a token are added at the end */
INLINE void ktile_pair(const uint8_t *tile, int64_t gs, const float *q, int D, Luts L, __m512 s0,
                       __m512 s1, float *sc, int64_t N, const int NR, const int BITS) {
    __m512 a[6][4];
    for (int i = 0; i < NR; i++)
        for (int k = 0; k < 4; k++) a[i][k] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 2) {
        __m512 v[4];
        pair_dec(tile + d * gs, tile + (d + 1) * gs, BITS, L, v);
        for (int i = 0; i < NR; i++) {
            double qq;
            memcpy(&qq, q + i * D + d, 8);
            const __m512 qb = _mm512_castpd_ps(_mm512_set1_pd(qq));
            for (int k = 0; k < 4; k++) a[i][k] = _mm512_fmadd_ps(qb, v[k], a[i][k]);
        }
    }
    for (int i = 0; i < NR; i++) {
        const __m512 t0 = _mm512_add_ps(evens(a[i][0], a[i][1]), odds(a[i][0], a[i][1]));
        const __m512 t1 = _mm512_add_ps(evens(a[i][2], a[i][3]), odds(a[i][2], a[i][3]));
        _mm512_storeu_ps(sc + i * N, _mm512_mul_ps(t0, s0));
        _mm512_storeu_ps(sc + i * N + 16, _mm512_mul_ps(t1, s1));
    }
}

void cb_k_tile(const Codec *c, int h, int64_t t0, const float *q, int R, int D,
               float *sc, int64_t N) {
    const uint8_t *tile = c->codes + h * c->cs[0] + (t0 / CT) * c->cs[1];
    const int64_t gs = c->cs[2];
    const Luts L = make_luts(c->lv, c->bits);
    float sf[CT];
    scales_f32(c, h, t0, CT, sf);
    const __m512 s0 = _mm512_loadu_ps(sf), s1 = _mm512_loadu_ps(sf + 16);
#define K4(r0, nr) ktile4(tile, gs, q + (r0) * D, D, L, s0, s1, sc + (r0) * N, N, nr)
#define K2(r0, nr) ktile_pair(tile, gs, q + (r0) * D, D, L, s0, s1, sc + (r0) * N, N, nr, 2)
#define K3(r0, nr) ktile_pair(tile, gs, q + (r0) * D, D, L, s0, s1, sc + (r0) * N, N, nr, 3)
    if (c->bits == 4) ROWS8(R, K4);
    else if (c->bits == 3) ROWS4(R, K3);
    else ROWS4(R, K2);
#undef K4
#undef K2
#undef K3
}

/* -- p.V: a run of tokens, NR rows ------------------------------------------------------------ */

/* acc[i * D + ch .. ch + 64] += sum_t w[i][t] level(t, channel): groups g0, g0 + 1 of each
 * token's row (4 bits: two group_dec, code order; 2 / 3 bits: pair_dec, put back in code
 * order once at the end), the accumulators in registers over the run; w = p scale */
INLINE void vmix_pair(const uint8_t *rows, int64_t rs, int64_t gs, int n, const float *w,
                      Luts L, float *acc, int D, const int NR, const int BITS) {
    __m512 a[6][4];
    for (int i = 0; i < NR; i++)
        for (int k = 0; k < 4; k++) a[i][k] = _mm512_setzero_ps();
    for (int t = 0; t < n; t++) {
        const uint8_t *g = rows + t * rs;
        __m512 v[4];
        if (BITS == 4) {
            group_dec(g, 4, L, &v[0], &v[1]);
            group_dec(g + gs, 4, L, &v[2], &v[3]);
        } else {
            pair_dec(g, g + gs, BITS, L, v);
        }
        for (int i = 0; i < NR; i++)
            for (int k = 0; k < 4; k++) a[i][k] = fma_bcast(a[i][k], v[k], w + i * VRUN + t);
    }
    for (int i = 0; i < NR; i++) {
        __m512 o[4] = {a[i][0], a[i][1], a[i][2], a[i][3]};
        if (BITS != 4) {
            o[0] = evens(a[i][0], a[i][1]);
            o[1] = evens(a[i][2], a[i][3]);
            o[2] = odds(a[i][0], a[i][1]);
            o[3] = odds(a[i][2], a[i][3]);
        }
        for (int k = 0; k < 4; k++)
            _mm512_storeu_ps(acc + i * D + 16 * k, _mm512_add_ps(_mm512_loadu_ps(acc + i * D + 16 * k), o[k]));
    }
}

/* one group (an odd group count's last) */
INLINE void vmix_one(const uint8_t *rows, int64_t rs, int n, const float *w, Luts L, float *acc,
                     int D, const int NR, const int BITS) {
    __m512 a[6][2];
    for (int i = 0; i < NR; i++) a[i][0] = a[i][1] = _mm512_setzero_ps();
    for (int t = 0; t < n; t++) {
        __m512 v0, v1;
        group_dec(rows + t * rs, BITS, L, &v0, &v1);
        for (int i = 0; i < NR; i++) {
            a[i][0] = fma_bcast(a[i][0], v0, w + i * VRUN + t);
            a[i][1] = fma_bcast(a[i][1], v1, w + i * VRUN + t);
        }
    }
    for (int i = 0; i < NR; i++)
        for (int k = 0; k < 2; k++)
            _mm512_storeu_ps(acc + i * D + 16 * k, _mm512_add_ps(_mm512_loadu_ps(acc + i * D + 16 * k), a[i][k]));
}

INLINE void vmix_rows(const Codec *c, const uint8_t *rows, int n, const float *w, Luts L,
                      float *acc, int D, const int NR, const int BITS) {
    const int64_t rs = c->cs[1], gs = c->cs[2];
    int g = 0;
    for (; g + 2 <= D / CT; g += 2) vmix_pair(rows + g * gs, rs, gs, n, w, L, acc + g * CT, D, NR, BITS);
    if (g < D / CT) vmix_one(rows + g * gs, rs, n, w, L, acc + g * CT, D, NR, BITS);
}

void cb_v_mix(const Codec *c, int h, int64_t t0, int64_t t1, const float *p, int64_t N,
              int R, int D, float *acc) {
    const Luts L = make_luts(c->lv, c->bits);
    const int RB = R <= 6 ? R : 4;
    float sf[VRUN], w[6 * VRUN];
    for (int64_t u0 = t0; u0 < t1; u0 += VRUN) {
        const int n = t1 - u0 < VRUN ? (int)(t1 - u0) : VRUN;
        const uint8_t *rows = c->codes + h * c->cs[0] + u0 * c->cs[1];
        scales_f32(c, h, u0, n, sf);
        for (int r0 = 0; r0 < R; r0 += RB) {
            const int nr = R - r0 < RB ? R - r0 : RB;
            for (int i = 0; i < nr; i++) {          /* -- the weights p scale of the run -- */
                const float *pr = p + (int64_t)(r0 + i) * N + u0;
                int j = 0;
                for (; j + 16 <= n; j += 16)
                    _mm512_storeu_ps(w + i * VRUN + j, _mm512_mul_ps(_mm512_loadu_ps(pr + j), _mm512_loadu_ps(sf + j)));
                for (; j < n; j++) w[i * VRUN + j] = pr[j] * sf[j];
            }
            float *ar = acc + (int64_t)r0 * D;
#define VM(nr_, bits_) vmix_rows(c, rows, n, w, L, ar, D, nr_, bits_)
#define VB(bits_) switch (nr) { case 6: VM(6, bits_); break; case 5: VM(5, bits_); break; \
                  case 4: VM(4, bits_); break; case 3: VM(3, bits_); break;              \
                  case 2: VM(2, bits_); break; default: VM(1, bits_); }
            if (c->bits == 4) { VB(4) } else if (c->bits == 3) { VB(3) } else { VB(2) }
#undef VB
#undef VM
        }
    }
}
#endif
