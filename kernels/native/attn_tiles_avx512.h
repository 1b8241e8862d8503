/* attn_tiles_avx512.h: the AVX-512 fast paths: packed codes decoded in registers, no tile
 * buffer (included only on an AVX-512 build).
 * A part of decode_attention.c's one translation unit, included there in the order its
 * parts depend on (Args, KLay and the helpers of the parts before it); not a header of
 * its own. */

/* -- AVX-512 fast paths: packed codes decoded in registers, no tile buffer -------------------- */
#define HAVE_FAST 1
#define PREFETCH 256

/* 16 codes from 16 bytes: (b >> sh) & mask, as fp32 */
static inline __m512 dec16(const uint8_t *b, __m128i sh, __m512i mask) {
    __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srl_epi32(w, sh), mask));
}

/* acc[i][j] = sum_d qx[i * D + d] * code(d, j), j < 32, i < NR; channel d's 32 codes as
 * k_layout's L says (one plane, or two combined as (first << fsh) + second). */
static inline __attribute__((always_inline)) void kdot_rows(const float *qx, int D, const KLay *L,
        float *acc, const int NR) {
    __m512 a[8][2];                        /* up to 8 rows: 16 of the 32 registers */
    for (int i = 0; i < NR; i++) a[i][0] = a[i][1] = _mm512_setzero_ps();
    const uint8_t *b = L->b, *b2 = L->b2;
    const int64_t ds = L->ds, ds2 = L->ds2;
    __m128i shv = _mm_cvtsi32_si128(L->sh), shv2 = _mm_cvtsi32_si128(L->sh2);
    __m512i mv = _mm512_set1_epi32(L->mask), mv2 = _mm512_set1_epi32(L->mask2);
    __m512 f = _mm512_set1_ps((float)(1 << L->fsh));
    for (int d = 0; d < D; d++) {
        /* channel rows are ds bytes apart (KIVI: one row per channel, 64+ streams, more
         * than the hardware prefetcher follows): fetch this row's bytes 8 tiles ahead */
        _mm_prefetch((const char *)(b + d * ds + PREFETCH), KV_PF_HINT);
        __m512 c0 = dec16(b + d * ds, shv, mv), c1 = dec16(b + d * ds + 16, shv, mv);
        if (b2) {
            c0 = _mm512_fmadd_ps(c0, f, dec16(b2 + d * ds2, shv2, mv2));
            c1 = _mm512_fmadd_ps(c1, f, dec16(b2 + d * ds2 + 16, shv2, mv2));
        }
        for (int i = 0; i < NR; i++) {
            __m512 qb = _mm512_set1_ps(qx[i * D + d]);
            a[i][0] = _mm512_fmadd_ps(qb, c0, a[i][0]);
            a[i][1] = _mm512_fmadd_ps(qb, c1, a[i][1]);
        }
    }
    for (int i = 0; i < NR; i++) {
        _mm512_storeu_ps(acc + i * TILE, a[i][0]);
        _mm512_storeu_ps(acc + i * TILE + 16, a[i][1]);
    }
}

/* KIVI K over TT consecutive tiles per visit of a channel row (its codes for 32*TT tokens
 * are 16*TT*bits/4 contiguous bytes): the D channel rows sit ds bytes apart, often one
 * page each, so visiting each row once per TT tiles cuts TLB and cache-line misses TT-fold.
 * qx: (TT, NR, D) per-tile scaled queries; off/sh: byte offset and shift of each tile;
 * acc: (TT, NR, 32). */
