"""Codes stored in the nibble layout of torch's CPU int4 GEMM, so the read path multiplies
q or p straight against packed codes with `aten._weight_int4pack_mm_for_cpu` (one fused
dequant + GEMM pass, ~4x faster than fp16 → fp32 + matmul over the same tokens).

The op computes out = x @ Wᵀ for x (M, K) bf16 and W (N, K) given as (N, K/2) uint8 with
W[n, k] = (code[n, k] − 8) · scale[k // gs, n] + zero[k // gs, n]. Its packed layout, in
blocks of 64 rows of W: for each k, 32 bytes, byte j = code(row j) | code(row j+32) << 4.
Every codec here passes unit scales (see `center`), so the op returns x·(c − 7.5) and the codec
folds its own (fp16) scales and zeros into x or into the small (M, n) result in fp32.

Two orientations:
- token-major ("tok", K scores): W rows = tokens, k = channels. Tokens come in 64-token
  blocks (a flush of G=32 fills the low or the high nibbles of a block), stored
  (Hkv, planes, S/64, D, 32): a token prefix is a contiguous (N, D/2) matrix.
- channel-major ("chan", V mix): W rows = channels (blocks of 64), k = tokens; every token
  is one 32-byte row per 64-channel block, stored (Hkv, planes, D/64, S, 32).
Bit widths: 4 = one nibble plane; 8 = two planes (c = 16·hi + lo); 2 = one byte array in
which `b & 0x33` and `(b >> 2) & 0x33` are each a valid nibble matrix (the A and B halves
of the tokens: per 128-token superblock tokens 0-63 / 64-127 (tok), per 64-token block
tokens 0-31 / 32-63 (chan)), so two cheap contiguous uint8 ops replace any bit shuffling.
Storage is padded to whole (super)blocks; the codec slots declare the padded shapes so
byte accounting stays exact.

Precision: x is rounded to bf16 and the op returns bf16 (fp32 accumulation inside), i.e.
relative 2^-9 on a score or a mixed value — the precision of bf16 attention, ~30x below
4-bit quantization error.

The layout above is what ATen's AVX-512 build of the op reads. Its AVX2 build (CPUs
without AVX-512, or ATEN_CPU_CAPABILITY=avx2) packs 32-row blocks as row d | row d+16 << 4,
and its scalar build packs row pairs, so the same bytes would mean other codes there. The
storage layout is fixed (the native C kernel and Triton read it too): `op_reads_layout()`
probes the op once on a known matrix, and where it reads another layout `tok_dot` /
`chan_mix` multiply explicit codes in fp32 instead (slower; exact).
"""
from __future__ import annotations

import torch

_op = torch.ops.aten._weight_int4pack_mm_for_cpu
_UNIT: dict = {}


_READS_LAYOUT: bool | None = None


