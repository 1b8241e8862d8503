/* decode_layer: the dense part of a decoder layer for a few rows (decode), native CPU.
 *
 * Why: a decode step of a small model through eager torch ops is ~1,300 small ops (casts,
 * copies, norms, RoPE, SwiGLU, residual adds) around GEMVs that are each a few
 * microseconds; the ops' dispatch costs more than the bytes they read. Here the work
 * around attention is two calls per layer:
 *
 *   kvrun_layer_pre   x -> RMSNorm -> one GEMV over the stacked [q; k; v] rows (+ bias)
 *                     -> RoPE on q and k (rotate-half convention, per-row positions)
 *   kvrun_layer_post  attention output -> o_proj GEMV -> residual add -> RMSNorm ->
 *                     gate and up rows in one pass, SwiGLU -> down GEMV -> residual add
 *   kvrun_logits      final RMSNorm -> lm_head GEMV
 *
 * Gemma 3 layers set the optional fields (NULL / 0 for Llama): per-head RMSNorm of q and k
 * before RoPE (q_norm, k_norm), RMSNorm of the attention and MLP outputs before their
 * residual adds (attn_out_norm, mlp_out_norm), the tanh GELU instead of SiLU (act), and a
 * q scale after RoPE (query_pre_attn_scalar). Its (1 + w) norms come in as 1 + w.
 * OLMo 2 layers have no block-input norms (norm1, norm2 NULL: the input goes in as it is)
 * and normalize q and k over the whole projection (qk_norm_proj: q_norm (H D,), k_norm
 * (Hkv D,)) instead of per head.
 *
 * Rows: B rows (each its own sequence or token), every weight byte is read once per call
 * and used for all rows. Activations are fp32 (no casts); weights stay in the bytes kvrun
 * stores (runtime/model/qlinear.py):
 *   int4  codes (N, K/2) uint8, per group of G columns byte j = column j (low nibble) |
 *         column j + G/2 (high nibble) (llama.cpp's Q4_0/Q4_1 block order), fp16 scale and
 *         min per (row, group): w = c * s + m.
 *   int8  codes (N, K) int8, one fp32 scale per row.
 * The GEMVs (gemv.h) run on one of two paths, chosen per Layer (gemv_int):
 *   integer (gemv_quant.c, gemv_int.c)  each GEMV input quantized once to int16 blocks of
 *                         32 columns (q/k/v share one, gate and up share one), int32 dots
 *                         with the weights repacked at load, 16 rows to a register
 *   fp32 (gemv_fp32.c)    codes decoded to fp32, FMAs with the fp32 input: the reference,
 *                         equal to the dequantized fp32 GEMV to rounding
 * Both compute each row independently of the others, so a row's result does not depend on
 * B. kvrun_gemv runs one GEMV alone (tests, tools/gemv_speed.py).
 *
 * Bytes read per call: every weight byte once (SmolLM2-135M int4: ~2.1 MB per layer,
 * ~90 MB per token with the int8 lm_head), activations of B rows (a few kB).
 * Work is split over output rows on torch's OpenMP pool (one parallel region per call).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#include "gemv.h"
#include "step_io.h"
#include "args.h"         /* the argument structs ctypes mirrors */

/* Layer: one decoder layer's weights and scratch (args.h) */

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

/* -- row-wise helpers (one thread) ----------------------------------------------------- */

static void rmsnorm(const float *x, const float *wt, int n, float eps, float *out)
{
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    const float r = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * r * wt[i];
}

/* rotate-half RoPE of one head vector in place with this row's cos/sin tables (D,) */
static void rope(float *v, const float *cs, const float *sn, int D)
{
    const int h = D / 2;
    for (int d = 0; d < h; d++) {
        const float a = v[d], b = v[d + h];
        v[d] = a * cs[d] - b * sn[d];
        v[d + h] = b * cs[d + h] + a * sn[d + h];
    }
}

/* one GEMV input in the form its path reads: quantized rows (integer) or group sums (fp32) */
typedef struct {
    int integer;
    uint8_t *xq;
    int64_t ldq;
    float *xs;
    int ldxs;
} Input;

static Input layer_input(const Layer *L)
{
    const int wide = L->inter > L->hidden ? L->inter : L->hidden, hd = L->H * L->D;
    return (Input){L->gemv_int, L->xq, L->ldq, L->xsum, (wide > hd ? wide : hd) / 32};
}

