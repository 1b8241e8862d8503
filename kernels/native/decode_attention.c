/* decode_attention, native CPU implementation (kvrun.kernels.native).
 *
 * Attention of R query rows per KV head (the GQA group x T new tokens, rows ordered
 * (g, t)) over [compressed tail, full-precision window, new tokens], reading the packed
 * codes of every codec in place. One call per layer:
 *
 *   phase 0  (arena decode step, optional) rotate q / new K / new V, round the new K/V to
 *            the window dtype and write them into the window slots.
 *   phase 1  logits. Work items are token splits (token_splits); each walks its tail
 *            in chunks of CHUNK tiles of 32 tokens with the KV heads innermost (TaDA's
 *            means, shared by the heads, come from memory once per chunk). A packed K
 *            tile is decoded in registers and dotted with the rows (AVX-512: 16 codes per
 *            register, scales folded into q or applied per token; AVX2: the same in two
 *            halves of 16 tokens on 8-lane registers, for int8, TaDA and KIVI keys); the layouts
 *            without such a path (and every one in plain C) are dequantized into a (D, 32)
 *            tile in L1 and multiplied by an AVX2/C micro-kernel.
 *            KIVI keys with Args.qint (KVRUN_ATTN=int, the default): per row and tile the
 *            folded row q s quantized to int16 and dotted with the codes in int32
 *            (kivi_tiles_int, kdot_int.c), exact integers on every ISA.
 *            fp tails, the window and the new tokens are dotted token by token; a
 *            codebook (cb) K tile is read by codebook_attention.c's cb_k_tile.
 *   phase 2  causal mask over the new tokens, one exact softmax per row (two-pass
 *            flash-decoding: a row's logits are few, R*N floats), optional attention mass.
 *   phase 3  p.V in the same chunk order: every V row is decoded and dequantized in
 *            registers (c s + z; TaDA mu - (c s + z); GEAR adds (p A) B^T per block; AVX2:
 *            int8 and KIVI with p s folded out of the token loop, TaDA per token) and
 *            accumulated into the rows' per-split partial outputs (a cb V by
 *            codebook_attention.c's cb_v_mix), summed at the end;
 *            then the output is un-rotated (phase 0's rotation).
 *
 * Work runs on OpenMP threads from torch's own libgomp (the .so is linked against the
 * libgomp.so.1 torch loaded, so there is one thread pool). Built at first use by
 * kvrun/kernels/native/__init__.py with -O3 -march=native.
 *
 * Bytes read per decode step and layer: every packed byte, scale and zero of the tail
 * once (TaDA's means once per chunk, the other heads hit cache), the window and the new
 * tokens once, q once; the logits (4*R*N bytes per head) are written and read twice in L2.
 * SmolLM2 at 4096 tokens, kivi-4: ~1.0 MB per layer, against 3.0 MB for the fp16 cache.
 *
 * Each role is read by its own codec kind, so a layer may pair any K codec with any V
 * codec (codec_desc.h). The packed layouts are described and indexed in codec_layout.h
 * (the cb layouts in codebook_attention.c); the flushes that write them are in pack.c and
 * codebook_pack.c.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "codec_desc.h"     /* Codec, the kinds; codec_layout.h */
#include "kdot_int.h"
#include "math_inline.h"
#include "rows_inline.h"
#include "step_io.h"
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)   /* each path's intrinsics */
#include <immintrin.h>
#endif

enum { TILE = 32, CHUNK = 8 };   /* CHUNK: tiles per head-interleaved chunk */

/* A diagnostic build (-DKVRUN_PHASE_CLOCK, KVRUN_NATIVE=clock; tools/attn_phases.py): TSC
 * ticks per phase summed over calls, on one thread only (the counters are plain globals).
 * PHASE(i) adds the ticks since the last mark to phase i; PHASE_START marks without adding. */
enum { PH_PREPARE, PH_TAIL_QK, PH_WINDOW_QK, PH_SOFTMAX, PH_PV, PH_OUTPUT, PH_N };
#if defined(KVRUN_PHASE_CLOCK) && defined(__x86_64__)
#include <x86intrin.h>
uint64_t kvrun_phase_ticks[PH_N], kvrun_phase_calls;
static uint64_t phase_mark;
uint64_t kvrun_phase_now(void) { return __rdtsc(); }
#define PHASE_START() do { phase_mark = __rdtsc(); kvrun_phase_calls++; } while (0)
#define PHASE(i) do { const uint64_t t_ = __rdtsc(); kvrun_phase_ticks[i] += t_ - phase_mark; phase_mark = t_; } while (0)
#else
#define PHASE_START() do {} while (0)
#define PHASE(i) do {} while (0)
#endif

