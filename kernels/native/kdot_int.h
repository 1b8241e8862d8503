/* The integer q.K of the attention over KIVI keys (decode_attention.c, KVRUN_ATTN=int), in
 * kdot_int.c. KIVI stores K per channel (chanpack layout, codec_layout.h) with one fp16 scale
 * s and zero z per (channel, token group), so q . k_t = (q s) . c_t + q . z: the folded row
 * q s is quantized to int8 (ki_quantize) and dotted with the unsigned codes in int32 (ki_dot);
 * the caller applies the row's scale and adds q . z in fp32. */
#ifndef KVRUN_KDOT_INT_H
#define KVRUN_KDOT_INT_H

#include <stdint.h>

enum { KI_ACC = 12 };         /* tiles x rows per ki_dot call: 24 of the 32 zmm registers */

/* x (n,) fp32 -> qi (n,) int8 = rint(x * (127 / max|x|)) (all 0 when max|x| = 0), rounding
 * half to even; returns the scale max|x| / 127. */
float ki_quantize(const float *x, int n, int8_t *qi);

/* out[(p * R + r) * 32 + j] = sum_{d < D} qi[(p * R + r) * D + d] * code(d, p, j) for P tiles
 * of 32 tokens that share their bytes (the planes of one chanpack block), p < P, r < R,
 * P * R <= KI_ACC, D % 4 == 0: channel d's 32 bytes are at b + d * ds and the code of token
 * j of tile p is (byte j >> (sh + bits * p)) & (2^bits - 1). Exact int32 on every ISA. */
void ki_dot(const uint8_t *b, int64_t ds, int D, int bits, int sh, int P, int R, const int8_t *qi,
            int32_t *out);

#endif
