/* Which integer dot products this build compiles, one decision for every kernel that has an
 * integer path (the GEMVs, gemv_int.c; the attention's q.K, kdot_int.c): AVX512-VNNI
 * (vpdpbusd: unsigned x signed bytes, 4 products per int32 lane; vpdpwssd: int16 pairs),
 * else AVX2 (vpmaddubsw + vpmaddwd; vpmaddwd), else plain C. The int32 sums are exact, so every path gives the same integers;
 * KVRUN_NATIVE=portable (-DKVRUN_NO_AVX512) builds the others on an AVX-512 machine. */
#ifndef KVRUN_INT_DOT_H
#define KVRUN_INT_DOT_H

#if !defined(KVRUN_NO_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define GI_VNNI 1
#elif !defined(KVRUN_NO_AVX2) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define GI_AVX2 1
#endif

#endif