/* the most token splits (math_inline.h token_splits) of this kernel */
int kvrun_attention_splits_max(void) { return NSPLIT_MAX; }

typedef struct {
    int32_t Hkv, R, D, Tq, t0, n_tail, W, Tn, wdtype, ndtype, qdtype, mass_lo, Gq, nthreads;
    const void *qin;           /* queries (H, Tq, D) in qdtype, strides h, t           */
    int64_t qs[2];
    float *q;                  /* scratch (Hkv, R, D): queries * 1/sqrt(D), fp32        */
    const void *kw, *vw;       /* window (Hkv, W, D) in wdtype, strides h, t           */
    int64_t kws[2], vws[2];
    const void *kn, *vn;       /* new tokens (Hkv, Tn, D) in ndtype                    */
    int64_t kns[2], vns[2];
    float *out;                /* (Hkv, R, D)                                          */
    float *sc;                 /* scratch (Hkv, R, N) logits / probabilities           */
    float *part;               /* scratch (Hkv, nsplit, R, D) partial outputs          */
    float *mass;               /* NULL or (Hkv*Gq, N) += p over rows t >= mass_lo      */
    int64_t mass_stride;
    const Codec *kc, *vc;
    /* fused window append (arena): when kdst is set, the new tokens are rotated (rk, rv:
     * (D, D) fp32 or NULL; q by rq, or by rk when rq is NULL), kb (Hkv, D) or NULL added to
     * each rotated key (a key transform: hadamard.py KeyMap), rounded to wdtype, written to
     * kdst / vdst (Hkv, Tn, D) and attended from there; the output is un-rotated by rv. */
    const float *rk, *rv, *rq, *kb;
    void *kdst, *vdst;
    int64_t kds[2], vds[2];
    int32_t qint;              /* 1: KIVI q.K in int32 (kivi_tiles_int), 0: in fp32 (KVRUN_ATTN) */
} Args;

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

/* -- AVX-512 fast paths: packed codes decoded in registers, no tile buffer -------------------- */
#if defined(__AVX512F__) && !defined(KVRUN_NO_AVX512)
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
#elif defined(__AVX2__) && defined(__FMA__) && !defined(KVRUN_NO_AVX2)
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
#else
#define HAVE_FAST 0
static int k_tile_fast(const Codec *c, int h, int64_t t0, const float *q, int R, int D,
                       float *sc, int64_t N) { return 0; }
static int kivi_tiles_fast(const Codec *c, int h, int64_t t0, int avail, const float *q, int R,
                           int D, float *sc, int64_t N) { return 0; }
static int v_mix_fast(const Codec *c, int h, int64_t t0, int64_t t1, const float *p, int64_t N,
                      int R, int D, float *acc) { return 0; }
static int vmix_kivi(const Codec *c, int h, int64_t t0, int64_t t1, const float *p, int64_t N,
                     int R, int D, float *acc) { return 0; }
#endif

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

/* -- the op ---------------------------------------------------------------------------------- */

static void fp_scores(const void *base, const int64_t *st, int kind, int h, int64_t n0, int64_t n1,
                      int64_t col0, const float *q, int R, int D, float *sc, int64_t N) {
    float row[MAXD];
#if defined(VR_HSUM)
    if (D % VW == 0 && n1 - n0 >= VW) {                 /* whole blocks of VW tokens */
        int64_t nb = (n1 - n0) / VW;
        fp_rows(base, h * st[0] + n0 * st[1], st[1], kind, nb, q, R, D, sc + col0 + n0, N);
        n0 += VW * nb;
    }
#endif
    for (int64_t t = n0; t < n1; t++) {
        load_row(base, h * st[0] + t * st[1], kind, D, row);
        for (int r = 0; r < R; r++) sc[r * N + col0 + t] = dot(q + r * D, row, D);
    }
}

/* The op in pieces over a range of KV heads [h0, h1): each piece does, for those heads, what
 * its phase does for all of them, in the same order per head, so a head's bits do not depend
 * on which heads a call covers. kvrun_decode_attention runs each phase over every head as
 * `omp for` over token splits or rows; kvrun_decode_attention_rows runs one (row, head) item
 * through every phase on one thread. */

