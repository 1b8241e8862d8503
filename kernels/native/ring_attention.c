/* ring_attention: one decode token of a sliding-window ring (Gemma 3's local layers,
 * runtime/kv/ring.py), native CPU implementation (kvrun.kernels.native).
 *
 * A ring slot holds one token's K or V row: a row of the ring dtype (16-bit rings, the
 * rings of an uncompressed --kv), or quantized per token: 4 or 8 bits, asymmetric, an fp16
 * scale and min per `group` channels, 4-bit codes two per byte as the channel pair
 * (2i, 2i+1) (low nibble = 2i). A quantized ring stores K Hadamard-rotated (R_k), V too
 * with rotate_v (R_v), both the signed Hadamard of hadamard.Hadamard; q, k and v arrive in
 * the model's space and are rotated here by its butterfly (rows_inline.h hadamard_rotate,
 * the fixed order of the torch step's `fwht`, so the stored codes are bit-identical to the
 * torch step's on every CPU). One call
 * per layer (kvrun_ring_attention), or the ring layers of B rows inside the one-call decode
 * step (kvrun_ring_attention_rows, decode_layer.c):
 *
 *   phase 0  rotate q (R_k) and the new K / V rows (R_k, R_v), round the new rows to the
 *            ring dtype, write them into slot `slot` (quantized bit-identical to
 *            _RingStore.write: per group quant_inline.h's asym_params over the fp32
 *            min/max and quant1's codes, the quantizer kernels/quant.py and the flushes
 *            share; a 16-bit ring stores the rounded row), and keep them in fp32.
 *   phase 1  logits of the Gq query rows of each KV head over the n filled slots: every slot
 *            dequantized from its codes (or converted from its row) in registers (c s + m),
 *            except slot `slot`, which uses the new row (SlidingWindowKV._attend's T == 1
 *            step).
 *   phase 2  the logits' soft-cap where set (cap tanh(s / cap)), one exact softmax per
 *            row (fp32, exp with |rel err| < 2e-7).
 *   phase 3  p.V in fp32 over per-split partial outputs, summed; then un-rotated by R_v
 *            (rows_inline.h hadamard_unrotate, `fwht_t`) so the caller gets
 *            the model-space output.
 *
 * Slots are split over OpenMP threads (torch's libgomp pool, as decode_attention.c), one
 * split per 256 head-slots at most, so a short ring does not wake threads for nothing.
 *
 * Vector path (GCC vectors of the register width: 16 lanes on AVX-512, 8 on AVX2, so the
 * same code is tested on either; needs D and, at 4 bits, the group divisible by BC = 2 lanes,
 * at 8 bits the group by the lane count; 16-bit rings in fp16): a slot's codes are decoded
 * and dequantized (fp16 rows converted) in registers, BC channels at a time; 4-bit codes
 * decode as the low nibbles (channels 2i) then the high ones (2i+1), so q, the new rows and
 * the partial outputs are kept in that "pair" order (no shuffle per slot) and restored to
 * channel order once at the end; the logits of VL slots are reduced together
 * (hsum_tokens). The portable path (-DKVRUN_NO_AVX512, the build KVRUN_NATIVE=portable
 * loads, or other groups, bf16 / fp32 rows) dequantizes each slot into L1 in channel order
 * and runs plain loops.
 *
 * Bytes read per decode step and layer: the n slots' codes, scales and mins of K and V once
 * each, 2 Hkv n (D bits/8 + 4 D/group) bytes (Gemma 3 270M at n = 512, D 256, group 32,
 * 4 bits: 160 KiB, against 512 KiB for its fp16 ring), plus q, the new rows and the
 * rotations' signs (4 D bytes each, shared by the layers: R_k for a quantized ring, R_v
 * with rotate_v); written: one slot per role. No dequantized copy of the ring is made.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "math_inline.h"
#include "quant_inline.h"
#include "rows_inline.h"    /* f16, MAXD, the rows' dtypes, load_row / store_row, the rotations */
#include "step_io.h"
#include "args.h"         /* the argument structs ctypes mirrors */
#if !defined(KVRUN_NO_AVX512)
#define HAVE_FAST 1
#else
#define HAVE_FAST 0
#endif

