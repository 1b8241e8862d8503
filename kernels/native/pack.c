/* The flushes (kvrun.kernels.native.pack): window tokens quantized into the compressed
 * tail of the int8, KIVI and TaDA codecs, native CPU implementation. One call per K or V
 * flush writes codes, scales / zeros (TaDA: and means) into the codec's preallocated
 * tensors in the layouts of codec_layout.h, which decode_attention.c reads in place.
 *
 * Bit-identical to the codecs' torch pack (KiviCodec / Int8Codec / TadaCodec.pack,
 * quant_inline.h's asym_params, quant.sym_int8_params): every float op is a separate IEEE op as in
 * torch (no contraction: zero + scale*qmax is a rounded product then a rounded sum, and
 * no reassociation although the build passes -fassociative-math), fp16 conversions round
 * to nearest even, codes round half to even (rintf). tests/kernels/test_native_pack.py
 * compares every byte.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "codec_layout.h"
#include "quant_inline.h"

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off", "no-associative-math")

/* -- quantization helpers ---------------------------------------------------------------- */

/* as quant.sym_int8_params / quantize_sym_int8: scale fp16(max(amax / 127, 2^-24)), code
 * clamp(rint(x / scale), -127, 127) + 128 */
static inline f16 sym8_scale(float amax) {
    float sv = amax / 127.0f;
    if (!(sv >= 0x1p-24f)) sv = 0x1p-24f;
    return (f16)sv;
}

static inline uint8_t sym8(float x, float sf) {
    float q = rintf(x / sf);
    q = q < -127.f ? -127.f : (q > 127.f ? 127.f : q);
    return (uint8_t)((int)q + 128);
}

/* -- one token's codes into a layout ------------------------------------------------------ */

/* one token's codes c[0, 64 * ncb) (0 past D) into the channel-major nibble layout
 * (Hkv, P, Dp/64, rows, 32): byte j of a row = channel j | channel j + 32 << 4; 8 bits = two
 * planes (hi, lo nibbles); 2 bits = 32 rows per 64 tokens, the second 32 two bits up. */
static void write_chan(uint8_t *codes, const int64_t *cs, int h, int64_t tok, const uint8_t *c,
                       int bits, int ncb) {
    for (int cb = 0; cb < ncb; cb++) {
        const uint8_t *cc = c + cb * 64;
        if (bits == 2) {
            int sh;
            int64_t row = chan_row(tok, bits, &sh);
            uint8_t *b = codes + h * cs[0] + cb * cs[2] + row * cs[3];
            uint8_t keep = (uint8_t)~(0x33 << sh);
            for (int j = 0; j < 32; j++)
                b[j] = (uint8_t)((b[j] & keep) | ((cc[j] | (cc[j + 32] << 4)) << sh));
        } else if (bits == 4) {
            uint8_t *b = codes + h * cs[0] + cb * cs[2] + tok * cs[3];
            for (int j = 0; j < 32; j++) b[j] = (uint8_t)(cc[j] | (cc[j + 32] << 4));
        } else {
            uint8_t *b = codes + h * cs[0] + cb * cs[2] + tok * cs[3];
            for (int j = 0; j < 32; j++) {
                b[j] = (uint8_t)((cc[j] >> 4) | ((cc[j + 32] >> 4) << 4));
                b[cs[1] + j] = (uint8_t)((cc[j] & 15) | ((cc[j + 32] & 15) << 4));
            }
        }
    }
}

/* one token's codes c[0, D) into the token-major nibble layout (Hkv, P, S/U, D, 32),
 * U = 64 (128 for 2 bits): token i of a block in byte i % 32 at shift 4*((i%64)/32) +
 * 2*(i/64); 8 bits = two planes (c >> 4, c & 15). Read-modify-write of the token's bits. */
static void write_tok(uint8_t *codes, const int64_t *cs, int h, int64_t tok, const uint8_t *c,
                      int bits, int D) {
    int sh = tok_shift(tok, bits);
    int m = bits == 2 ? 3 : 15;
    uint8_t keep = (uint8_t)~(m << sh);
    uint8_t *b = codes + h * cs[0] + (tok / tok_unit(bits)) * cs[2] + tok % 32;
    for (int d = 0; d < D; d++) {
        uint8_t *p0 = b + d * cs[3];
        if (bits == 8) {
            uint8_t *p1 = p0 + cs[1];
            *p0 = (uint8_t)((*p0 & keep) | ((c[d] >> 4) << sh));
            *p1 = (uint8_t)((*p1 & keep) | ((c[d] & 15) << sh));
        } else {
            *p0 = (uint8_t)((*p0 & keep) | (c[d] << sh));
        }
    }
}