/* phase 0 for heads [h0, h1): their query rows loaded, rotated, scaled; their new K / V rows
 * appended to the window (arena) */
static void heads_prepare(const Args *a, int h0, int h1) {
    const int D = a->D;
    const float scale = 1.f / sqrtf((float)D);
    for (int hq = h0 * a->Gq; hq < h1 * a->Gq; hq++)      /* rows of head h: (g, t) */
        for (int t = 0; t < a->Tq; t++) {
            float *dst = a->q + ((int64_t)hq * a->Tq + t) * D;
            load_row(a->qin, hq * a->qs[0] + t * a->qs[1], a->qdtype, D, dst);
            if (a->kdst && a->rk) matvec(dst, a->rq ? a->rq : a->rk, D);
            for (int d = 0; d < D; d++) dst[d] *= scale;
        }
    if (a->kdst) {                                       /* fused window append */
        float row[MAXD];
        for (int h = h0; h < h1; h++)
            for (int64_t t = 0; t < a->Tn; t++) {
                load_row(a->kn, h * a->kns[0] + t * a->kns[1], a->ndtype, D, row);
                if (a->rk) matvec(row, a->rk, D);
                if (a->kb)
                    for (int d = 0; d < D; d++) row[d] += a->kb[h * D + d];
                store_row(a->kdst, h * a->kds[0] + t * a->kds[1], a->wdtype, D, row);
                load_row(a->vn, h * a->vns[0] + t * a->vns[1], a->ndtype, D, row);
                if (a->rv) matvec(row, a->rv, D);
                store_row(a->vdst, h * a->vds[0] + t * a->vds[1], a->wdtype, D, row);
            }
    }
}

/* where the new tokens' K and V are read: the window slots after an append */
typedef struct { const void *k, *v; const int64_t *ks, *vs; int dtype; } NewRows;

static NewRows new_rows(const Args *a) {
    return a->kdst ? (NewRows){a->kdst, a->vdst, a->kds, a->vds, a->wdtype}
                   : (NewRows){a->kn, a->vn, a->kns, a->vns, a->ndtype};
}

/* -- prefetch: phase 3's V requested in phase 1 ------------------------------------------- */

/* A decode step finds a layer's cache in DRAM (the weights and the other rows' caches pass
 * through L2 and L3 between two visits of a layer), and phase 3 reads V as short runs, a
 * split's few KB per head, where the hardware prefetcher restarts at every 4 KB page. So
 * phase 1 requests, after each K call, the V bytes of the tokens that call scored, into L2:
 * a few dozen lines at a time, since a longer burst of prefetches overflows the miss buffers
 * and most of it is dropped. p.V in a step, SmolLM2, kivi-4, one thread
 * (tools/attn_phases.py): 56-67 us a layer at 2048 tokens before, 34-35 after; 98 -> 59 at
 * 4096. The same bits either way: a prefetch changes no value. */
static inline void pf_lines(const void *p, int64_t nbytes) {
    const char *c = p;
    for (int64_t i = 0; i < nbytes; i += 64) {
#if defined(__x86_64__)
        /* asm volatile, not __builtin_prefetch: GCC's IPA deems a function whose only
         * effect is a prefetch builtin const and deletes its calls */
        __asm__ volatile("prefetcht1 %0" : : "m"(*(const char *)(c + i)));
#else
        __builtin_prefetch(c + i, 0, 2);
#endif
    }
}

/* the V bytes of tail tokens [t0, t1) (whole tiles) of head h in the chan layout
 * (codec_layout.h): the code rows and per-token scales and zeros of KIVI, int8 and TaDA
 * values. An fp tail is not requested (its rows are long runs the hardware prefetcher
 * follows, and 128+ lines a call overflow the miss buffers), nor TaDA's means, GEAR's terms
 * or codebook values. */
