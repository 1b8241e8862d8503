/* attn_tiles_avx2.h: the AVX2 fast paths, the same register decode on 8-lane registers
 * (included only on an AVX2 build without AVX-512).
 * A part of decode_attention.c's one translation unit, included there in the order its
 * parts depend on (Args, KLay and the helpers of the parts before it); not a header of
 * its own. */

/* -- AVX2 fast paths: the same register decode on 8-lane registers --------------------------
 * With 16 registers of 8 lanes a K tile is taken in two halves of 16 tokens (up to 4 rows: 8
 * accumulators, 2 code registers) and a V block in four quarters of 16 channels, so every code
 * is still decoded once per call and nothing goes through a tile buffer. The fp rows (tails,
 * window, new tokens) are dotted 8 tokens at a time, reduced together (hsum8x8). KIVI keys
 * one tile at a time (no multi-tile pass); GEAR terms and TaDA values with int8 means take
 * the tile path. */
#define HAVE_FAST 0
#define PREFETCH 256

/* 16 codes from 16 bytes, (b >> sh) & mask, one a byte: a 16-bit shift brings no bit of the
 * next byte under the mask (sh + bits <= 8) */
static inline __m128i codes16x(const uint8_t *b, __m128i sh, __m128i mask) {
    return _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)b), sh), mask);
}

/* 16 byte codes as fp32 in two registers, widened 8 at a time */
static inline void widen16x(__m128i x, __m256 *c0, __m256 *c1) {
    *c0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x));
    *c1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(x, x)));
}

static inline void dec16x(const uint8_t *b, __m128i sh, __m128i mask, __m256 *c0, __m256 *c1) {
    widen16x(codes16x(b, sh, mask), c0, c1);
}

/* two planes' codes joined as bytes before one widening, hi << fsh | lo: 3-bit KIVI keys'
 * 1-bit and 2-bit planes (fsh 2), 8-bit codes' nibble planes (fsh 4); each fits in its byte */
static inline void dec16x2(__m128i hi, __m128i lo, __m128i fsh, __m256 *c0, __m256 *c1) {
    widen16x(_mm_or_si128(_mm_sll_epi16(hi, fsh), lo), c0, c1);
}

/* The step every AVX2 path ends a token or channel with, for NR rows of two registers (16
 * floats) each: a[i] += broadcast(x[i * xs]) * (c0, c1); and the rows' loads and stores. */
static inline __attribute__((always_inline)) void fma_rows2(__m256 (*a)[2], const float *x, int64_t xs,
                                                            __m256 c0, __m256 c1, const int NR) {
    for (int i = 0; i < NR; i++) {
        const __m256 xb = _mm256_broadcast_ss(x + i * xs);
        a[i][0] = _mm256_fmadd_ps(xb, c0, a[i][0]);
        a[i][1] = _mm256_fmadd_ps(xb, c1, a[i][1]);
    }
}

static inline __attribute__((always_inline)) void load_rows2(__m256 (*a)[2], const float *o, int64_t os,
                                                             const int NR) {
    for (int i = 0; i < NR; i++) {
        a[i][0] = _mm256_loadu_ps(o + i * os);
        a[i][1] = _mm256_loadu_ps(o + i * os + 8);
    }
}

static inline __attribute__((always_inline)) void store_rows2(float *o, int64_t os, __m256 (*a)[2],
                                                              const int NR) {
    for (int i = 0; i < NR; i++) {
        _mm256_storeu_ps(o + i * os, a[i][0]);
        _mm256_storeu_ps(o + i * os + 8, a[i][1]);
    }
}

/* acc[i * 32 + j0 + j] = sum_d qx[i * D + d] * code(d, j0 + j), j < 16, i < NR: half j0 of a
 * K tile, channel d's codes as k_layout's L says */
