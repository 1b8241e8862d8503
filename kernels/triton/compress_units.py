"""The register-level pieces of the fused write kernels (fused_compress.py): the rows of
[window, new tokens] computed in registers (`_rows`: RoPE of new K rows, or the V
projection), and, per codec, the packing of one unit of flushed tokens into the storage
layouts the torch codecs write (chanpack.py for KIVI K, nibble.py token-major for int8 /
TaDA K and channel-major for every V, quant.pack_codes words for TaDA's int8 μ), with
torch's rounding (see fused_compress.py's docstring).
"""
import triton
import triton.language as tl

from .dequant import _word_codes
from .kivi_pack import _asym_params, _quantize


@triton.jit
def _rnd(v, XDT: tl.constexpr):
    """v rounded to the rows' dtype (0 fp32, 1 fp16, 2 bf16), back in fp32. bf16 by
    integer round-to-nearest-even on the bits (finite v): Triton's interpreter truncates
    fp32 → bf16 casts, and the explicit form rounds the same way on every backend."""
    if XDT == 1:
        v = v.to(tl.float16).to(tl.float32)
    elif XDT == 2:
        b = v.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        v = b.to(tl.float32, bitcast=True)
    return v


@triton.jit
def _rows(h, i, i_ok, d, WIN, sw_h, sw_t, w, X, sx_h, sx_t, A, B, s_a, KH, D,
          SRC: tl.constexpr, XDT: tl.constexpr, HAS_BIAS: tl.constexpr,
          BLOCK_K: tl.constexpr):
    """Rows (N, len(d)) fp32 of tokens i (N,) of [window, new] for KV head h at channels
    d, in the window dtype (0 where i_ok or d < D is false). Token i < w: the window;
    else new token j = i − w: SRC 0 RoPE of X (Hkv, T, D) with A = cos, B = sin (T, D);
    SRC 1 X (T, KH) @ A[h·D + d]ᵀ (+ B[h·D + d]), A = Wv (Hkv·D, KH); SRC 2 the rows of
    X (Hkv, T, D) as given (V from a weight-quantized projection the model ran)."""
    d_ok = d < D
    old = i < w
    y_old = tl.load(WIN + h * sw_h + i[:, None] * sw_t + d[None, :],
                    mask=(i_ok & old)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    j = tl.where(old, 0, i - w)
    m_new = (i_ok & ~old)[:, None] & d_ok[None, :]
    if SRC == 0:
        # -- RoPE, rotate-half: y = x·cos + [−x_{d+D/2} | x_{d−D/2}]·sin ------------------
        half = D // 2
        lo = (d < half)[None, :]
        dp = tl.where(d < half, d + half, d - half)
        xa = tl.load(X + h * sx_h + j[:, None] * sx_t + d[None, :], mask=m_new, other=0.0)
        xb = tl.load(X + h * sx_h + j[:, None] * sx_t + dp[None, :], mask=m_new, other=0.0)
        xb = tl.where(lo, -xb.to(tl.float32), xb.to(tl.float32))
        c = tl.load(A + j[:, None] * s_a + d[None, :], mask=m_new, other=0.0).to(tl.float32)
        s = tl.load(B + j[:, None] * s_a + d[None, :], mask=m_new, other=0.0).to(tl.float32)
        c = _rnd(c, XDT)
        s = _rnd(s, XDT)
        y = _rnd(_rnd(xa.to(tl.float32) * c, XDT) + _rnd(xb * s, XDT), XDT)
    elif SRC == 2:
        y = tl.load(X + h * sx_h + j[:, None] * sx_t + d[None, :], mask=m_new,
                    other=0.0).to(tl.float32)                    # exact: already in XDT
    else:
        # -- V projection: fp32 accumulation over the hidden dim --------------------------
        acc = tl.zeros(y_old.shape, tl.float32)
        kk = tl.arange(0, BLOCK_K)
        for k0 in range(0, KH, BLOCK_K):
            k_ok = (k0 + kk) < KH
            xk = tl.load(X + j[:, None] * sx_t + (k0 + kk)[None, :],
                         mask=(i_ok & ~old)[:, None] & k_ok[None, :], other=0.0)
            wk = tl.load(A + (h * D + d)[:, None] * s_a + (k0 + kk)[None, :],
                         mask=d_ok[:, None] & k_ok[None, :], other=0.0).to(xk.dtype)
            if XDT == 0:
                acc += tl.dot(xk, tl.trans(wk), input_precision="ieee")
            else:
                acc += tl.dot(xk, tl.trans(wk))
        if HAS_BIAS:
            acc += _rnd(tl.load(B + h * D + d, mask=d_ok, other=0.0).to(tl.float32), XDT)[None, :]
        y = _rnd(acc, XDT)
    if WIN.dtype.element_ty == tl.bfloat16:
        y = _rnd(y, 2)
    y = y.to(WIN.dtype.element_ty).to(tl.float32)
    return tl.where(old[:, None], y_old, tl.where(m_new, y, 0.0))


@triton.jit
def _rhe(v):
    """Round half to even (exact for |v| < 2^22), like torch.round."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def _sym8(x, scale):
    """quant.quantize_sym_int8: codes + 128, int32. scale fp16 (broadcastable)."""
    r = _rhe(tl.math.div_rn(x, scale.to(tl.float32)))
    return (tl.minimum(tl.maximum(r, -127.0), 127.0) + 128.0).to(tl.int32)


@triton.jit
def _sym8_scale(amax):
    """quant.sym_int8_params from |x|max: fp16 (amax / 127).clamp_min(2^-24)."""
    return tl.maximum(tl.math.div_rn(amax, 127.0), 5.9604644775390625e-08).to(tl.float16)


@triton.jit
def _mu_hat(MU, MUS, t, d, d_ok, G, D, MU8: tl.constexpr):
    """TaDA's stored μ̂ (N, BD) fp32 of tail tokens t (N,), as the codec reconstructs it."""
    msk = d_ok[None, :] & (t >= 0)[:, None]
    if MU8:
        cm = _word_codes(MU, t[:, None], d[None, :], msk, G, D, 8)
        ms = tl.load(MUS + t).to(tl.float32)
        return (cm - 128).to(tl.float32) * ms[:, None]
    return tl.load(MU + t[:, None] * D + d[None, :], mask=msk, other=0.0).to(tl.float32)


@triton.jit
def _tada_mu(t0, n_tail, h_all, d, d_ok, MU, MUS, D,
             WIN, sw_h, sw_t, w, X, sx_h, sx_t, A, B, s_a, KH,
             G: tl.constexpr, MU8: tl.constexpr, SRC: tl.constexpr, XDT: tl.constexpr,
             HAS_BIAS: tl.constexpr, BLOCK_K: tl.constexpr):
    """μ of the G-token group at tail token t0 (sum over heads in order, / Hkv), stored."""
    t = t0 + tl.arange(0, G)
    i = t - n_tail
    ok = i >= 0
    sm = tl.zeros((G, d.shape[0]), tl.float32)
    for h in range(h_all):
        sm += _rows(h, i, ok, d, WIN, sw_h, sw_t, w, X, sx_h, sx_t, A, B, s_a, KH, D,
                    SRC, XDT, HAS_BIAS, BLOCK_K)
    mu = tl.math.div_rn(sm, h_all * 1.0)
    if MU8:
        ms = _sym8_scale(tl.max(tl.abs(mu), 1))                          # (G,)
        tl.store(MUS + t, ms)
        cm = _sym8(mu, ms[:, None])                                       # (G, BD)
        # -- quant.pack_codes: word row j holds tokens j + i·G/4 at bits 8i, top plane ^ 128
        c4 = tl.reshape(cm, (4, G // 4, d.shape[0]))
        pl = tl.arange(0, 4)[:, None, None]
        c4 = tl.where(pl == 3, c4 ^ 128, c4) << (8 * pl)
        words = tl.reduce(c4, 0, _bit_or)                                 # (G/4, BD)
        r = t0 // 4 + tl.arange(0, G // 4)
        tl.store(MU + r[:, None] * D + d[None, :], words, mask=d_ok[None, :])
    else:
        tl.store(MU + t[:, None] * D + d[None, :], mu.to(tl.float16), mask=d_ok[None, :])


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _tok_run_codes(x, t, h, d, d_ok, SC, ZP, sc_h, MU, MUS, G, D,
                   KIND: tl.constexpr, BITS: tl.constexpr, MU8: tl.constexpr):
    """Codes (32, BD) int32 of one run of tokens t (32,) of head h with per-(token, head)
    parameters over D (int8: symmetric scale; TaDA: deviations from μ̂), params stored."""
    if KIND == 1:
        scale = _sym8_scale(tl.max(tl.abs(x), 1))
        tl.store(SC + h * sc_h + t, scale)
        return _sym8(x, scale[:, None])
    else:
        QMAX: tl.constexpr = (1 << BITS) - 1
        dv = _mu_hat(MU, MUS, t, d, d_ok, G, D, MU8) - x
        lo = tl.min(tl.where(d_ok[None, :], dv, float("inf")), 1)
        hi = tl.max(tl.where(d_ok[None, :], dv, float("-inf")), 1)
        scale, zero = _asym_params(lo, hi, QMAX)
        tl.store(SC + h * sc_h + t, scale)
        tl.store(ZP + h * sc_h + t, zero)
        return _quantize(dv, scale[:, None], zero[:, None], QMAX)


@triton.jit
def _chan_run_codes(x_lo, x_hi, t, h, d_lo, d_hi, SC, ZP, sc_h, MU, MUS, G, D,
                    KIND: tl.constexpr, BITS: tl.constexpr, MU8: tl.constexpr,
                    NG: tl.constexpr, VG: tl.constexpr):
    """Codes of one run of V tokens t (32,) at the low / high nibble channels d_lo, d_hi
    (32, BD/2) each; per-token parameters (KIVI: per VG-channel group) stored."""
    QMAX: tl.constexpr = (1 << BITS) - 1
    ok_lo = (d_lo < D)[None, :]
    ok_hi = (d_hi < D)[None, :]
    if KIND == 1:
        amax = tl.maximum(tl.max(tl.abs(x_lo), 1), tl.max(tl.abs(x_hi), 1))
        scale = _sym8_scale(amax)
        tl.store(SC + h * sc_h + t, scale)
        c_lo = _sym8(x_lo, scale[:, None])
        c_hi = _sym8(x_hi, scale[:, None])
    elif KIND == 3:
        x_lo = _mu_hat(MU, MUS, t, d_lo, d_lo < D, G, D, MU8) - x_lo
        x_hi = _mu_hat(MU, MUS, t, d_hi, d_hi < D, G, D, MU8) - x_hi
        lo = tl.minimum(tl.min(tl.where(ok_lo, x_lo, float("inf")), 1),
                        tl.min(tl.where(ok_hi, x_hi, float("inf")), 1))
        hi = tl.maximum(tl.max(tl.where(ok_lo, x_lo, float("-inf")), 1),
                        tl.max(tl.where(ok_hi, x_hi, float("-inf")), 1))
        scale, zero = _asym_params(lo, hi, QMAX)
        tl.store(SC + h * sc_h + t, scale)
        tl.store(ZP + h * sc_h + t, zero)
        c_lo = _quantize(x_lo, scale[:, None], zero[:, None], QMAX)
        c_hi = _quantize(x_hi, scale[:, None], zero[:, None], QMAX)
    else:
        c_lo = tl.zeros(x_lo.shape, tl.int32)
        c_hi = tl.zeros(x_hi.shape, tl.int32)
        for gi in tl.static_range(NG):
            # -- KIVI V: per-token (scale, zero) of channel group gi, both channel halves ----
            g_lo = (d_lo // VG == gi)[None, :]
            g_hi = (d_hi // VG == gi)[None, :]
            lo = tl.minimum(tl.min(tl.where(g_lo, x_lo, float("inf")), 1),
                            tl.min(tl.where(g_hi, x_hi, float("inf")), 1))
            hi = tl.maximum(tl.max(tl.where(g_lo, x_lo, float("-inf")), 1),
                            tl.max(tl.where(g_hi, x_hi, float("-inf")), 1))
            scale, zero = _asym_params(lo, hi, QMAX)
            tl.store(SC + h * sc_h + t * NG + gi, scale)
            tl.store(ZP + h * sc_h + t * NG + gi, zero)
            c_lo = tl.where(g_lo, _quantize(x_lo, scale[:, None], zero[:, None], QMAX), c_lo)
            c_hi = tl.where(g_hi, _quantize(x_hi, scale[:, None], zero[:, None], QMAX), c_hi)
    # padded channels (D < Dp) store code 0, like nibble.chan_write
    return tl.where(ok_lo, c_lo, 0), tl.where(ok_hi, c_hi, 0)


@triton.jit
def _unit_chanpack(u, h, n_tail, f, d, d_ok, CODES, c_h, c_d, SC, ZP, sc_h, D,
                   WIN, sw_h, sw_t, w, X, sx_h, sx_t, A, B, s_a, KH,
                   BITS: tl.constexpr, G: tl.constexpr, U: tl.constexpr, SRC: tl.constexpr,
                   XDT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_K: tl.constexpr):
    """KIVI K of unit u, head h: per 32-token plane e of each chanpack block, its G-token
    group's per-channel (scale, zero) and the plane's codes OR-ed into bits [BITS·e, ..)."""
    E: tl.constexpr = 8 // BITS
    UB: tl.constexpr = 32 * E
    QMAX: tl.constexpr = (1 << BITS) - 1
    j = tl.arange(0, 32)
    for b in tl.static_range(U // UB):
        blk = u * (U // UB) + b
        bptr = CODES + h * c_h + d[:, None] * c_d + blk * 32 + j[None, :]      # (BD, 32)
        byte = tl.load(bptr, mask=d_ok[:, None], other=0).to(tl.int32)
        for e in tl.static_range(E):
            t0 = blk * UB + 32 * e
            if (t0 >= n_tail) & (t0 < n_tail + f):
                # -- the plane's group: per-channel min / max → (scale, zero) --------------
                ig = t0 // G * G - n_tail + tl.arange(0, G)
                xg = _rows(h, ig, ig >= 0, d, WIN, sw_h, sw_t, w, X, sx_h, sx_t, A, B, s_a,
                           KH, D, SRC, XDT, HAS_BIAS, BLOCK_K)                  # (G, BD)
                scale, zero = _asym_params(tl.min(xg, 0), tl.max(xg, 0), QMAX)
                soff = h * sc_h + (t0 // G) * D + d
                tl.store(SC + soff, scale, mask=d_ok)
                tl.store(ZP + soff, zero, mask=d_ok)
                ip = t0 - n_tail + j
                xp = _rows(h, ip, ip >= 0, d, WIN, sw_h, sw_t, w, X, sx_h, sx_t, A, B, s_a,
                           KH, D, SRC, XDT, HAS_BIAS, BLOCK_K)                  # (32, BD)
                c = _quantize(tl.trans(xp), scale[:, None], zero[:, None], QMAX)  # (BD, 32)
                byte = (byte & ~(QMAX << (BITS * e))) | (c << (BITS * e))
        tl.store(bptr, byte.to(tl.uint8), mask=d_ok[:, None])


@triton.jit
def _unit_tok(u, h, n_tail, f, d, d_ok, CODES, c_h, c_p, c_b, SC, ZP, sc_h, MU, MUS, D,
              WIN, sw_h, sw_t, w, X, sx_h, sx_t, A, B, s_a, KH,
              KIND: tl.constexpr, BITS: tl.constexpr, MU8: tl.constexpr, G: tl.constexpr,
              U: tl.constexpr, SRC: tl.constexpr, XDT: tl.constexpr, HAS_BIAS: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """int8 / TaDA K of unit u, head h, in nibble.py's token-major layout: per block of UB
    tokens, byte j of channel d holds tokens j + 32·e at bits 4·(e%2) + 2·(e//2) (2 bits)
    or 4·e; 8 bits are two planes, high nibble first."""
    UB: tl.constexpr = 128 if BITS == 2 else 64
    M: tl.constexpr = 3 if BITS == 2 else 15
    j = tl.arange(0, 32)
    for b in tl.static_range(U // UB):
        blk = u * (U // UB) + b
        p0 = CODES + h * c_h + blk * c_b + d[:, None] * 32 + j[None, :]        # (BD, 32)
        by0 = tl.load(p0, mask=d_ok[:, None], other=0).to(tl.int32)
        by1 = by0
        if BITS == 8:
            by1 = tl.load(p0 + c_p, mask=d_ok[:, None], other=0).to(tl.int32)
        for e in tl.static_range(UB // 32):
            t0 = blk * UB + 32 * e
            if (t0 >= n_tail) & (t0 < n_tail + f):
                t = t0 + j
                x = _rows(h, t - n_tail, t >= 0, d, WIN, sw_h, sw_t, w, X, sx_h, sx_t, A, B,
                          s_a, KH, D, SRC, XDT, HAS_BIAS, BLOCK_K)              # (32, BD)
                c = tl.trans(_tok_run_codes(x, t, h, d, d_ok, SC, ZP, sc_h, MU, MUS, G, D,
                                            KIND, BITS, MU8))                   # (BD, 32)
                sh = 4 * (e % 2) + 2 * (e // 2) if BITS == 2 else 4 * e
                if BITS == 8:
                    by0 = (by0 & ~(15 << sh)) | ((c >> 4) << sh)
                    by1 = (by1 & ~(15 << sh)) | ((c & 15) << sh)
                else:
                    by0 = (by0 & ~(M << sh)) | (c << sh)
        tl.store(p0, by0.to(tl.uint8), mask=d_ok[:, None])
        if BITS == 8:
            tl.store(p0 + c_p, by1.to(tl.uint8), mask=d_ok[:, None])


@triton.jit
def _unit_chan(u, h, n_tail, f, CODES, c_h, c_p, c_c, SC, ZP, sc_h, MU, MUS, D,
               WIN, sw_h, sw_t, w, X, sx_h, sx_t, A, B, s_a, KH,
               KIND: tl.constexpr, BITS: tl.constexpr, MU8: tl.constexpr, G: tl.constexpr,
               U: tl.constexpr, NG: tl.constexpr, VG: tl.constexpr, SRC: tl.constexpr,
               XDT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """V of unit u, head h, in nibble.py's channel-major layout: one 32-byte row per token
    and 64-channel block, byte j = channel j (low nibble) | channel 32 + j (high); 2 bits:
    tokens 32..63 of a 64-token block two bits up in the rows of tokens 0..31."""
    bcol = tl.arange(0, BLOCK_D // 2)                                           # byte column
    d_lo = (bcol // 32) * 64 + bcol % 32
    d_hi = d_lo + 32
    col = CODES + h * c_h + (bcol // 32)[None, :] * c_c + (bcol % 32)[None, :]
    j = tl.arange(0, 32)
    for b in tl.static_range(U // 64):
        blk = u * (U // 64) + b
        if BITS == 2:
            ptr = col + (blk * 32 + j)[:, None] * 32                            # (32, BD/2)
            byte = tl.load(ptr).to(tl.int32)
        for half in tl.static_range(2):
            t0 = blk * 64 + 32 * half
            if (t0 >= n_tail) & (t0 < n_tail + f):
                t = t0 + j
                i = t - n_tail
                x_lo = _rows(h, i, i >= 0, d_lo, WIN, sw_h, sw_t, w, X, sx_h, sx_t, A, B,
                             s_a, KH, D, SRC, XDT, HAS_BIAS, BLOCK_K)           # (32, BD/2)
                x_hi = _rows(h, i, i >= 0, d_hi, WIN, sw_h, sw_t, w, X, sx_h, sx_t, A, B,
                             s_a, KH, D, SRC, XDT, HAS_BIAS, BLOCK_K)
                c_lo, c_hi = _chan_run_codes(x_lo, x_hi, t, h, d_lo, d_hi, SC, ZP, sc_h, MU,
                                             MUS, G, D, KIND, BITS, MU8, NG, VG)
                if BITS == 2:
                    nib = c_lo | (c_hi << 4)
                    byte = (byte & ~(0x33 << (2 * half))) | (nib << (2 * half))
                elif BITS == 8:
                    rp = col + t[:, None] * 32
                    tl.store(rp, ((c_lo >> 4) | ((c_hi >> 4) << 4)).to(tl.uint8))
                    tl.store(rp + c_p, ((c_lo & 15) | ((c_hi & 15) << 4)).to(tl.uint8))
                else:
                    tl.store(col + t[:, None] * 32, (c_lo | (c_hi << 4)).to(tl.uint8))
        if BITS == 2:
            tl.store(ptr, byte.to(tl.uint8))