static void v_prefetch(const Codec *c, int h, int64_t t0, int64_t t1, int D) {
    if (t1 <= t0 || (c->kind != C_KIVI && c->kind != C_INT8 && c->kind != C_TADA)) return;
    const int64_t *s = c->cs;
    int sh;                                       /* the rows of [t0, t1): first to past-last */
    const int64_t r0 = chan_row(t0, c->bits, &sh), r1 = chan_row(t1 - 1, c->bits, &sh) + 1;
    for (int p = 0; p < (c->bits == 8 ? 2 : 1); p++)
        for (int cb = 0; cb < (D + 63) / 64; cb++)
            pf_lines(c->codes + h * s[0] + p * s[1] + cb * s[2] + r0 * s[3], (r1 - r0) * s[3]);
    pf_lines(c->scale + h * c->ss[0] + t0 * c->ss[1], (t1 - t0) * c->ss[1] * 2);
    if (c->zero) pf_lines(c->zero + h * c->ss[0] + t0 * c->ss[1], (t1 - t0) * c->ss[1] * 2);
}

/* phase 1, split sp of nsplit, heads [h0, h1): chunks of CHUNK tiles with the heads
 * innermost, so data the heads share (TaDA's means) is read from memory once per chunk and
 * from L1/L2 by the other heads; then the split's window and new tokens */
static void split_logits(const Args *a, const NewRows *nr, int sp, int nsplit, int h0, int h1) {
    const int R = a->R, D = a->D;
    const int64_t nt = a->n_tail, W = a->W, Tn = a->Tn, N = nt + W + Tn, ntile = nt / TILE;
    int64_t a0 = ntile * sp / nsplit, a1 = ntile * (sp + 1) / nsplit;
    float kt[MAXD * TILE];
    HiRows hr;
    hr.from = NULL;                               /* rows unset: not zeroed, 8 KB a call */
    for (int64_t c0 = a0; c0 < a1; c0 += CHUNK) {
        int64_t c1 = c0 + CHUNK < a1 ? c0 + CHUNK : a1;
        for (int h = h0; h < h1; h++) {
            const float *q = a->q + (int64_t)h * R * D;
            float *sc = a->sc + (int64_t)h * R * N;
            for (int64_t ti = c0; ti < c1; ) {
                const int64_t tp = ti;
                const int kivi = a->kc->kind == C_KIVI && !a->kc->rank && !a->kc->k2;
                int done = kivi && a->qint
                    ? kivi_tiles_int(a->kc, h, ti * TILE, (int)(c1 - ti), q, R, D, sc + ti * TILE, N, &hr)
                    : a->kc->kind == C_INT8 && a->qint
                    ? int8_tiles_int(a->kc, h, ti * TILE, (int)(c1 - ti), q, R, D, sc + ti * TILE, N)
                    : HAVE_FAST && kivi
                    ? kivi_tiles_fast(a->kc, h, ti * TILE, (int)(c1 - ti), q, R, D, sc + ti * TILE, N) : 0;
                if (!done && a->kc->kind == C_CB) {
                    cb_k_tile(a->kc, h, ti * TILE, q, R, D, sc + ti * TILE, N);
                    done = 1;
                }
                if (!done) {
                    if (!k_tile_fast(a->kc, h, ti * TILE, q, R, D, sc + ti * TILE, N)) {
                        k_tile(a->kc, h, ti * TILE, D, kt);
                        tile_scores(q, R, D, kt, sc + ti * TILE, N);
                    }
                    done = 1;
                }
                ti += done;
                v_prefetch(a->vc, h, tp * TILE, ti * TILE, D);
            }
        }
    }
    PHASE(PH_TAIL_QK);
    int64_t w0 = W * sp / nsplit, w1 = W * (sp + 1) / nsplit;
    int64_t u0 = Tn * sp / nsplit, u1 = Tn * (sp + 1) / nsplit;
    for (int h = h0; h < h1; h++) {
        const float *q = a->q + (int64_t)h * R * D;
        float *sc = a->sc + (int64_t)h * R * N;
        fp_scores(a->kw, a->kws, a->wdtype, h, w0, w1, nt, q, R, D, sc, N);
        fp_scores(nr->k, nr->ks, nr->dtype, h, u0, u1, nt + W, q, R, D, sc, N);
    }
    PHASE(PH_WINDOW_QK);
}

/* phase 2 for row hr of (Hkv, R): causal mask over the new tokens, one exact softmax */
static void row_softmax(const Args *a, int hr) {
    const int64_t N = (int64_t)a->n_tail + a->W + a->Tn;
    float *s = a->sc + (int64_t)hr * N;
    int r = hr % a->R, t = r % a->Tq;                    /* rows ordered (g, t) */
    int64_t vis = (int64_t)a->n_tail + a->W + a->t0 + t + 1;      /* keys this query sees */
    if (vis > N) vis = N;
    softmax_visible(s, vis, N);
}

