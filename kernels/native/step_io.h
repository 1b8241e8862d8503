/* step_io.h: what the one-call decode step (decode_layer.c kvrun_decode_step) hands a
 * layer's attention for one row (an arena layer's or a sliding ring's, ring_attention.c
 * kvrun_ring_attention_rows), and how an arena attention kernel takes it.
 *
 * An arena layer's attention arguments (decode_attention.c Args) are built once per cache
 * and layer by native/decode_step.py, as
 * native/decode_attention.py's FusedStep builds them: window pointers and strides, the
 * rotations, the tail descriptors, Gq / R / Tq = Tn = 1, fp32 q and new rows. A step moves
 * only the fields below; STEP_BIND sets them the way FusedStep's call does, so the kernel
 * sees the same arguments and computes the same bits. */
#ifndef KVRUN_STEP_IO_H
#define KVRUN_STEP_IO_H
#include <stdint.h>

typedef struct {
    int32_t n_tail, W, nthreads;     /* tail tokens, window tokens before this one, threads */
    const float *q;                  /* the row's roped q (H, D), fp32 */
    const float *k, *v;              /* its new K (roped) and V rows (Hkv, D), fp32 */
    float *out;                      /* (H, D) attention output */
    float *qs, *sc, *part;           /* scratch: (H, D), (H, N), (H, splits, D) floats */
    int32_t slot, n;                 /* a ring layer (ring_attention.c; n_tail, W unused): the
                                      * slot the new rows take, the filled slots attended */
} StepIO;

/* the window dtype's bytes per element (rows_inline.h's ROW_* kinds) */
#define STEP_WBYTES(kind) ((kind) == ROW_FP32 ? 4 : 2)

/* a prebuilt Args `a` bound to one step of one row: the new rows go to window
 * slot W (kdst / vdst) and are attended from there */
#define STEP_BIND(a, io) do {                                                           \
        (a)->n_tail = (io)->n_tail; (a)->W = (io)->W; (a)->nthreads = (io)->nthreads;   \
        (a)->qin = (io)->q; (a)->kn = (io)->k; (a)->vn = (io)->v; (a)->out = (io)->out; \
        (a)->q = (io)->qs; (a)->sc = (io)->sc; (a)->part = (io)->part;                  \
        (a)->kdst = (char *)(a)->kw + (int64_t)(io)->W * (a)->kws[1] * STEP_WBYTES((a)->wdtype); \
        (a)->vdst = (char *)(a)->vw + (int64_t)(io)->W * (a)->vws[1] * STEP_WBYTES((a)->wdtype); \
    } while (0)

#endif
