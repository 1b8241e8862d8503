"""Channel-major byte planes: the packed layout of per-channel K codes (KIVI's K side).

Why a layout of its own: KIVI scales K per (channel, group of G tokens), so the scale sits
inside the q·k contraction over channels and cannot be folded into q for a whole block, nor
expressed as the scales of torch's int4 GEMM (which run along tokens per channel group).
The read path therefore unpacks a block, scales it, and runs one GEMM. What makes that fast
on CPU is that every step is a wide contiguous op:

    storage (Hkv, D, S/E) uint8, E = 8/bits codes per byte, in token blocks of U = 32·E:
    byte j of block i (per head, per channel) holds token i·U + 32·e + j at bits
    [bits·e, bits·(e+1)) for e = 0..E-1 — plane e of a block is a run of 32 tokens.

Unpacking plane e of a whole read block is one shift/mask over uint8 and one uint8 → fp32
copy with a contiguous destination (Hkv, D, e, tokens): the unpacked buffer is a (D, n)
matrix per head in *plane-major* token order (all plane-0 runs, then plane-1 runs, ...),
which the GEMM q·U consumes as is; the (R, n) scores are put back in token order
afterwards (a copy of R·n floats instead of D·n). A 32-token run never straddles a scale
group (G is a multiple of 32), so scaling the buffer is one broadcast multiply.
"""
from __future__ import annotations

import torch

from .quant import Workspace

_IDX: dict = {}


def per_byte(bits: int) -> int:
    assert bits in (1, 2, 4, 8), bits
    return 8 // bits


def byte_planes(bits: int) -> list[tuple[str, int, int]]:
    """The byte-plane buffers of `bits`-bit codes: (slot name, plane width, code shift).
    3 bits are split in two buffers, the low two bits ("codes", 2-bit planes) and the third
    ("hi", 1-bit planes), so every plane keeps the layout above: a 32-token run of a channel
    is 32 bytes at one shift, and a kernel decodes a 3-bit code as the 2-bit one plus one
    more masked shift (code = lo + 4·hi), instead of codes straddling bytes."""
    return [("codes", 2, 0), ("hi", 1, 2)] if bits == 3 else [("codes", bits, 0)]


def unit(bits: int) -> int:
    """Tokens per block (the storage's padding unit)."""
    return 32 * per_byte(bits)