static inline __attribute__((always_inline)) void kdot_multi(const float *qx, int D, const uint8_t *b,
        int64_t ds, const int *off, const int *sh, int mask, float *acc, const int NR, const int TT) {
    __m512 a[6][8];
    for (int i = 0; i < NR; i++)
        for (int k = 0; k < 2 * TT; k++) a[i][k] = _mm512_setzero_ps();
    __m512i mv = _mm512_set1_epi32(mask);
    __m128i shv[4];
    for (int tt = 0; tt < TT; tt++) shv[tt] = _mm_cvtsi32_si128(sh[tt]);
    for (int d = 0; d < D; d++) {
        const uint8_t *row = b + d * ds;
        _mm_prefetch((const char *)(row + PREFETCH), KV_PF_HINT);
        for (int tt = 0; tt < TT; tt++) {
            __m512 c0 = dec16(row + off[tt], shv[tt], mv), c1 = dec16(row + off[tt] + 16, shv[tt], mv);
            for (int i = 0; i < NR; i++) {
                __m512 qb = _mm512_set1_ps(qx[(tt * NR + i) * D + d]);
                a[i][2 * tt] = _mm512_fmadd_ps(qb, c0, a[i][2 * tt]);
                a[i][2 * tt + 1] = _mm512_fmadd_ps(qb, c1, a[i][2 * tt + 1]);
            }
        }
    }
    for (int tt = 0; tt < TT; tt++)
        for (int i = 0; i < NR; i++) {
            _mm512_storeu_ps(acc + (tt * NR + i) * TILE, a[i][2 * tt]);
            _mm512_storeu_ps(acc + (tt * NR + i) * TILE + 16, a[i][2 * tt + 1]);
        }
}

static void kdot(const float *qx, int R, int D, const KLay *L, float *acc) {
#define KR(r0, nr) kdot_rows(qx + (r0) * D, D, L, acc + (r0) * TILE, nr)
    ROW_BLOCKS8(R, KR);                  /* blocks of 8 rows: a channel row decoded once */
#undef KR
}

static inline float hsum_dot(const float *a, const float *b, int D) {
    __m512 s = _mm512_setzero_ps();
    int d = 0;
    for (; d + 16 <= D; d += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), s);
    float r = _mm512_reduce_add_ps(s);
    for (; d < D; d++) r += a[d] * b[d];
    return r;
}

/* TaDA's q . mu_t for the 32 tokens of a tile: out[r * 32 + j]. At decode (fp16 means,
 * D 64, up to 3 rows) each mean row is converted once and FMA'd into every row's partials,
 * 16 tokens reduced together (hsum16x16); else mu_rows_scores. */
static void mu_scores(const Codec *c, int64_t t0, const float *q, int R, int D, float *out) {
    if (!c->mu_int8 && D == 64 && R <= 3) {  /* decode: each mean row converted once, */
        __m512 part[3][16];                    /* FMAs into every query row's partials  */
        for (int j0 = 0; j0 < TILE; j0 += 16) {
            const f16 *m = (const f16 *)c->mu + (t0 + j0) * c->mus;
            for (int j = 0; j < 16; j++) {
                const __m256i *mr = (const __m256i *)(m + j * c->mus);
                __m512 m0 = _mm512_cvtph_ps(_mm256_loadu_si256(mr)), m1 = _mm512_cvtph_ps(_mm256_loadu_si256(mr + 1));
                __m512 m2 = _mm512_cvtph_ps(_mm256_loadu_si256(mr + 2)), m3 = _mm512_cvtph_ps(_mm256_loadu_si256(mr + 3));
                for (int r = 0; r < R; r++) {
                    const float *qr = q + r * D;
                    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qr), m0);
                    a = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16), m1, a);
                    a = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 32), m2, a);
                    part[r][j] = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 48), m3, a);
                }
            }
            for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * TILE + j0, hsum16x16(part[r]));
        }
        return;
    }
    mu_rows_scores(c, t0, q, R, D, out);
}

/* (n, r) row-major -> (r, n): for rank 4 and n % 16 == 0 with two-source permutes (16
 * rows = 4 registers of 4 rows x 4 ranks), else element by element */
