/* attn_tiles_int.h: the integer q.K tiles (KIVI and int8 keys: the folded rows quantized
 * to int16, int32 dots, kdot_int.c) and the integer p.V (vmix_int).
 * A part of decode_attention.c's one translation unit, included there in the order its
 * parts depend on (Args, KLay and the helpers of the parts before it); not a header of
 * its own. */

/* KIVI keys: the per-channel scales and zeros of token t's group, head h, as fp32 (D,) */
static void kivi_group_scales(const Codec *c, int h, int64_t t, int D, float *sv, float *zv) {
    const int64_t off = h * c->ss[0] + (t / c->G) * c->ss[1];
    if (c->ss[2] == 1) {                   /* contiguous channels: converted in vectors */
        f16_to_f32(c->scale + off, D, sv);
        f16_to_f32(c->zero + off, D, zv);
    } else {
        for (int d = 0; d < D; d++) {
            sv[d] = (float)c->scale[off + d * c->ss[2]];
            zv[d] = (float)c->zero[off + d * c->ss[2]];
        }
    }
}


/* KIVI keys, q . (s c + z) = (q s) . c + q . z: the rows scaled by the per-channel scales
 * of tile t's group, qx (R, D), and the zero-point term per row, bias (R,) */
static void kivi_fold_q(const Codec *c, int h, int64_t t, const float *q, int R, int D,
                        float *qx, float *bias) {
    float sv[MAXD], zv[MAXD];
    kivi_group_scales(c, h, t, D, sv, zv);
#if defined(__AVX2__) && defined(__FMA__) && !defined(KVRUN_NO_AVX2) \
    && !(defined(__AVX512F__) && !defined(KVRUN_NO_AVX512))
    if (D % 8 == 0) {       /* AVX2 builds: q . z in 8 lanes (a kivi-4 call ~2 % faster, tools/attn_ab.py) */
        for (int r = 0; r < R; r++) {
            __m256 bz = _mm256_setzero_ps();
            for (int d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(q + r * D + d);
                _mm256_storeu_ps(qx + r * D + d, _mm256_mul_ps(qv, _mm256_loadu_ps(sv + d)));
                bz = _mm256_fmadd_ps(qv, _mm256_loadu_ps(zv + d), bz);
            }
            const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(bz), _mm256_extractf128_ps(bz, 1));
            const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
            bias[r] = _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
        }
        return;
    }
#endif
    for (int r = 0; r < R; r++) {
        float bz = 0.f;
        for (int d = 0; d < D; d++) { qx[r * D + d] = q[r * D + d] * sv[d]; bz += q[r * D + d] * zv[d]; }
        bias[r] = bz;
    }
}

/* The rows a packed K tile is dotted with and each row's constant term: KIVI's rows folded
 * with the tile group's scales (qx) and q . z; the other codecs' q itself and sum q (int8's
 * -128 offset, TaDA's zero point) */
static const float *tile_rows(const Codec *c, int h, int64_t t0, const float *q, int R, int D,
                              float *qx, float *bias) {
    if (c->kind == C_KIVI) {
        kivi_fold_q(c, h, t0, q, R, D, qx, bias);
        return qx;
    }
    for (int r = 0; r < R; r++) {
        float sq = 0.f;
        for (int d = 0; d < D; d++) sq += q[r * D + d];
        bias[r] = sq;
    }
    return q;
}

/* 3-bit keys' third-bit rows as ki_dot transposed them (kdot_int.h KI_HY_FILL), for the
 * next call over the same 8-tile block; `from`: the block's bytes they came from */
typedef struct {
    const uint8_t *from;
    _Alignas(64) uint8_t rows[KI_HY_BYTES(MAXD)];
} HiRows;

/* KIVI keys on the integer path (kdot_int.h): the logits of the tiles from t0 that share its
 * chanpack block (at most `avail`), halved until every row shares one pass (P R <= KI_ACC;
 * one tile when the rows alone fill it), rows in blocks of KI_ACC / tiles. A pass decodes
 * each of its tiles' codes once, so a second pass over the same tiles for the rows that did
 * not fit would decode them again: Gemma's 4 rows over 4 two-bit tiles ran as 3 rows + 1 and
 * now run as 2 tiles + 2, ~10 % less time for kivi-2 and kivi-3 keys (tools/attn_ab.py
 * --geom 1,4,256). Per row and tile the folded row q s is quantized to int16 with one
 * scale d (ki_fold_quantize) and logit = fma(d, (q s)_int16 . c, q . z). Returns the number
 * of tiles done (0: D % 4 != 0). */
