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
 *
 * Rows: B rows (each its own sequence or token), every weight byte is read once per call
 * and used for all rows. Activations are fp32 throughout (no casts); weights stay in the
 * bytes kvrun stores (runtime/qlinear.py):
 *   int4  codes (N, K/2) uint8, per group of G columns byte j = column j (low nibble) |
 *         column j + G/2 (high nibble) (llama.cpp's Q4_0/Q4_1 block order), fp16 scale and
 *         min per (row, group): w = c * s + m. A row dot is  sum_g s_g (c . x)_g + m_g sum(x)_g,
 *         the group sums of x computed once per call.
 *   int8  codes (N, K) int8, one fp32 scale per row.
 * AVX-512 decodes 16 codes per register (the nibbles are split with one AND and one
 * shift) and multiplies in fp32 with FMAs; without it a plain C loop runs (compilers
 * vectorize it for AVX2). Exact fp32 accumulation order differs from torch's, nothing
 * else: the result equals the dequantized fp32 GEMV to rounding.
 *
 * Bytes read per call: every weight byte once (SmolLM2-135M int4: ~2.1 MB per layer,
 * ~90 MB per token with the int8 lm_head), activations of B rows (a few kB).
 * Work is split over output rows on torch's OpenMP pool (one parallel region per call).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) && !defined(KVRUN_NO_AVX512)
#include <immintrin.h>
#define KV_AVX512 1
#endif

typedef _Float16 f16;

enum { W_INT4 = 0, W_INT8 = 1 };
enum { MAXB = 32 };           /* rows per call: each weight row is read from memory once and
                                * re-read from L1 for every row (batched decode, runtime/batch.py) */

/* one weight matrix (N, K) in a stored format */
typedef struct {
    int32_t kind, N, K, G;      /* G: int4 group (columns per scale/min) */
    const uint8_t *q;           /* int4: (N, K/2) packed; int8: (N, K) int8 */
    const f16 *s, *m;           /* int4: (N, K/G) scale, min */
    const float *scale;         /* int8: (N,) */
    const float *bias;          /* (N,) or NULL */
} Weight;

typedef struct {
    int32_t hidden, H, Hkv, D, inter, nthreads;
    float eps;
    const float *norm1, *norm2;     /* (hidden,) RMSNorm weights */
    Weight qkv, o, gate, up, down;
    /* scratch, (MAXB, ...) float32 each */
    float *x;                        /* residual stream (B, hidden), in and out */
    float *xn;                       /* normed input (B, max(hidden, inter)) */
    float *xsum;                     /* group sums of xn (B, max(hidden, inter) / 32) */
    float *qkv_out;                  /* (B, (H + 2 Hkv) D): q, k, v of each row */
    float *tmp;                      /* (B, hidden) o_proj output */
    float *h;                        /* (B, inter) SwiGLU output */
    /* Gemma 3 (NULL / 0 / 1 for Llama) */
    const float *q_norm, *k_norm;    /* (D,) per-head RMSNorm weights of q and k, before RoPE */
    const float *attn_out_norm;      /* (hidden,) RMSNorm of o_proj's output before the add */
    const float *mlp_out_norm;       /* (hidden,) RMSNorm of down's output before the add */
    int32_t act;                     /* ACT_SILU or ACT_GELU_TANH, of the gate rows */
    float q_scale;                   /* q multiplied by it after RoPE */
} Layer;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

/* -- dot products of one weight row with B input rows --------------------------------- */

/* int4 row n dotted with one input row x and its group sums xs */
static float q4_dot(const Weight *w, int n, const float *x, const float *xs)
{
    const int K = w->K, G = w->G, ng = K / G, half = G / 2;
    const uint8_t *q = w->q + (int64_t)n * (K / 2);
    const f16 *sp = w->s + (int64_t)n * ng, *mp = w->m + (int64_t)n * ng;
    float r = 0.f;
#if KV_AVX512
    /* four accumulators, rotating by group: each FMA chain advances every fourth group,
     * so the loop is bound by the nibble decode, not by FMA latency */
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const __m128i low = _mm_set1_epi8(0x0f);
    for (int g = 0; g < ng; g++) {
        const __m512 sg = _mm512_set1_ps((float)sp[g]);
        const uint8_t *qg = q + g * half;
        const float *xg = x + g * G;
        __m512 t = _mm512_setzero_ps();
        for (int j = 0; j < half; j += 16) {
            __m128i byt = _mm_loadu_si128((const __m128i *)(qg + j));
            __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(byt, low)));
            __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                _mm_and_si128(_mm_srli_epi16(byt, 4), low)));
            t = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xg + j), t);
            t = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + j + half), t);
        }
        switch (g & 3) {
        case 0: a0 = _mm512_fmadd_ps(t, sg, a0); break;
        case 1: a1 = _mm512_fmadd_ps(t, sg, a1); break;
        case 2: a2 = _mm512_fmadd_ps(t, sg, a2); break;
        default: a3 = _mm512_fmadd_ps(t, sg, a3);
        }
    }
    r = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#else
    for (int g = 0; g < ng; g++) {
        const uint8_t *qg = q + g * half;
        const float *xg = x + g * G;
        float a = 0.f;
        for (int j = 0; j < half; j++)
            a += (float)(qg[j] & 15) * xg[j] + (float)(qg[j] >> 4) * xg[j + half];
        r += (float)sp[g] * a;
    }
