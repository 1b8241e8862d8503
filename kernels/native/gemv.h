/* The GEMVs of the decode layer (decode_layer.c): one weight matrix in kvrun's stored bytes
 * times B <= MAXB input rows, a block of output rows per call.
 *
 *   gemv_fp32.c  the reference: codes decoded to fp32, fp32 FMAs with the fp32 inputs
 *   gemv_int.c   the default: each input row quantized once per GEMV input to int8 blocks
 *                of 32 columns (gi_quantize), int32 dot products per block, the scales
 *                applied per block in fp32
 */
#ifndef KVRUN_GEMV_H
#define KVRUN_GEMV_H

#include <stdint.h>

typedef _Float16 f16;

enum { W_INT4 = 0, W_INT8 = 1 };
enum { MAXB = 32 };           /* input rows per call: each weight row is read from memory once
                                * and re-read from L1 for every row (batched decode) */
enum { GEMV_NR = 4 };         /* output rows per gf_rows / gi_rows call */
enum { QB = 32 };             /* columns per activation block (one int8 scale each) */

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

/* -- integer (gemv_int.c) -------------------------------------------------------------- */

/* Bytes of one quantized input row of K columns (gi_quantize's layout, Kp = K rounded up to
 * 64): Kp int8 codes in the weight's decode order, Kp/4 fp32 per-lane block scales, Kp/4
 * int32 per-lane corrections (int8 weights), Kp/8 bytes of int4 group sums. */
static inline int64_t gi_row_bytes(int K) { return 4 * (int64_t)((K + 63) / 64 * 64); }

/* x (K,) fp32 -> row (gi_row_bytes(w->K) bytes): x quantized for the dot products with w. */
void gi_quantize(const Weight *w, const float *x, uint8_t *row);

/* out[j * ldo + b] = W[n0 + j] . x[b] (+ bias) for j < nn <= GEMV_NR, b < B, with x[b]
 * quantized by gi_quantize at xq + b * ldq. A row's result does not depend on B. */
void gi_rows(const Weight *w, int n0, int nn, int B, const uint8_t *xq, int64_t ldq, float *out,
             int ldo);

/* which dot products this build compiled: 2 AVX512-VNNI, 1 AVX2, 0 plain C */
int kvrun_gemv_isa(void);

#endif
