/* gemv_quant: the integer GEMV's operands (gemv.h, gemv_int.c).
 *
 * Input (gi_quantize): one GEMV input row x (K,) quantized once, before the GEMV, for every
 * weight row that reads it (q/k/v share one input, gate and up share one). Per block j of
 * GI_KB = 32 columns: d_j = max|x| / 32767 and q = rint(x * (32767 / max|x|)) in
 * [-32767, 32767] (ties to even); a block whose max|x| is below TINY gets d_j = 0 and zero
 * codes; columns past K (K padded to a multiple of 32) are zero codes. For int4 weights the
 * sums d_j sum(q)_j are added up per weight group g into xs_g, the input of the min term
 * m_g xs_g. int16 codes: the rounding error is 2^-16 of the block's max, where int8 codes
 * needed blocks of 4 columns to keep the output's KL divergence small.
 *
 * Weights (kvrun_gemv_repack, once at load): the stored matrix (N, K) rewritten as one
 * ascending stream of blocks of GI_RB = 16 rows (N padded with zero rows), each block the
 * K columns in blocks of 32 (K padded with zero columns), so that one 512-bit register holds
 * per int32 lane r (weight row r of the 16) two adjacent columns as int16:
 *   int4  per 32-column block: if a weight group starts there, the 16 rows' fp16 scales
 *         s_g (32 bytes) then fp16 mins m_g (32 bytes); then 256 code bytes, 8 chunks of
 *         32: byte 32 t + 2 r + e of the block = c[r][2 t + e] | c[r][16 + 2 t + e] << 4.
 *         A chunk zero-extended to 32 int16 (vpmovzxbw) and masked with 15 is the register
 *         of columns (2t, 2t + 1); shifted right by 4, that of columns (16 + 2t, 17 + 2t).
 *   int8  the 16 rows' fp32 scales (64 bytes), then per 32-column block 512 bytes, 16
 *         chunks of 32: byte 32 p + 2 r + e = w[r][2 p + e]; vpmovsxbw gives the register
 *         of columns (2p, 2p + 1).
 * Block bytes: gemv.h gi_block_bytes (int4 5 bits a weight as stored, int8 8 bits + 4 bytes
 * a row). Plain C: it runs once per weight at load.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "gemv.h"

/* blocks whose max |x| is below this quantize to zeros: 32767 / max|x| would overflow */
#define TINY 1e-30f

void gi_quantize(const Weight *w, const float *x, uint8_t *row)
{
    const int K = w->K, Kp = pad32(K), nk = Kp / GI_KB;
    int16_t *q = (int16_t *)row;
    float *d = (float *)(row + 2 * Kp), *xs = d + nk;
    float bsum[nk];                     /* d_j sum(q)_j per block */
    for (int j = 0; j < nk; j++) {
        const int k0 = j * GI_KB, n = K - k0 < GI_KB ? K - k0 : GI_KB;
        uint32_t m = 0;         /* max |x| as the largest bit pattern of |x|: an integer max
                                 * the compiler vectorizes, where fmaxf's NaN rules stop it */
        for (int k = k0; k < k0 + n; k++) {
            uint32_t u;
            memcpy(&u, x + k, 4);
            u &= 0x7fffffffu;
            m = u > m ? u : m;
        }
        float amax;
        memcpy(&amax, &m, 4);
        const int live = amax >= TINY;
        const float id = live ? GI_QMAX / amax : 0.f;
        int32_t sum = 0;
        for (int k = k0; k < k0 + n; k++) {
            const int v = (int)rintf(x[k] * id);
            q[k] = (int16_t)v;
            sum += v;
        }
        for (int k = k0 + n; k < k0 + GI_KB; k++) q[k] = 0;
        d[j] = live ? amax / GI_QMAX : 0.f;
        bsum[j] = d[j] * (float)sum;
    }
    if (w->kind == W_INT4) {
        const int per = w->G / GI_KB;
        for (int g = 0; g < K / w->G; g++) {
            float a = 0.f;
            for (int j = g * per; j < (g + 1) * per; j++) a += bsum[j];
            xs[g] = a;
        }
    }
}

