"""Register-level dequantization of the arena's packed formats, for the Triton kernels.

Each helper turns a tile of tail tokens t (N, 1) x channels d (1, BD) into values in
registers, straight from the storage the torch codecs write (kernels/nibble.py,
kernels/quant.py, codec_*.py — the layouts are frozen; the torch `dequant(st, s0, s1)` is
the definition of what the bytes mean and tests/kernels/test_triton_dequant.py checks against it):

- nibble layouts (int8, TaDA deviations, KIVI V codes): uint8 bytes holding two 4-bit codes
  (or four 2-bit codes); token-major for K (W rows = tokens), channel-major for V;
- pack_codes words (TaDA's int8 means): int32 words holding 32/b codes of consecutive token
  planes of a G-token block, top plane stored two's complement;
- chanpack byte planes (KIVI / GEAR K codes; 3-bit KIVI keys: 2-bit planes plus 1-bit
  planes of the third bits): per (head, channel) a row of bytes, runs of
  32 tokens in successive bit fields.

A codec is described to the kernel by one KIND constexpr and a fixed argument bundle (see
decode_attention._codec_args); unused pointers are dummies and never dereferenced.
"""
import triton
import triton.language as tl

FP, INT8, KIVI, TADA, GEAR = 0, 1, 2, 3, 4


