/* The descriptor of one codec's storage for one layer, as the attention kernels read it:
 * pointers into the preallocated tensors and their element strides (built by
 * native/decode_attention.py `describe`). decode_attention.c runs the attention;
 * codebook_attention.c holds the codebook codecs' tile reads it calls for a cb role, so
 * a layer may pair any K codec with any V codec.
 */
#ifndef KVRUN_CODEC_DESC_H
#define KVRUN_CODEC_DESC_H

#include <stdint.h>

#include "codec_layout.h"

/* kinds: fp tails, then the packed codecs (native/decode_attention.py numbers them alike) */
enum { C_FP16 = 0, C_BF16 = 1, C_FP32 = 2, C_INT8 = 3, C_KIVI = 4, C_TADA = 5, C_CB = 6 };

typedef struct {
    int32_t kind, role, bits, G, g, rank, k2, mu_int8;
    const void *x;       int64_t xs[2];     /* fp tail (Hkv, S, D): h, t           */
    const uint8_t *codes; int64_t cs[4];    /* packed codes, layout per kind/role   */
    const uint8_t *hi; int64_t hs[2];       /* KIVI 3-bit K: the third bits' 1-bit
                                               chanpack planes (Hkv, D, S/8): h, d  */
    const f16 *scale, *zero; int64_t ss[3]; /* scales / zeros                       */
    const void *mu; const f16 *mu_scale; int64_t mus;   /* TaDA means               */
    const f16 *lr_a; int64_t as[2];         /* GEAR A (Hkv, S, r): h, t             */
    const f16 *lr_b; int64_t bs[3];         /* GEAR B (Hkv, S/G, D, r): h, blk, d   */
    const uint8_t *oidx; const f16 *oval; int64_t os[3];  /* GEAR outliers          */
    float lv[16];                           /* cb: the 2^bits levels                */
} Codec;

/* codebook_attention.c: a cb K tile's logits sc[r * N + j] (j < 32) for tokens
 * [t0, t0 + 32) of head h, and p.V over cb V tokens [t0, t1) accumulated into acc (R, D) */
void cb_k_tile(const Codec *c, int h, int64_t t0, const float *q, int R, int D, float *sc, int64_t N);
void cb_v_mix(const Codec *c, int h, int64_t t0, int64_t t1, const float *p, int64_t N, int R,
              int D, float *acc);

#endif
