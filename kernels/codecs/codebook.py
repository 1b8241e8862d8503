"""Codebook codecs after rotation (cb-2, cb-3, cb-4): one shared scalar codebook per width.

After a Hadamard rotation every coordinate of a head vector divided by its RMS follows
nearly one fixed distribution, so one table of 2^bits Lloyd-Max levels (kernels/cbpack.py,
computed for a randomly rotated D-vector) quantizes K and V of every layer and head, and
the only metadata is one fp16 scale per (token, head): no zero point, no per-group range.
This is the quantizer of TurboQuant's MSE stage (Zandieh et al. 2025, "TurboQuant:
Online Vector Quantization with Near-optimal Distortion Rate", as vLLM runs it: Hadamard +
Lloyd-Max centroids, without the QJL residual) and the non-uniform levels of KVQuant.

The codec stores rotated rows: it declares `needs_rotation`, and the arena rotates its role
(K: q·k = (qR)·(kR); V: the output is un-rotated once), whatever --kv's "+rot" says.

Per (token, head), x (D,) rotated:
    rms = sqrt(Σ x² / D),  code_d = #{boundaries < x_d / rms},  c_d = level[code_d]
    scale = Σ x² / Σ x_d c_d            (so that x̂ = scale · c keeps x̂·x = |x|²)
The scale is the one that makes x̂'s projection on x exact: a Lloyd-Max code is a shrunken
copy of its input (E[x·c] = E[c²] < E[x²]), and scaling by the RMS alone would shrink
every tail logit q·k̂ by about 1 − MSE (12 % at 2 bits) against the window's exact ones.
Sums of squares and products are taken in float64 and rounded once, so the native flush
(native/codebook_pack.c) writes the same bytes.

Storage (per layer; packed groups of 32 codes, cbpack.py):
    K: codes (Hkv, S/32, D, 4·bits) — per 32-token tile, channel d's 32 tokens in one
       group (a tile is D groups, decoded by channel like KIVI's K);
    V: codes (Hkv, S, D/32, 4·bits) — per token, its D channels in D/32 groups;
    scale (Hkv, S) fp16.
Read path: q·k̂_t = scale_t · (q·c_t), p·V̂ = (p ⊙ scale)·C.
"""
from __future__ import annotations

import torch

from .. import cbpack
from .base import Codec, Slot


class CodebookCodec(Codec):
    kind = "cb"
    needs_rotation = True

    def __init__(self, role: str, G: int, bits: int):
        super().__init__(role, G)
        assert bits in cbpack.BITS, bits
        self.bits = bits
        self.method = f"cb-{bits}"

    def levels(self, D: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(levels, boundaries) float32 for head dim D (cbpack.levels)."""
        return cbpack.levels(self.bits, D)

    def slots(self, Hkv, D, S):
        assert D % cbpack.GROUP == 0, f"{self.method}: head dim {D} is not a multiple of 32"
        assert self.G % cbpack.GROUP == 0 and S % cbpack.GROUP == 0, (self.G, S)
        gb = cbpack.group_bytes(self.bits)
        if self.role == "k":
            codes = Slot("codes", "codes", (Hkv, S // 32, D, gb), torch.uint8, 1, 32)
        else:
            codes = Slot("codes", "codes", (Hkv, S, D // 32, gb), torch.uint8, 1, 1)
        return [codes, Slot("scale", "scales_zeros", (Hkv, S), torch.float16, 1, 1)]

    def _head_dim(self, st) -> int:
        c = st["codes"]                                       # K: (Hkv, S/32, D, gb)
        return c.shape[2] if self.role == "k" else c.shape[2] * 32

    # -- pack --------------------------------------------------------------------------------
    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (Hkv, n, D) float32 → (codes (Hkv, n, D) int64, scale (Hkv, n) fp16)."""
        D = x.shape[-1]
        lv, bd = self.levels(D)
        xd = x.double()
        ss = (xd * xd).sum(-1)                                          # (Hkv, n)
        rms = torch.sqrt(ss / D).float()
        rms = torch.where(rms > 0, rms, torch.ones_like(rms))           # zero rows: code 0s
        codes = torch.bucketize(x / rms[..., None], bd.to(x.device))    # #{b < u}
        xc = (xd * lv.to(x.device)[codes].double()).sum(-1)
        scale = torch.where(xc > 0, ss / xc, torch.zeros_like(ss)).float().half()
        return codes, scale

    def pack(self, st, x, s0):
        Hkv, n, D = x.shape
        assert s0 % 32 == 0 and n % 32 == 0, (s0, n)
        codes, scale = self.quantize(x)
        if self.role == "k":                                 # (Hkv, n/32, D, 32): tile, channel
            g = codes.view(Hkv, n // 32, 32, D).transpose(2, 3)
            st["codes"][:, s0 // 32:(s0 + n) // 32] = cbpack.pack_groups(g, self.bits)
        else:                                                # (Hkv, n, D/32, 32): token, group
            st["codes"][:, s0:s0 + n] = cbpack.pack_groups(codes.view(Hkv, n, D // 32, 32), self.bits)
        st["scale"][:, s0:s0 + n] = scale
        return self.levels(D)[0].to(x.device)[codes] * scale.float()[..., None]

    # -- read path ---------------------------------------------------------------------------
    def unit_rows(self, st, s0: int, s1: int) -> torch.Tensor:
        """The levels of tokens [s0, s1) (Hkv, n, D) float32, before the per-token scale."""
        D = self._head_dim(st)
        lv = self.levels(D)[0].to(st["codes"].device)
        if self.role == "k":
            g = cbpack.unpack_groups(st["codes"][:, s0 // 32:s1 // 32], self.bits)  # (Hkv, n/32, D, 32)
            c = g.transpose(2, 3).reshape(g.shape[0], s1 - s0, D)
        else:
            g = cbpack.unpack_groups(st["codes"][:, s0:s1], self.bits)              # (Hkv, n, D/32, 32)
            c = g.reshape(g.shape[0], s1 - s0, D)
        return lv[c]

    def dequant(self, st, s0, s1):
        return self.unit_rows(st, s0, s1) * st["scale"][:, s0:s1, None].float()

    def scores(self, st, qg, s0, s1):
        sc = torch.bmm(qg, self.unit_rows(st, s0, s1).transpose(1, 2))  # (Hkv, R, n)
        return sc.mul_(st["scale"][:, None, s0:s1].float())

    def mix(self, st, p, s0, s1):
        ps = p * st["scale"][:, None, s0:s1].float()                    # (Hkv, R, n)
        return torch.bmm(ps, self.unit_rows(st, s0, s1))                # (Hkv, R, D)