static void transpose_rank(const float *restrict src, int n, int r, float *restrict dst) {
    if (r == 4 && n % 16 == 0) {
        for (int k = 0; k < 4; k++) {
            int lo[16], hi[16];
            for (int c = 0; c < 16; c++) {              /* lanes 0-7 used: rows c of (X0 | X1) */
                lo[c] = (c % 8 < 4 ? 0 : 16) + (c % 4) * 4 + k;
                hi[c] = lo[c];
            }
            __m512i il = _mm512_loadu_si512(lo), ih = _mm512_loadu_si512(hi);
            for (int i0 = 0; i0 < n; i0 += 16) {
                const float *x = src + i0 * 4;
                __m512 p01 = _mm512_permutex2var_ps(_mm512_loadu_ps(x), il, _mm512_loadu_ps(x + 16));
                __m512 p23 = _mm512_permutex2var_ps(_mm512_loadu_ps(x + 32), ih, _mm512_loadu_ps(x + 48));
                _mm512_storeu_ps(dst + k * n + i0, _mm512_shuffle_f32x4(p01, p23, 0x44));
            }
        }
        return;
    }
    for (int i = 0; i < n; i++)
        for (int k = 0; k < r; k++) dst[k * n + i] = src[i * r + k];
}

/* KIVI: logits of up to `avail` consecutive tiles from t0 in one pass over the channel
 * rows (see kdot_multi); returns the number of tiles done */
static int kivi_tiles_fast(const Codec *c, int h, int64_t t0, int avail, const float *q, int R,
                           int D, float *sc, int64_t N) {
    int TT = R <= 3 ? 4 : R <= 6 ? 2 : 1;
    if (TT > avail) TT = avail >= 2 && R <= 6 ? 2 : 1;
    if (TT == 1 || c->bits == 3) return 0;     /* 3 bits: one tile at a time (k_tile_fast) */
    const uint8_t *b = c->codes + h * c->cs[0] + chanpack_byte(t0, c->bits);
    int off[4], sh[4];
    float qx[4 * 6 * MAXD], acc[4 * 6 * TILE], bias[4 * 6];
    for (int tt = 0; tt < TT; tt++) {
        int64_t t = t0 + 32 * tt;
        off[tt] = (int)(chanpack_byte(t, c->bits) - chanpack_byte(t0, c->bits));
        sh[tt] = chanpack_shift(t, c->bits);
        kivi_fold_q(c, h, t, q, R, D, qx + tt * R * D, bias + tt * R);
    }
    int mask = (1 << c->bits) - 1;
#define KM(nr, tt) kdot_multi(qx, D, b, c->cs[1], off, sh, mask, acc, nr, tt)
    if (TT == 4) {
        switch (R) { case 3: KM(3, 4); break; case 2: KM(2, 4); break; default: KM(1, 4); }
    } else {
        switch (R) {
        case 6: KM(6, 2); break; case 5: KM(5, 2); break; case 4: KM(4, 2); break;
        case 3: KM(3, 2); break; case 2: KM(2, 2); break; default: KM(1, 2);
        }
    }
#undef KM
    for (int tt = 0; tt < TT; tt++)
        for (int r = 0; r < R; r++)
            for (int j = 0; j < TILE; j++)
                sc[r * N + tt * TILE + j] = acc[(tt * R + r) * TILE + j] + bias[tt * R + r];
    return TT;
}

/* logits of a packed K tile (int8 / KIVI / GEAR / TaDA) straight from the codes into
 * sc[r * N + j]; returns 0 when the layout has no fast path */