static int kivi_tiles_int(const Codec *c, int h, int64_t t0, int avail, const float *q, int R,
                          int D, float *sc, int64_t N, HiRows *hr) {
    if (D % 4) return 0;
    const int lb = chanpack_lo_bits(c->bits);      /* the "codes" planes' width */
    const int E = 8 / lb, first = (int)((t0 / TILE) % E);
    int P = E - first < avail ? E - first : avail;
    while (P > 1 && P * R > KI_ACC) P /= 2;      /* halves: calls stay on the block's tile grid */
    const int RB = KI_ACC / P;
    const uint8_t *b = c->codes + h * c->cs[0] + chanpack_byte(t0, lb);
    const uint8_t *hb = c->bits == 3 ? c->hi + h * c->hs[0] + chanpack_byte(t0, 1) : NULL;
    float sv[4][MAXD], zv[4][MAXD], qd[KI_ACC], bias[KI_ACC];
    int16_t qi[KI_ACC * MAXD];
    int32_t dots[KI_ACC * TILE];
    int hmode = 0;                                 /* the third bits: transposed once per block */
    if (hb) {
        hmode = hr->from == hb ? KI_HY_READ : KI_HY_FILL;
        hr->from = hb;
    }
    int same[4];                                   /* 1: tile p is in tile p - 1's group */
    for (int p = 0; p < P; p++) {
        same[p] = p && (t0 + TILE * p) / c->G == (t0 + TILE * (p - 1)) / c->G;
        if (!same[p]) kivi_group_scales(c, h, t0 + TILE * p, D, sv[p], zv[p]);
    }
    for (int r0 = 0; r0 < R; r0 += RB) {
        const int nr = R - r0 < RB ? R - r0 : RB;
        for (int p = 0; p < P; p++) {                /* (P, nr, D) folded and quantized rows */
            for (int r = 0; r < nr; r++) {
                const int k = p * nr + r;
                if (same[p]) {                       /* the group of the tile before */
                    memcpy(qi + k * D, qi + (k - nr) * D, sizeof(int16_t) * D);
                    qd[k] = qd[k - nr];
                    bias[k] = bias[k - nr];
                } else {
                    qd[k] = ki_fold_quantize(q + (r0 + r) * D, sv[p], zv[p], D, qi + k * D, bias + k);
                }
            }
        }
        ki_dot(b, c->cs[1], D, lb, chanpack_shift(t0, lb), hb, hb ? c->hs[1] : 0,
               hb ? chanpack_shift(t0, 1) : 0, hr->rows, hmode, P, nr, qi, dots);
        if (hmode) hmode = KI_HY_READ;            /* the next rows' pass */
        for (int p = 0; p < P; p++)
            for (int r = 0; r < nr; r++) {
                const int k = p * nr + r;
                float *s = sc + (int64_t)(r0 + r) * N + p * TILE;
                for (int j = 0; j < TILE; j++) s[j] = fmaf((float)dots[k * TILE + j], qd[k], bias[k]);
            }
    }
    return P;
}

/* src (n, ng) fp16 at strides (st, sg) -> dst (ng, n) fp32, n % 16 == 0: the per-token group
 * scales or zeros of a run of tokens as one vector per group (the KIVI and int8 V folds) */
static void groups_T(const f16 *src, int64_t st, int64_t sg, int n, int ng, float *restrict dst) {
    if (st == 1 && ng == 1) {
        f16_to_f32(src, n, dst);
#if defined(__AVX512F__) && !defined(KVRUN_NO_AVX512)
    } else if (st == ng && sg == 1 && ng == 2) {   /* 16 tokens: two registers, deinterleaved */
        const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
        for (int t = 0; t < n; t += 16) {
            const __m512 a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + 2 * t)));
            const __m512 b = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + 2 * t + 16)));
            _mm512_storeu_ps(dst + t, _mm512_permutex2var_ps(a, ev, b));
            _mm512_storeu_ps(dst + n + t, _mm512_permutex2var_ps(a, od, b));
        }
#elif defined(__AVX2__) && !defined(KVRUN_NO_AVX2)
    } else if (st == ng && sg == 1 && ng == 2) {   /* 8 tokens: two registers, deinterleaved */
        for (int t = 0; t < n; t += 8) {
            const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * t)));
            const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * t + 8)));
            /* per 128-bit lane (a0 a2 b0 b2 | a4 a6 b4 b6), then the 64-bit pairs in order */
            const __m256 e = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
            const __m256 o = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
            _mm256_storeu_ps(dst + t, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), 0xD8)));
            _mm256_storeu_ps(dst + n + t, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), 0xD8)));
        }
