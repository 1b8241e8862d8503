/* The GEMVs of the decode layer (decode_layer.c): one weight matrix in kvrun's stored bytes
 * times B <= MAXB input rows, a block of output rows per call.
 *
 *   gemv_fp32.c  the reference: codes decoded to fp32, fp32 FMAs with the fp32 inputs
 *   gemv_quant.c the integer path's input: each input row quantized once per GEMV input to int8
 *                blocks of QB columns (gi_quantize)
 *   gemv_int.c   the integer path (KVRUN_GEMV=int): int32 dot products, block scales in fp32
 */
#ifndef KVRUN_GEMV_H
#define KVRUN_GEMV_H

#include <stdint.h>

typedef _Float16 f16;

enum { W_INT4 = 0, W_INT8 = 1 };
enum { MAXB = 32 };           /* input rows per call: each weight row is read from memory once
                                * and re-read from L1 for every row (batched decode) */
enum { GEMV_NR = 4 };         /* output rows per gf_rows / gi_rows call */
#define QB 4                  /* columns per activation block, one fp32 scale each: 4, 8 or 16
                               * (gemv_quant.c) */

/* one weight matrix (N, K) in a stored format (runtime/model/qlinear.py) */
typedef struct {
    int32_t kind, N, K, G;      /* G: int4 group (columns per scale/min), a multiple of 32 */
    const uint8_t *q;           /* int4: (N, K/2) packed; int8: (N, K) int8 */
    const f16 *s, *m;           /* int4: (N, K/G) scale, min */
    const float *scale;         /* int8: (N,) */
    const float *bias;          /* (N,) or NULL */
} Weight;

/* -- fp32 reference (gemv_fp32.c) ------------------------------------------------------ */

/* sums of x over groups of G columns, the int4 min term's input (0 groups for int8) */
void gf_group_sums(const Weight *w, const float *x, float *out);

/* out[j * ldo + b] = W[n0 + j] . x[b] (+ bias) for j < nn <= GEMV_NR, b < B; x rows of
 * stride ldx, their group sums xs of stride ldxs. A row's result does not depend on B. */
void gf_rows(const Weight *w, int n0, int nn, int B, const float *x, int ldx, const float *xs,
             int ldxs, float *out, int ldo);

/* -- integer (gemv_quant.c quantizes the inputs, gemv_int.c multiplies) ----------------- */

#include "int_dot.h"            /* GI_VNNI / GI_AVX2: the dot products compiled */

static inline int pad64(int K) { return (K + 63) / 64 * 64; }

/* One quantized input row of K columns (Kp = pad64(K); gi_row_bytes bytes), in the order
 * its weight's chunks of 64 columns decode in (gemv_quant.c): */
typedef struct {
    const int8_t *q;        /* (Kp,) int8 codes */
    const float *d;         /* (Kp/4,) the block scale of each lane of 4 codes */
    const int32_t *c;       /* (Kp/4,) -128 x each lane's code sum (the VNNI int8 dot's start) */
    const float *s;         /* (K/G,) int4: sum over each weight group of d_j sum(q)_j */
} QRow;

static inline int64_t gi_row_bytes(int K) { return 4 * (int64_t)pad64(K); }

static inline QRow qrow(const uint8_t *row, int K)
{
    const int Kp = pad64(K);
    return (QRow){(const int8_t *)row, (const float *)(row + Kp), (const int32_t *)(row + 2 * Kp),
                  (const float *)(row + 3 * Kp)};
}

/* x (K,) fp32 -> row (gi_row_bytes(w->K) bytes): x quantized for the dot products with w. */
void gi_quantize(const Weight *w, const float *x, uint8_t *row);

/* out[j * ldo + b] = W[n0 + j] . x[b] (+ bias) for j < nn <= GEMV_NR, b < B, with x[b]
 * quantized by gi_quantize at xq + b * ldq. A row's result does not depend on B. */
void gi_rows(const Weight *w, int n0, int nn, int B, const uint8_t *xq, int64_t ldq, float *out,
             int ldo);

/* which dot products this build compiled: 2 AVX512-VNNI, 1 AVX2, 0 plain C */
int kvrun_gemv_isa(void);

#endif
