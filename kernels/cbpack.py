"""Codebook codes: Lloyd-Max levels for rotated coordinates, and their packed groups of 32.

The levels. After an orthogonal rotation that mixes every channel (kernels/hadamard.py), a
head vector x of dimension D divided by its RMS, u = x / rms(x), has coordinates whose
distribution barely depends on the model: for a uniformly random direction it is exactly
the marginal of √D times a point on the unit sphere,
    f(y) ∝ (1 − y²/D)^((D−3)/2),   |y| < √D            (→ N(0, 1) as D grows).
`levels(bits, D)` runs Lloyd-Max (nearest level / conditional mean, alternated to a fixed
point) on that density, once per (bits, D), in float64 on a fine grid, and returns the
2^bits levels, rounded to fp16 values, and the 2^bits − 1 decision boundaries between them
(midpoints of the rounded levels) in float32. The rounding moves a level by at most 2^-11 of
itself (the 4-bit quantizer's own RMS error is ~0.1) and lets a kernel without AVX-512 look a
code up as the two bytes of a half with two byte shuffles, exactly
(native/codebook_portable.c).
Fixed tables and not tables fitted per model: they need no calibration text, no profile
and no search, they are the same for K and V and for every layer, and a model whose rotated
keys are far from this density shows it as error (kvrun ppl), not as a stale fit.

The packed group: 32 codes of `bits` bits in 4·bits bytes, laid out so a 16-lane register
decodes them with shifts and masks only (no code straddles a byte):
    4 bits:  byte i = code i | code (i + 16) << 4                       (16 bytes)
    2 bits:  byte i = code i | code (i+8) << 2 | code (i+16) << 4 | code (i+24) << 6   (8 bytes)
    3 bits:  the low two bits of every code as a 2-bit group (8 bytes), then the high bit
             of code j at bit j of a little-endian 32-bit word (4 bytes)    (12 bytes)
The 3-bit split (llama.cpp's q3_K keeps its high bits apart the same way) costs exactly 3
bits a code, and a kernel decodes it as the 2-bit group plus one masked OR per 16 codes
(AVX-512: the 16-bit slice of the word is the mask register itself); 8 codes in 3 bytes
would straddle bytes and need byte shuffles per code.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

GROUP = 32                      # codes per packed group
BITS = (2, 3, 4)


def group_bytes(bits: int) -> int:
    """Bytes of one packed group of 32 codes."""
    assert bits in BITS, bits
    return 4 * bits


@lru_cache(maxsize=None)
def _lloyd_max(bits: int, D: int) -> tuple[float, ...]:
    """The levels in float64, unrounded (levels() rounds them and takes the boundaries)."""
    assert bits in BITS and D >= 4, (bits, D)
    lim = min(float(np.sqrt(D)), 12.0)                     # beyond 12 the mass is < 1e-30
    y = np.linspace(-lim, lim, 200001)
    f = np.clip(1.0 - y * y / D, 0.0, None) ** ((D - 3) / 2)
    cf, cyf = np.cumsum(f), np.cumsum(y * f)               # cell sums by differences
    n = 1 << bits
    c = np.linspace(-2.0, 2.0, n)                          # symmetric start
    for _ in range(1000):
        b = (c[1:] + c[:-1]) / 2
        idx = np.concatenate([[0], np.searchsorted(y, b), [len(y)]])
        m = np.diff(np.concatenate([[0.0], cf])[idx])
        s = np.diff(np.concatenate([[0.0], cyf])[idx])
        new = s / m
        new = (new - new[::-1]) / 2                         # exact symmetry
        if np.abs(new - c).max() < 1e-12:
            c = new
            break
        c = new
    return tuple(float(v) for v in c)


def levels(bits: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(levels (2^bits,), boundaries (2^bits − 1,)) float32, ascending: the Lloyd-Max
    quantizer of a unit-RMS coordinate of a randomly rotated D-vector (module docstring)."""
    c = torch.tensor(_lloyd_max(bits, D), dtype=torch.float16).float()
    return c, (c[1:] + c[:-1]) / 2


def pack_groups(c: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (..., 32) integer in [0, 2^bits) → packed groups (..., 4·bits) uint8."""
    assert c.shape[-1] == GROUP, c.shape
    c = c.to(torch.uint8)
    if bits == 4:
        return c[..., :16] | (c[..., 16:] << 4)
    lo = c & 3
    crumbs = lo[..., 0:8] | (lo[..., 8:16] << 2) | (lo[..., 16:24] << 4) | (lo[..., 24:32] << 6)
    if bits == 2:
        return crumbs
    hi = ((c >> 2) & 1).reshape(*c.shape[:-1], 4, 8)        # bit j of byte m: code 8m + j
    w = (hi << torch.arange(8, dtype=torch.uint8, device=c.device)).sum(-1, dtype=torch.uint8)
    return torch.cat([crumbs, w], -1)


def unpack_groups(b: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed groups (..., 4·bits) uint8 → codes (..., 32) int64 (pack_groups' inverse)."""
    assert b.shape[-1] == group_bytes(bits), (b.shape, bits)
    b = b.long()
    if bits == 4:
        return torch.cat([b & 15, b >> 4], -1)
    crumbs = torch.cat([(b[..., :8] >> s) & 3 for s in (0, 2, 4, 6)], -1)
    if bits == 2:
        return crumbs
    sh = torch.arange(8, device=b.device)
    hi = ((b[..., 8:12, None] >> sh) & 1).reshape(*b.shape[:-1], GROUP)
    return crumbs | (hi << 2)