def op_reads_layout() -> bool:
    """Whether this process's int4 op reads the layout above (probed once: 64 known codes
    per row of W against an identity x; the AVX-512 dispatch of ATen does)."""
    global _READS_LAYOUT
    if _READS_LAYOUT is None:
        K = 32
        codes = (torch.arange(64 * K).view(64, K) * 7 + 3) % 16                 # (N=64, K)
        packed = (codes[:32].T | (codes[32:].T << 4)).to(torch.uint8).contiguous()  # (K, 32)
        unit = torch.stack([torch.ones(1, 64), torch.full((1, 64), 8 - 7.5)], -1).to(torch.bfloat16)
        try:
            out = _op(torch.eye(K, dtype=torch.bfloat16), packed.view(64, K // 2), 32, unit)
            _READS_LAYOUT = bool(torch.equal(out.float().T, codes.float() - 7.5))
        except RuntimeError:                                                    # no such kernel
            _READS_LAYOUT = False
    return _READS_LAYOUT


def center(bits: int) -> float:
    """Mid-code of a nibble plane: the op is run on c − center so its bf16 output carries
    no large offset (2-bit codes against the op's fixed −8 would lose 2 bits to it)."""
    return 1.5 if bits == 2 else 7.5


def _unit(rows: int, N: int, bits: int, device) -> torch.Tensor:
    """(rows, N, 2) bf16 scale 1, zero 8 − center: W = c − center exactly (a prefix view of
    a cached, grown-on-demand table)."""
    key = (rows, bits == 2, str(device))
    t = _UNIT.get(key)
    if t is None or t.shape[1] < N:
        n = max(N, 2 * (t.shape[1] if t is not None else 0), 8192)
        t = _UNIT[key] = torch.stack([torch.ones(rows, n), torch.full((rows, n), 8 - center(bits))],
                                     -1).to(torch.bfloat16).to(device)
    return t[:, :N]


def tok_unit(bits: int) -> int:
    """Token padding unit of the token-major layout."""
    return 128 if bits == 2 else 64


def nibble_planes(bits: int) -> int:
    """Nibble planes of the nibble layouts (8 bits: hi and lo; else one)."""
    return 2 if bits == 8 else 1


def tok_shape(bits: int, Hkv: int, D: int, S: int) -> tuple:
    U = tok_unit(bits)
    nsb = -(-S // U)
    return (Hkv, nibble_planes(bits), nsb, D, 32)                               # uint8


def chan_shape(bits: int, Hkv: int, D: int, S: int) -> tuple:
    Dp = -(-D // 64)
    rows = -(-S // 64) * 32 if bits == 2 else -(-S // 64) * 64           # token rows
    return (Hkv, nibble_planes(bits), Dp, rows, 32)                             # uint8


def _split_planes(codes: torch.Tensor, bits: int) -> list[torch.Tensor]:
    c = codes.to(torch.int32)
    return [c >> 4, c & 15] if bits == 8 else [c]


# -- token-major (K) ----------------------------------------------------------------------

def _tok_pos(U: int):
    """(byte j, bit shift) of token i of a superblock of U tokens."""
    i = torch.arange(U)
    return i % 32, 4 * ((i % 64) // 32) + 2 * (i // 64)


def tok_write(buf: torch.Tensor, codes: torch.Tensor, s0: int, bits: int) -> None:
    """Write codes (Hkv, n, D) uint8 < 2^bits for tokens [s0, s0+n) into buf (tok_shape).
    Read-modify-write of the touched superblocks (a flush half-fills a 64-token block)."""
    Hkv, n, D = codes.shape
    U = tok_unit(bits)
    a, e = s0 // U * U, -(-(s0 + n) // U) * U
    nsb = (e - a) // U
    _, shift = _tok_pos(U)
    shift = shift.repeat(nsb)[s0 - a:s0 - a + n]                         # (n,)
    keep = torch.full((nsb * U,), 0, dtype=torch.int32)
    keep[s0 - a:s0 - a + n] = (1 << bits if bits < 8 else 16) - 1
    keep = (keep << _tok_pos(U)[1].repeat(nsb)).view(nsb, U // 32, 32).sum(1)  # (nsb, 32)
    for p, c in enumerate(_split_planes(codes, bits)):
        full = torch.zeros(Hkv, nsb * U, D, dtype=torch.int32)
        full[:, s0 - a:s0 - a + n] = c << shift[None, :, None]
        add = full.view(Hkv, nsb, U // 32, 32, D).sum(2).transpose(2, 3)  # (Hkv, nsb, D, 32)
        dst = buf[:, p, a // U:e // U]
        old = dst.to(torch.int32) & ~keep[None, :, None, :]
        dst.copy_((old | add).to(torch.uint8))


def tok_codes(buf: torch.Tensor, s0: int, s1: int, bits: int) -> torch.Tensor:
    """Explicit codes (Hkv, n, D) float32 for tokens [s0, s1) (tests, context shift)."""
    U = tok_unit(bits)
    a, e = s0 // U * U, -(-s1 // U) * U
    j, shift = _tok_pos(U)
    out = 0
    for p in range(nibble_planes(bits)):
        b = buf[:, p, a // U:e // U].to(torch.int32)                     # (Hkv, nsb, D, 32)
        c = (b[..., j] >> shift) & (3 if bits == 2 else 15)              # (Hkv, nsb, D, U)
        c = c.transpose(2, 3).reshape(b.shape[0], -1, b.shape[2])[:, s0 - a:s1 - a]
        out = out * 16 + c
    return out.float()


def tok_dot(x: torch.Tensor, buf: torch.Tensor, s0: int, s1: int, bits: int,
            ws) -> torch.Tensor:
    """x (Hkv, M, D) float32 → (Hkv, M, n) float32 = x · c_t for tokens [s0, s1), c the
    unsigned integer codes."""
    Hkv, M, D = x.shape
    if not op_reads_layout():
        return torch.bmm(x.float(), tok_codes(buf, s0, s1, bits).transpose(1, 2))
    U = tok_unit(bits)
    a, e = s0 // U * U, -(-s1 // U) * U
    N = e - a
    xb = x.to(torch.bfloat16).contiguous()
    unit = _unit(D // 32, N if bits != 2 else N // 2, bits, x.device)
    off = xb.float().sum(-1, keepdim=True) * center(bits)               # (Hkv, M, 1)
    outs = []
    for h in range(Hkv):
        if bits == 2:
            b = buf[h, 0, a // U:e // U]                                 # (nsb, D, 32)
            m = ws.get_u8("tok2", (2,) + tuple(b.shape), b.device)
            torch.bitwise_and(b, 0x33, out=m[0])
            torch.bitwise_right_shift(b, 2, out=m[1]).bitwise_and_(0x33)
            outs += [_op(xb[h], m[half].view(N // 2, D // 2), 32, unit) for half in range(2)]
        else:
            outs += [_op(xb[h], buf[h, p, a // U:e // U].view(N, D // 2), 32, unit)
                     for p in range(nibble_planes(bits))]
    # one bf16 → fp32 conversion for every head and plane (mixed-dtype ops are slow on CPU)
    # (into reused buffers: fresh ~100 kB temporaries page-fault every step)
    o16 = torch.stack(outs, out=ws.get_as("tok_bf16", (len(outs),) + tuple(outs[0].shape), torch.bfloat16))
    o = ws.get("tok_f32", tuple(o16.shape), x.device).copy_(o16)          # (Hkv*planes, M, N')
    if bits == 2:                   # halves A / B are tokens 0-63 / 64-127 of each superblock
        out = ws.get("tok_out", (Hkv, M, N), x.device).view(Hkv, M, N // U, 2, 64)
        out.copy_(o.view(Hkv, 2, M, N // U, 64).permute(0, 2, 3, 1, 4))
        out = out.view(Hkv, M, N)
    elif bits == 8:
        o = o.view(Hkv, 2, M, N)
        out = torch.add(o[:, 1], o[:, 0], alpha=16, out=ws.get("tok_out", (Hkv, M, N), x.device))
    else:
        out = o
    out.add_(off, alpha=17 if bits == 8 else 1)                          # 16·hi + lo: 17 offsets
    return out[:, :, s0 - a:s1 - a]


# -- channel-major (V) ----------------------------------------------------------------------

def chan_write(buf: torch.Tensor, codes: torch.Tensor, s0: int, bits: int) -> None:
    """Write codes (Hkv, n, D) uint8 for tokens [s0, s0+n) into buf (chan_shape). For 2 bits
    s0 and n are multiples of 32 and the 64-token blocks are read-modified-written."""
    Hkv, n, D = codes.shape
    Dp = buf.shape[2] * 64
    for p, c in enumerate(_split_planes(codes, bits)):
        if Dp != D:
            c = torch.nn.functional.pad(c, (0, Dp - D))
        c = c.view(Hkv, n, Dp // 64, 2, 32)
        if bits != 2:
            rows = (c[..., 0, :] | (c[..., 1, :] << 4)).transpose(1, 2)  # (Hkv, Dp/64, n, 32)
            buf[:, p, :, s0:s0 + n] = rows.to(torch.uint8)
            continue
        nib = c[..., 0, :] | (c[..., 1, :] << 4)                         # (Hkv, n, Dp/64, 32)
        a, e = s0 // 64 * 64, -(-(s0 + n) // 64) * 64
        full = torch.zeros(Hkv, e - a, Dp // 64, 32, dtype=torch.int32)
        mask = torch.zeros(e - a, dtype=torch.int32)
        full[:, s0 - a:s0 - a + n] = nib
        mask[s0 - a:s0 - a + n] = 0x33
        half_shift = 2 * ((torch.arange(e - a) % 64) // 32)              # B half: bits 2-3, 6-7
        full = (full << half_shift[None, :, None, None]).view(Hkv, (e - a) // 64, 2, 32, Dp // 64, 32).sum(2)
        keep = (mask << half_shift).view(-1, 2, 32).sum(1)               # (nblk, 32)
        dst = buf[:, p, :, a // 2:e // 2].view(Hkv, Dp // 64, (e - a) // 64, 32, 32)
        old = dst.to(torch.int32) & ~keep.view(1, 1, -1, 32, 1)
        dst.copy_((old | full.permute(0, 3, 1, 2, 4)).to(torch.uint8))


def chan_codes(buf: torch.Tensor, s0: int, s1: int, bits: int, D: int) -> torch.Tensor:
    """Explicit codes (Hkv, n, D) float32 for tokens [s0, s1)."""
    Hkv = buf.shape[0]
    out = 0
    for p in range(nibble_planes(bits)):
        if bits == 2:
            a, e = s0 // 64 * 64, -(-s1 // 64) * 64
            b = buf[:, p, :, a // 2:e // 2].to(torch.int32)              # (Hkv, Dp/64, rows, 32)
            b = b.view(Hkv, b.shape[1], -1, 1, 32, 32)
            nib = torch.cat([b & 0x33, (b >> 2) & 0x33], 3).flatten(2, 4)  # (Hkv, Dp/64, n64, 32)
            nib = nib[:, :, s0 - a:s1 - a]
        else:
            nib = buf[:, p, :, s0:s1].to(torch.int32)
        c = torch.stack([nib & 15, nib >> 4], 3)                          # (Hkv, Dp/64, n, 2, 32)
        c = c.permute(0, 2, 1, 3, 4).reshape(Hkv, s1 - s0, -1)[..., :D]
        out = out * 16 + c
    return out.float()


def chan_mix(x: torch.Tensor, buf: torch.Tensor, s0: int, s1: int, bits: int, D: int,
             ws, centered: bool = False) -> torch.Tensor:
    """x (Hkv, M, n) float32 or bf16 over tokens [s0, s1) → (Hkv, M, D) float32 = x · C, or
    x · (C − center(bits)) with `centered` (the caller folds Σ x·center into its own
    per-token offsets and saves a pass over x)."""
    Hkv, M, n = x.shape
    nc = buf.shape[2]
    if not op_reads_layout():
        xf = x.float()
        out = torch.bmm(xf, chan_codes(buf, s0, s1, bits, D))                 # (Hkv, M, D)
        if centered:
            out.sub_(xf.sum(-1, keepdim=True), alpha=center(bits) * (17 if bits == 8 else 1))
        return out
    if bits == 2:
        a, e = s0 // 64 * 64, -(-s1 // 64) * 64
        xp = torch.zeros(Hkv, M, e - a, dtype=torch.bfloat16, device=x.device)
        xp[:, :, s0 - a:s1 - a] = x
        xh = xp.view(Hkv, M, -1, 2, 32)                                  # (.., nblk, A/B, 32)
        K = (e - a) // 2
        unit = _unit(K // 32, 64, bits, x.device)
        outs = []
        for h in range(Hkv):
            for c in range(nc):
                b = buf[h, 0, c, a // 2:e // 2]                          # (K, 32)
                m = ws.get_u8("chan2", (2,) + tuple(b.shape), b.device)
                torch.bitwise_and(b, 0x33, out=m[0])
                torch.bitwise_right_shift(b, 2, out=m[1]).bitwise_and_(0x33)
                outs += [_op(xh[h, :, :, i].reshape(M, K).contiguous(), m[i].view(64, K // 2), 32, unit)
                         for i in range(2)]
        o = torch.stack(outs).float().view(Hkv, nc, 2, M, 64).sum(2)
        out = o.permute(0, 2, 1, 3).reshape(Hkv, M, nc * 64)
        if centered:
            return out[..., :D]
        off = xp.float().sum(-1, keepdim=True) * center(bits)
    else:
        xb = x.to(torch.bfloat16).contiguous()
        unit = _unit(n // 32, 64, bits, x.device)
        outs = [_op(xb[h], buf[h, p, c, s0:s1].view(64, n // 2), 32, unit)
                for h in range(Hkv) for c in range(nc) for p in range(nibble_planes(bits))]
        o = torch.stack(outs).float().view(Hkv, nc, nibble_planes(bits), M, 64)
        o = torch.add(o[:, :, 1], o[:, :, 0], alpha=16) if bits == 8 else o[:, :, 0]
        out = o.permute(0, 2, 1, 3).reshape(Hkv, M, nc * 64)
        if centered:
            return out[..., :D]
        off = xb.float().sum(-1, keepdim=True) * (center(bits) * (17 if bits == 8 else 1))
    return out[..., :D].add_(off)