#endif
    for (int g = 0; g < ng; g++) r += (float)mp[g] * xs[g];
    return r;
}

/* int8 row n dotted with one input row x */
static float i8_dot(const Weight *w, int n, const float *x)
{
    const int K = w->K;
    const int8_t *q = (const int8_t *)w->q + (int64_t)n * K;
    int k = 0;
    float r = 0.f;
#if KV_AVX512
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; k + 64 <= K; k += 64) {
        __m512i c = _mm512_loadu_si512((const void *)(q + k));
        a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_castsi512_si128(c))),
                             _mm512_loadu_ps(x + k), a0);
        a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(c, 1))),
                             _mm512_loadu_ps(x + k + 16), a1);
        a2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(c, 2))),
                             _mm512_loadu_ps(x + k + 32), a2);
        a3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(c, 3))),
                             _mm512_loadu_ps(x + k + 48), a3);
    }
    r = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#endif
    for (; k < K; k++) r += (float)q[k] * x[k];
    return r * w->scale[n];
}

#if KV_AVX512
/* Row blocks: weight row n dotted with NB (<= 4) input rows at once. The codes are decoded
 * once per block and used for every row; each row's arithmetic is exactly q4_dot's / i8_dot's
 * (same accumulators, same order), so a row's result does not depend on the batch it is in
 * (runtime/batch.py relies on it: a sequence decodes bit-identically alone or batched). */
#define Q4_GROUP(ACC, NB)                                                                   \
    {                                                                                       \
        const __m512 sg = _mm512_set1_ps((float)sp[g]);                                     \
        const uint8_t *qg = q + g * half;                                                   \
        __m512 t[NB];                                                                       \
        for (int b = 0; b < NB; b++) t[b] = _mm512_setzero_ps();                            \
        for (int j = 0; j < half; j += 16) {                                                \
            __m128i byt = _mm_loadu_si128((const __m128i *)(qg + j));                       \
            __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(byt, low)));  \
            __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(                            \
                _mm_and_si128(_mm_srli_epi16(byt, 4), low)));                               \
            for (int b = 0; b < NB; b++) {                                                  \
                const float *xg = x + (int64_t)b * ldx + g * G;                             \
                t[b] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xg + j), t[b]);                  \
                t[b] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + j + half), t[b]);           \
            }                                                                               \
        }                                                                                   \
        for (int b = 0; b < NB; b++) ACC[b] = _mm512_fmadd_ps(t[b], sg, ACC[b]);            \
        g++;                                                                                \
    }