def shape(bits: int, Hkv: int, D: int, S: int) -> tuple:
    U = unit(bits)
    return (Hkv, D, -(-S // U) * 32)                                     # uint8


def write(buf: torch.Tensor, codes: torch.Tensor, s0: int, bits: int) -> None:
    """Store codes (Hkv, n, D) uint8 < 2^bits for tokens [s0, s0+n) (s0, n multiples of 32).
    Read-modify-write of the touched blocks: a flush of 32 tokens fills one plane."""
    Hkv, n, D = codes.shape
    assert s0 % 32 == 0 and n % 32 == 0, (s0, n)
    E, U = per_byte(bits), unit(bits)
    a, e = s0 // U * U, -(-(s0 + n) // U) * U
    nblk = (e - a) // U
    full = torch.zeros(Hkv, D, e - a, dtype=torch.int32, device=codes.device)
    full[:, :, s0 - a:s0 - a + n] = codes.transpose(1, 2).to(torch.int32)
    mask = torch.zeros(e - a, dtype=torch.int32, device=codes.device)
    mask[s0 - a:s0 - a + n] = (1 << bits) - 1
    shifts = (torch.arange(E, device=codes.device) * bits).view(E, 1)    # (E, 1)
    full = (full.view(Hkv, D, nblk, E, 32) << shifts).sum(3)             # (Hkv, D, nblk, 32)
    keep = (mask.view(nblk, E, 32) << shifts).sum(1)                     # (nblk, 32)
    dst = buf[:, :, a // E:e // E].view(Hkv, D, nblk, 32)
    old = dst.to(torch.int32) & ~keep
    dst.copy_((old | full).to(torch.uint8))


def unpack_into(buf: torch.Tensor, a: int, s1: int, bits: int, ws, key: str = "kc") -> torch.Tensor:
    """Codes of the whole blocks covering [a, s1) (a a multiple of `unit(bits)`) as float32
    (Hkv, D, E, M) in plane-major order, M = 32·(blocks): column e·M + 32·i + j is token
    a + i·U + 32·e + j. Padding tokens past s1 come along (callers drop them)."""
    E, U = per_byte(bits), unit(bits)
    assert a % U == 0, (a, U)
    Hkv, D = buf.shape[:2]
    M = -(-(s1 - a) // U) * 32
    src = buf[:, :, a // E:a // E + M]                                   # (Hkv, D, M) uint8
    out = ws.get(key, (Hkv, D, E, M), buf.device)
    if E == 1:
        out[:, :, 0].copy_(src)
        return out
    tmp = ws.get_u8(key + "_u8", (Hkv, D, M), buf.device)
    m = (1 << bits) - 1
    for e in range(E):
        if e == 0:
            torch.bitwise_and(src, m, out=tmp)
        else:
            torch.bitwise_right_shift(src, bits * e, out=tmp)
            if e < E - 1:
                tmp.bitwise_and_(m)
        out[:, :, e].copy_(tmp)
    return out


def add_high(u: torch.Tensor, hi: torch.Tensor, a: int, s1: int, ws) -> torch.Tensor:
    """u = unpack_into(lo, a, s1, 2) of a split 3-bit buffer (byte_planes(3)), a a multiple of
    unit(1): add 4 × the third bit from the 1-bit buffer `hi`, in u's plane-major order.
    Token a + 128·i + 32·e + j is run e of 2-bit block i, and run 4·(i % 2) + e of 1-bit
    block i // 2."""
    assert a % unit(1) == 0, a
    Hkv, D, E, M = u.shape
    h = unpack_into(hi, a, s1, 1, ws, key="kc_hi")                     # (Hkv, D, 8, M1)
    nb = h.shape[3] // 32
    h = h.view(Hkv, D, 2, 4, nb, 32).permute(0, 1, 3, 4, 2, 5).reshape(Hkv, D, 4, nb * 64)
    return u.add_(h[..., :M], alpha=4)


def group_index(a: int, s1: int, bits: int, G: int, device) -> torch.Tensor:
    """(E, blocks) index of the scale group, relative to group a // G, of every 32-token run
    of unpack_into(a, s1)'s order; runs past s1 get the last group (their scores are
    dropped). G is a multiple of 32, so a run never straddles two groups."""
    key = (a % G, s1 - a, bits, G, str(device))
    idx = _IDX.get(key)
    if idx is None:
        E, U = per_byte(bits), unit(bits)
        nblk = -(-(s1 - a) // U)
        t = a % G + torch.arange(nblk)[None, :] * U + torch.arange(E)[:, None] * 32  # (E, nblk)
        idx = _IDX[key] = (t // G).clamp_max((a % G + s1 - a - 1) // G).to(device)
    return idx


def to_token_order(x: torch.Tensor, skip: int, n: int, bits: int,
                   out: torch.Tensor) -> torch.Tensor:
    """x (..., E·M) in plane-major order → `out` (..., n): tokens skip .. skip+n-1 of x in
    token order (a copy)."""
    E = per_byte(bits)
    if E == 1:
        return out.copy_(x[..., skip:skip + n])
    M = x.shape[-1] // E
    lead = x.shape[:-1]
    xv = x.view(*lead, E, M // 32, 32).transpose(-3, -2)                 # (..., blocks, E, 32)
    if skip == 0 and n == M * E:
        out.view(*lead, M // 32, E, 32).copy_(xv)
        return out
    return out.copy_(xv.reshape(*lead, M * E)[..., skip:skip + n])


def codes(buf: torch.Tensor, s0: int, s1: int, bits: int) -> torch.Tensor:
    """Explicit codes (Hkv, n, D) float32 in token order (dequantization, tests) of one
    plane buffer (`bits` its plane width)."""
    a = s0 // unit(bits) * unit(bits)
    u = unpack_into(buf, a, s1, bits, Workspace())                       # (Hkv, D, E, M)
    Hkv, D, E, M = u.shape
    tok = torch.empty(Hkv, D, s1 - s0)
    to_token_order(u.view(Hkv, D, E * M), s0 - a, s1 - s0, bits, tok)
    return tok.transpose(1, 2).contiguous()
