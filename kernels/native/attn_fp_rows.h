/* attn_fp_rows.h: fp rows VW tokens at a time (the fp tails, the window, the new tokens,
 * TaDA's means), VW the register's lanes.
 * A part of decode_attention.c's one translation unit, included there in the order its
 * parts depend on (Args, KLay and the helpers of the parts before it); not a header of
 * its own. */

/* -- fp rows VW tokens at a time, VW the register's lanes (AVX-512 16, AVX2 8): the fp tails,
 * the window, the new tokens and TaDA's means -------------------------------------------- */
#if defined(__AVX512F__) && !defined(KVRUN_NO_AVX512)
enum { VW = 16 };
typedef __m512 vrow;
#define VR_LOAD _mm512_loadu_ps
#define VR_STORE _mm512_storeu_ps
#define VR_MUL _mm512_mul_ps
#define VR_FMA _mm512_fmadd_ps
#define VR_HSUM hsum16x16
/* lane i of the result = sum of the 16 lanes of v[i] */
static inline __m512 hsum16x16(const __m512 v[16]) {
    __m512 s[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(s[2 * i]), b = _mm512_castps_pd(s[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

#elif defined(__AVX2__) && defined(__FMA__) && !defined(KVRUN_NO_AVX2)
enum { VW = 8 };
typedef __m256 vrow;
#define VR_LOAD _mm256_loadu_ps
#define VR_STORE _mm256_storeu_ps
#define VR_MUL _mm256_mul_ps
#define VR_FMA _mm256_fmadd_ps
#define VR_HSUM hsum8x8                  /* rows_inline.h */
#endif

#if defined(VR_HSUM)
/* out[r * os + j] = q_r . rows_j for VW token-major fp32 rows (D % VW == 0, j < VW): the VW
 * dot products of a row reduced together (VR_HSUM) instead of one by one */
static void rows_scores(const float *rows, const float *q, int R, int D, float *out, int64_t os) {
    for (int r = 0; r < R; r++) {
        const float *qr = q + r * D;
        vrow v[VW];
        for (int j = 0; j < VW; j++) {
            vrow a = VR_MUL(VR_LOAD(qr), VR_LOAD(rows + j * D));
            for (int d = VW; d < D; d += VW) a = VR_FMA(VR_LOAD(qr + d), VR_LOAD(rows + j * D + d), a);
            v[j] = a;
        }
        VR_STORE(out + r * os, VR_HSUM(v));
    }
}

/* logits of tokens [t0, t0 + VW n) of fp rows (fp16 / bf16 / fp32, token-major) into
 * sc[r * N + col0 + t]; D % VW == 0 */
static void fp_rows(const void *base, int64_t off, int64_t stride, int kind, int64_t n,
                    const float *q, int R, int D, float *sc, int64_t N) {
    float rows[VW * MAXD];
    for (int64_t j0 = 0; j0 < VW * n; j0 += VW) {
        for (int j = 0; j < VW; j++) load_row(base, off + (j0 + j) * stride, kind, D, rows + j * D);
        rows_scores(rows, q, R, D, sc + j0, N);
    }
}

/* TaDA's q . mu_t for the 32 tokens of a tile, VW means at a time: out[r * 32 + j] */
static void mu_rows_scores(const Codec *c, int64_t t0, const float *q, int R, int D, float *out) {
    float mu[VW * MAXD];
    for (int j0 = 0; j0 < TILE; j0 += VW) {
        for (int j = 0; j < VW; j++) mu_row(c, t0 + j0 + j, D, mu + j * D);
        if (D % VW == 0) {
            rows_scores(mu, q, R, D, out + j0, TILE);
            continue;
        }
        for (int r = 0; r < R; r++)
            for (int j = 0; j < VW; j++) out[r * TILE + j0 + j] = dot(q + r * D, mu + j * D, D);
    }
}

static void mu_scores(const Codec *c, int64_t t0, const float *q, int R, int D, float *out);

/* The logits of a packed K tile (int8 / KIVI / TaDA) into sc[r * N + j] from the products of
 * tile_rows' query rows with its codes, acc[r * 32 + j], and tile_rows' per-row bias:
 * KIVI acc + q . z; int8 s (q . c - 128 sum q); TaDA q . mu_t - s (q . c) - z sum q (the
 * means' dots from the fast path's mu_scores) */
static void k_tile_logits(const Codec *c, int h, int64_t t0, const float *q, int R, int D,
                          const float *acc, const float *bias, float *sc, int64_t N) {
    if (c->kind == C_KIVI) {
        for (int r = 0; r < R; r++)
            for (int j = 0; j < TILE; j++) sc[r * N + j] = acc[r * TILE + j] + bias[r];
        return;
    }
    const f16 *sp = c->scale + h * c->ss[0] + t0 * c->ss[1];
    if (c->kind == C_INT8) {
        for (int j = 0; j < TILE; j++) {
            const float st = (float)sp[j * c->ss[1]];
            for (int r = 0; r < R; r++) sc[r * N + j] = st * (acc[r * TILE + j] - 128.f * bias[r]);
        }
        return;
    }
    const f16 *zp = c->zero + h * c->ss[0] + t0 * c->ss[1];
    float qm[64 * TILE];
    mu_scores(c, t0, q, R, D, qm);
    for (int j = 0; j < TILE; j++) {
        const float st = (float)sp[j * c->ss[1]], z = (float)zp[j * c->ss[1]];
        for (int r = 0; r < R; r++) sc[r * N + j] = qm[r * TILE + j] - st * acc[r * TILE + j] - z * bias[r];
    }
}
#endif
