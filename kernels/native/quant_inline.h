/* The asymmetric min/max quantizer every writer of codes shares (kvrun.kernels.quant
 * asym_params / quantize_asym): the KIVI and TaDA flushes (pack.c) and the quantized ring's
 * slot write (ring_attention.c). Bit-identical to torch: every float op is a separate IEEE
 * op (no contraction: zero + scale*qmax is a rounded product then a rounded sum; no
 * reassociation although the build passes -fassociative-math), fp16 conversions round to
 * nearest even, codes round half to even (rintf). The including file's functions that call
 * these must be compiled under the same options (the pragmas below, pushed around them). */
#ifndef KVRUN_QUANT_INLINE_H
#define KVRUN_QUANT_INLINE_H

#include <math.h>
#include <stdint.h>

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off", "no-associative-math")

/* quant.asym_params: zero fp16(lo), scale fp16(max((hi - zero) / qmax, 1e-6)) nudged up
 * one fp16 ulp when zero + scale * qmax < hi */
static inline void asym_params(float lo, float hi, int qmax, _Float16 *scale, _Float16 *zero) {
    _Float16 z = (_Float16)lo;
    float zf = (float)z;
    float sv = (hi - zf) / (float)qmax;
    if (!(sv >= 1e-6f)) sv = 1e-6f;
    _Float16 s = (_Float16)sv;
    volatile float prod = (float)s * (float)qmax;   /* rounded product, then the sum */
    if (zf + prod < hi) {                            /* nudge up one fp16 ulp */
        union { _Float16 h; uint16_t u; } b = { s };
        if ((float)s < 65504.f) b.u += 1;
        s = b.h;
    }
    *scale = s; *zero = z;
}

/* quant.quantize_asym: clamp(rint((x - zero) / scale), 0, qmax); NaN -> 0 (torch's uint8
 * cast of a NaN on x86) */
static inline uint8_t quant1(float x, float zf, float sf, int qmax) {
    float c = rintf((x - zf) / sf);
    if (c != c) return 0;
    c = c < 0.f ? 0.f : (c > (float)qmax ? (float)qmax : c);
    return (uint8_t)c;
}

#pragma GCC pop_options

#endif