/* phase 2's attention mass of query head hq = kv * Gq + g */
static void head_mass(const Args *a, int hq) {
    const int64_t N = (int64_t)a->n_tail + a->W + a->Tn;
    int h = hq / a->Gq, g = hq % a->Gq;
    float *m = a->mass + (int64_t)hq * a->mass_stride;
    for (int t = 0; t < a->Tq; t++) {
        if (a->t0 + t < a->mass_lo) continue;
        const float *s = a->sc + ((int64_t)h * a->R + g * a->Tq + t) * N;
        for (int64_t n = 0; n < N; n++) m[n] += s[n];
    }
}

/* phase 3, split sp of nsplit, heads [h0, h1): p.V into the split's partial outputs
 * part (nsplit, Hkv, R, D), the same chunk order as phase 1 */
static void split_mix(const Args *a, const NewRows *nr, int sp, int nsplit, int h0, int h1) {
    const int Hkv = a->Hkv, R = a->R, D = a->D;
    const int64_t nt = a->n_tail, W = a->W, Tn = a->Tn, N = nt + W + Tn, ntile = nt / TILE;
    float *part = a->part + (int64_t)sp * Hkv * R * D;
    memset(part + (int64_t)h0 * R * D, 0, sizeof(float) * (h1 - h0) * R * D);
    float vt[TILE * MAXD];
    int64_t b0 = ntile * sp / nsplit * TILE, b1 = ntile * (sp + 1) / nsplit * TILE;
    for (int64_t c0 = b0; c0 < b1; c0 += CHUNK * TILE) {
        int64_t c1 = c0 + CHUNK * TILE < b1 ? c0 + CHUNK * TILE : b1;
        for (int h = h0; h < h1; h++) {
            const float *p = a->sc + (int64_t)h * R * N;
            float *acc = part + (int64_t)h * R * D;
            if (a->vc->kind == C_CB) {
                cb_v_mix(a->vc, h, c0, c1, p, N, R, D, acc);
                continue;
            }
            if (a->qint && (vmix_int(a->vc, h, c0, c1, p, N, R, D, acc)
                            || vmix_kivi(a->vc, h, c0, c1, p, N, R, D, acc))) continue;
            if (v_mix_fast(a->vc, h, c0, c1, p, N, R, D, acc)) continue;
            for (int64_t t0 = c0; t0 < c1; t0 += TILE) {
                for (int j = 0; j < TILE; j++) v_row(a->vc, h, t0 + j, D, vt + j * D);
                tile_mix(p + t0, N, R, TILE, D, vt, acc);
            }
        }
    }
    int64_t w0 = W * sp / nsplit, w1 = W * (sp + 1) / nsplit;
    int64_t u0 = Tn * sp / nsplit, u1 = Tn * (sp + 1) / nsplit;
    for (int h = h0; h < h1; h++) {
        const float *p = a->sc + (int64_t)h * R * N;
        float *acc = part + (int64_t)h * R * D;
        for (int64_t t0 = w0; t0 < w1; t0 += TILE) {
            int n = w1 - t0 < TILE ? (int)(w1 - t0) : TILE;
            for (int j = 0; j < n; j++)
                load_row(a->vw, h * a->vws[0] + (t0 + j) * a->vws[1], a->wdtype, D, vt + j * D);
            tile_mix(p + nt + t0, N, R, n, D, vt, acc);
        }
        for (int64_t t0 = u0; t0 < u1; t0 += TILE) {
            int n = u1 - t0 < TILE ? (int)(u1 - t0) : TILE;
            for (int j = 0; j < n; j++)
                load_row(nr->v, h * nr->vs[0] + (t0 + j) * nr->vs[1], nr->dtype, D, vt + j * D);
            tile_mix(p + nt + W + t0, N, R, n, D, vt, acc);
        }
    }
}

/* row hr of (Hkv, R): the splits' partial outputs summed in split order */
static void row_output(const Args *a, int hr, int nsplit) {
    const int D = a->D;
    float *o = a->out + (int64_t)hr * D;
    for (int d = 0; d < D; d++) o[d] = 0.f;
    for (int sp = 0; sp < nsplit; sp++) {
        const float *pp = a->part + ((int64_t)sp * a->Hkv * a->R + hr) * D;
        for (int d = 0; d < D; d++) o[d] += pp[d];
    }
}