static int k_tile_fast(const Codec *c, int h, int64_t t0, const float *q, int R, int D,
                       float *sc, int64_t N) {
    if (c->kind <= C_FP32 && D % 16 == 0) {            /* fp tail: rows as they are */
        fp_rows(c->x, h * c->xs[0] + t0 * c->xs[1], c->xs[1], c->kind, TILE / VW, q, R, D, sc, N);
        return 1;
    }
    if (c->kind < C_INT8 || R > 64) return 0;
    const KLay L = k_layout(c, h, t0);
    float qx[64 * MAXD], acc[64 * TILE], bias[64];
    const float *qd = tile_rows(c, h, t0, q, R, D, qx, bias);
    kdot(qd, R, D, &L, acc);
    k_tile_logits(c, h, t0, q, R, D, acc, bias, sc, N);
    if (c->kind == C_KIVI) {
        if (c->rank) {                     /* GEAR: q . (A_t B^T) = (q B) . A_t */
            const f16 *A = c->lr_a + h * c->as[0] + t0 * c->as[1];
            const f16 *B = c->lr_b + h * c->bs[0] + (t0 / c->G) * c->bs[1];
            float bf[MAXD * 8], bt[8 * MAXD], af[TILE * 8];
            int rk = c->rank;
            f16_to_f32(B, D * rk, bf);
            transpose_rank(bf, D, rk, bt);
            f16_to_f32(A, TILE * rk, af);      /* (32, r) rows, contiguous */
            float at[8 * TILE];                /* A^T (r, 32): vectors over the tile's tokens */
            transpose_rank(af, TILE, rk, at);
            for (int r = 0; r < R; r++) {
                __m512 s0 = _mm512_loadu_ps(sc + r * N), s1 = _mm512_loadu_ps(sc + r * N + 16);
                for (int k = 0; k < rk; k++) {
                    __m512 qk = _mm512_set1_ps(hsum_dot(q + r * D, bt + k * D, D));
                    s0 = _mm512_fmadd_ps(qk, _mm512_loadu_ps(at + k * TILE), s0);
                    s1 = _mm512_fmadd_ps(qk, _mm512_loadu_ps(at + k * TILE + 16), s1);
                }
                _mm512_storeu_ps(sc + r * N, s0);
                _mm512_storeu_ps(sc + r * N + 16, s1);
            }
        }
        if (c->k2) {                       /* GEAR outliers of this tile's tokens */
            int64_t blk = t0 / c->G, off = t0 - blk * c->G;
            const uint8_t *ix = c->oidx + h * c->os[0] + blk * c->os[1];
            const f16 *vx = c->oval + h * c->os[0] + blk * c->os[1];
            for (int d = 0; d < D; d++)
                for (int k = 0; k < c->k2; k++) {
                    int64_t tok = (int64_t)ix[d * c->os[2] + k] - off;
                    if (tok < 0 || tok >= TILE) continue;
                    float v = (float)vx[d * c->os[2] + k];
                    for (int r = 0; r < R; r++) sc[r * N + tok] += q[r * D + d] * v;
                }
        }
    }
    return 1;
}

/* One 64-channel block cb of V for NR rows over tokens [t0, t1): KW = 4 registers (the
 * whole block, NR <= 4) or KW = 2 (half HF of it: the low / high nibbles, NR <= 8, so 8
 * GQA rows decode each code once). Register k holds channels cb*64 + 32*half + 16*(k%2). */
static inline __attribute__((always_inline)) void vmix_rows(const Codec *c, int h, int64_t t0, int64_t t1,
        int cb, const float *p, int64_t N, int D, float *acc, const int NR, const int KW, const int HF) {
    const int64_t *s = c->cs;
    int ch[4];
    for (int k = 0; k < KW; k++) ch[k] = cb * 64 + 32 * (KW == 4 ? k / 2 : HF) + 16 * (k % 2);
    __m512 a[8][4];
    for (int i = 0; i < NR; i++)
        for (int k = 0; k < KW; k++) a[i][k] = _mm512_loadu_ps(acc + i * D + ch[k]);
    __m512i mv = _mm512_set1_epi32(c->bits == 2 ? 3 : 15), m15 = _mm512_set1_epi32(15);
    __m512 sixteen = _mm512_set1_ps(16.f);
    for (int64_t t = t0; t < t1; t++) {
        int sh;
        int64_t row = chan_row(t, c->bits, &sh);
        const uint8_t *b = c->codes + h * s[0] + cb * s[2] + row * s[3];
        __m512 v[4];
        for (int k = 0; k < KW; k++) {
            int hk = KW == 4 ? k / 2 : HF;
            v[k] = dec16(b + 16 * (k % 2), _mm_cvtsi32_si128(sh + 4 * hk), mv);
            if (c->bits == 8)              /* second nibble plane: 16 * hi + lo */
                v[k] = _mm512_fmadd_ps(v[k], sixteen,
                                       dec16(b + s[1] + 16 * (k % 2), _mm_cvtsi32_si128(4 * hk), m15));
        }
        if (c->kind == C_KIVI) {
            const f16 *sp = c->scale + h * c->ss[0] + t * c->ss[1];
            const f16 *zp = c->zero + h * c->ss[0] + t * c->ss[1];
            for (int k = 0; k < KW; k++) {
                int gi = ch[k] / c->g;
                v[k] = _mm512_fmadd_ps(v[k], _mm512_set1_ps((float)sp[gi * c->ss[2]]),
                                       _mm512_set1_ps((float)zp[gi * c->ss[2]]));
            }
        } else {
            float sv = (float)c->scale[h * c->ss[0] + t * c->ss[1]];
            if (c->kind == C_INT8) {
                __m512 ss = _mm512_set1_ps(sv), zz = _mm512_set1_ps(-128.f * sv);
                for (int k = 0; k < KW; k++) v[k] = _mm512_fmadd_ps(v[k], ss, zz);
            } else {
                float zv = (float)c->zero[h * c->ss[0] + t * c->ss[1]];
                __m512 ss = _mm512_set1_ps(sv), zz = _mm512_set1_ps(zv), m[4];
                if (!c->mu_int8) {         /* the block's fp16 means, converted in registers */
                    const f16 *mp = (const f16 *)c->mu + t * c->mus;
                    for (int k = 0; k < KW; k++)
                        m[k] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mp + ch[k])));
                } else {
                    float mu[MAXD];
                    mu_row(c, t, D, mu);
                    for (int k = 0; k < KW; k++) m[k] = _mm512_loadu_ps(mu + ch[k]);
                }
                for (int k = 0; k < KW; k++) v[k] = _mm512_sub_ps(m[k], _mm512_fmadd_ps(v[k], ss, zz));
            }
        }
        for (int i = 0; i < NR; i++) {
            __m512 pb = _mm512_set1_ps(p[i * N + t]);
            for (int k = 0; k < KW; k++) a[i][k] = _mm512_fmadd_ps(pb, v[k], a[i][k]);
        }
    }
    for (int i = 0; i < NR; i++)
        for (int k = 0; k < KW; k++) _mm512_storeu_ps(acc + i * D + ch[k], a[i][k]);
}

