/* attn_code_rows.h: packed code rows (a K tile's channel rows, a V row, TaDA's means
 * decoded into fp32) and the AVX2 / C micro-kernels that multiply a decoded tile.
 * A part of decode_attention.c's one translation unit, included there in the order its
 * parts depend on (Args, KLay and the helpers of the parts before it); not a header of
 * its own. */

/* -- packed code rows -------------------------------------------------------------------- */

/* 32 codes of one channel row of a K tile: (b >> shift) & mask over 32 bytes */
static inline void codes32(const uint8_t *restrict b, int shift, int mask, float *restrict o) {
    for (int j = 0; j < TILE; j++) o[j] = (float)((b[j] >> shift) & mask);
}

/* Where the 32 codes of tail tile t0 (t0 % 32 == 0) of head h live in a packed K layout:
 * channel d's bytes at b + d * ds, code = (byte >> sh) & mask; with a second plane b2
 * (bytes at b2 + d * ds2), code = code << fsh | ((b2 byte >> sh2) & mask2): the 8-bit tok
 * layout's two nibble planes (fsh 4), or 3-bit KIVI keys' 1-bit third planes in b and
 * 2-bit low planes in b2 (fsh 2). */
typedef struct {
    const uint8_t *b, *b2;
    int64_t ds, ds2;
    int sh, sh2, mask, mask2, fsh;
} KLay;

static KLay k_layout(const Codec *c, int h, int64_t t0) {
    const int64_t *s = c->cs;
    KLay L = {0};
    if (c->kind == C_KIVI && c->bits == 3) {
        L.b = c->hi + h * c->hs[0] + chanpack_byte(t0, 1);
        L.ds = c->hs[1];
        L.sh = chanpack_shift(t0, 1);
        L.mask = 1;
        L.b2 = c->codes + h * s[0] + chanpack_byte(t0, chanpack_lo_bits(3));
        L.ds2 = s[1];
        L.sh2 = chanpack_shift(t0, chanpack_lo_bits(3));
        L.mask2 = 3;
        L.fsh = 2;
        return L;
    }
    if (c->kind == C_KIVI) {
        L.b = c->codes + h * s[0] + chanpack_byte(t0, c->bits);
        L.ds = s[1];
        L.sh = chanpack_shift(t0, c->bits);
        L.mask = (1 << c->bits) - 1;
        return L;
    }
    L.b = c->codes + h * s[0] + (t0 / tok_unit(c->bits)) * s[2];
    L.ds = L.ds2 = s[3];
    L.sh = L.sh2 = tok_shift(t0, c->bits);
    L.mask = c->bits == 2 ? 3 : 15;
    if (c->bits == 8) {
        L.b2 = L.b + s[1];
        L.mask2 = 15;
        L.fsh = 4;
    }
    return L;
}

/* K tile (D, 32) of raw codes for tokens [t0, t0+32) of head h (t0 % 32 == 0), from the
 * tok (int8 / TaDA) or chanpack (KIVI) layout of codec_layout.h. */
static void k_codes(const Codec *c, int h, int64_t t0, int D, float *restrict kt) {
    const KLay L = k_layout(c, h, t0);
    for (int d = 0; d < D; d++) {
        codes32(L.b + d * L.ds, L.sh, L.mask, kt + d * TILE);
        if (L.b2) {                        /* first << fsh, plus second */
            float lo[TILE];
            codes32(L.b2 + d * L.ds2, L.sh2, L.mask2, lo);
            for (int j = 0; j < TILE; j++) kt[d * TILE + j] = (float)(1 << L.fsh) * kt[d * TILE + j] + lo[j];
        }
    }
}

/* V row (D,) of raw codes for token t of head h. chan layout (nibble.py):
 * (Hkv, P, Dp/64, rows, 32), byte j of a row = channel j (low nibble) | j+32 (high);
 * 2 bits: rows per 64 tokens = 32, token i of the block in row i % 32, shift 2*(i/32). */
static void v_codes(const Codec *c, int h, int64_t t, int D, float *restrict o) {
    const int64_t *s = c->cs;
    int sh, mask = c->bits == 2 ? 3 : 15;
    int64_t row = chan_row(t, c->bits, &sh);
    int ncb = (D + 63) / 64;
    for (int cb = 0; cb < ncb; cb++) {
        const uint8_t *b = c->codes + h * s[0] + cb * s[2] + row * s[3];
        float tmp[64];
        for (int j = 0; j < 32; j++) {
            tmp[j] = (float)((b[j] >> sh) & mask);
            tmp[j + 32] = (float)((b[j] >> (sh + 4)) & mask);
        }
        if (c->bits == 8) {
            const uint8_t *l = b + s[1];
            for (int j = 0; j < 32; j++) {
                tmp[j] = 16.f * tmp[j] + (float)(l[j] & 15);
                tmp[j + 32] = 16.f * tmp[j + 32] + (float)(l[j] >> 4);
            }
        }
        int n = D - cb * 64 < 64 ? D - cb * 64 : 64;
        memcpy(o + cb * 64, tmp, n * sizeof(float));
    }
}

