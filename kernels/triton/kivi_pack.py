"""kivi_pack, Triton: KIVI's compression of a flushed block (K per channel over G-token
groups, V per token over g-channel groups) written straight into the codec's packed storage
— the pack op of kernels/dispatch.py for the KIVI codec. Bit-identical to
`KiviCodec.pack` (codes, fp16 scales and zeros): the same min-max parameters (zero = lo
rounded to fp16, scale = (hi − zero)/qmax rounded to fp16 and nudged up one ulp if it does
not reach hi), IEEE division (div_rn), round-half-even (the 1.5·2^23 trick, exact for
|v| < 2^22) and no fused multiply-add (`enable_fp_fusion=False` on GPU).

Not yet fused with RoPE or the V projection, and not called by the arena (which packs with
the torch codec): this is the kernel those fused ops would end in, tested bit-exact.

- `_kivi_k_kernel`, grid (Hkv, storage blocks touched), storage block U = 32·8/bits tokens:
  one program owns every byte of its block (so concurrent flushes never read-modify-write
  the same byte), loads the old bytes, and per 32-token plane e of the block that lies in
  [s0, s0+n): the plane's G-token group (G, D) tile → per-channel (scale, zero), codes of
  the plane's 32 tokens, OR-ed into bits [bits·e, bits·(e+1)). Blocks BLOCK_D = next
  power of two >= D. Reads n·D·4 (fp32 x; 2 if fp16) bytes (the group tile is re-read per
  plane when G > 32), writes n·D·bits/8 code bytes + 4·D per group.
- `_kivi_v_kernel`, grid (Hkv, 64-token blocks touched): per 32-token half of the block,
  per-token (scale, zero) over each g-channel group, codes arranged as the channel-major
  nibble rows (byte j of 64-channel block c: channel c·64+j low nibble, c·64+32+j high;
  2 bits: the second half's codes two bits up in the first half's rows). Reads n·D·4,
  writes n·Dp·bits/8 + 4·n·D/g.
Per decode step the arena flushes one block of G = 32 tokens every 32 steps; for Llama-3.1-70B
(Hkv 8, D 128) kivi-4 that is, per layer and flush, 128 KiB read (fp32 x; 64 KiB from
fp16) and 16 + 2 KiB written for K (codes, scales/zeros), 16 + 4 KiB for V. Warps: 4 (K; 2
at D <= 64), 8 (V); neither spills registers on sm_90 at D = 64 or 128 (tools/sm90_check.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..table import covers
from .rounding import _rhe

K_WARPS, V_WARPS = 4, 8                 # no register spills on sm_90 at D = 128 (sm90_check)


def k_warps(D: int) -> int:
    """Warps of the K kernel: 2 at D <= 64, where ptxas caps 4 warps at 128 registers."""
    return K_WARPS if D > 64 else 2


@triton.jit
def _asym_params(lo, hi, QMAX: tl.constexpr):
    """quant.asym_params from the fp32 min / max: (scale fp16, zero fp16)."""
    zero = lo.to(tl.float16)
    zf = zero.to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(hi - zf, QMAX * 1.0), 1e-6).to(tl.float16)
    # fp16 rounding may leave zero + qmax·scale short of hi: one ulp up (scale > 0)
    short = zf + scale.to(tl.float32) * QMAX < hi
    bits = scale.to(tl.int16, bitcast=True)
    up = tl.where(scale < 65504.0, bits + 1, bits).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.where(short, up, scale), zero


@triton.jit
def _quantize(x, scale, zero, QMAX: tl.constexpr):
    r = _rhe(tl.math.div_rn(x - zero.to(tl.float32), scale.to(tl.float32)))
    return tl.minimum(tl.maximum(r, 0.0), QMAX * 1.0).to(tl.int32)


@triton.jit
def _kivi_k_kernel(X, sx_h, sx_t,                     # (Hkv, n, D) new tokens [s0, s0+n)
                   CODES, sc_h, sc_d,                 # (Hkv, D, S*bits/8) uint8 (chanpack)
                   SCALE, ZERO,                       # (Hkv, S/G, D) fp16
                   s0, n, D, n_groups,
                   BITS: tl.constexpr, G: tl.constexpr, BLOCK_D: tl.constexpr):
    h = tl.program_id(0)
    E: tl.constexpr = 8 // BITS
    U: tl.constexpr = 32 * E
    QMAX: tl.constexpr = (1 << BITS) - 1
    blk = s0 // U + tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    j = tl.arange(0, 32)
    bptr = CODES + h * sc_h + d[:, None] * sc_d + blk * 32 + j[None, :]     # (BD, 32)
    byte = tl.load(bptr, mask=d_ok[:, None], other=0).to(tl.int32)
    for e in tl.static_range(E):
        t0 = blk * U + 32 * e                                              # plane's first token
        if (t0 >= s0) & (t0 < s0 + n):
            # -- the plane's G-token group: per-channel min / max → (scale, zero) -----------
            g0 = t0 // G * G
            tg = g0 + tl.arange(0, G)
            xg = tl.load(X + h * sx_h + (tg - s0)[:, None] * sx_t + d[None, :],
                         mask=d_ok[None, :], other=0.0).to(tl.float32)      # (G, BD)
            scale, zero = _asym_params(tl.min(xg, 0), tl.max(xg, 0), QMAX)  # (BD,)
            gi = t0 // G
            tl.store(SCALE + (h * n_groups + gi) * D + d, scale, mask=d_ok)
            tl.store(ZERO + (h * n_groups + gi) * D + d, zero, mask=d_ok)
            # -- the plane's 32 tokens, channel-major, into bits [BITS·e, BITS·(e+1)) -------
            xp = tl.load(X + h * sx_h + (t0 - s0 + j)[None, :] * sx_t + d[:, None],
                         mask=d_ok[:, None], other=0.0).to(tl.float32)      # (BD, 32)
            c = _quantize(xp, scale[:, None], zero[:, None], QMAX)
            byte = (byte & ~(QMAX << (BITS * e))) | (c << (BITS * e))
    tl.store(bptr, byte.to(tl.uint8), mask=d_ok[:, None])


@triton.jit
def _v_half(X, sx_h, sx_t, SCALE, ZERO, sp_h, h, t0, s0, d_lo, d_hi, dn, D,
            QMAX: tl.constexpr, NG: tl.constexpr, VG: tl.constexpr, BLOCK_D: tl.constexpr):
    """Codes of tokens t0..t0+31 at the low / high nibble channels (32, BLOCK_D/2) each;
    stores the per-(token, group) scale / zero."""
    t = t0 + tl.arange(0, 32)
    x = tl.load(X + h * sx_h + (t - s0)[:, None] * sx_t + dn[None, :],
                mask=(dn < D)[None, :], other=0.0).to(tl.float32)           # (32, BD)
    x_lo = tl.load(X + h * sx_h + (t - s0)[:, None] * sx_t + d_lo[None, :],
                   mask=(d_lo < D)[None, :], other=0.0).to(tl.float32)      # (32, BD/2)
    x_hi = tl.load(X + h * sx_h + (t - s0)[:, None] * sx_t + d_hi[None, :],
                   mask=(d_hi < D)[None, :], other=0.0).to(tl.float32)
    c_lo = tl.zeros(x_lo.shape, tl.int32)
    c_hi = tl.zeros(x_hi.shape, tl.int32)
    for gi in tl.static_range(NG):
        # -- per-token (scale, zero) of channel group gi, applied where it owns a column ----
        in_g = (dn // VG == gi)[None, :]
        lo = tl.min(tl.where(in_g, x, float("inf")), 1)
        hi = tl.max(tl.where(in_g, x, float("-inf")), 1)
        scale, zero = _asym_params(lo, hi, QMAX)                          # (32,)
        tl.store(SCALE + h * sp_h + t * NG + gi, scale)
        tl.store(ZERO + h * sp_h + t * NG + gi, zero)
        q_lo = _quantize(x_lo, scale[:, None], zero[:, None], QMAX)
        q_hi = _quantize(x_hi, scale[:, None], zero[:, None], QMAX)
        c_lo = tl.where((d_lo // VG == gi)[None, :], q_lo, c_lo)
        c_hi = tl.where((d_hi // VG == gi)[None, :], q_hi, c_hi)
    # padded channels (D < Dp) store code 0, like nibble.chan_write
    c_lo = tl.where((d_lo < D)[None, :], c_lo, 0)
    c_hi = tl.where((d_hi < D)[None, :], c_hi, 0)
    return c_lo | (c_hi << 4)


@triton.jit
def _kivi_v_kernel(X, sx_h, sx_t,                     # (Hkv, n, D) new tokens [s0, s0+n)
                   CODES, sc_h, sc_c,                 # (Hkv, 1, Dp/64, rows, 32) uint8
                   SCALE, ZERO, sp_h,                 # (Hkv, S, D/g) fp16
                   s0, n, D,
                   BITS: tl.constexpr, NG: tl.constexpr, VG: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    h = tl.program_id(0)
    QMAX: tl.constexpr = (1 << BITS) - 1
    blk = s0 // 64 + tl.program_id(1)                                      # 64-token block
    b = tl.arange(0, BLOCK_D // 2)                                         # byte column
    d_lo = (b // 32) * 64 + b % 32                                         # its two channels
    d_hi = d_lo + 32
    dn = tl.arange(0, BLOCK_D)
    col = CODES + h * sc_h + (b // 32)[None, :] * sc_c + (b % 32)[None, :]
    j = tl.arange(0, 32)
    if BITS == 2:
        # tokens 32..63 of the block share the rows of tokens 0..31, two bits up
        ptr = col + (blk * 32 + j)[:, None] * 32                           # (32, BD/2)
        byte = tl.load(ptr).to(tl.int32)
        for half in tl.static_range(2):
            t0 = blk * 64 + 32 * half
            if (t0 >= s0) & (t0 < s0 + n):
                nib = _v_half(X, sx_h, sx_t, SCALE, ZERO, sp_h, h, t0, s0, d_lo, d_hi, dn, D,
                              QMAX, NG, VG, BLOCK_D)
                byte = (byte & ~(0x33 << (2 * half))) | (nib << (2 * half))
        tl.store(ptr, byte.to(tl.uint8))
    else:
        for half in tl.static_range(2):
            t0 = blk * 64 + 32 * half
            if (t0 >= s0) & (t0 < s0 + n):
                nib = _v_half(X, sx_h, sx_t, SCALE, ZERO, sp_h, h, t0, s0, d_lo, d_hi, dn, D,
                              QMAX, NG, VG, BLOCK_D)
                tl.store(col + (t0 + j)[:, None] * 32, nib.to(tl.uint8))


def supports(codec) -> bool:
    """KIVI codecs of 2 or 4 bits with G a multiple of 32 (not GEAR, whose pack also takes
    out outliers and fits the low-rank residual)."""
    return covers("pack", "triton", codec) and codec.G % 32 == 0


def kivi_pack(codec, st: dict, x: torch.Tensor, s0: int) -> None:
    """Compress x (Hkv, n, D) float32/fp16 — tokens [s0, s0+n), n and s0 multiples of G —
    into `st` exactly as codec.pack(st, x.float(), s0) does (codes, scales, zeros)."""
    if not supports(codec):
        raise ValueError(f"kivi_pack: {codec} is not a 2/4-bit KIVI codec with G % 32 == 0")
    Hkv, n, D = x.shape
    G = codec.G
    if n % G or s0 % G:
        raise ValueError(f"kivi_pack: s0={s0} and n={n} must be multiples of G={G}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    codes, scale, zero = st["codes"], st["scale"], st["zero"]
    assert codes.is_contiguous() and scale.is_contiguous() and zero.is_contiguous()
    BLOCK_D = max(64, triton.next_power_of_2(D))
    # no FMA: zero + qmax·scale must round like torch's separate multiply and add
    opts = dict(enable_fp_fusion=False) if x.is_cuda else {}
    if codec.role == "k":
        U = 32 * (8 // codec.bits)
        nblk = (s0 + n - 1) // U - s0 // U + 1
        _kivi_k_kernel[(Hkv, nblk)](x, x.stride(0), x.stride(1), codes, codes.stride(0),
                                    codes.stride(1), scale, zero, s0, n, D, scale.shape[1],
                                    BITS=codec.bits, G=G, BLOCK_D=BLOCK_D, num_warps=k_warps(D),
                                    **opts)
    else:
        if D % codec.g:
            raise ValueError(f"kivi_pack: D={D} is not a multiple of the V group {codec.g}")
        nblk = (s0 + n - 1) // 64 - s0 // 64 + 1
        _kivi_v_kernel[(Hkv, nblk)](x, x.stride(0), x.stride(1), codes, codes.stride(0),
                                    codes.stride(2), scale, zero, scale.stride(0), s0, n, D,
                                    BITS=codec.bits, NG=D // codec.g, VG=codec.g,
                                    BLOCK_D=BLOCK_D, num_warps=V_WARPS, **opts)