/* row b of a GEMV input x (K,) for weight w: quantized, or its group sums */
static void prepare(const Input *in, const Weight *w, const float *x, int b)
{
    if (in->integer) gi_quantize(w, x, in->xq + b * in->ldq);
    else gf_group_sums(w, x, in->xs + (int64_t)b * in->ldxs);
}

/* out[j * MAXB + b] = W[n0 + j] . x[b] for j < nn <= GEMV_NR, b < B (x: rows of stride ldx,
 * prepared) */
static void rows(const Input *in, const Weight *w, int n0, int nn, int B, const float *x,
                 int ldx, float *out)
{
    if (in->integer) gi_rows(w, n0, nn, B, in->xq, in->ldq, out, MAXB);
    else gf_rows(w, n0, nn, B, x, ldx, in->xs, in->ldxs, out, MAXB);
}

/* the MLP's gate activation: SiLU (SwiGLU) or the tanh approximation of GELU (GeGLU,
 * torch's gelu(approximate="tanh")) */
static float act(int kind, float g)
{
    if (kind == ACT_GELU_TANH)
        return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    return g / (1.0f + expf(-g));
}

/* a GEMV y (B, N) = x (B, K) W^T over this thread's blocks of GEMV_NR output rows: `omp for`
 * inside a region; BODY runs for each (n, b) with v_ the result */
#define GEMV_FOR(in, w, B, x, ldx, BODY)                                                 \
    _Pragma("omp for schedule(static)")                                                 \
    for (int n0 = 0; n0 < (w)->N; n0 += GEMV_NR) {                                      \
        float r_[GEMV_NR][MAXB];                                                        \
        const int nn_ = (w)->N - n0 < GEMV_NR ? (w)->N - n0 : GEMV_NR;                  \
        rows((in), (w), n0, nn_, (B), (x), (ldx), r_[0]);                               \
        for (int j_ = 0; j_ < nn_; j_++)                                                \
            for (int b = 0; b < (B); b++) {                                             \
                const int n = n0 + j_;                                                  \
                const float v_ = r_[j_][b];                                             \
                BODY;                                                                   \
            }                                                                           \
    }

/* x (B, hidden) -> q, k, v (roped) in L->qkv_out (B, (H + 2 Hkv) D).
 * cosb, sinb: (B, D) tables of each row's position. */
int kvrun_layer_pre(const Layer *L, int B, const float *cosb, const float *sinb)
{
    if (B < 1 || B > MAXB) return -1;
    const int C = L->hidden, D = L->D, NQKV = (L->H + 2 * L->Hkv) * D;
    const Input in = layer_input(L);
#pragma omp parallel num_threads(L->nthreads)
    {
#pragma omp for schedule(static)
        for (int b = 0; b < B; b++) {
            float *xn = L->xn + (int64_t)b * C;
            if (L->norm1) rmsnorm(L->x + (int64_t)b * C, L->norm1, C, L->eps, xn);
            else memcpy(xn, L->x + (int64_t)b * C, (size_t)C * sizeof(float));
            prepare(&in, &L->qkv, xn, b);
        }
        GEMV_FOR(&in, &L->qkv, B, L->xn, C, L->qkv_out[(int64_t)b * NQKV + n] = v_)
        if (L->qk_norm_proj) {                  /* OLMo 2: over all of q, all of k */
#pragma omp for schedule(static)
            for (int b = 0; b < B; b++) {
                float *q = L->qkv_out + (int64_t)b * NQKV, *k = q + L->H * D;
                rmsnorm(q, L->q_norm, L->H * D, L->eps, q);
                rmsnorm(k, L->k_norm, L->Hkv * D, L->eps, k);
            }
        }
#pragma omp for schedule(static)
        for (int i = 0; i < B * (L->H + L->Hkv); i++) {           /* q and k heads of every row */
            const int b = i / (L->H + L->Hkv), hd = i % (L->H + L->Hkv);
            float *head = L->qkv_out + (int64_t)b * NQKV + hd * D;
            const float *nw = L->qk_norm_proj ? NULL : hd < L->H ? L->q_norm : L->k_norm;
            if (nw) rmsnorm(head, nw, D, L->eps, head);
            rope(head, cosb + (int64_t)b * D, sinb + (int64_t)b * D, D);
            if (hd < L->H && L->q_scale != 1.0f)
                for (int d = 0; d < D; d++) head[d] *= L->q_scale;
        }
    }
    return 0;
}