#endif
#if defined(__AVX2__) && defined(__F16C__) && !defined(KVRUN_NO_AVX2)
    } else if (st == ng && sg == 1 && ng % 8 == 0) {   /* 8 tokens x 8 groups: one 8x8 transpose */
        for (int g0 = 0; g0 < ng; g0 += 8)
            for (int t = 0; t < n; t += 8) {
                __m256 r[8], u[8], v[8];
                for (int k = 0; k < 8; k++)
                    r[k] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + (int64_t)(t + k) * st + g0)));
                for (int k = 0; k < 8; k += 2) {            /* pairs of tokens interleaved */
                    u[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);
                    u[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
                }
                for (int k = 0; k < 8; k += 4) {            /* four tokens per 128-bit lane */
                    v[k] = _mm256_shuffle_ps(u[k], u[k + 2], _MM_SHUFFLE(1, 0, 1, 0));
                    v[k + 1] = _mm256_shuffle_ps(u[k], u[k + 2], _MM_SHUFFLE(3, 2, 3, 2));
                    v[k + 2] = _mm256_shuffle_ps(u[k + 1], u[k + 3], _MM_SHUFFLE(1, 0, 1, 0));
                    v[k + 3] = _mm256_shuffle_ps(u[k + 1], u[k + 3], _MM_SHUFFLE(3, 2, 3, 2));
                }
                for (int j = 0; j < 4; j++) {               /* groups g0 + j (low lanes), g0 + 4 + j */
                    _mm256_storeu_ps(dst + (int64_t)(g0 + j) * n + t, _mm256_permute2f128_ps(v[j], v[4 + j], 0x20));
                    _mm256_storeu_ps(dst + (int64_t)(g0 + 4 + j) * n + t, _mm256_permute2f128_ps(v[j], v[4 + j], 0x31));
                }
            }
#endif
    } else {
        for (int t = 0; t < n; t++)
            for (int g = 0; g < ng; g++) dst[g * n + t] = (float)src[t * st + g * sg];
    }
}

/* V tokens [t0, t0 + n) of an int8 or KIVI V: per channel group (ng of them) the tokens'
 * scales and zeros as one vector each, sT, zT (ng, n); int8's zero is -128 s (u = c + 128) */
static void run_scales(const Codec *c, int h, int64_t t0, int n, int ng, float *sT, float *zT) {
    const int i8 = c->kind == C_INT8;
    const int64_t off = h * c->ss[0] + t0 * c->ss[1];
    groups_T(c->scale + off, c->ss[1], i8 ? 0 : c->ss[2], n, ng, sT);
    if (i8)
        for (int t = 0; t < n; t++) zT[t] = -128.f * sT[t];
    else
        groups_T(c->zero + off, c->ss[1], c->ss[2], n, ng, zT);
}

/* int8 keys on the integer path: the `avail` tiles from t0. Each query row is quantized to
 * int16 once per call (ki_quantize: one scale d, no fold, the int8 scale is per token) and
 * dotted with each 64-token tok block's two nibble planes (ki_dot, bits 4), so
 * q . k_t = s_t d (16 hi + lo - 128 sum qi), the integer exact in int64 and rounded to fp32
 * once. Returns the number of tiles done (0: D % 4 != 0). */
static int int8_tiles_int(const Codec *c, int h, int64_t t0, int avail, const float *q, int R,
                          int D, float *sc, int64_t N) {
    if (D % 4) return 0;
    enum { RB = KI_ACC / 2 };                    /* rows per ki_dot call: 2 tiles a block */
    int16_t qi[KI_ACC * MAXD];
    int32_t dots[KI_ACC * TILE];
    float qd[RB], st[2 * TILE];
    int64_t qsum[RB];
    for (int r0 = 0; r0 < R; r0 += RB) {
        const int nr = R - r0 < RB ? R - r0 : RB;
        for (int r = 0; r < nr; r++) {
            qd[r] = ki_quantize(q + (r0 + r) * D, D, qi + r * D);
            int64_t sum = 0;
            for (int d = 0; d < D; d++) sum += qi[r * D + d];
            qsum[r] = sum;
        }
        memcpy(qi + nr * D, qi, sizeof(int16_t) * nr * D);   /* the rows again for tile 1 */
        for (int done = 0, P; done < avail; done += P) {
            const int64_t tb = t0 + done * TILE;               /* a block's first tile here */
            const int first = (int)((tb / TILE) % 2);
            P = 2 - first < avail - done ? 2 - first : avail - done;
            const KLay L = k_layout(c, h, tb);
            const f16 *sp = c->scale + h * c->ss[0] + tb * c->ss[1];
            for (int j = 0; j < P * TILE; j++) st[j] = (float)sp[j * c->ss[1]];
            ki_dot8(L.b, L.ds, L.sh, L.b2, L.ds2, L.sh2, D, P, nr, qi, dots);
            for (int pt = 0; pt < P; pt++)
                for (int r = 0; r < nr; r++) {
                    const int k = pt * nr + r;
                    float *o = sc + (int64_t)(r0 + r) * N + (done + pt) * TILE;
                    for (int j = 0; j < TILE; j++) {
                        const int64_t x = (int64_t)dots[k * TILE + j] - 128 * qsum[r];
                        o[j] = st[pt * TILE + j] * ((float)x * qd[r]);
                    }
                }
        }
    }
    return avail;
}