/* -- the flushes (exported; signatures as native/pack.py calls them) --------------------- */

/* K: x (Hkv, n, D) fp32 contiguous for tokens [s0, s0+n), per (head, group of G tokens,
 * channel) params into scale/zero (Hkv, S/G, D) (strides ss), codes into the chanpack
 * layout (Hkv, D, M) (strides cs0, cs1); 3 bits: the low two there and the third into
 * the 1-bit chanpack planes `third` (strides hs0, hs1). */
int kvrun_kivi_pack_k(const float *x, int Hkv, int n, int D, int64_t s0, int G, int bits,
                      uint8_t *codes, int64_t cs0, int64_t cs1, uint8_t *third, int64_t hs0,
                      int64_t hs1, f16 *scale, f16 *zero, int64_t ss0, int64_t ss1) {
    if (bits == 3 && !third) return 1;
    if (n % G || s0 % 32 || G % 32) return 1;
    const int qmax = (1 << bits) - 1, lb = chanpack_lo_bits(bits), lm = (1 << lb) - 1;
    for (int h = 0; h < Hkv; h++)
        for (int g0 = 0; g0 < n; g0 += G) {
            int64_t grp = (s0 + g0) / G;
            for (int d = 0; d < D; d++) {
                const float *xs = x + ((int64_t)h * n + g0) * D + d;
                float lo = xs[0], hi = xs[0];
                for (int t = 1; t < G; t++) {
                    float v = xs[(int64_t)t * D];
                    lo = v < lo ? v : lo;
                    hi = v > hi ? v : hi;
                }
                f16 s, z;
                asym_params(lo, hi, qmax, &s, &z);
                scale[h * ss0 + grp * ss1 + d] = s;
                zero[h * ss0 + grp * ss1 + d] = z;
                float zf = (float)z, sf = (float)s;
                uint8_t *row = codes + h * cs0 + d * cs1;
                for (int t = 0; t < G; t++) {
                    int64_t tok = s0 + g0 + t;
                    int sh = chanpack_shift(tok, lb);
                    uint8_t *p = row + chanpack_byte(tok, lb);
                    uint8_t c = quant1(xs[(int64_t)t * D], zf, sf, qmax);
                    *p = (uint8_t)((*p & ~(lm << sh)) | ((c & lm) << sh));
                    if (bits == 3) {
                        uint8_t *ph = third + h * hs0 + d * hs1 + chanpack_byte(tok, 1);
                        int hsh = chanpack_shift(tok, 1);
                        *ph = (uint8_t)((*ph & ~(1 << hsh)) | ((c >> 2) << hsh));
                    }
                }
            }
        }
    return 0;
}

/* V: per (head, token, group of g channels) params into scale/zero (Hkv, S, D/g), codes
 * into the channel-major nibble layout (Hkv, P, Dp/64, rows, 32) (strides cs[4]). */
int kvrun_kivi_pack_v(const float *x, int Hkv, int n, int D, int64_t s0, int g, int bits,
                      uint8_t *codes, const int64_t *cs, f16 *scale, f16 *zero,
                      int64_t ss0, int64_t ss1) {
    if (D % g || (bits == 2 && (s0 % 32 || n % 32))) return 1;
    int qmax = (1 << bits) - 1, ncb = (D + 63) / 64;
    uint8_t c[MAXD + 64];
    for (int h = 0; h < Hkv; h++)
        for (int t = 0; t < n; t++) {
            const float *xr = x + ((int64_t)h * n + t) * D;
            int64_t tok = s0 + t;
            memset(c, 0, sizeof c);
            for (int g0 = 0, gi = 0; g0 < D; g0 += g, gi++) {
                float lo = xr[g0], hi = xr[g0];
                for (int d = g0 + 1; d < g0 + g; d++) {
                    lo = xr[d] < lo ? xr[d] : lo;
                    hi = xr[d] > hi ? xr[d] : hi;
                }
                f16 s, z;
                asym_params(lo, hi, qmax, &s, &z);
                scale[h * ss0 + tok * ss1 + gi] = s;
                zero[h * ss0 + tok * ss1 + gi] = z;
                for (int d = g0; d < g0 + g; d++) c[d] = quant1(xr[d], (float)z, (float)s, qmax);
            }
            write_chan(codes, cs, h, tok, c, bits, ncb);
        }
    return 0;
}

/* int8: per (head, token) symmetric scale fp16(max(amax / 127, 2^-24)), codes
 * clamp(rint(x / s), -127, 127) + 128, as quant.sym_int8_params / quantize_sym_int8.
 * K codes go to the token-major nibble layout (Hkv, 2, S/64, D, 32) (two planes: c >> 4,
 * c & 15; token i of a 64-token block in byte i % 32 at shift 4 * (i / 32)), V codes to the
 * channel-major one (Hkv, 2, Dp/64, rows, 32). scale: (Hkv, S). */