enum { MAXR = 16, SPLIT_MIN = 256 };
/* slot splits: one per SPLIT_MIN logits, at most RING_SPLITS, whatever the thread count (their
 * partial outputs are summed in split order: the same bits on 1 or 2 threads) */
enum { RING_SPLITS = 4 };

int kvrun_ring_splits_max(void) { return RING_SPLITS; }

/* RingStore, RingArgs: the step's arguments (args.h) */

/* -- scalar helpers ------------------------------------------------------------------------ */

/* x rounded to dtype `kind` and back (nearest even), as torch's .to(ring dtype) */
static void round_row(float *x, int kind, int D) {
    if (kind == ROW_FP16) {
        for (int d = 0; d < D; d++) x[d] = (float)(f16)x[d];
    } else if (kind == ROW_BF16) {
        for (int d = 0; d < D; d++) {
            union { float f; uint32_t u; } v = { x[d] };
            v.u = (v.u + 0x7FFFu + ((v.u >> 16) & 1u)) & 0xFFFF0000u;
            x[d] = v.f;
        }
    }
}

/* channel order <-> working order: with pair blocks of P channels (P = 2 VL, 0: channel
 * order), position b + i (i < P/2) holds channel b + 2i and b + P/2 + i holds b + 2i + 1
 * (the low and high nibbles of P/2 code bytes) */
static void to_work(const float *restrict x, int D, int P, float *restrict o) {
    if (!P) { memcpy(o, x, sizeof(float) * D); return; }
    for (int b = 0; b < D; b += P)
        for (int i = 0; i < P / 2; i++) { o[b + i] = x[b + 2 * i]; o[b + P / 2 + i] = x[b + 2 * i + 1]; }
}

static void from_work(float *x, int D, int P) {
    if (!P) return;
    float t[MAXD];
    memcpy(t, x, sizeof(float) * D);
    for (int b = 0; b < D; b += P)
        for (int i = 0; i < P / 2; i++) { x[b + 2 * i] = t[b + i]; x[b + 2 * i + 1] = t[b + P / 2 + i]; }
}


static inline const uint8_t *codes_at(const RingStore *s, int layer, int h, int64_t t) {
    return s->codes + layer * s->cs[0] + h * s->cs[1] + t * s->cs[2];
}

static inline int64_t param_off(const RingStore *s, int layer, int h, int64_t t) {
    return layer * s->ss[0] + h * s->ss[1] + t * s->ss[2];
}

/* -- phase 0: the new row's codes, bit-identical to _RingStore.write ----------------------------
 * Per group of `group` channels: quant_inline.h's asym_params over the fp32 min / max, codes
 * quant1 (the shared quantizer of kernels/quant.py). */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off", "no-associative-math")

static void quant_row(const float *x, int D, int bits, int group, uint8_t *codes, f16 *scale,
                      f16 *mn) {
    const int top = (1 << bits) - 1;
    uint8_t c[MAXD];
    for (int g0 = 0, gi = 0; g0 < D; g0 += group, gi++) {
        float lo = x[g0], hi = x[g0];
        for (int d = g0 + 1; d < g0 + group; d++) {
            lo = x[d] < lo ? x[d] : lo;
            hi = x[d] > hi ? x[d] : hi;
        }
        f16 s, m;
        asym_params(lo, hi, top, &s, &m);
        float sf = (float)s, mf = (float)m;
        scale[gi] = s;
        mn[gi] = m;
        for (int d = g0; d < g0 + group; d++) c[d] = quant1(x[d], mf, sf, top);
    }
    if (bits == 8) {
        memcpy(codes, c, D);
    } else {
        for (int i = 0; i < D / 2; i++) codes[i] = (uint8_t)(c[2 * i] | (c[2 * i + 1] << 4));
    }
}
#pragma GCC pop_options

/* -- portable path: one slot dequantized into L1 in channel order ----------------------------- */

static void deq_row(const RingStore *s, int layer, int h, int64_t t, int D, int bits, int group,
                    int rdtype, float *restrict o) {
    const uint8_t *c = codes_at(s, layer, h, t);
    if (bits == 16) {                                   /* rows of the ring dtype */
        load_row(c, 0, rdtype, D, o);
        return;
    }
    const int64_t po = param_off(s, layer, h, t);
    if (bits == 4) {
        for (int i = 0; i < D / 2; i++) { o[2 * i] = (float)(c[i] & 15); o[2 * i + 1] = (float)(c[i] >> 4); }
    } else {
        for (int d = 0; d < D; d++) o[d] = (float)c[d];
    }
    for (int g0 = 0, gi = 0; g0 < D; g0 += group, gi++) {
        float sg = (float)s->scale[po + gi], mg = (float)s->min[po + gi];
        for (int d = g0; d < g0 + group; d++) o[d] = o[d] * sg + mg;
    }
}