/* rows [r0, R) of block cb: whole-block passes for up to 4 rows, half-block passes of 8 */
static void vmix_block(const Codec *c, int h, int64_t t0, int64_t t1, int cb, const float *p,
                       int64_t N, int R, int D, float *acc) {
#define VM(nr, kw, hf) vmix_rows(c, h, t0, t1, cb, p + r0 * N, N, D, acc + r0 * D, nr, kw, hf)
    int r0 = 0;
    for (; R - r0 > 4; r0 += 8) {
        switch (R - r0 >= 8 ? 8 : R - r0) {
        case 8: VM(8, 2, 0); VM(8, 2, 1); break;
        case 7: VM(7, 2, 0); VM(7, 2, 1); break;
        case 6: VM(6, 2, 0); VM(6, 2, 1); break;
        default: VM(5, 2, 0); VM(5, 2, 1); break;
        }
    }
    switch (R - r0) {
    case 4: VM(4, 4, 0); break;
    case 3: VM(3, 4, 0); break;
    case 2: VM(2, 4, 0); break;
    case 1: VM(1, 4, 0); break;
    default: break;
    }
#undef VM
}

/* KIVI V (2 or 4 bits, g % 16 == 0) for NR rows over whole tiles [t0, t1) of 64-channel
 * block cb, the scales and zeros folded out of the token loop: with v = c s_g + z_g,
 * sum_t p_t v_t = sum_t (p_t s_tg) c_t + sum_t p_t z_tg. Per tile the products p s (per
 * row, group and token, in vectors over the tile's tokens) become the broadcasts of the
 * FMAs and sum p z a scalar per row and group, added at the end; per token the 32 bytes are
 * decoded once into 4 registers of 16 channels (low nibbles then high). */