/* Row b's router probabilities M->probs (E,) from its logits, in place: softmax in fp32;
 * then its top_k experts (most probable first, ties to the lower id, as torch.topk) and their
 * weights, renormalized to sum 1 (summed most probable first) when norm_topk. */
static void moe_route(const Moe *M, int b)
{
    const int E = M->E, K = M->top_k;
    float *p = M->probs + (int64_t)b * E, mx = p[0], sum = 0.0f;
    for (int e = 1; e < E; e++) mx = p[e] > mx ? p[e] : mx;
    for (int e = 0; e < E; e++) { p[e] = expf(p[e] - mx); sum += p[e]; }
    int32_t *ch = M->chosen + b * K;
    float *w = M->weight + b * K, tot = 0.0f;
    for (int j = 0; j < K; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= ch[i] == e;
            if (!taken && (best < 0 || p[e] > p[best])) best = e;
        }
        ch[j] = best;
        w[j] = p[best] / sum;
        tot += w[j];
    }
    if (M->norm_topk)
        for (int j = 0; j < K; j++) w[j] /= tot;
}

/* x (B, hidden) += the sparse MLP of xn (B, hidden), inside a parallel region (orphaned
 * `omp for`s): the router GEMV in fp32 and each row's top-k (moe_route); then per expert in
 * ascending id, only the rows that chose it, gathered: gate and up, SwiGLU, down, each row's
 * output times its weight added into acc (runtime/model/moe.py's order); x += acc. An expert
 * no row chose is skipped, its weights never read. */
static void moe_mlp(const Layer *L, const Input *in, int B)
{
    const Moe *M = L->moe;
    const int C = L->hidden, E = M->E, K = M->top_k, I = M->inter;
#pragma omp for schedule(static)
    for (int i = 0; i < B * E; i++) {                               /* router logits (B, E) */
        const float *xb = L->xn + (int64_t)(i / E) * C, *we = M->router + (int64_t)(i % E) * C;
        float acc = 0.0f;
        for (int c = 0; c < C; c++) acc += xb[c] * we[c];
        M->probs[i] = acc;
    }
#pragma omp for schedule(static)
    for (int b = 0; b < B; b++) {
        moe_route(M, b);
        memset(M->acc + (int64_t)b * C, 0, (size_t)C * sizeof(float));
    }
    for (int e = 0; e < E; e++) {              /* every thread walks the experts in step */
        int row[MAXB], slot[MAXB], nr = 0;     /* the rows that chose e, and where in their list */
        for (int b = 0; b < B; b++)
            for (int j = 0; j < K; j++)
                if (M->chosen[b * K + j] == e) { row[nr] = b; slot[nr++] = j; }
        if (!nr) continue;
        const Weight *gw = M->gate + e, *uw = M->up + e, *dw = M->down + e;
#pragma omp for schedule(static)
        for (int r = 0; r < nr; r++) {         /* gather; gate and up read one quantized row */
            memcpy(M->xg + (int64_t)r * C, L->xn + (int64_t)row[r] * C, (size_t)C * sizeof(float));
            prepare(in, gw, M->xg + (int64_t)r * C, r);
        }
#pragma omp for schedule(static)
        for (int n0 = 0; n0 < I; n0 += GEMV_NR) {
            float g_[GEMV_NR][MAXB], u_[GEMV_NR][MAXB];
            const int nn = I - n0 < GEMV_NR ? I - n0 : GEMV_NR;
            rows(in, gw, n0, nn, nr, M->xg, C, g_[0]);
            rows(in, uw, n0, nn, nr, M->xg, C, u_[0]);
            for (int j = 0; j < nn; j++)
                for (int r = 0; r < nr; r++)
                    M->hg[(int64_t)r * I + n0 + j] = act(ACT_SILU, g_[j][r]) * u_[j][r];
        }
#pragma omp for schedule(static)
        for (int r = 0; r < nr; r++)
            prepare(in, dw, M->hg + (int64_t)r * I, r);
        GEMV_FOR(in, dw, nr, M->hg, I, M->yg[(int64_t)b * C + n] = v_)
#pragma omp for schedule(static)
        for (int r = 0; r < nr; r++) {
            const float w = M->weight[row[r] * K + slot[r]];
            float *ab = M->acc + (int64_t)row[r] * C;
            const float *yb = M->yg + (int64_t)r * C;
            for (int c = 0; c < C; c++) ab[c] += yb[c] * w;
        }
    }
#pragma omp for schedule(static)
    for (int b = 0; b < B; b++)
        for (int c = 0; c < C; c++) L->x[(int64_t)b * C + c] += M->acc[(int64_t)b * C + c];
}