#define DEFINE_Q4_ROWS(NB)                                                                  \
static void q4_rows##NB(const Weight *w, int n, const float *x, int ldx, const float *xs,   \
                        int ldxs, float *out)                                               \
{                                                                                           \
    const int K = w->K, G = w->G, ng = K / G, half = G / 2;                                 \
    const uint8_t *q = w->q + (int64_t)n * (K / 2);                                         \
    const f16 *sp = w->s + (int64_t)n * ng, *mp = w->m + (int64_t)n * ng;                   \
    const __m128i low = _mm_set1_epi8(0x0f);                                                \
    __m512 a0[NB], a1[NB], a2[NB], a3[NB];                                                  \
    for (int b = 0; b < NB; b++)                                                            \
        a0[b] = a1[b] = a2[b] = a3[b] = _mm512_setzero_ps();                                \
    int g = 0;                                                                              \
    while (g + 4 <= ng) { Q4_GROUP(a0, NB) Q4_GROUP(a1, NB) Q4_GROUP(a2, NB) Q4_GROUP(a3, NB) } \
    if (g < ng) Q4_GROUP(a0, NB)                                                            \
    if (g < ng) Q4_GROUP(a1, NB)                                                            \
    if (g < ng) Q4_GROUP(a2, NB)                                                            \
    for (int b = 0; b < NB; b++) {                                                          \
        float r = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0[b], a1[b]),           \
                                                     _mm512_add_ps(a2[b], a3[b])));         \
        const float *xsb = xs + (int64_t)b * ldxs;                                          \
        for (int gg = 0; gg < ng; gg++) r += (float)mp[gg] * xsb[gg];                       \
        out[b] = r;                                                                         \
    }                                                                                       \
}

#define DEFINE_I8_ROWS(NB)                                                                  \
static void i8_rows##NB(const Weight *w, int n, const float *x, int ldx, float *out)       \
{                                                                                           \
    const int K = w->K;                                                                     \
    const int8_t *q = (const int8_t *)w->q + (int64_t)n * K;                                \
    __m512 a0[NB], a1[NB], a2[NB], a3[NB];                                                  \
    for (int b = 0; b < NB; b++)                                                            \
        a0[b] = a1[b] = a2[b] = a3[b] = _mm512_setzero_ps();                                \
    int k = 0;                                                                              \
    for (; k + 64 <= K; k += 64) {                                                          \
        __m512i c = _mm512_loadu_si512((const void *)(q + k));                              \
        __m512 c0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_castsi512_si128(c)));    \
        __m512 c1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(c, 1))); \
        __m512 c2 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(c, 2))); \
        __m512 c3 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(c, 3))); \
        for (int b = 0; b < NB; b++) {                                                      \
            const float *xb = x + (int64_t)b * ldx + k;                                     \
            a0[b] = _mm512_fmadd_ps(c0, _mm512_loadu_ps(xb), a0[b]);                        \
            a1[b] = _mm512_fmadd_ps(c1, _mm512_loadu_ps(xb + 16), a1[b]);                   \
            a2[b] = _mm512_fmadd_ps(c2, _mm512_loadu_ps(xb + 32), a2[b]);                   \
            a3[b] = _mm512_fmadd_ps(c3, _mm512_loadu_ps(xb + 48), a3[b]);                   \
        }                                                                                   \
    }                                                                                       \
    for (int b = 0; b < NB; b++) {                                                          \
        const float *xb = x + (int64_t)b * ldx;                                             \
        float r = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0[b], a1[b]),           \
                                                     _mm512_add_ps(a2[b], a3[b])));         \
        for (int kk = k; kk < K; kk++) r += (float)q[kk] * xb[kk];                          \
        out[b] = r * w->scale[n];                                                           \
    }                                                                                       \
}

DEFINE_Q4_ROWS(2) DEFINE_Q4_ROWS(3) DEFINE_Q4_ROWS(4)
DEFINE_I8_ROWS(2) DEFINE_I8_ROWS(3) DEFINE_I8_ROWS(4)
#endif

#if KV_AVX512
/* B >= 2 rows in blocks of 4 that share one decode of the codes (a last lone row: q4_dot /
 * i8_dot; tests/test_batch.py checks the blocks equal them bit for bit). Out of line, so
 * that row_dot, inlined into every GEMV loop, costs a lone row (one sequence) nothing. */