int kvrun_int8_pack(const float *x, int Hkv, int n, int D, int64_t s0, int role_v,
                    uint8_t *codes, const int64_t *cs, f16 *scale, int64_t ss0, int64_t ss1) {
    int ncb = (D + 63) / 64;
    uint8_t c[MAXD + 64];
    for (int h = 0; h < Hkv; h++)
        for (int t = 0; t < n; t++) {
            const float *xr = x + ((int64_t)h * n + t) * D;
            int64_t tok = s0 + t;
            float amax = 0.f;
            for (int d = 0; d < D; d++) {
                float a = fabsf(xr[d]);
                amax = a > amax ? a : amax;
            }
            f16 s = sym8_scale(amax);
            scale[h * ss0 + tok * ss1] = s;
            memset(c, 0, sizeof c);                          /* V padding channels: 0 */
            for (int d = 0; d < D; d++) c[d] = sym8(xr[d], (float)s);
            if (role_v) write_chan(codes, cs, h, tok, c, 8, ncb);
            else write_tok(codes, cs, h, tok, c, 8, D);
        }
    return 0;
}

/* TaDA: mu_t = (sum_h x_h in head order) / Hkv, stored fp16, or symmetric int8 with an fp16
 * scale per token in quant.pack_codes' words ((S/4, D) int32: per block of G tokens, word
 * row j holds tokens j + i*G/4 at bits 8i, the top plane stored as c ^ 128); deviations
 * d = mu_hat - x per (head, token), asymmetric over D, codes into the tok (K) or chan (V)
 * layout. As TadaCodec.pack (x.mean(0) is a head-ordered sum then a division). */
int kvrun_tada_pack(const float *x, int Hkv, int n, int D, int64_t s0, int G, int bits, int role_v,
                    uint8_t *codes, const int64_t *cs, f16 *scale, f16 *zero, int64_t ss0,
                    int64_t ss1, void *mu, int64_t mus, f16 *mu_scale, int mu_int8) {
    if (n % G || s0 % G || (mu_int8 && G % 4)) return 1;
    int qmax = (1 << bits) - 1, ncb = (D + 63) / 64, J = G / 4;
    uint8_t c[MAXD + 64];
    float muh[MAXD];
    for (int t = 0; t < n; t++) {
        int64_t tok = s0 + t;
        for (int d = 0; d < D; d++) {
            float sm = 0.f;
            for (int h = 0; h < Hkv; h++) sm += x[((int64_t)h * n + t) * D + d];
            muh[d] = sm / (float)Hkv;
        }
        if (!mu_int8) {
            f16 *m = (f16 *)mu + tok * mus;
            for (int d = 0; d < D; d++) { m[d] = (f16)muh[d]; muh[d] = (float)m[d]; }
        } else {
            float amax = 0.f;
            for (int d = 0; d < D; d++) { float a = fabsf(muh[d]); amax = a > amax ? a : amax; }
            f16 ms = sym8_scale(amax);
            mu_scale[tok] = ms;
            int64_t w = tok % G;
            int pl = (int)(w / J);
            uint32_t *row = (uint32_t *)mu + ((tok / G) * J + w % J) * mus;
            for (int d = 0; d < D; d++) {
                uint8_t cm = sym8(muh[d], (float)ms);
                uint32_t f = pl == 3 ? (uint32_t)(cm ^ 128u) : cm;
                row[d] = (row[d] & ~(255u << (8 * pl))) | (f << (8 * pl));
                muh[d] = ((float)cm - 128.f) * (float)ms;
            }
        }
        for (int h = 0; h < Hkv; h++) {
            const float *xr = x + ((int64_t)h * n + t) * D;
            float dv[MAXD] = {0};
            for (int d = 0; d < D; d++) dv[d] = muh[d] - xr[d];
            float lo = dv[0], hi = dv[0];
            for (int d = 1; d < D; d++) { lo = dv[d] < lo ? dv[d] : lo; hi = dv[d] > hi ? dv[d] : hi; }
            f16 s, z;
            asym_params(lo, hi, qmax, &s, &z);
            scale[h * ss0 + tok * ss1] = s;
            zero[h * ss0 + tok * ss1] = z;
            memset(c, 0, sizeof c);
            for (int d = 0; d < D; d++) c[d] = quant1(dv[d], (float)z, (float)s, qmax);
            if (role_v) write_chan(codes, cs, h, tok, c, bits, ncb);
            else write_tok(codes, cs, h, tok, c, bits, D);
        }
    }
    return 0;
}
#pragma GCC pop_options