@triton.jit
def _nibble_codes(X, h, t, d, mask, s_h, s_p, s_b, BITS: tl.constexpr, CHAN: tl.constexpr):
    """Unsigned codes (N, BD) int32. X: (Hkv, planes, blocks, ·, 32) uint8 with strides
    s_h, s_p, s_b (the last two dims are contiguous, 32 bytes per row)."""
    if CHAN:
        # channel-major (V): rows = tokens, 64-channel blocks, byte j = channel % 32,
        # channels 32..63 of a block in the high nibble; 2-bit: tokens 32..63 of every
        # 64-token block share the rows of tokens 0..31, two bits up
        if BITS == 2:
            row = (t // 64) * 32 + t % 32
            shift = 4 * ((d % 64) // 32) + 2 * ((t % 64) // 32)
        else:
            row = t
            shift = 4 * ((d % 64) // 32)
        off = h * s_h + (d // 64) * s_b + row * 32 + d % 32
    else:
        # token-major (K): 64-token blocks (128 for 2 bits) of (D, 32) bytes, byte j =
        # token % 32, tokens 32..63 in the high nibble (2-bit: tokens 64..127 two bits up)
        if BITS == 2:
            off = h * s_h + (t // 128) * s_b + d * 32 + t % 32
            shift = 4 * ((t % 64) // 32) + 2 * ((t % 128) // 64)
        else:
            off = h * s_h + (t // 64) * s_b + d * 32 + t % 32
            shift = 4 * ((t % 64) // 32)
    c = (tl.load(X + off, mask=mask, other=0).to(tl.int32) >> shift) & (3 if BITS == 2 else 15)
    if BITS == 8:                               # plane 0 holds the high nibble: c = 16 hi + lo
        lo = (tl.load(X + s_p + off, mask=mask, other=0).to(tl.int32) >> shift) & 15
        c = c * 16 + lo
    return c


@triton.jit
def _word_codes(X, t, d, mask, G, D_row, BITS: tl.constexpr):
    """Unsigned codes (N, BD) int32 from quant.pack_codes words. X: (S*BITS/32, D_row) int32
    (already offset to the head): word row j of block b holds tokens b*G + j + i*G/P,
    plane i at bits [BITS*i, BITS*(i+1)); the top plane stores c − 2^(BITS−1)."""
    P: tl.constexpr = 32 // BITS
    J = G // P
    r = t % G
    i = r // J
    w = tl.load(X + ((t // G) * J + r % J) * D_row + d, mask=mask, other=0)
    f = (w >> (i * BITS)) & ((1 << BITS) - 1)
    return tl.where(i == P - 1, f ^ (1 << (BITS - 1)), f)


@triton.jit
def _chanpack_codes(X, t, d, mask, s_d, BITS: tl.constexpr):
    """Unsigned codes (N, BD) int32 from chanpack.py's byte planes. X: (D, S*BITS/8) uint8
    rows per channel (already offset to the head, row stride s_d): byte j of block i holds
    token i*U + 32*e + j at bits [BITS*e, BITS*(e+1)), U = 32 * 8/BITS."""
    U: tl.constexpr = 32 * (8 // BITS)
    b = tl.load(X + d * s_d + (t // U) * 32 + t % 32, mask=mask, other=0).to(tl.int32)
    return (b >> (BITS * ((t % U) // 32))) & ((1 << BITS) - 1)


@triton.jit
def dequant_tile(X, SC, ZP, MU, MUS, LA, LB, OI, OV,
                 s_h, s_p, s_b, sc_h, G, VG, la_h, lb_h, o_h,
                 h, t, d, tmask, mask, D,
                 KIND: tl.constexpr, BITS: tl.constexpr, CHAN: tl.constexpr,
                 MU8: tl.constexpr, RANK: tl.constexpr, K2: tl.constexpr):
    """x̂ (N, BD) float32 for tail tokens t (N, 1) of KV head h, channels d (1, BD);
    0 where `mask` is false. CHAN selects the V orientation (K otherwise)."""
    if KIND == 0:
        # -- FP: (Hkv, S, D) fp16/bf16 (or a window view), head stride s_h, token stride s_b
        x = tl.load(X + h * s_h + t * s_b + d, mask=mask, other=0.0).to(tl.float32)
    elif KIND == 1:
        # -- int8: symmetric per (token, head), codes offset by 128, scale (Hkv, S)
        c = _nibble_codes(X, h, t, d, mask, s_h, s_p, s_b, 8, CHAN)
        s = tl.load(SC + h * sc_h + t, mask=tmask, other=0.0).to(tl.float32)
        x = (c - 128).to(tl.float32) * s
    elif KIND == 3:
        # -- TaDA: x̂ = μ̂_t − (c s + z), (s, z) per (token, head); μ̂ fp16 (S, D) or int8
        c = _nibble_codes(X, h, t, d, mask, s_h, s_p, s_b, BITS, CHAN)
        s = tl.load(SC + h * sc_h + t, mask=tmask, other=0.0).to(tl.float32)
        z = tl.load(ZP + h * sc_h + t, mask=tmask, other=0.0).to(tl.float32)
        if MU8:
            cm = _word_codes(MU, t, d, mask, G, D, 8)
            ms = tl.load(MUS + t, mask=tmask, other=0.0).to(tl.float32)
            mu = (cm - 128).to(tl.float32) * ms
        else:
            mu = tl.load(MU + t * D + d, mask=mask, other=0.0).to(tl.float32)
        x = mu - (c.to(tl.float32) * s + z)
    else:
        # -- KIVI backbone (KIND 2, and GEAR's): K per channel over G-token groups
        #    (scale (Hkv, S/G, D)), V per token over VG-channel groups (scale (Hkv, S, D/VG))
        if CHAN:
            c = _nibble_codes(X, h, t, d, mask, s_h, s_p, s_b, BITS, CHAN)
            soff = h * sc_h + t * (D // VG) + d // VG
        elif BITS == 3:
            # 3-bit keys: the low two bits in 2-bit planes, the third in 1-bit planes passed
            # as MU (KIVI has no means), its head / channel strides as la_h / lb_h
            c = _chanpack_codes(X + h * s_h, t, d, mask, s_b, 2)
            c += 4 * _chanpack_codes(MU + h * la_h, t, d, mask, lb_h, 1)
            soff = h * sc_h + (t // G) * D + d
        else:
            c = _chanpack_codes(X + h * s_h, t, d, mask, s_b, BITS)
            soff = h * sc_h + (t // G) * D + d
        s = tl.load(SC + soff, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(ZP + soff, mask=mask, other=0.0).to(tl.float32)
        x = c.to(tl.float32) * s + z
        if KIND == 4:
            # -- GEAR: + A_t B_blkᵀ (A (Hkv, S, r), B (Hkv, S/G, D, r)), rank-1 updates in
            #    registers: the low-rank matrix never exists outside this tile
            for k in tl.static_range(RANK):
                a = tl.load(LA + h * la_h + t * RANK + k, mask=tmask, other=0.0).to(tl.float32)
                b = tl.load(LB + h * lb_h + ((t // G) * D + d) * RANK + k, mask=mask,
                            other=0.0).to(tl.float32)
                x += a * b
            # -- sparse outliers (uint8 position, fp16 value): K per (block, channel) with
            #    positions along the block's tokens, V per token with positions along D
            for j in tl.static_range(K2):
                if CHAN:
                    ix = tl.load(OI + h * o_h + t * K2 + j, mask=tmask, other=255).to(tl.int32)
                    vv = tl.load(OV + h * o_h + t * K2 + j, mask=tmask, other=0.0).to(tl.float32)
                    x += tl.where(d == ix, vv, 0.0)
                else:
                    ooff = h * o_h + ((t // G) * D + d) * K2 + j
                    ix = tl.load(OI + ooff, mask=mask, other=255).to(tl.int32)
                    vv = tl.load(OV + ooff, mask=mask, other=0.0).to(tl.float32)
                    x += tl.where(t % G == ix, vv, 0.0)
    return x
