/* The argument structs Python fills through ctypes, in one place: kernels/native/structs.py
 * mirrors each of them field for field, and the build compiles a table of their sizes and
 * offsets generated from that mirror (structs.py `layout_source`), which `load()` compares
 * with ctypes' before the first call — a field added on one side only is a load error, not
 * a silent misread. */
#ifndef KVRUN_ARGS_H
#define KVRUN_ARGS_H

#include <stdint.h>

#include "codec_desc.h"     /* Codec (and f16) */
#include "gemv.h"           /* Weight */

/* -- decode_attention.c: one layer's attention over [tail, window, new tokens] ----------- */
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
    float softcap;             /* > 0: logits soft-capped to cap tanh(s / cap) (Gemma 2); 0: off */
} Args;

/* -- ring_attention.c: one decode token of a sliding-window ring ------------------------- */

/* One role's (K or V) ring storage, all sliding layers: codes (L, Hkv, W, D*bits/8) uint8,
 * scale and min (L, Hkv, W, D/group) fp16 — or, for a 16-bit ring, rows (L, Hkv, W, D) of the
 * ring dtype in `codes` (no scale / min). Strides layer, head, slot: cs in bytes, ss in
 * elements. */
typedef struct {
    uint8_t *codes; f16 *scale, *min;
    int64_t cs[3], ss[3];
} RingStore;

typedef struct {
    int32_t Hkv, Gq, D, n, slot, layer, bits, group, qdtype, kdtype, vdtype, rdtype, nthreads;
    const void *q; int64_t qs;         /* (H, D) queries in qdtype (model space), head stride */
    const void *kn, *vn; int64_t kns, vns;   /* (Hkv, D) new rows (model space), head stride   */
    RingStore k, v;
    const float *rk, *rv;              /* (D,) signs of R_k (q and k are rotated by it) and of
                                        * R_v (v rotated, the output un-rotated), or NULL:
                                        * R = diag(s) blockdiag(H_n)/sqrt(n), by its butterfly */
    float *out;                        /* (H, D) fp32, H = Hkv * Gq (head = kv * Gq + g)     */
    float *qp;                         /* scratch (H, D): q R / sqrt(D), in the working order */
    float *kx, *vx;                    /* scratch (Hkv, D): the new rows, working order      */
    float *sc;                         /* scratch (H, n): logits, then probabilities         */
    float *part;                       /* scratch (RING_SPLITS, H, D): partial outputs       */
    float softcap;                     /* > 0: logits soft-capped to cap tanh(s / cap); 0: off */
} RingArgs;

/* -- decode_layer.c: Qwen3-MoE's sparse MLP of one layer (Layer.moe; moe_mlp) ---------- */
typedef struct {
    int32_t E, top_k, inter;         /* experts, each row's chosen count, an expert's width */
    int32_t norm_topk;               /* 1: the chosen probabilities renormalized to sum 1 */
    const float *router;             /* (E, hidden) fp32 */
    const Weight *gate, *up, *down;  /* (E,) each: expert e's (inter, hidden) / (hidden, inter) */
    float *probs;                    /* scratch (MAXB, E): router logits, then probabilities */
    int32_t *chosen;                 /* out (MAXB, top_k): each row's experts, most probable first */
    float *weight;                   /* out (MAXB, top_k): their weights */
    float *xg, *hg, *yg, *acc;       /* scratch (MAXB, hidden), (MAXB, inter), (MAXB, hidden),
                                      * (MAXB, hidden): one expert's gathered rows, its SwiGLU
                                      * and down outputs, each row's weighted sum */
} Moe;

/* -- decode_layer.c: a decoder layer's dense part, and the whole one-call step ----------- */
typedef struct {
    int32_t hidden, H, Hkv, D, inter, nthreads;
    float eps;
    const float *norm1, *norm2;     /* (hidden,) RMSNorm weights; NULL: none (OLMo 2) */
    Weight qkv, o, gate, up, down;
    /* scratch, (MAXB, ...) float32 each */
    float *x;                        /* residual stream (B, hidden), in and out */
    float *xn;                       /* normed input (B, max(hidden, inter)) */
    float *xsum;                     /* fp32 path: group sums of a GEMV input
                                      * (B, max(hidden, inter, H D) / 32) */
    float *qkv_out;                  /* (B, (H + 2 Hkv) D): q, k, v of each row */
    float *tmp;                      /* (B, hidden) o_proj output */
    float *h;                        /* (B, inter) SwiGLU output */
    /* Gemma 3 (NULL / 0 / 1 for Llama) */
    const float *q_norm, *k_norm;    /* (D,) per-head RMSNorm weights of q and k, before RoPE */
    const float *attn_out_norm;      /* (hidden,) RMSNorm of o_proj's output before the add */
    const float *mlp_out_norm;       /* (hidden,) RMSNorm of down's output before the add */
    int32_t act;                     /* ACT_SILU or ACT_GELU_TANH, of the gate rows */
    float q_scale;                   /* q multiplied by it after RoPE */
    /* the integer GEMVs' quantized input: (MAXB, ldq) bytes, ldq >= gi_row_bytes(widest K) */
    uint8_t *xq;
    int64_t ldq;
    int32_t gemv_int;                /* 1: integer GEMVs (gemv_int.c), 0: fp32 (gemv_fp32.c) */
    int32_t qk_norm_proj;            /* OLMo 2, 1: q_norm (H D,) / k_norm (Hkv D,) over the whole
                                      * projection, not per head; norm1 / norm2 may be NULL */
    const Moe *moe;                  /* Qwen3-MoE: the sparse MLP replaces gate / up / down
                                      * (inter is then the experts' width); NULL: dense */
} Layer;

/* one row's cache: per layer its prebuilt attention arguments, and this step's lengths
 * (native/decode_step.py RowPlan) */
typedef struct {
    void *const *args;               /* (L,) decode_attention.c Args, or ring_attention.c
                                      * RingArgs where ring[l] */
    const int32_t *n_tail, *n_win;   /* (L,) arena layers' tail and window tokens before this step */
    const uint8_t *ring;             /* (L,) 1: a sliding-window ring layer; NULL: none */
    int32_t ring_slot, ring_n;       /* ring layers: the slot the new token takes, the filled
                                      * slots it attends (one ring position for all of them) */
} RowCache;

typedef struct {
    int32_t n_layers, nthreads;
    Layer *const *layers;            /* (L,) */
    const uint8_t *local;            /* (L,) 1: the layer takes cos_local / sin_local */
    const float *cos, *sin, *cos_local, *sin_local;     /* (MAXB, D) each row's tables */
    const RowCache *const *rows;     /* (B,) */
    float *attn;                     /* (MAXB, H D) the rows' attention outputs */
    float *qs, *sc, *part;           /* attention scratch (step_io.h), one block per row: */
    int64_t qs_row, sc_row, part_row;   /* floats per row's block of qs, sc, part */
    const float *norm;               /* (hidden,) the final norm */
    const Weight *head;              /* lm_head */
    float *logits;                   /* (MAXB, V) */
} Step;

#endif