static inline __attribute__((always_inline)) void vmix_kivi_rows(const Codec *c, int h, int64_t t0,
        int64_t t1, int cb, const float *p, int64_t N, int D, float *acc, const float *sT,
        const float *zT, const int NR, const int BITS) {
    const int64_t *s = c->cs;
    const int g = c->g, gpb = g < 64 ? 64 / g : 1, g0 = cb * 64 / g;   /* groups in the block */
    __m512 a[6][4], zacc[6][4];
    for (int i = 0; i < NR; i++)
        for (int k = 0; k < 4; k++) {
            a[i][k] = _mm512_loadu_ps(acc + i * D + cb * 64 + 16 * k);
            zacc[i][k] = _mm512_setzero_ps();
        }
    const __m512i m = _mm512_set1_epi32(BITS == 2 ? 3 : 15);
    float pw[4][6][TILE];                  /* p s per (group of the block, row, token) */
    for (int64_t tt = t0; tt < t1; tt += TILE) {
        /* -- fold: p s per token into pw, p z summed per group in zacc -- */
        for (int gb = 0; gb < gpb; gb++) {
            const float *sv = sT + (g0 + gb) * (t1 - t0) + (tt - t0), *zv = zT + (g0 + gb) * (t1 - t0) + (tt - t0);
            for (int i = 0; i < NR; i++)
                for (int j = 0; j < TILE; j += 16) {
                    const __m512 pv = _mm512_loadu_ps(p + i * N + tt + j);
                    _mm512_storeu_ps(pw[gb][i] + j, _mm512_mul_ps(pv, _mm512_loadu_ps(sv + j)));
                    zacc[i][gb] = _mm512_fmadd_ps(pv, _mm512_loadu_ps(zv + j), zacc[i][gb]);
                }
        }
        /* -- tokens: decode once, NR x 4 FMAs -- */
        int sh;
        const int64_t row0 = chan_row(tt, c->bits, &sh);
        const __m128i s0 = _mm_cvtsi32_si128(sh), s1 = _mm_cvtsi32_si128(sh + 4);
        const uint8_t *b = c->codes + h * s[0] + cb * s[2] + row0 * s[3];
        for (int j = 0; j < TILE; j++, b += s[3]) {
            _mm_prefetch((const char *)(b + PREFETCH), KV_PF_HINT);
            const __m512i w0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
            const __m512i w1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 16)));
            __m512 v[4];
            if (BITS == 4) {                   /* bytes zero-extended: the high nibble needs no mask */
                v[0] = _mm512_cvtepi32_ps(_mm512_and_si512(w0, m));
                v[1] = _mm512_cvtepi32_ps(_mm512_and_si512(w1, m));
                v[2] = _mm512_cvtepi32_ps(_mm512_srli_epi32(w0, 4));
                v[3] = _mm512_cvtepi32_ps(_mm512_srli_epi32(w1, 4));
            } else {
                v[0] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srl_epi32(w0, s0), m));
                v[1] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srl_epi32(w1, s0), m));
                v[2] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srl_epi32(w0, s1), m));
                v[3] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srl_epi32(w1, s1), m));
            }
            for (int i = 0; i < NR; i++)
                for (int k = 0; k < 4; k++)
                    a[i][k] = _mm512_fmadd_ps(_mm512_set1_ps(pw[16 * k / g][i][j]), v[k], a[i][k]);
        }
    }
    for (int i = 0; i < NR; i++) {
        float zs[4];                       /* sum_t p z per group of the block */
        for (int gb = 0; gb < gpb; gb++) zs[gb] = _mm512_reduce_add_ps(zacc[i][gb]);
        for (int k = 0; k < 4; k++)
            _mm512_storeu_ps(acc + i * D + cb * 64 + 16 * k,
                             _mm512_add_ps(a[i][k], _mm512_set1_ps(zs[16 * k / g])));
    }
}

/* p.V over whole tiles [t0, t1) of a KIVI V without GEAR terms (vmix_kivi_rows); 0 when the
 * codec has no such path (8 bits, groups that are not 16, 32 or a multiple of 64 channels,
 * D % 64 != 0) */