/* sc[r * n + t] = q_r . k_t for slots t in [t0, t1) of head h (none of them the new one) */
static void k_logits_plain(const RingArgs *a, int h, int64_t t0, int64_t t1, const float *q,
                           float *sc) {
    float row[MAXD];
    for (int64_t t = t0; t < t1; t++) {
        deq_row(&a->k, a->layer, h, t, a->D, a->bits, a->group, a->rdtype, row);
        for (int r = 0; r < a->Gq; r++) sc[r * a->n + t] = dot(q + r * a->D, row, a->D);
    }
}

/* acc[r] += p[r * n + t] v_t over slots [t0, t1) of head h */
static void v_mix_plain(const RingArgs *a, int h, int64_t t0, int64_t t1, const float *p,
                        float *acc) {
    float row[MAXD];
    const int D = a->D;
    for (int64_t t = t0; t < t1; t++) {
        deq_row(&a->v, a->layer, h, t, D, a->bits, a->group, a->rdtype, row);
        for (int r = 0; r < a->Gq; r++) {
            float pr = p[r * a->n + t];
            for (int d = 0; d < D; d++) acc[r * D + d] += pr * row[d];
        }
    }
}

/* -- vector path: codes decoded and dequantized in registers ---------------------------------
 * GCC vectors of VL lanes, the machine's register width (16 floats on AVX-512, 8 on AVX2),
 * so the same code runs and is tested on either. A block of BC = 2 VL channels is decoded
 * at a time: VL bytes of 4-bit codes (low nibbles, then high) or 2 VL bytes of 8-bit ones. */
#if HAVE_FAST
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
#define BC (2 * VL)
typedef float vf __attribute__((vector_size(4 * VL)));
typedef int32_t vi __attribute__((vector_size(4 * VL)));
typedef uint8_t vb __attribute__((vector_size(VL)));
typedef f16 vh __attribute__((vector_size(2 * VL)));

static inline __attribute__((always_inline)) vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline __attribute__((always_inline)) void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline __attribute__((always_inline)) vi bytes(const uint8_t *p) {   /* VL bytes, zero-extended */
    vb b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, vi);
}

/* BC dequantized values of one slot at channel block d0 (working order) into v0, v1;
 * gx[i]: the group of channels VL i .. VL i + VL-1 (a table: an integer division per block
 * cost more than the block's FMAs). A 16-bit ring's slot is BC fp16 values (sp, mp unused). */
static inline __attribute__((always_inline)) void deq(const uint8_t *c, const f16 *sp,
        const f16 *mp, int d0, int bits, const int *gx, vf *v0, vf *v1) {
    if (bits == 16) {
        vh h0, h1;
        memcpy(&h0, c + 2 * d0, sizeof h0);
        memcpy(&h1, c + 2 * (d0 + VL), sizeof h1);
        *v0 = __builtin_convertvector(h0, vf);
        *v1 = __builtin_convertvector(h1, vf);
        return;
    }
    const int g0 = gx[d0 / VL], g1 = gx[d0 / VL + 1];
    if (bits == 4) {
        vi w = bytes(c + d0 / 2);
        float s = (float)sp[g0], m = (float)mp[g0];
        *v0 = __builtin_convertvector(w & 15, vf) * s + m;
        *v1 = __builtin_convertvector(w >> 4, vf) * s + m;
    } else {
        *v0 = __builtin_convertvector(bytes(c + d0), vf) * (float)sp[g0] + (float)mp[g0];
        *v1 = __builtin_convertvector(bytes(c + d0 + VL), vf) * (float)sp[g1] + (float)mp[g1];
    }
}

/* lane j of the result = sum of the VL lanes of v[j]: rounds of pairwise folds, each halving
 * the lanes per token and the number of vectors */