/* x (B, hidden) += down(act(gate(xn)) * up(xn)) (mlp_out_norm: normed first), inside a
 * parallel region; xn's rows already prepared for gate */
static void dense_mlp(const Layer *L, const Input *in, int B)
{
    const int C = L->hidden, I = L->inter;
#pragma omp for schedule(static)
    for (int n0 = 0; n0 < I; n0 += GEMV_NR) {      /* gate and up rows, then SwiGLU */
        float g_[GEMV_NR][MAXB], u_[GEMV_NR][MAXB];
        const int nn = I - n0 < GEMV_NR ? I - n0 : GEMV_NR;
        rows(in, &L->gate, n0, nn, B, L->xn, C, g_[0]);
        rows(in, &L->up, n0, nn, B, L->xn, C, u_[0]);
        for (int j = 0; j < nn; j++)
            for (int b = 0; b < B; b++)
                L->h[(int64_t)b * I + n0 + j] = act(L->act, g_[j][b]) * u_[j][b];
    }
#pragma omp for schedule(static)
    for (int b = 0; b < B; b++)
        prepare(in, &L->down, L->h + (int64_t)b * I, b);
    if (!L->mlp_out_norm) {
        GEMV_FOR(in, &L->down, B, L->h, I, L->x[(int64_t)b * C + n] += v_)
    } else {
        GEMV_FOR(in, &L->down, B, L->h, I, L->tmp[(int64_t)b * C + n] = v_)
#pragma omp for schedule(static)
        for (int b = 0; b < B; b++) {
            float *xb = L->x + (int64_t)b * C, *tb = L->tmp + (int64_t)b * C;
            rmsnorm(tb, L->mlp_out_norm, C, L->eps, tb);
            for (int i = 0; i < C; i++) xb[i] += tb[i];
        }
    }
}

/* attn (B, H D) -> x += o_proj(attn); x += down(silu(gate(n(x))) * up(n(x))), or with
 * L->moe the sparse MLP of n(x) (moe_mlp) */
int kvrun_layer_post(const Layer *L, int B, const float *attn, int64_t lda)
{
    if (B < 1 || B > MAXB) return -1;
    const int C = L->hidden;
    const Input in = layer_input(L);
#pragma omp parallel num_threads(L->nthreads)
    {
#pragma omp for schedule(static)
        for (int b = 0; b < B; b++)
            prepare(&in, &L->o, attn + b * lda, b);
        GEMV_FOR(&in, &L->o, B, attn, (int)lda, L->tmp[(int64_t)b * C + n] = v_)
#pragma omp for schedule(static)
        for (int b = 0; b < B; b++) {
            float *xb = L->x + (int64_t)b * C, *tb = L->tmp + (int64_t)b * C;
            if (L->attn_out_norm) rmsnorm(tb, L->attn_out_norm, C, L->eps, tb);
            for (int i = 0; i < C; i++) xb[i] += tb[i];
            if (L->norm2) rmsnorm(xb, L->norm2, C, L->eps, L->xn + (int64_t)b * C);
            else memcpy(L->xn + (int64_t)b * C, xb, (size_t)C * sizeof(float));
            if (!L->moe) prepare(&in, &L->gate, L->xn + (int64_t)b * C, b);   /* up reads it too */
        }
        if (L->moe) moe_mlp(L, &in, B);
        else dense_mlp(L, &in, B);
    }
    return 0;
}

