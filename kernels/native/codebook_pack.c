/* The codebook codecs' flush (kvrun.kernels.native.pack `store`): window tokens
 * quantized into a cb tail in the layouts codebook_attention.c reads (cbpack.py: K codes
 * (Hkv, S/32, D, 4 bits) per tile and channel, V codes (Hkv, S, D/32, 4 bits) per token and
 * channel group, scale (Hkv, S) fp16).
 *
 * Bit-identical to CodebookCodec.pack: sums of squares and products in float64 in channel
 * order, every other op a separate IEEE float op (the pragmas below: no contraction, no
 * reassociation although the build passes -fassociative-math), fp16 rounding to nearest
 * even. tests/kernels/test_codecs_codebook.py compares every byte.
 */
#include <math.h>
#include <stdint.h>

#include "codec_layout.h"

enum { CT = 32 };                  /* codes per packed group */

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off", "no-associative-math")

static void group_pack(const uint8_t *c, int bits, uint8_t *g) {
    if (bits == 4) {
        for (int i = 0; i < 16; i++) g[i] = (uint8_t)(c[i] | (c[i + 16] << 4));
        return;
    }
    for (int i = 0; i < 8; i++)
        g[i] = (uint8_t)((c[i] & 3) | ((c[i + 8] & 3) << 2) | ((c[i + 16] & 3) << 4) | ((c[i + 24] & 3) << 6));
    if (bits == 3)
        for (int m = 0; m < 4; m++) {
            uint8_t b = 0;
            for (int j = 0; j < 8; j++) b |= (uint8_t)(((c[8 * m + j] >> 2) & 1) << j);
            g[8 + m] = b;
        }
}

/* one token: codes c[D] and its fp16 scale (CodebookCodec.quantize) */
static f16 cb_quantize(const float *x, int D, const float *lv, const float *bd, int nb, uint8_t *c) {
    double ss = 0.0;
    for (int d = 0; d < D; d++) ss += (double)x[d] * (double)x[d];
    float rms = (float)sqrt(ss / (double)D);
    if (!(rms > 0.f)) rms = 1.f;
    double xc = 0.0;
    for (int d = 0; d < D; d++) {
        float u = x[d] / rms;
        int k = 0;
        for (int j = 0; j < nb; j++) k += u > bd[j];
        c[d] = (uint8_t)k;
        xc += (double)x[d] * (double)lv[k];
    }
    return xc > 0.0 ? (f16)(float)(ss / xc) : (f16)0.f;
}

/* x (Hkv, n, D) float32 contiguous, n and s0 multiples of 32, into tokens [s0, s0 + n) */
int kvrun_cb_pack(const float *x, int Hkv, int n, int D, int64_t s0, int role, int bits,
                  const float *lv, const float *bd, uint8_t *codes, const int64_t *cs,
                  f16 *scale, const int64_t *ss) {
    if (D > MAXD || D % CT || n % CT || s0 % CT || bits < 2 || bits > 4) return 1;
    int nb = (1 << bits) - 1;
#pragma omp parallel for schedule(static) collapse(2) if (Hkv * n >= 1024)
    for (int h = 0; h < Hkv; h++)
        for (int ti = 0; ti < n / CT; ti++) {
            uint8_t c[CT][MAXD], grp[CT];
            for (int j = 0; j < CT; j++) {
                int64_t t = (int64_t)ti * CT + j;
                scale[h * ss[0] + (s0 + t) * ss[1]] =
                    cb_quantize(x + ((int64_t)h * n + t) * D, D, lv, bd, nb, c[j]);
            }
            if (role == 0) {                                 /* K: a group per channel */
                uint8_t *tile = codes + h * cs[0] + ((s0 / CT) + ti) * cs[1];
                for (int d = 0; d < D; d++) {
                    for (int j = 0; j < CT; j++) grp[j] = c[j][d];
                    group_pack(grp, bits, tile + d * cs[2]);
                }
            } else {                                         /* V: D/32 groups per token */
                for (int j = 0; j < CT; j++) {
                    uint8_t *row = codes + h * cs[0] + (s0 + (int64_t)ti * CT + j) * cs[1];
                    for (int k = 0; k < D / CT; k++) group_pack(c[j] + k * CT, bits, row + k * cs[2]);
                }
            }
        }
    return 0;
}

#pragma GCC pop_options
