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
 *   phase 2  causal mask over the new tokens, the logits' soft-cap where set (Gemma 2:
 *            cap tanh(s / cap), after every phase-1 read, integer or fp32, has written
 *            them), one exact softmax per row (two-pass
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
 * The file holds the arguments and the phases (the op); the reads it runs are its parts,
 * included as one translation unit (so every helper still inlines): attn_code_rows.h (code
 * rows, micro-kernels), attn_tiles_int.h (integer q.K and p.V), attn_fp_rows.h (fp rows),
 * attn_tiles_avx512.h or attn_tiles_avx2.h (the register fast paths of the build's ISA),
 * attn_tail_reads.h (the generic tail reads).
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
#include "args.h"         /* the argument structs ctypes mirrors */
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

/* Args: the op's arguments (args.h) */


/* the parts, in dependency order (each file says what it holds) */
#include "attn_code_rows.h"
#include "attn_tiles_int.h"
#include "attn_fp_rows.h"
#if defined(__AVX512F__) && !defined(KVRUN_NO_AVX512)
#include "attn_tiles_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && !defined(KVRUN_NO_AVX2)
#include "attn_tiles_avx2.h"
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
#include "attn_tail_reads.h"

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

/* phase 2 for row hr of (Hkv, R): causal mask over the new tokens, the soft-cap (Args.softcap),
 * one exact softmax */
static void row_softmax(const Args *a, int hr) {
    const int64_t N = (int64_t)a->n_tail + a->W + a->Tn;
    float *s = a->sc + (int64_t)hr * N;
    int r = hr % a->R, t = r % a->Tq;                    /* rows ordered (g, t) */
    int64_t vis = (int64_t)a->n_tail + a->W + a->t0 + t + 1;      /* keys this query sees */
    if (vis > N) vis = N;
    softcap_row(s, vis, a->softcap);     /* every tail read's logits meet here, int and fp32 */
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