/* TaDA mean row (D,) of token t: fp16, or int8 in quant.pack_codes' word layout
 * ((S/4, D) int32, per block of G tokens: word row j, plane i = token j + i*G/4 at bits
 * [8i, 8i+8), the top plane stored as c - 128) times the per-token fp16 scale. */
static void mu_row(const Codec *c, int64_t t, int D, float *restrict o) {
    if (!c->mu_int8) {
        load_row(c->mu, t * c->mus, C_FP16, D, o);
        return;
    }
    int J = c->G / 4;
    int64_t w = t % c->G;
    int i = (int)(w / J);
    const uint32_t *row = (const uint32_t *)c->mu + ((t / c->G) * J + w % J) * c->mus;
    float ms = (float)c->mu_scale[t];
    for (int d = 0; d < D; d++) {
        uint32_t f = (row[d] >> (8 * i)) & 255u;
        if (i == 3) f ^= 128u;
        o[d] = ((float)f - 128.f) * ms;
    }
}

/* -- micro-kernels ---------------------------------------------------------------------------- */

/* sc[r * N + j] = sum_d q[r * D + d] * kt[d * 32 + j] for r < R, j < 32 (a tile's logits) */
#if defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) void scores_rows(const float *q, int D, const float *kt,
                                                              float *sc, int64_t N, const int NR) {
    for (int j0 = 0; j0 < TILE; j0 += 16) {
        __m256 a[4][2];
        for (int i = 0; i < NR; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
        for (int d = 0; d < D; d++) {
            __m256 k0 = _mm256_loadu_ps(kt + d * TILE + j0), k1 = _mm256_loadu_ps(kt + d * TILE + j0 + 8);
            for (int i = 0; i < NR; i++) {
                __m256 qb = _mm256_broadcast_ss(q + i * D + d);
                a[i][0] = _mm256_fmadd_ps(qb, k0, a[i][0]);
                a[i][1] = _mm256_fmadd_ps(qb, k1, a[i][1]);
            }
        }
        for (int i = 0; i < NR; i++) {
            _mm256_storeu_ps(sc + i * N + j0, a[i][0]);
            _mm256_storeu_ps(sc + i * N + j0 + 8, a[i][1]);
        }
    }
}
#endif

static void tile_scores(const float *q, int R, int D, const float *kt, float *sc, int64_t N) {
#if defined(__AVX2__) && defined(__FMA__)
#define SR(r0, nr) scores_rows(q + (r0) * D, D, kt, sc + (r0) * N, N, nr)
    ROW_BLOCKS4(R, SR);
#undef SR
    return;
#endif
    for (int r0 = 0; r0 < R; r0++) {
        float acc[TILE] = {0};
        for (int d = 0; d < D; d++) {
            float qd = q[r0 * D + d];
            for (int j = 0; j < TILE; j++) acc[j] += qd * kt[d * TILE + j];
        }
        memcpy(sc + r0 * N, acc, sizeof acc);
    }
}

/* acc[r * D + d] += sum_{j<n} p[r * N + j] * vt[j * D + d] (a tile's share of p.V) */
#if defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) void mix_rows(const float *p, int64_t N, int n, int D,
                                                           const float *vt, float *acc, const int NR) {
    int d0 = 0;
    for (; d0 + 16 <= D; d0 += 16) {
        __m256 a[4][2];
        for (int i = 0; i < NR; i++) {
            a[i][0] = _mm256_loadu_ps(acc + i * D + d0);
            a[i][1] = _mm256_loadu_ps(acc + i * D + d0 + 8);
        }
        for (int j = 0; j < n; j++) {
            __m256 v0 = _mm256_loadu_ps(vt + j * D + d0), v1 = _mm256_loadu_ps(vt + j * D + d0 + 8);
            for (int i = 0; i < NR; i++) {
                __m256 pb = _mm256_broadcast_ss(p + i * N + j);
                a[i][0] = _mm256_fmadd_ps(pb, v0, a[i][0]);
                a[i][1] = _mm256_fmadd_ps(pb, v1, a[i][1]);
            }
        }
        for (int i = 0; i < NR; i++) {
            _mm256_storeu_ps(acc + i * D + d0, a[i][0]);
            _mm256_storeu_ps(acc + i * D + d0 + 8, a[i][1]);
        }
    }
    for (; d0 < D; d0++)
        for (int i = 0; i < NR; i++)
            for (int j = 0; j < n; j++) acc[i * D + d0] += p[i * N + j] * vt[j * D + d0];
}
#endif

static void tile_mix(const float *p, int64_t N, int R, int n, int D, const float *vt, float *acc) {
#if defined(__AVX2__) && defined(__FMA__)
#define MR(r0, nr) mix_rows(p + (r0) * N, N, n, D, vt, acc + (r0) * D, nr)
    ROW_BLOCKS4(R, MR);
#undef MR
    return;
#endif
    for (int r0 = 0; r0 < R; r0++)
        for (int j = 0; j < n; j++) {
            float pr = p[r0 * N + j];
            for (int d = 0; d < D; d++) acc[r0 * D + d] += pr * vt[j * D + d];
        }
}