/* KIVI V (2 or 4 bits, channel groups of a multiple of 32) or int8 V, D % 64 == 0, over tail
 * tokens [t0, t1) (at most KV_RUN, whole tiles) on the integer path. Both are v = c s + z per
 * token and channel group (int8: one group, its codes u = c + 128, z = -128 s), so per query
 * row and group the weights p s of the run are quantized to int16 with one scale
 * (kv_quantize), dotted with the codes tile by tile into int32 sums (kv_mix; int8: its two
 * nibble planes, 16 hi + lo, < 32767 * 255 * 256 < 2^31), and the sums scaled into acc with
 * sum p z. Returns 0 when the codec has no such path (then vmix_kivi / v_mix_fast read it in
 * fp32). */
static int vmix_int(const Codec *c, int h, int64_t t0, int64_t t1, const float *p, int64_t N,
                    int R, int D, float *acc) {
    const int i8 = c->kind == C_INT8;
    if (D % 64 || t1 - t0 > KV_RUN || !(i8 || (c->kind == C_KIVI && !c->rank && !c->k2
                                                 && (c->bits == 2 || c->bits == 4) && c->g % 32 == 0)))
        return 0;
    const int g = i8 ? D : c->g, ng = D / g, n = (int)(t1 - t0), bits = i8 ? 4 : c->bits;
    const int64_t *s = c->cs;
    float sT[MAXD / 32 * KV_RUN], zT[MAXD / 32 * KV_RUN], x[KV_RUN];   /* (ng, n) */
    run_scales(c, h, t0, n, ng, sT, zT);
    int16_t wq[KV_ROWS][MAXD / 32][KV_RUN];
    float wd[KV_ROWS][MAXD / 32], zs[KV_ROWS][MAXD / 32];
    int32_t dots[KV_ROWS * 64];
    for (int r0 = 0; r0 < R; r0 += KV_ROWS) {
        const int nr = R - r0 < KV_ROWS ? R - r0 : KV_ROWS;
        for (int r = 0; r < nr; r++)             /* the run's weights, one scale per row and group */
            for (int gi = 0; gi < ng; gi++) {
                const float *pr = p + (int64_t)(r0 + r) * N + t0, *sv = sT + gi * n, *zv = zT + gi * n;
                float z = 0.f;
                for (int j = 0; j < n; j++) {
                    x[j] = pr[j] * sv[j];
                    z += pr[j] * zv[j];
                }
                zs[r][gi] = z;
                wd[r][gi] = kv_quantize(x, n, wq[r][gi]);
            }
        for (int cb = 0; cb < D / 64; cb++) {
            const int glo = cb * 64 / g, ghi = (cb * 64 + 32) / g;
            memset(dots, 0, sizeof(int32_t) * 64 * nr);
            for (int64_t tt = t0; tt < t1; tt += TILE) {
                int sh;
                const int64_t row0 = chan_row(tt, c->bits, &sh);
                const uint8_t *b = c->codes + h * s[0] + cb * s[2] + row0 * s[3];
                const int16_t *wl = wq[0][glo] + (tt - t0), *wh = wq[0][ghi] + (tt - t0);
                if (i8)                          /* both nibble planes, the low one s[1] on */
                    kv_mix8(b, s[1], s[3], nr, wl, wh, MAXD / 32 * KV_RUN, dots);
                else
                    kv_mix(b, s[3], bits, sh, nr, wl, wh, MAXD / 32 * KV_RUN, dots);
            }
            for (int r = 0; r < nr; r++) {
                float *o = acc + (int64_t)(r0 + r) * D + cb * 64;
                const float dl = wd[r][glo], dh = wd[r][ghi], zl = zs[r][glo], zh = zs[r][ghi];
                for (int k = 0; k < 32; k++) o[k] += (float)dots[r * 64 + k] * dl + zl;
                for (int k = 32; k < 64; k++) o[k] += (float)dots[r * 64 + k] * dh + zh;
            }
        }
    }
    return 1;
}