static inline __attribute__((always_inline)) vf hsum_tokens(const vf v[VL]) {
#if VL == 16
    static const vi a1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                    b1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
                    a2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
                    b2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31},
                    a3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
                    b3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31},
                    a4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30},
                    b4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    vf s[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        s[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], a1) + __builtin_shuffle(v[2 * i], v[2 * i + 1], b1);
#else
    static const vi a2 = {0, 1, 2, 3, 8, 9, 10, 11}, b2 = {4, 5, 6, 7, 12, 13, 14, 15},
                    a3 = {0, 1, 4, 5, 8, 9, 12, 13}, b3 = {2, 3, 6, 7, 10, 11, 14, 15},
                    a4 = {0, 2, 4, 6, 8, 10, 12, 14}, b4 = {1, 3, 5, 7, 9, 11, 13, 15};
    const vf *s = v;
    vf u[4], w[2];
#endif
    for (int i = 0; i < 4; i++)
        u[i] = __builtin_shuffle(s[2 * i], s[2 * i + 1], a2) + __builtin_shuffle(s[2 * i], s[2 * i + 1], b2);
    for (int i = 0; i < 2; i++)
        w[i] = __builtin_shuffle(u[2 * i], u[2 * i + 1], a3) + __builtin_shuffle(u[2 * i], u[2 * i + 1], b3);
    return __builtin_shuffle(w[0], w[1], a4) + __builtin_shuffle(w[0], w[1], b4);
}

/* part[i][j] = lane sums of q_i . k_t for NR rows (the VL lanes still to be reduced) */
static inline __attribute__((always_inline)) void kdot_slot(const RingArgs *a, int h, int64_t t,
        const float *q, const int *gx, vf (*part)[VL], int j, const int NR) {
    const int D = a->D;
    const uint8_t *c = codes_at(&a->k, a->layer, h, t);
    const int64_t po = param_off(&a->k, a->layer, h, t);
    vf acc[8];
    for (int i = 0; i < NR; i++) acc[i] = (vf){0};
    for (int d0 = 0; d0 < D; d0 += BC) {
        vf k0, k1;
        deq(c, a->k.scale + po, a->k.min + po, d0, a->bits, gx, &k0, &k1);
        for (int i = 0; i < NR; i++)
            acc[i] += vload(q + i * D + d0) * k0 + vload(q + i * D + d0 + VL) * k1;
    }
    for (int i = 0; i < NR; i++) part[i][j] = acc[i];
}

static void k_logits_fast(const RingArgs *a, int h, int64_t t0, int64_t t1, const float *q,
                          const int *gx, float *sc) {
    vf part[MAXR][VL];
    const int R = a->Gq;
    for (int64_t tb = t0; tb < t1; tb += VL) {
        int nb = t1 - tb < VL ? (int)(t1 - tb) : VL;
        for (int j = 0; j < nb; j++) {
            int r0 = 0;
#define KS(nr) kdot_slot(a, h, tb + j, q + r0 * a->D, gx, part + r0, j, nr)
            for (; r0 + 4 <= R; r0 += 4) KS(4);
            switch (R - r0) {
            case 3: KS(3); break; case 2: KS(2); break; case 1: KS(1); break;
            default: break;
            }
#undef KS
        }
        for (int r = 0; r < R; r++) {
            for (int j = nb; j < VL; j++) part[r][j] = (vf){0};
            float l[VL];
            vstore(l, hsum_tokens(part[r]));
            memcpy(sc + r * a->n + tb, l, sizeof(float) * nb);
        }
    }
}

/* acc (NR rows, BC channels at d0, working order) += p_t v_t over slots [t0, t1) */
static inline __attribute__((always_inline)) void vmix_block(const RingArgs *a, int h, int64_t t0,
        int64_t t1, int d0, const int *gx, const float *p, float *acc, const int NR) {
    const int D = a->D;
    vf x[4][2];
    for (int i = 0; i < NR; i++) {
        x[i][0] = vload(acc + i * D + d0);
        x[i][1] = vload(acc + i * D + d0 + VL);
    }
    for (int64_t t = t0; t < t1; t++) {
        const int64_t po = param_off(&a->v, a->layer, h, t);
        vf v0, v1;
        deq(codes_at(&a->v, a->layer, h, t), a->v.scale + po, a->v.min + po, d0, a->bits, gx,
            &v0, &v1);
        for (int i = 0; i < NR; i++) {
            float pt = p[i * a->n + t];
            x[i][0] += pt * v0;
            x[i][1] += pt * v1;
        }
    }
    for (int i = 0; i < NR; i++) {
        vstore(acc + i * D + d0, x[i][0]);
        vstore(acc + i * D + d0 + VL, x[i][1]);
    }
}

