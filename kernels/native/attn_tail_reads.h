/* attn_tail_reads.h: the generic tail reads: any codec's K tile or V row dequantized into
 * fp32 in L1 (the path every layout without a fast one takes, and plain C's).
 * A part of decode_attention.c's one translation unit, included there in the order its
 * parts depend on (Args, KLay and the helpers of the parts before it); not a header of
 * its own. */

/* -- tail reads ----------------------------------------------------------------------------- */

/* rows [32][D] of an uncompressed (or mean) tensor transposed into kt[D][32] */
static void rows_to_tile(const void *base, int64_t off, int64_t stride, int kind, int D,
                         float *restrict kt, float sign) {
    float row[MAXD];
    for (int j = 0; j < TILE; j++) {
        load_row(base, off + j * stride, kind, D, row);
        for (int d = 0; d < D; d++) kt[d * TILE + j] += sign * row[d];
    }
}

/* dequantized K tile kt[D][32] for tail tokens [t0, t0+32) of head h */
static void k_tile(const Codec *c, int h, int64_t t0, int D, float *restrict kt) {
    if (c->kind <= C_FP32) {
        memset(kt, 0, sizeof(float) * D * TILE);
        rows_to_tile(c->x, h * c->xs[0] + t0 * c->xs[1], c->xs[1], c->kind, D, kt, 1.f);
        return;
    }
    k_codes(c, h, t0, D, kt);
    if (c->kind == C_KIVI) {               /* k = c * s[grp][d] + z[grp][d] */
        const f16 *s = c->scale + h * c->ss[0] + (t0 / c->G) * c->ss[1];
        const f16 *z = c->zero + h * c->ss[0] + (t0 / c->G) * c->ss[1];
        for (int d = 0; d < D; d++) {
            float sd = (float)s[d * c->ss[2]], zd = (float)z[d * c->ss[2]];
            float *k = kt + d * TILE;
            for (int j = 0; j < TILE; j++) k[j] = k[j] * sd + zd;
        }
        if (c->rank) {                     /* GEAR: + A_t B_blk^T */
            const f16 *A = c->lr_a + h * c->as[0] + t0 * c->as[1];
            const f16 *B = c->lr_b + h * c->bs[0] + (t0 / c->G) * c->bs[1];
            float a[8][TILE], b[MAXD * 8];
            for (int k = 0; k < c->rank; k++)
                for (int j = 0; j < TILE; j++) a[k][j] = (float)A[j * c->as[1] + k];
            f16_to_f32(B, D * c->rank, b);
            for (int d = 0; d < D; d++) {
                float *kd = kt + d * TILE;
                for (int k = 0; k < c->rank; k++) {
                    float bk = b[d * c->rank + k];
                    for (int j = 0; j < TILE; j++) kd[j] += bk * a[k][j];
                }
            }
        }
        if (c->k2) {                       /* GEAR outliers: (token in block, value) per channel */
            int64_t blk = t0 / c->G, off = t0 - blk * c->G;
            const uint8_t *ix = c->oidx + h * c->os[0] + blk * c->os[1];
            const f16 *vx = c->oval + h * c->os[0] + blk * c->os[1];
            for (int d = 0; d < D; d++)
                for (int k = 0; k < c->k2; k++) {
                    int64_t tok = (int64_t)ix[d * c->os[2] + k] - off;
                    if (tok >= 0 && tok < TILE) kt[d * TILE + tok] += (float)vx[d * c->os[2] + k];
                }
        }
        return;
    }
    /* int8: s (c - 128); TaDA: mu - (c s + z) */
    const f16 *s = c->scale + h * c->ss[0] + t0 * c->ss[1];
    float st[TILE], zt[TILE];
    for (int j = 0; j < TILE; j++) st[j] = (float)s[j * c->ss[1]];
    if (c->kind == C_INT8) {
        for (int j = 0; j < TILE; j++) zt[j] = -128.f * st[j];
    } else {
        const f16 *z = c->zero + h * c->ss[0] + t0 * c->ss[1];
        for (int j = 0; j < TILE; j++) { st[j] = -st[j]; zt[j] = -(float)z[j * c->ss[1]]; }
    }
    for (int d = 0; d < D; d++) {
        float *k = kt + d * TILE;
        for (int j = 0; j < TILE; j++) k[j] = k[j] * st[j] + zt[j];
    }
    if (c->kind == C_TADA) {               /* + mu_t (shared by the KV heads) */
        if (!c->mu_int8) {
            rows_to_tile(c->mu, t0 * c->mus, c->mus, C_FP16, D, kt, 1.f);
        } else {
            float row[MAXD];
            for (int j = 0; j < TILE; j++) {
                mu_row(c, t0 + j, D, row);
                for (int d = 0; d < D; d++) kt[d * TILE + j] += row[d];
            }
        }
    }
}

/* dequantized V row (D,) of tail token t of head h */
static void v_row(const Codec *c, int h, int64_t t, int D, float *restrict o) {
    if (c->kind <= C_FP32) {
        load_row(c->x, h * c->xs[0] + t * c->xs[1], c->kind, D, o);
        return;
    }
    v_codes(c, h, t, D, o);
    if (c->kind == C_KIVI) {               /* per token and channel group of g */
        const f16 *s = c->scale + h * c->ss[0] + t * c->ss[1];
        const f16 *z = c->zero + h * c->ss[0] + t * c->ss[1];
        for (int d0 = 0, gi = 0; d0 < D; d0 += c->g, gi++) {
            float sg = (float)s[gi * c->ss[2]], zg = (float)z[gi * c->ss[2]];
            for (int d = d0; d < d0 + c->g; d++) o[d] = o[d] * sg + zg;
        }
        if (c->rank) {
            const f16 *A = c->lr_a + h * c->as[0] + t * c->as[1];
            const f16 *B = c->lr_b + h * c->bs[0] + (t / c->G) * c->bs[1];
            float a[8], b[MAXD * 8];
            f16_to_f32(A, c->rank, a);
            f16_to_f32(B, D * c->rank, b);          /* (D, r) contiguous */
            for (int d = 0; d < D; d++)
                for (int k = 0; k < c->rank; k++) o[d] += a[k] * b[d * c->rank + k];
        }
        if (c->k2) {
            const uint8_t *ix = c->oidx + h * c->os[0] + t * c->os[1];
            const f16 *vx = c->oval + h * c->os[0] + t * c->os[1];
            for (int k = 0; k < c->k2; k++) o[ix[k]] += (float)vx[k];
        }
        return;
    }
    float s = (float)c->scale[h * c->ss[0] + t * c->ss[1]];
    if (c->kind == C_INT8) {
        for (int d = 0; d < D; d++) o[d] = (o[d] - 128.f) * s;
        return;
    }
    float z = (float)c->zero[h * c->ss[0] + t * c->ss[1]];
    float mu[MAXD];
    mu_row(c, t, D, mu);
    for (int d = 0; d < D; d++) o[d] = mu[d] - (o[d] * s + z);
}