static inline __attribute__((always_inline)) void kdot8_rows(const float *qx, int D, const KLay *L,
        int j0, float *acc, const int NR, const int TWO) {
    __m256 a[4][2];
    for (int i = 0; i < NR; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
    const uint8_t *b = L->b + j0, *b2 = TWO ? L->b2 + j0 : NULL;
    const int64_t ds = L->ds, ds2 = L->ds2;
    const __m128i shv = _mm_cvtsi32_si128(L->sh), shv2 = _mm_cvtsi32_si128(L->sh2);
    const __m128i mv = _mm_set1_epi8((char)L->mask), mv2 = _mm_set1_epi8((char)L->mask2);
    const __m128i fsh = _mm_cvtsi32_si128(L->fsh);
    for (int d = 0; d < D; d++) {
        if (!j0) _mm_prefetch((const char *)(b + d * ds + PREFETCH), KV_PF_HINT);
        __m256 c0, c1;
        if (TWO) dec16x2(codes16x(b + d * ds, shv, mv), codes16x(b2 + d * ds2, shv2, mv2), fsh, &c0, &c1);
        else dec16x(b + d * ds, shv, mv, &c0, &c1);
        fma_rows2(a, qx + d, D, c0, c1, NR);
    }
    store_rows2(acc + j0, TILE, a, NR);
}

/* logits of a packed K tile (int8, TaDA, KIVI without GEAR terms) or an fp tail tile
 * straight into sc[r * N + j]; returns 0 when the layout has no fast path here */
static int k_tile_fast(const Codec *c, int h, int64_t t0, const float *q, int R, int D,
                       float *sc, int64_t N) {
    if (c->kind <= C_FP32 && D % VW == 0) {
        fp_rows(c->x, h * c->xs[0] + t0 * c->xs[1], c->xs[1], c->kind, TILE / VW, q, R, D, sc, N);
        return 1;
    }
    if (!(c->kind == C_INT8 || c->kind == C_TADA || (c->kind == C_KIVI && !c->rank && !c->k2))
        || R > 64 || (c->kind == C_TADA && D % VW)) return 0;
    const KLay L = k_layout(c, h, t0);
    float qx[64 * MAXD], acc[64 * TILE], bias[64];
    const float *qd = tile_rows(c, h, t0, q, R, D, qx, bias);
    for (int j0 = 0; j0 < TILE; j0 += 16) {
#define KR(r0, nr) (L.b2 ? kdot8_rows(qd + (r0) * D, D, &L, j0, acc + (r0) * TILE, nr, 1) \
                           : kdot8_rows(qd + (r0) * D, D, &L, j0, acc + (r0) * TILE, nr, 0))
        ROW_BLOCKS4(R, KR);
#undef KR
    }
    k_tile_logits(c, h, t0, q, R, D, acc, bias, sc, N);
    return 1;
}

/* TaDA's q . mu_t for the 32 tokens of a tile: 8 means at a time */
static void mu_scores(const Codec *c, int64_t t0, const float *q, int R, int D, float *out) {
    mu_rows_scores(c, t0, q, R, D, out);
}

/* the 16 codes of quarter k of a chan-layout V row at b: bytes 16 (k % 2), nibble half k / 2
 * (2 bits: sh the row's token pair), 8 bits 16 hi + lo from the second plane b + pl */
static inline __attribute__((always_inline)) void vquarter(const uint8_t *b, int64_t pl, const int bits,
                                                           int sh, int k, __m256 *v0, __m256 *v1) {
    const int hk = k / 2;
    b += 16 * (k % 2);
    const __m128i x = codes16x(b, _mm_cvtsi32_si128(sh + 4 * hk), _mm_set1_epi8(bits == 2 ? 3 : 15));
    if (bits == 8)
        dec16x2(x, codes16x(b + pl, _mm_cvtsi32_si128(4 * hk), _mm_set1_epi8(15)), _mm_cvtsi32_si128(4), v0, v1);
    else
        widen16x(x, v0, v1);
}

/* The channels of quarter k of 64-channel block cb: cb * 64 + 32 (k / 2) + 16 (k % 2) + [0, 16) */
static inline int vquarter_ch(int cb, int k) { return cb * 64 + 32 * (k / 2) + 16 * (k % 2); }

/* KIVI / int8 V, v = c s + z per token and group (int8: z = -128 s), quarter k of block cb
 * over tokens [t0, t1) for NR rows: sum_t p_t v_t = sum_t (p_t s_t) c_t + sum_t p_t z_t, the
 * products p s (pw, (NR, n)) the broadcasts of the FMAs and sum p z (zs) added at the end,
 * so the token loop is decode + FMAs only */
static inline __attribute__((always_inline)) void vmix8_fold(const Codec *c, int h, int64_t t0, int64_t t1,
        int cb, int k, const float *pw, const float *zs, int D, float *acc, const int NR, const int BITS) {
    const int64_t *s = c->cs, n = t1 - t0;
    const int ch = vquarter_ch(cb, k);
    __m256 a[4][2];
    load_rows2(a, acc + ch, D, NR);
    for (int64_t t = t0; t < t1; t++) {
        int sh;
        const int64_t row = chan_row(t, BITS, &sh);
        const uint8_t *b = c->codes + h * s[0] + cb * s[2] + row * s[3];
        __m256 v0, v1;
        vquarter(b, s[1], BITS, sh, k, &v0, &v1);
        fma_rows2(a, pw + (t - t0), n, v0, v1, NR);
    }
    for (int i = 0; i < NR; i++) {
        const __m256 z = _mm256_set1_ps(zs[i]);
        a[i][0] = _mm256_add_ps(a[i][0], z);
        a[i][1] = _mm256_add_ps(a[i][1], z);
    }
    store_rows2(acc + ch, D, a, NR);
}