/* int4 codes of row n, columns k0 .. k0 + 31 (one group's, G a multiple of 32) in the stored
 * layout: per group byte j holds column j (low nibble) and column j + G/2 (high) */
static void q4_span(const Weight *w, int n, int k0, uint8_t *c)
{
    const int G = w->G, h = G / 2, o = k0 % G;
    const uint8_t *q = w->q + (int64_t)n * (w->K / 2) + (k0 / G) * h;
    if (G == GI_KB) {                          /* 16 bytes: low nibbles, then high */
        for (int j = 0; j < GI_KB / 2; j++) {
            c[j] = q[j] & 15;
            c[GI_KB / 2 + j] = q[j] >> 4;
        }
    } else if (o + GI_KB <= h) {               /* wholly in the group's low half */
        for (int j = 0; j < GI_KB; j++) c[j] = q[o + j] & 15;
    } else if (o >= h) {                       /* wholly in its high half */
        for (int j = 0; j < GI_KB; j++) c[j] = q[o - h + j] >> 4;
    } else {                                   /* across the halves (G an odd multiple of 32) */
        for (int j = 0; j < GI_KB; j++) c[j] = o + j < h ? q[o + j] & 15 : q[o + j - h] >> 4;
    }
}

int64_t kvrun_gemv_repack_bytes(const Weight *w)
{
    return (int64_t)((w->N + GI_RB - 1) / GI_RB) * gi_block_bytes(w);
}

/* the layout above into dst (kvrun_gemv_repack_bytes(w) bytes) */
void kvrun_gemv_repack(const Weight *w, uint8_t *dst)
{
    const int N = w->N, K = w->K, nk = pad32(K) / GI_KB, nblk = (N + GI_RB - 1) / GI_RB;
    const int64_t bb = gi_block_bytes(w);
#pragma omp parallel for schedule(static)
    for (int nb = 0; nb < nblk; nb++) {
        uint8_t *o = dst + nb * bb;
        const int n0 = nb * GI_RB, nr = N - n0 < GI_RB ? N - n0 : GI_RB;   /* live rows */
        if (w->kind == W_INT8) {
            float sc[GI_RB] = {0};
            for (int r = 0; r < nr; r++) sc[r] = w->scale[n0 + r];
            memcpy(o, sc, sizeof sc);
            o += sizeof sc;
        }
        for (int kb = 0; kb < nk; kb++) {
            const int k0 = kb * GI_KB;
            if (w->kind == W_INT4) {
                if (k0 % w->G == 0) {
                    const int g = k0 / w->G, ng = K / w->G;
                    f16 s[GI_RB], m[GI_RB];
                    for (int r = 0; r < GI_RB; r++) {
                        s[r] = r < nr ? w->s[(int64_t)(n0 + r) * ng + g] : (f16)0;
                        m[r] = r < nr ? w->m[(int64_t)(n0 + r) * ng + g] : (f16)0;
                    }
                    memcpy(o, s, sizeof s);
                    memcpy(o + sizeof s, m, sizeof m);
                    o += sizeof s + sizeof m;
                }
                for (int r = 0; r < GI_RB; r++) {
                    uint8_t c[GI_KB] = {0};
                    if (r < nr) q4_span(w, n0 + r, k0, c);
                    for (int t = 0; t < 8; t++)
                        for (int e = 0; e < 2; e++)
                            o[32 * t + 2 * r + e] = (uint8_t)(c[2 * t + e] | c[16 + 2 * t + e] << 4);
                }
                o += 256;
            } else {
                const int nc = K - k0 < GI_KB ? K - k0 : GI_KB;      /* live columns */
                for (int r = 0; r < GI_RB; r++) {
                    uint8_t c[GI_KB] = {0};
                    if (r < nr) memcpy(c, w->q + (int64_t)(n0 + r) * K + k0, nc);
                    for (int p = 0; p < 16; p++) {
                        o[32 * p + 2 * r] = c[2 * p];
                        o[32 * p + 2 * r + 1] = c[2 * p + 1];
                    }
                }
                o += 512;
            }
        }
    }
}
