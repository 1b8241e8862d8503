/* The integer q.K and p.V of the attention over KIVI codes (decode_attention.c,
 * KVRUN_ATTN=int), in kdot_int.c. KIVI stores K per channel (chanpack layout, codec_layout.h) with one fp16 scale
 * s and zero z per (channel, token group), so q . k_t = (q s) . c_t + q . z: the folded row
 * q s is quantized to int16 (ki_quantize) and dotted with the unsigned codes in int32
 * (ki_dot); the caller applies the row's scale and adds q . z in fp32. int16, not int8: one
 * scale per row of D channels, and KIVI's outlier channels (large s) set it, so int8 steps
 * moved the next-token distribution measurably (docs/measurements.md); int16 costs twice the
 * dot instructions (vpdpwssd, 2 products per lane) and nothing else. */
#ifndef KVRUN_KDOT_INT_H
#define KVRUN_KDOT_INT_H

#include <stdint.h>

enum { KI_ACC = 12 };         /* tiles x rows per ki_dot call: 24 of the 32 zmm registers */

/* The hint of the attention kernels' software prefetches of code rows a few calls ahead:
 * into L2 (T1). A decode step reads KIVI K as 64+ channel rows at once, and prefetches to
 * L1 (T0) each hold an L1 miss buffer until their line arrives, so many were dropped: q.K
 * over the tail took 55-58 us a layer with T0 against 48-50 with T1 (SmolLM2, kivi-4,
 * 2048 tokens, one thread, 2-core EPYC Zen 4, tools/attn_phases.py; int8 keys: no
 * difference beyond the noise). */
#define KV_PF_HINT _MM_HINT_T1

#define KI_QMAX 32767.f   /* |codes| of the quantized rows; 32767 * 255 * 256 < 2^31: exact int32 */

/* x (n,) fp32, n % 4 == 0 -> qi (n,) int16 = rint(x * (KI_QMAX / max|x|)) (all 0 when
 * max|x| = 0), rounding half to even, in the order ki_dot reads them (within each 4
 * channels d, d+2, d+1, d+3 on the VNNI build); returns the scale max|x| / KI_QMAX. */
float ki_quantize(const float *x, int n, int16_t *qi);

/* ki_quantize of the folded row x = q s (n,) (one fp32 product per channel), and
 * *bias = q . z in fp32: a row's both inputs of a tile's logits, s and z its channel scales
 * and zeros; n <= 256 */
float ki_fold_quantize(const float *q, const float *s, const float *z, int n, int16_t *qi,
                       float *bias);

/* out[(p * R + r) * 32 + j] = sum_{d < D} qi[(p * R + r) * D + d] * code(d, p, j) for P tiles
 * of 32 tokens that share their bytes (the planes of one chanpack block), p < P, r < R,
 * P * R <= KI_ACC, D % 4 == 0: channel d's 32 bytes are at b + d * ds and the code of token
 * j of tile p is (byte j >> (sh + bits * p)) & (2^bits - 1); bits <= 8, D <= 256. With hb
 * (3-bit keys: bits 2), each code gains 4 x its third bit, the bit (hsh + p) of byte j at
 * hb + d * hds (chanpack 1-bit planes). Exact int32 on every ISA.
 *
 * A 1-bit plane's byte holds 8 tiles, the 2-bit planes' 4, so the two calls over one 8-tile
 * block of 3-bit keys (and a call's passes over more rows) read the same third bits: with
 * hy (KI_HY_BYTES(D) bytes) and hmode KI_HY_FILL a call keeps their transposed rows there,
 * and with KI_HY_READ it takes them from there instead of transposing hb's rows again (the
 * VNNI build; the others read hb in place). hmode 0: hy unused. */
enum { KI_HY_FILL = 1, KI_HY_READ = 2 };
#define KI_HY_BYTES(D) ((D) * 32)

void ki_dot(const uint8_t *b, int64_t ds, int D, int bits, int sh, const uint8_t *hb, int64_t hds,
            int hsh, uint8_t *hy, int hmode, int P, int R, const int16_t *qi, int32_t *out);

/* ki_dot over 8-bit codes held as two nibble planes (int8 keys): code(d, p, j) = 16 hi + lo,
 * hi from bh (rows dsh apart, tile p at bit shh + 4 p), lo from bl likewise; P <= 2.
 * Exact in int32: 32767 * 255 * 256 < 2^31. AVX2 takes both planes in one pass, the others
 * as two ki_dot calls. */
void ki_dot8(const uint8_t *bh, int64_t dsh, int shh, const uint8_t *bl, int64_t dsl, int shl,
             int D, int P, int R, const int16_t *qi, int32_t *out);

/* p.V over KIVI values (per token, groups of g channels: v = c s + z): for a 32-token tile
 * sum_t p_t v_t = sum_t (p_t s_t) c_t + sum_t p_t z_t, and the weights w_t = p_t s_t of a
 * query row and channel group are quantized to int16 with one scale per tile (kv_quantize)
 * and dotted with the codes in int32 (kv_mix), two tokens per vpdpwssd lane; the caller
 * scales the sums and adds sum p z in fp32. One scale per run of up to 256 tokens keeps the
 * sums exact (32767 * 15 * 256 < 2^31) and the quantization and scaling off the tiles. */
enum { KV_ROWS = 4 };         /* rows per kv_mix call: 16 accumulators of the 32 zmm registers */

/* x (n,) fp32 -> qi (n,) int16 = rint(x * (KI_QMAX / max|x|)) in x's order, as ki_quantize
 * rounds; returns max|x| / KI_QMAX */
float kv_quantize(const float *x, int n, int16_t *qi);

enum { KV_RUN = 256 };        /* most tokens per quantized run of weights */

/* out[r * 64 + c] += sum_{j < 32} w(r, c)[j] * code(j, c) for one 32-token tile of a 64-channel
 * block of the chan layout (codec_layout.h), r < R <= KV_ROWS: token j's 32 bytes at
 * b + j * rs, the code of channel c = (byte c % 32 >> (sh + 4 (c / 32))) & (2^bits - 1),
 * bits 2 or 4; w(r, c) = wlo + r * ws for channels 0-31 (the low nibbles), whi + r * ws for
 * 32-63 (int16, token order; the same pointer when one channel group spans the block).
 * Exact int32 on every ISA. */
void kv_mix(const uint8_t *b, int64_t rs, int bits, int sh, int R, const int16_t *wlo,
            const int16_t *whi, int ws, int32_t *out);

/* kv_mix over int8 values' two nibble planes, the high one at b, the low one at b + pl: the
 * code of channel c is 16 hi + lo (bits 4, sh 0); exact over a run of KV_RUN tokens. AVX2
 * takes both planes in one pass, the others as two kv_mix calls. */
void kv_mix8(const uint8_t *b, int64_t pl, int64_t rs, int R, const int16_t *wlo,
             const int16_t *whi, int ws, int32_t *out);

#endif