/* logits (B, V) = lm_head(RMSNorm(x)); x (B, hidden) */
int kvrun_logits(const Layer *L, int B, const float *norm, const Weight *head, float *logits)
{
    if (B < 1 || B > MAXB) return -1;
    const int C = L->hidden;
    const Input in = layer_input(L);
#pragma omp parallel num_threads(L->nthreads)
    {
#pragma omp for schedule(static)
        for (int b = 0; b < B; b++) {
            rmsnorm(L->x + (int64_t)b * C, norm, C, L->eps, L->xn + (int64_t)b * C);
            prepare(&in, head, L->xn + (int64_t)b * C, b);
        }
        GEMV_FOR(&in, head, B, L->xn, C, logits[(int64_t)b * head->N + n] = v_)
    }
    return 0;
}

/* y (B, N) = x (B, K) W^T (+ bias), one GEMV alone on the given path: x rows of stride ldx;
 * scratch xq (B, ldq) bytes (ldq >= gi_row_bytes(K)), xs (B, K / 32) floats. */
int kvrun_gemv(const Weight *w, int B, const float *x, int64_t ldx, float *y, uint8_t *xq,
               int64_t ldq, float *xs, int integer, int nthreads)
{
    if (B < 1 || B > MAXB || (integer && (ldq < gi_row_bytes(w->K) || !w->rp))) return -1;
    const Input in = {integer, xq, ldq, xs, w->K / 32};
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int b = 0; b < B; b++)
            prepare(&in, w, x + b * ldx, b);
        GEMV_FOR(&in, w, B, x, (int)ldx, y[(int64_t)b * w->N + n] = v_)
    }
    return 0;
}

/* -- the whole decode step in one call ---------------------------------------------------- */

int kvrun_decode_attention_rows(void *const *args, const StepIO *io, int B);   /* decode_attention.c */
int kvrun_ring_attention_rows(void *const *args, const StepIO *io, int B);     /* ring_attention.c */

/* RowCache, Step: the one-call step's arguments (args.h) */

/* The decode step of B rows over every layer: per layer kvrun_layer_pre, the rows' attention
 * each on its own cache (an arena layer's new K/V written to its window slot n_win, a ring
 * layer's to its slot ring_slot; all rows of a kind in one parallel region:
 * decode_attention.c kvrun_decode_attention_rows, ring_attention.c
 * kvrun_ring_attention_rows), then kvrun_layer_post; then kvrun_logits. The same arithmetic
 * as the per-layer route (runtime/model/native_step.py), so the same bits; each call opens
 * its own parallel region from this thread, none nested. The caller advances the windows
 * and flushes after. Returns 0, -1 for a bad B, or the layer's attention refusal as
 * 1000 * (l + 1) + rc. */
int kvrun_decode_step(const Step *s, int B)
{
    if (B < 1 || B > MAXB) return -1;
    for (int l = 0; l < s->n_layers; l++) {
        Layer *L = s->layers[l];
        const int H = L->H, Hkv = L->Hkv, D = L->D, NQKV = (H + 2 * Hkv) * D;
        L->nthreads = s->nthreads;
        kvrun_layer_pre(L, B, s->local[l] ? s->cos_local : s->cos, s->local[l] ? s->sin_local : s->sin);
        void *args[MAXB], *rargs[MAXB];                 /* the arena rows, the ring rows */
        StepIO io[MAXB], rio[MAXB];
        int na = 0, nr = 0;
        for (int b = 0; b < B; b++) {
            const RowCache *r = s->rows[b];
            const float *qkv = L->qkv_out + (int64_t)b * NQKV;
            const StepIO x = {.n_tail = r->n_tail[l], .W = r->n_win[l], .nthreads = s->nthreads,
                              .q = qkv, .k = qkv + H * D, .v = qkv + (H + Hkv) * D,
                              .out = s->attn + (int64_t)b * H * D, .qs = s->qs + b * s->qs_row,
                              .sc = s->sc + b * s->sc_row, .part = s->part + b * s->part_row,
                              .slot = r->ring_slot, .n = r->ring_n};
            if (r->ring && r->ring[l]) { rargs[nr] = r->args[l]; rio[nr++] = x; }
            else { args[na] = r->args[l]; io[na++] = x; }
        }
        int rc = na ? kvrun_decode_attention_rows(args, io, na) : 0;
        if (!rc && nr) rc = kvrun_ring_attention_rows(rargs, rio, nr);
        if (rc) return 1000 * (l + 1) + rc;
        kvrun_layer_post(L, B, s->attn, (int64_t)H * D);
    }
    return kvrun_logits(s->layers[s->n_layers - 1], B, s->norm, s->head, s->logits);
}