/* TaDA V with fp16 means, v = mu - (c s + z) per token, quarter k of block cb: dequantized
 * in registers per token (the means are a vector per token, so nothing folds out) */
static inline __attribute__((always_inline)) void vmix8_tada(const Codec *c, int h, int64_t t0, int64_t t1,
        int cb, int k, const float *p, int64_t N, int D, float *acc, const int NR) {
    const int64_t *s = c->cs;
    const int ch = vquarter_ch(cb, k);
    __m256 a[4][2];
    load_rows2(a, acc + ch, D, NR);
    for (int64_t t = t0; t < t1; t++) {
        int sh;
        const int64_t row = chan_row(t, c->bits, &sh);
        __m256 v0, v1;
        vquarter(c->codes + h * s[0] + cb * s[2] + row * s[3], s[1], c->bits, sh, k, &v0, &v1);
        const int64_t so = h * c->ss[0] + t * c->ss[1];
        const __m256 sv = _mm256_set1_ps((float)c->scale[so]), zv = _mm256_set1_ps((float)c->zero[so]);
        const f16 *mp = (const f16 *)c->mu + t * c->mus + ch;
        v0 = _mm256_sub_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)mp)), _mm256_fmadd_ps(v0, sv, zv));
        v1 = _mm256_sub_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mp + 8))), _mm256_fmadd_ps(v1, sv, zv));
        fma_rows2(a, p + t, N, v0, v1, NR);
    }
    store_rows2(acc + ch, D, a, NR);
}

/* p.V over tail tokens [t0, t1) (at most CHUNK tiles) of a packed V in the chan layout (int8,
 * KIVI without GEAR terms, TaDA with fp16 means), D a multiple of 64, every quarter of every
 * block in row blocks of 4; 0 when there is no fast path here */
static int v_mix_fast(const Codec *c, int h, int64_t t0, int64_t t1, const float *p, int64_t N,
                      int R, int D, float *acc) {
    const int fold = c->kind == C_INT8 || (c->kind == C_KIVI && !c->rank && !c->k2 && c->g % 16 == 0);
    if (D % 64 || t1 - t0 > CHUNK * TILE || !(fold || (c->kind == C_TADA && !c->mu_int8))) return 0;
    if (!fold) {
        for (int cb = 0; cb < D / 64; cb++)
            for (int k = 0; k < 4; k++) {
#define VT(r0, nr) vmix8_tada(c, h, t0, t1, cb, k, p + (r0) * N, N, D, acc + (r0) * D, nr)
                ROW_BLOCKS4(R, VT);
#undef VT
            }
        return 1;
    }
    const int n = (int)(t1 - t0), i8 = c->kind == C_INT8, g = i8 ? D : c->g, ng = D / g;
    float sT[MAXD / 16 * CHUNK * TILE], zT[MAXD / 16 * CHUNK * TILE];     /* (ng, n) */
    float pw[4 * CHUNK * TILE], zs[4];
    run_scales(c, h, t0, n, ng, sT, zT);
    for (int r0 = 0; r0 < R; r0 += 4) {
        const int nr = R - r0 < 4 ? R - r0 : 4;
        for (int cb = 0; cb < D / 64; cb++)
            for (int k = 0; k < 4; k++) {
                const int gi = vquarter_ch(cb, k) / g;
                if (k == 0 || gi != vquarter_ch(cb, k - 1) / g)   /* a new group: its p s, sum p z */
                    for (int i = 0; i < nr; i++) {
                        const float *pr = p + (int64_t)(r0 + i) * N + t0, *sv = sT + gi * n, *zv = zT + gi * n;
                        float z = 0.f;
                        for (int j = 0; j < n; j++) {
                            pw[i * n + j] = pr[j] * sv[j];
                            z += pr[j] * zv[j];
                        }
                        zs[i] = z;
                    }
                float *ar = acc + (int64_t)r0 * D;
#define VF(nr) (c->bits == 4 ? vmix8_fold(c, h, t0, t1, cb, k, pw, zs, D, ar, nr, 4)          \
                : c->bits == 2 ? vmix8_fold(c, h, t0, t1, cb, k, pw, zs, D, ar, nr, 2)        \
                : vmix8_fold(c, h, t0, t1, cb, k, pw, zs, D, ar, nr, 8))
                switch (nr) {
                case 4: VF(4); break;
                case 3: VF(3); break;
                case 2: VF(2); break;
                default: VF(1);
                }
#undef VF
            }
    }
    return 1;
}
static int kivi_tiles_fast(const Codec *c, int h, int64_t t0, int avail, const float *q, int R,
                           int D, float *sc, int64_t N) { return 0; }
static int vmix_kivi(const Codec *c, int h, int64_t t0, int64_t t1, const float *p, int64_t N,
                     int R, int D, float *acc) { return 0; }
