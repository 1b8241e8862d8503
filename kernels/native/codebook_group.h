/* The codebook codecs' packed groups of 32 codes as the attention reads them (cbpack.py):
 * shared by the AVX-512 tile reads (codebook_attention.c) and the others
 * (codebook_portable.c), one definition inlined into each. CB_FAST: this build reads with
 * AVX-512 (with BW and BMI2, as every AVX-512 CPU kvrun targets has them). */
#ifndef KVRUN_CODEBOOK_GROUP_H
#define KVRUN_CODEBOOK_GROUP_H

#include <stdint.h>

#include "codec_desc.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__BMI2__) && !defined(KVRUN_NO_AVX512)
#define CB_FAST 1
#else
#define CB_FAST 0
#endif

enum { CT = 32, VRUN = 256 };      /* tokens per tile, codes per group; p.V tokens per run */

/* -- a packed group of 32 codes -------------------------------------------------------------- */

static inline int group_code(const uint8_t *g, int bits, int j) {
    if (bits == 4) return j < 16 ? g[j] & 15 : g[j - 16] >> 4;
    int c = (g[j & 7] >> (2 * (j >> 3))) & 3;
    if (bits == 3) c |= ((g[8 + (j >> 3)] >> (j & 7)) & 1) << 2;
    return c;
}

/* the 32 levels of a group, o[j * stride] */
static inline void group_levels(const uint8_t *g, int bits, const float *lv, float *o, int stride) {
    for (int j = 0; j < CT; j++) o[j * stride] = lv[group_code(g, bits, j)];
}

static inline void f16x32(const f16 *s, int64_t st, float *o) {
    for (int j = 0; j < CT; j++) o[j] = (float)s[j * st];
}

#endif
