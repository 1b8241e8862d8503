/* The GEMVs of the decode layer (decode_layer.c): one weight matrix in kvrun's stored bytes
 * times B <= MAXB input rows, a block of output rows per call.
 *
 *   gemv_fp32.c  the reference: codes decoded to fp32, fp32 FMAs with the fp32 inputs
 *   gemv_quant.c the integer path's operands: each input row quantized once per GEMV input to
 *                int16 blocks of 32 columns (gi_quantize); the weights repacked once at load,
 *                16 rows interleaved (kvrun_gemv_repack)
 *   gemv_int.c   the integer path (KVRUN_GEMV=int): int32 dot products of 16 weight rows at
 *                once, block scales in fp32
 */
#ifndef KVRUN_GEMV_H
#define KVRUN_GEMV_H

#include <stdint.h>

typedef _Float16 f16;

enum { W_INT4 = 0, W_INT8 = 1 };
enum { MAXB = 32 };           /* input rows per call: each weight row is read from memory once
                                * and re-read from L1 for every row (batched decode) */
enum { GEMV_NR = 16 };        /* output rows per gf_rows / gi_rows call: one repacked block
                               * of the integer path (GI_RB) */

/* one weight matrix (N, K) in a stored format (runtime/model/qlinear.py) */
typedef struct {
    int32_t kind, N, K, G;      /* G: int4 group (columns per scale/min), a multiple of 32 */
    const uint8_t *q;           /* int4: (N, K/2) packed; int8: (N, K) int8 */
    const f16 *s, *m;           /* int4: (N, K/G) scale, min */
    const float *scale;         /* int8: (N,) */
    const float *bias;          /* (N,) or NULL */
    const uint8_t *rp;          /* the integer path's repacked copy (gemv_quant.c
                                 * kvrun_gemv_repack), or NULL where only fp32 runs */
} Weight;

/* -- fp32 reference (gemv_fp32.c) ------------------------------------------------------ */

/* sums of x over groups of G columns, the int4 min term's input (0 groups for int8) */
void gf_group_sums(const Weight *w, const float *x, float *out);

/* out[j * ldo + b] = W[n0 + j] . x[b] (+ bias) for j < nn <= GEMV_NR, b < B; x rows of
 * stride ldx, their group sums xs of stride ldxs. A row's result does not depend on B. */
void gf_rows(const Weight *w, int n0, int nn, int B, const float *x, int ldx, const float *xs,
             int ldxs, float *out, int ldo);

/* -- integer (gemv_quant.c quantizes the inputs and repacks the weights, gemv_int.c
 *    multiplies) ------------------------------------------------------------------------ */

#include "int_dot.h"            /* GI_VNNI / GI_AVX2: the dot products compiled */

enum { GI_RB = 16 };          /* weight rows per repacked block: one int32 lane each */
enum { GI_KB = 32 };          /* columns per input block (one fp32 scale) and per repacked
                               * weight block */
#define GI_QMAX 32767.f       /* input codes are int16 in [-GI_QMAX, GI_QMAX] */

static inline int pad32(int K) { return (K + GI_KB - 1) / GI_KB * GI_KB; }

/* One quantized input row of K columns (Kp = pad32(K); gi_row_bytes bytes, gemv_quant.c):
 * int16 codes in column order (zero past K), one fp32 scale per block of 32 columns, and
 * for int4 weights the min term's input per weight group. */
typedef struct {
    const int16_t *q;       /* (Kp,) codes, |q| <= 32767 */
    const float *d;         /* (Kp/32,) block scales: x ~ d q */
    const float *s;         /* (K/G,) int4: sum over each weight group of d_j sum(q)_j */
} QRow;

static inline int64_t gi_row_bytes(int K) { return 2 * (int64_t)pad32(K) + 8 * (pad32(K) / GI_KB); }

static inline QRow qrow(const uint8_t *row, int K)
{
    const int Kp = pad32(K);
    return (QRow){(const int16_t *)row, (const float *)(row + 2 * Kp),
                  (const float *)(row + 2 * Kp + 4 * (Kp / GI_KB))};
}

/* x (K,) fp32 -> row (gi_row_bytes(w->K) bytes): x quantized for the dot products with w. */
void gi_quantize(const Weight *w, const float *x, uint8_t *row);

/* bytes of one repacked block of GI_RB weight rows (gemv_quant.c describes the layout) */
static inline int64_t gi_block_bytes(const Weight *w)
{
    const int64_t nk = pad32(w->K) / GI_KB;
    return w->kind == W_INT4 ? nk * 256 + (int64_t)(w->K / w->G) * 64 : 64 + nk * 512;
}

/* out[j * ldo + b] = W[n0 + j] . x[b] (+ bias) for j < nn <= GEMV_NR, b < B, with x[b]
 * quantized by gi_quantize at xq + b * ldq; n0 a multiple of GI_RB, w->rp the repacked
 * weight. A row's result does not depend on B, nor on the build (the int32 sums are exact
 * and every build rounds the same fp32 operations in the same order per row). */
void gi_rows(const Weight *w, int n0, int nn, int B, const uint8_t *xq, int64_t ldq, float *out,
             int ldo);

/* which dot products this build compiled: 2 AVX512-VNNI, 1 AVX2, 0 plain C */
int kvrun_gemv_isa(void);

#endif