static int vmix_kivi(const Codec *c, int h, int64_t t0, int64_t t1, const float *p, int64_t N,
                     int R, int D, float *acc) {
    if (c->kind != C_KIVI || c->rank || c->k2 || c->bits == 8 || c->g % 16 || (64 % c->g && c->g % 64)
        || D % 64 || c->ss[2] != 1) return 0;
    const int RB = R <= 6 ? R : 4, ng = D / c->g;
    float sT[MAXD / 16 * CHUNK * TILE], zT[MAXD / 16 * CHUNK * TILE];   /* (ng, n) */
    for (int64_t u0 = t0; u0 < t1; u0 += CHUNK * TILE) {
        const int64_t u1 = u0 + CHUNK * TILE < t1 ? u0 + CHUNK * TILE : t1;
        const int64_t off = h * c->ss[0] + u0 * c->ss[1];
        groups_T(c->scale + off, c->ss[1], 1, (int)(u1 - u0), ng, sT);
        groups_T(c->zero + off, c->ss[1], 1, (int)(u1 - u0), ng, zT);
        for (int cb = 0; cb < D / 64; cb++)
            for (int r0 = 0; r0 < R; r0 += RB) {
#define VK(nr) (c->bits == 4 ? vmix_kivi_rows(c, h, u0, u1, cb, p + r0 * N, N, D, acc + r0 * D, sT, zT, nr, 4) \
                       : vmix_kivi_rows(c, h, u0, u1, cb, p + r0 * N, N, D, acc + r0 * D, sT, zT, nr, 2))
                switch (R - r0 < RB ? R - r0 : RB) {
                case 6: VK(6); break; case 5: VK(5); break; case 4: VK(4); break;
                case 3: VK(3); break; case 2: VK(2); break; default: VK(1);
                }
#undef VK
            }
    }
    return 1;
}

/* p.V over tail tokens [t0, t1) of a packed V in the chan layout (int8 / KIVI / GEAR /
 * TaDA), D a multiple of 64: every token's 64-channel blocks decoded in registers,
 * dequantized (c s + z, TaDA mu - (c s + z)) and accumulated into acc (R, D) by vmix_block;
 * GEAR adds (p A) B^T per block and its outliers. Returns 0 when there is no fast path. */
static int v_mix_fast(const Codec *c, int h, int64_t t0, int64_t t1, const float *p, int64_t N,
                      int R, int D, float *acc) {
    if (c->kind < C_INT8 || D % 64 != 0 || (c->kind == C_KIVI && c->g % 16 != 0)) return 0;
    /* GEAR: runs of tokens within one block of G share B (converted once per run) */
    int64_t step = c->rank ? c->G - t0 % c->G : t1 - t0;
    float bfull[8 * MAXD];
    for (int64_t a0 = t0; a0 < t1; ) {
        int64_t a1 = a0 + step < t1 ? a0 + step : t1;
        if (c->rank) {
            const f16 *B = c->lr_b + h * c->bs[0] + (a0 / c->G) * c->bs[1];     /* (D, r) */
            float tmp[MAXD * 8];
            f16_to_f32(B, D * c->rank, tmp);
            transpose_rank(tmp, D, c->rank, bfull);
        }
        for (int cb = 0; cb < D / 64; cb++) vmix_block(c, h, a0, a1, cb, p, N, R, D, acc);
        if (c->rank) {                     /* GEAR: sum_t p_t A_t B^T = (sum_t p_t A_t) B^T */
            int n = (int)(a1 - a0), rk = c->rank;
            float af[8 * 256], at[8 * 256];    /* A rows of the run (n <= G <= 256), A^T */
            f16_to_f32(c->lr_a + h * c->as[0] + a0 * c->as[1], n * rk, af);
            transpose_rank(af, n, rk, at);
            for (int r = 0; r < R; r++)
                for (int k = 0; k < rk; k++) {
                    float pa = dot(p + r * N + a0, at + k * n, n);
                    for (int d = 0; d < D; d++) acc[r * D + d] += pa * bfull[k * D + d];
                }
        }
        if (c->k2)                         /* GEAR outliers: p_t * value at their channels */
            for (int64_t t = a0; t < a1; t++) {
                const uint8_t *ix = c->oidx + h * c->os[0] + t * c->os[1];
                const f16 *vx = c->oval + h * c->os[0] + t * c->os[1];
                for (int k = 0; k < c->k2; k++) {
                    float v = (float)vx[k];
                    for (int r = 0; r < R; r++) acc[r * D + ix[k]] += p[r * N + t] * v;
                }
            }
        a0 = a1;
        step = c->rank ? c->G : t1 - t0;
    }
    return 1;
}