__attribute__((noinline)) static void row_blocks(const Weight *w, int n, int B, const float *x,
                                                 int ldx, const float *xs, int ldxs, float *out)
{
    for (int b0 = 0; b0 < B; b0 += 4) {
        const float *xb = x + (int64_t)b0 * ldx, *xsb = xs + (int64_t)b0 * ldxs;
        float *o = out + b0;
        if (w->kind == W_INT4) {
            switch (B - b0) {
            case 1: o[0] = q4_dot(w, n, xb, xsb); break;
            case 2: q4_rows2(w, n, xb, ldx, xsb, ldxs, o); break;
            case 3: q4_rows3(w, n, xb, ldx, xsb, ldxs, o); break;
            default: q4_rows4(w, n, xb, ldx, xsb, ldxs, o);
            }
        } else {
            switch (B - b0) {
            case 1: o[0] = i8_dot(w, n, xb); break;
            case 2: i8_rows2(w, n, xb, ldx, o); break;
            case 3: i8_rows3(w, n, xb, ldx, o); break;
            default: i8_rows4(w, n, xb, ldx, o);
            }
        }
    }
}
#endif

/* weight row n dotted with B input rows x[b] (row stride ldx; int4: group sums xs[b],
 * stride ldxs), plus the bias. */
static void row_dot(const Weight *w, int n, int B, const float *x, int ldx, const float *xs,
                    int ldxs, float *out)
{
#if KV_AVX512
    if (B > 1)
        row_blocks(w, n, B, x, ldx, xs, ldxs, out);
    else
#endif
    for (int b = 0; b < B; b++)
        out[b] = w->kind == W_INT4 ? q4_dot(w, n, x + (int64_t)b * ldx, xs + (int64_t)b * ldxs)
                                   : i8_dot(w, n, x + (int64_t)b * ldx);
    if (w->bias)
        for (int b = 0; b < B; b++) out[b] += w->bias[n];
}

/* -- row-wise helpers (one thread) ----------------------------------------------------- */

static void rmsnorm(const float *x, const float *wt, int n, float eps, float *out)
{
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    const float r = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * r * wt[i];
}