static void v_mix_fast(const RingArgs *a, int h, int64_t t0, int64_t t1, const int *gx,
                       const float *p, float *acc) {
    const int R = a->Gq;
    for (int d0 = 0; d0 < a->D; d0 += BC) {
        int r0 = 0;
#define VM(nr) vmix_block(a, h, t0, t1, d0, gx, p + r0 * a->n, acc + r0 * a->D, nr)
        for (; r0 + 4 <= R; r0 += 4) VM(4);
        switch (R - r0) {
        case 3: VM(3); break; case 2: VM(2); break; case 1: VM(1); break;
        default: break;
        }
#undef VM
    }
}
#else
#define BC 32
#endif

/* slots [t0, t1) of a split, less the slot being written (read from its fp32 row): the
 * ranges [cut[0][0], cut[0][1]) and [cut[1][0], cut[1][1]), either possibly empty */
static inline void around_slot(int64_t t0, int64_t t1, int64_t slot, int64_t cut[2][2]) {
    cut[0][0] = t0;
    cut[0][1] = slot < t0 ? t0 : slot < t1 ? slot : t1;
    cut[1][0] = slot + 1 > t0 ? slot + 1 : t0;
    cut[1][1] = t1;
}

/* -- the op, in pieces per KV head --------------------------------------------------------
 * Each piece does for one head h what its phase does, in the same order, so a head's bits do
 * not depend on which heads a call covers: kvrun_ring_attention runs each phase over every
 * head (`omp for` over slot splits or rows), kvrun_ring_attention_rows runs one (row, head)
 * item through every phase on one thread. */

/* what a call's arguments select: the vector path, the working order, the slot splits */
typedef struct { int fast, pair, nsplit; int gx[MAXD / 8 + 1]; } Mode;

static int mode_of(const RingArgs *a, Mode *m) {
    const int D = a->D, bits = a->bits;
    if (D > MAXD || D < 1 || a->Gq > MAXR || a->Gq < 1 || (bits != 4 && bits != 8 && bits != 16)
        || (bits != 16 && (a->group < 1 || D % a->group)) || (bits == 4 && D % 2)
        || a->slot < 0 || a->slot >= a->n)
        return 0;
    m->fast = HAVE_FAST && D % BC == 0
        && (bits == 16 ? a->rdtype == ROW_FP16 : a->group % (bits == 4 ? BC : BC / 2) == 0);
    m->pair = m->fast && bits == 4 ? BC : 0;
    for (int i = 0; i < D / (BC / 2); i++) m->gx[i] = BC / 2 * i / (bits == 16 ? D : a->group);
    int64_t ns = (int64_t)a->n * a->Hkv / SPLIT_MIN + 1;
    m->nsplit = ns > RING_SPLITS ? RING_SPLITS : (int)ns;
    return 1;
}

/* phase 0 for head h: its query rows loaded, rotated by R_k (decode_attention.c's
 * heads_prepare order: load, x R, scale) into the working order; its new K / V rows rotated
 * (R_k, R_v), rounded to the ring dtype, written into slot `slot` (codes bit-identical to
 * _RingStore.write) and kept in fp32 */
