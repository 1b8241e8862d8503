/* The packed code layouts of the compressed tail: where token t's code of channel d sits.
 * Shared by the kernels that read them (decode_attention.c) and those that write them
 * (pack.c, the flushes): one definition, inlined into each translation unit. Integer
 * index arithmetic only, so including it changes no float result.
 *
 *   tok   (int8 / TaDA K; codecs' nibble.py): (Hkv, P, S/U, D, 32), U = 64 (128 for 2 bits);
 *         token i of a block in byte i % 32 at shift 4*((i%64)/32) + 2*(i/64); 8 bits = two
 *         nibble planes (c >> 4, c & 15).
 *   chan  (int8 / KIVI / TaDA V; nibble.py): (Hkv, P, Dp/64, rows, 32), byte j of a row =
 *         channel j (low nibble) | channel j + 32 (high); 2 bits: 32 rows per 64 tokens,
 *         token i of the block in row i % 32 at shift 2*(i/32); 8 bits = two planes.
 *   chanpack (KIVI K; chanpack.py): (Hkv, D, S/E), a block of U = 32E tokens (E = 8/bits)
 *         is 32 bytes per channel, token i of the block in byte i % 32 at bits
 *         [bits*(i/32), bits*(i/32 + 1)). 3 bits: the low two in a 2-bit buffer, the
 *         third in a 1-bit one (E = 8), code = lo + 4 hi.
 */
#ifndef KVRUN_CODEC_LAYOUT_H
#define KVRUN_CODEC_LAYOUT_H

#include <stdint.h>

typedef _Float16 f16;

enum { MAXD = 256 };          /* largest head dim (native/decode_attention.py MAX_D) */

/* tok layout: tokens per block, and token t's bit shift in its byte */
static inline int tok_unit(int bits) { return bits == 2 ? 128 : 64; }

static inline int tok_shift(int64_t t, int bits) {
    int64_t i = t % tok_unit(bits);
    return 4 * (int)((i % 64) / 32) + 2 * (int)(i / 64);
}

/* chan layout: token t's row, its bit shift in the row's bytes into *sh */
static inline int64_t chan_row(int64_t t, int bits, int *sh) {
    if (bits != 2) { *sh = 0; return t; }
    *sh = 2 * (int)((t % 64) / 32);
    return (t / 64) * 32 + t % 32;
}

/* chanpack layout: tokens per block, token t's byte in its channel's row and bit shift */
static inline int chanpack_unit(int bits) { return 32 * (8 / bits); }

static inline int64_t chanpack_byte(int64_t t, int bits) {
    return (t / chanpack_unit(bits)) * 32 + t % 32;
}

static inline int chanpack_shift(int64_t t, int bits) {
    return bits * (int)((t % chanpack_unit(bits)) / 32);
}

/* the plane width of a chanpack "codes" buffer holding `bits`-bit codes: 3-bit KIVI keys
 * keep their low two bits there and the third in a 1-bit buffer (chanpack.py planes) */
static inline int chanpack_lo_bits(int bits) { return bits == 3 ? 2 : bits; }

#endif