/* row hr's output un-rotated, o = o' R_v^T (when phase 0 rotated) */
static void row_unrotate(const Args *a, int hr) {
    matvec_t(a->out + (int64_t)hr * a->D, a->rv, a->D);
}

static int args_ok(const Args *a) { return a->D <= MAXD && a->n_tail % TILE == 0; }

int kvrun_decode_attention(const Args *a) {
    const int Hkv = a->Hkv, R = a->R;
    if (!args_ok(a)) return 1;
    const int nsplit = token_splits(a->n_tail / TILE);
    PHASE_START();
    heads_prepare(a, 0, Hkv);
    const NewRows nr = new_rows(a);
    PHASE(PH_PREPARE);
#pragma omp parallel num_threads(a->nthreads < 1 ? 1 : a->nthreads)
    {
#pragma omp for schedule(static)
        for (int sp = 0; sp < nsplit; sp++) split_logits(a, &nr, sp, nsplit, 0, Hkv);
#pragma omp for schedule(static)
        for (int hr = 0; hr < Hkv * R; hr++) row_softmax(a, hr);
        if (a->mass) {
#pragma omp for schedule(static)
            for (int hq = 0; hq < Hkv * a->Gq; hq++) head_mass(a, hq);
        }
        PHASE(PH_SOFTMAX);
#pragma omp for schedule(static)
        for (int sp = 0; sp < nsplit; sp++) split_mix(a, &nr, sp, nsplit, 0, Hkv);
        PHASE(PH_PV);
#pragma omp for schedule(static)
        for (int hr = 0; hr < Hkv * R; hr++) row_output(a, hr, nsplit);
    }
    if (a->kdst && a->rv)
        for (int hr = 0; hr < Hkv * R; hr++) row_unrotate(a, hr);
    PHASE(PH_OUTPUT);
    return 0;
}

/* one KV head h of a: every phase, on the calling thread; the same bits as
 * kvrun_decode_attention gives that head */
static void head_attention(const Args *a, int h) {
    const int R = a->R, nsplit = token_splits(a->n_tail / TILE);
    PHASE_START();
    heads_prepare(a, h, h + 1);
    const NewRows nr = new_rows(a);
    PHASE(PH_PREPARE);
    for (int sp = 0; sp < nsplit; sp++) split_logits(a, &nr, sp, nsplit, h, h + 1);
    for (int hr = h * R; hr < (h + 1) * R; hr++) row_softmax(a, hr);
    if (a->mass)
        for (int hq = h * a->Gq; hq < (h + 1) * a->Gq; hq++) head_mass(a, hq);
    PHASE(PH_SOFTMAX);
    for (int sp = 0; sp < nsplit; sp++) split_mix(a, &nr, sp, nsplit, h, h + 1);
    PHASE(PH_PV);
    for (int hr = h * R; hr < (h + 1) * R; hr++) {
        row_output(a, hr, nsplit);
        if (a->kdst && a->rv) row_unrotate(a, hr);
    }
    PHASE(PH_OUTPUT);
}

/* one decode token of an arena layer in the one-call decode step (decode_layer.c) for B rows:
 * each row's prebuilt arguments args[b] bound to its step io[b] (step_io.h; each row its own
 * scratch), then every row's attention. One row: kvrun_decode_attention (its token splits
 * share the threads). Several: one parallel region whose items are (row, KV head) pairs, each
 * run whole by one thread (head_attention), so a layer costs one fork and one barrier
 * however many rows, where a region per row cost B forks and 4 B barriers. The same bits
 * either way. Returns 0, or the first refusing row's kvrun_decode_attention code. */
int kvrun_decode_attention_rows(void *const *args, const StepIO *io, int B) {
    for (int b = 0; b < B; b++) {
        Args *a = args[b];
        STEP_BIND(a, &io[b]);
        if (!args_ok(a)) return 1;
    }
    if (B == 1) return kvrun_decode_attention(args[0]);
    const int Hkv = ((const Args *)args[0])->Hkv, n = B * Hkv;
    const int nth = io[0].nthreads < 1 ? 1 : io[0].nthreads;
    /* dynamic: rows of different depths cost different times */
#pragma omp parallel for schedule(dynamic, 1) num_threads(nth < n ? nth : n)
    for (int i = 0; i < n; i++) head_attention(args[i / Hkv], i % Hkv);
    return 0;
}