static void head_prepare(const RingArgs *a, const Mode *m, int h) {
    const int D = a->D;
    const float qscale = 1.f / sqrtf((float)D);
    float row[MAXD];
    for (int hq = h * a->Gq; hq < (h + 1) * a->Gq; hq++) {
        load_row(a->q, hq * a->qs, a->qdtype, D, row);
        if (a->rk) hadamard_rotate(row, a->rk, D);
        for (int d = 0; d < D; d++) row[d] *= qscale;
        to_work(row, D, m->pair, a->qp + (int64_t)hq * D);
    }
    const RingStore *st[2] = { &a->k, &a->v };
    const void *src[2] = { a->kn, a->vn };
    const int64_t off[2] = { h * a->kns, h * a->vns };
    const int dt[2] = { a->kdtype, a->vdtype };
    const float *rot[2] = { a->rk, a->rv };
    float *keep[2] = { a->kx + (int64_t)h * D, a->vx + (int64_t)h * D };
    for (int role = 0; role < 2; role++) {
        load_row(src[role], off[role], dt[role], D, row);
        if (rot[role]) hadamard_rotate(row, rot[role], D);
        round_row(row, a->rdtype, D);
        uint8_t *dst = (uint8_t *)codes_at(st[role], a->layer, h, a->slot);
        if (a->bits == 16) {
            store_row(dst, 0, a->rdtype, D, row);
        } else {
            const int64_t po = param_off(st[role], a->layer, h, a->slot);
            quant_row(row, D, a->bits, a->group, dst, st[role]->scale + po, st[role]->min + po);
        }
        to_work(row, D, m->pair, keep[role]);
    }
}

/* slots [t0, t1) of split sp of the n filled ones, and the two runs of them around the new
 * slot (cut: around_slot), which phases 1 and 3 read from the ring */
static inline void split_cuts(const RingArgs *a, const Mode *m, int sp, int64_t *t0, int64_t *t1,
                              int64_t cut[2][2]) {
    *t0 = (int64_t)a->n * sp / m->nsplit;
    *t1 = (int64_t)a->n * (sp + 1) / m->nsplit;
    around_slot(*t0, *t1, a->slot, cut);
}

/* phase 1, split sp, head h: logits of its Gq rows; the new slot from its fp32 row */
static void head_logits(const RingArgs *a, const Mode *m, int h, int sp) {
    const int Gq = a->Gq, D = a->D;
    const int64_t n = a->n, slot = a->slot;
    const float *q = a->qp + (int64_t)h * Gq * D;
    float *sc = a->sc + (int64_t)h * Gq * n;
    int64_t t0, t1, cut[2][2];
    split_cuts(a, m, sp, &t0, &t1, cut);
    for (int k = 0; k < 2; k++) {
        if (cut[k][0] >= cut[k][1]) continue;
#if HAVE_FAST
        if (m->fast) { k_logits_fast(a, h, cut[k][0], cut[k][1], q, m->gx, sc); continue; }
#endif
        k_logits_plain(a, h, cut[k][0], cut[k][1], q, sc);
    }
    if (slot >= t0 && slot < t1)
        for (int r = 0; r < Gq; r++) sc[r * n + slot] = dot(q + r * D, a->kx + (int64_t)h * D, D);
}

/* phase 2 for row hr of (H,): the soft-cap (RingArgs.softcap), one exact softmax */
static void row_softmax(const RingArgs *a, int hr) {
    const int64_t n = a->n;
    float *s = a->sc + (int64_t)hr * n;
    softcap_row(s, n, a->softcap);
    float mx = -INFINITY;
    for (int64_t t = 0; t < n; t++) mx = s[t] > mx ? s[t] : mx;
    float den = 0.f;
    for (int64_t t = 0; t < n; t++) { float e = exp_neg(s[t] - mx); s[t] = e; den += e; }
    float inv = 1.f / den;
    for (int64_t t = 0; t < n; t++) s[t] *= inv;
}

/* phase 3, split sp, head h: p.V into the split's partial outputs part (nsplit, H, D) */
static void head_mix(const RingArgs *a, const Mode *m, int h, int sp) {
    const int Gq = a->Gq, D = a->D, H = a->Hkv * Gq;
    const int64_t n = a->n, slot = a->slot;
    const float *p = a->sc + (int64_t)h * Gq * n;
    float *acc = a->part + ((int64_t)sp * H + (int64_t)h * Gq) * D;
    memset(acc, 0, sizeof(float) * Gq * D);
    int64_t t0, t1, cut[2][2];
    split_cuts(a, m, sp, &t0, &t1, cut);
    for (int k = 0; k < 2; k++) {
        if (cut[k][0] >= cut[k][1]) continue;
#if HAVE_FAST
        if (m->fast) { v_mix_fast(a, h, cut[k][0], cut[k][1], m->gx, p, acc); continue; }
#endif
        v_mix_plain(a, h, cut[k][0], cut[k][1], p, acc);
    }
    if (slot >= t0 && slot < t1) {
        const float *vx = a->vx + (int64_t)h * D;
        for (int r = 0; r < Gq; r++) {
            float pr = p[r * n + slot];
            for (int d = 0; d < D; d++) acc[r * D + d] += pr * vx[d];
        }
    }
}