/* sums of x over groups of G columns (int4 weights need them; 0 groups otherwise) */
static void group_sums(const float *x, int n, int G, float *out)
{
    if (G <= 0) return;
    for (int g = 0; g < n / G; g++) {
        float a = 0.f;
        for (int j = 0; j < G; j++) a += x[g * G + j];
        out[g] = a;
    }
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

static int wgroup(const Weight *w) { return w->kind == W_INT4 ? w->G : 0; }

/* the MLP's gate activation: SiLU (SwiGLU) or the tanh approximation of GELU (GeGLU,
 * torch's gelu(approximate="tanh")) */
static float act(int kind, float g)
{
    if (kind == ACT_GELU_TANH)
        return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    return g / (1.0f + expf(-g));
}

/* a GEMV y (B, N) = x (B, K) W^T over this thread's rows: `omp for` inside a region */
#define GEMV_FOR(w, B, x, ldx, xs, ldxs, BODY)                                          \
    _Pragma("omp for schedule(static)")                                                 \
    for (int n = 0; n < (w)->N; n++) {                                                  \
        float r_[MAXB];                                                                 \
        row_dot((w), n, (B), (x), (ldx), (xs), (ldxs), r_);                             \
        for (int b = 0; b < (B); b++) { BODY; }                                         \
    }

/* x (B, hidden) -> q, k, v (roped) in L->qkv_out (B, (H + 2 Hkv) D).
 * cosb, sinb: (B, D) tables of each row's position. */
int kvrun_layer_pre(const Layer *L, int B, const float *cosb, const float *sinb)
{
    if (B < 1 || B > MAXB) return -1;
    const int C = L->hidden, D = L->D, NQKV = (L->H + 2 * L->Hkv) * D;
    const int G = wgroup(&L->qkv), ldxs = C / 32;
#pragma omp parallel num_threads(L->nthreads)
    {
#pragma omp single
        for (int b = 0; b < B; b++) {
            rmsnorm(L->x + (int64_t)b * C, L->norm1, C, L->eps, L->xn + (int64_t)b * C);
            group_sums(L->xn + (int64_t)b * C, C, G, L->xsum + (int64_t)b * ldxs);
        }
        GEMV_FOR(&L->qkv, B, L->xn, C, L->xsum, ldxs, L->qkv_out[(int64_t)b * NQKV + n] = r_[b])
#pragma omp for schedule(static)
        for (int i = 0; i < B * (L->H + L->Hkv); i++) {           /* q and k heads of every row */
            const int b = i / (L->H + L->Hkv), hd = i % (L->H + L->Hkv);
            float *head = L->qkv_out + (int64_t)b * NQKV + hd * D;
            const float *nw = hd < L->H ? L->q_norm : L->k_norm;
            if (nw) rmsnorm(head, nw, D, L->eps, head);
            rope(head, cosb + (int64_t)b * D, sinb + (int64_t)b * D, D);
            if (hd < L->H && L->q_scale != 1.0f)
                for (int d = 0; d < D; d++) head[d] *= L->q_scale;
        }
    }
    return 0;
}

/* attn (B, H D) -> x += o_proj(attn); x += down(silu(gate(n(x))) * up(n(x))) */
int kvrun_layer_post(const Layer *L, int B, const float *attn, int64_t lda)
{
    if (B < 1 || B > MAXB) return -1;
    const int C = L->hidden, I = L->inter, HD = L->H * L->D;
    const int Go = wgroup(&L->o), Gg = wgroup(&L->gate), Gd = wgroup(&L->down);
    const int ldxs = (I > C ? I : C) / 32;
#pragma omp parallel num_threads(L->nthreads)
    {
#pragma omp single
        for (int b = 0; b < B; b++)
            group_sums(attn + b * lda, HD, Go, L->xsum + (int64_t)b * ldxs);
        GEMV_FOR(&L->o, B, attn, (int)lda, L->xsum, ldxs, L->tmp[(int64_t)b * C + n] = r_[b])
#pragma omp single
        for (int b = 0; b < B; b++) {
            float *xb = L->x + (int64_t)b * C, *tb = L->tmp + (int64_t)b * C;
            if (L->attn_out_norm) rmsnorm(tb, L->attn_out_norm, C, L->eps, tb);
            for (int i = 0; i < C; i++) xb[i] += tb[i];
            rmsnorm(xb, L->norm2, C, L->eps, L->xn + (int64_t)b * C);
            group_sums(L->xn + (int64_t)b * C, C, Gg, L->xsum + (int64_t)b * ldxs);
        }
#pragma omp for schedule(static)
        for (int n = 0; n < I; n++) {                  /* gate and up row n, then SwiGLU */
            float g_[MAXB], u_[MAXB];
            row_dot(&L->gate, n, B, L->xn, C, L->xsum, ldxs, g_);
            row_dot(&L->up, n, B, L->xn, C, L->xsum, ldxs, u_);
            for (int b = 0; b < B; b++)
                L->h[(int64_t)b * I + n] = act(L->act, g_[b]) * u_[b];
        }
#pragma omp single
        for (int b = 0; b < B; b++)
            group_sums(L->h + (int64_t)b * I, I, Gd, L->xsum + (int64_t)b * ldxs);
        if (!L->mlp_out_norm) {
            GEMV_FOR(&L->down, B, L->h, I, L->xsum, ldxs, L->x[(int64_t)b * C + n] += r_[b])
        } else {
            GEMV_FOR(&L->down, B, L->h, I, L->xsum, ldxs, L->tmp[(int64_t)b * C + n] = r_[b])
#pragma omp single
            for (int b = 0; b < B; b++) {
                float *xb = L->x + (int64_t)b * C, *tb = L->tmp + (int64_t)b * C;
                rmsnorm(tb, L->mlp_out_norm, C, L->eps, tb);
                for (int i = 0; i < C; i++) xb[i] += tb[i];
            }
        }
    }
    return 0;
}

/* logits (B, V) = lm_head(RMSNorm(x)); x (B, hidden) */
int kvrun_logits(const Layer *L, int B, const float *norm, const Weight *head, float *logits)
{
    if (B < 1 || B > MAXB) return -1;
    const int C = L->hidden, G = wgroup(head), ldxs = C / 32;
#pragma omp parallel num_threads(L->nthreads)
    {
#pragma omp single
        for (int b = 0; b < B; b++) {
            rmsnorm(L->x + (int64_t)b * C, norm, C, L->eps, L->xn + (int64_t)b * C);
            group_sums(L->xn + (int64_t)b * C, C, G, L->xsum + (int64_t)b * ldxs);
        }
        GEMV_FOR(head, B, L->xn, C, L->xsum, ldxs, logits[(int64_t)b * head->N + n] = r_[b])
    }
    return 0;
}