/* row hr: the splits summed in split order, back to channel order, un-rotated (o R_v^T) */
static void row_out(const RingArgs *a, const Mode *m, int hr) {
    const int D = a->D, H = a->Hkv * a->Gq;
    float *o = a->out + (int64_t)hr * D;
    float acc[MAXD] = {0};
    for (int sp = 0; sp < m->nsplit; sp++) {
        const float *pp = a->part + ((int64_t)sp * H + hr) * D;
        for (int d = 0; d < D; d++) acc[d] += pp[d];
    }
    from_work(acc, D, m->pair);
    if (a->rv) hadamard_unrotate(acc, a->rv, D);
    memcpy(o, acc, sizeof(float) * D);
}

/* One decode token of one ring layer: every phase over every head, slot splits over threads.
 * Returns 0, or 1 for arguments it does not cover. */
int kvrun_ring_attention(const RingArgs *a) {
    Mode m;
    if (!mode_of(a, &m)) return 1;
    const int Hkv = a->Hkv, H = Hkv * a->Gq, nsplit = m.nsplit;
    for (int h = 0; h < Hkv; h++) head_prepare(a, &m, h);
    const int nth = a->nthreads < 1 ? 1 : a->nthreads < nsplit ? a->nthreads : nsplit;
#pragma omp parallel num_threads(nth) if (nth > 1)
    {
#pragma omp for schedule(static)
        for (int sp = 0; sp < nsplit; sp++)
            for (int h = 0; h < Hkv; h++) head_logits(a, &m, h, sp);
#pragma omp for schedule(static)
        for (int hr = 0; hr < H; hr++) row_softmax(a, hr);
#pragma omp for schedule(static)
        for (int sp = 0; sp < nsplit; sp++)
            for (int h = 0; h < Hkv; h++) head_mix(a, &m, h, sp);
#pragma omp for schedule(static)
        for (int hr = 0; hr < H; hr++) row_out(a, &m, hr);
    }
    return 0;
}

/* KV head h of a, every phase on the calling thread: the bits kvrun_ring_attention gives it */
static void head_attention(const RingArgs *a, int h) {
    Mode m;
    mode_of(a, &m);                                     /* checked by the caller */
    head_prepare(a, &m, h);
    for (int sp = 0; sp < m.nsplit; sp++) head_logits(a, &m, h, sp);
    for (int hr = h * a->Gq; hr < (h + 1) * a->Gq; hr++) row_softmax(a, hr);
    for (int sp = 0; sp < m.nsplit; sp++) head_mix(a, &m, h, sp);
    for (int hr = h * a->Gq; hr < (h + 1) * a->Gq; hr++) row_out(a, &m, hr);
}

/* one decode token of a ring layer in the one-call decode step (decode_layer.c) for B rows,
 * as decode_attention.c's kvrun_decode_attention_rows does for arena layers: each row's
 * prebuilt arguments args[b] (native/decode_step.py: storage, rotations, fp32 q and new rows
 * of head stride D) bound to its step io[b] (q / k / v / out, scratch, io.slot, io.n), then
 * one row through kvrun_ring_attention, several in one parallel region of (row, KV head)
 * items. The same bits either way. Returns 0, or the first refusing row's code. */
int kvrun_ring_attention_rows(void *const *args, const StepIO *io, int B) {
    for (int b = 0; b < B; b++) {
        RingArgs *a = args[b];
        const StepIO *s = &io[b];
        a->slot = s->slot; a->n = s->n; a->nthreads = s->nthreads;
        a->q = s->q; a->kn = s->k; a->vn = s->v; a->out = s->out;
        a->qp = s->qs; a->sc = s->sc; a->part = s->part;
        Mode m;
        if (!mode_of(a, &m)) return 1;
    }
    if (B == 1) return kvrun_ring_attention(args[0]);
    const int Hkv = ((const RingArgs *)args[0])->Hkv, n = B * Hkv;
    const int nth = io[0].nthreads < 1 ? 1 : io[0].nthreads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nth < n ? nth : n)
    for (int i = 0; i < n; i++) head_attention(args[i / Hkv], i % Hkv);
    return 0;
}
