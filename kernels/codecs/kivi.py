"""KIVI: asymmetric 2/4-bit KV quantization, K per channel and V per token (and 3-bit keys).

Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache" (described
in the GEAR paper, seeds/002_…). Keys have outlier *channels*, so K is quantized per channel
over a group of G tokens (one fp16 (scale, zero) per (head, channel, token group)); values
are quantized per token over groups of g channels. Round-to-nearest, min-max.

Read path, one block of up to `block` tokens at a time, zero points never applied per
element:
    K:  q·k̂_t = q·(s_grp(t) ⊙ c_t) + q·z_grp(t)
    V:  p·V̂[:, γ] = (p ⊙ s_γ)·C[:, γ] + Σ_t p_t z_tγ          (per channel group γ)
K codes live in the channel-major byte planes of chanpack.py: a block is unpacked into a
reused (D, n) buffer per head, scaled in place (the per-channel scale is the wrong axis for
any fold into q: it changes every G tokens inside the contraction over channels), and
multiplied by q in one GEMM. 3-bit codes (keys only, `kivi-3`) are stored as their low
two bits in 2-bit planes and their third bit in 1-bit planes (chanpack.planes), added into
the same unpack buffer before the scale. V codes live in the channel-major int4-GEMM nibble layout
(nibble.py) and are multiplied packed: the per-token scale goes into p, one op call per
head for all channel groups stacked as rows. Neither builds a dequantized copy of the
cache: the buffers hold one block and are reused for every block and layer.
"""
from __future__ import annotations

import torch

from .. import chanpack, nibble
from .base import Codec, Slot
from ..quant import asym_params, dequantize_asym, quantize_asym


class KiviCodec(Codec):
    kind = "kivi"

    def __init__(self, role: str, G: int, bits: int, v_group: int):
        super().__init__(role, G)
        assert bits in (2, 3, 4, 8), bits
        if bits == 3 and role != "k":
            raise ValueError("kivi-3 is a key codec: per-channel keys only")
        self.bits, self.g = bits, v_group
        self.method = f"kivi-{bits}"

    def slots(self, Hkv, D, S):
        if self.role == "k":
            par = (Hkv, S // self.G, D)                       # per (head, token group, channel)
            unit = self.G
        else:
            par = (Hkv, S, D // self.g)                       # per (head, token, channel group)
            unit = 1
        codes = ([Slot(name, "codes", chanpack.shape(w, Hkv, D, S), torch.uint8, 2, chanpack.per_byte(w))
                  for name, w, _ in chanpack.byte_planes(self.bits)] if self.role == "k"
                 else [self._nib_slot(Hkv, D, S, self.bits)])
        return [*codes,
                Slot("scale", "scales_zeros", par, torch.float16, 1, unit),
                Slot("zero", "scales_zeros", par, torch.float16, 1, unit)]

    # -- pack ---------------------------------------------------------------------------
    def pack(self, st, x, s0):
        Hkv, n, D = x.shape
        if self.role == "k":
            G = self.G
            xv = x.view(Hkv, n // G, G, D)                                # (Hkv, nb, G, D)
            scale, zero = asym_params(xv, 2, self.bits)                   # (Hkv, nb, 1, D)
            codes = quantize_asym(xv, scale, zero, self.bits)
            rec = dequantize_asym(codes, scale, zero).view(Hkv, n, D)
            b0 = s0 // G
            st["scale"][:, b0:b0 + n // G] = scale[:, :, 0]
            st["zero"][:, b0:b0 + n // G] = zero[:, :, 0]
        else:
            ng = D // self.g
            xv = x.view(Hkv, n, ng, self.g)                               # (Hkv, n, ng, g)
            scale, zero = asym_params(xv, 3, self.bits)                   # (Hkv, n, ng, 1)
            codes = quantize_asym(xv, scale, zero, self.bits)
            rec = dequantize_asym(codes, scale, zero).view(Hkv, n, D)
            st["scale"][:, s0:s0 + n] = scale[..., 0]
            st["zero"][:, s0:s0 + n] = zero[..., 0]
        if self.role == "k":
            codes = codes.reshape(Hkv, n, D)
            for name, w, sh in chanpack.byte_planes(self.bits):
                chanpack.write(st[name], (codes >> sh) & ((1 << w) - 1), s0, w)
        else:
            self._nib_write(st, codes.reshape(Hkv, n, D), s0, self.bits)
        return rec

    def dequant(self, st, s0, s1):
        if self.role == "k":                                             # integer codes
            C = sum(chanpack.codes(st[name], s0, s1, w) * (1 << sh)
                    for name, w, sh in chanpack.byte_planes(self.bits))
        else:
            C = self._nib_codes(st, s0, s1, self.bits, self.D)
        Hkv, n, D = C.shape
        if self.role == "k":
            G, b0 = self.G, s0 // self.G
            s = st["scale"][:, b0:b0 + n // G, None].float()             # (Hkv, nb, 1, D)
            z = st["zero"][:, b0:b0 + n // G, None].float()
            return (C.view(Hkv, n // G, G, D) * s + z).view(Hkv, n, D)
        ng = D // self.g
        s = st["scale"][:, s0:s1, :, None].float()                       # (Hkv, n, ng, 1)
        z = st["zero"][:, s0:s1, :, None].float()
        return (C.view(Hkv, n, ng, self.g) * s + z).view(Hkv, n, D)

    # -- read path ------------------------------------------------------------------------
    def scores(self, st, qg, s0, s1):
        """K per channel: unpack the block's codes into the reused (D, n) buffer per head
        (chanpack order), scale it in place per (channel, run of 32 tokens), one GEMM, back
        to token order, plus the zero-point term q·z per token group."""
        assert self.role == "k"
        Hkv, R, D = qg.shape
        G, n = self.G, s1 - s0
        planes = chanpack.byte_planes(self.bits)
        bits = planes[0][1]                                              # the "codes" planes' width
        U = max(chanpack.unit(w) for _, w, _ in planes)
        a = s0 // U * U                                                  # block-aligned start
        u = chanpack.unpack_into(st["codes"], a, s1, bits, self.ws)      # (Hkv, D, E, M)
        if self.bits == 3:
            chanpack.add_high(u, st["hi"], a, s1, self.ws)
        E, M = u.shape[2], u.shape[3]
        ga, nb = a // G, (s1 - 1) // G + 1 - a // G                      # groups touched
        sT = st["scale"][:, ga:ga + nb].float().transpose(1, 2)          # (Hkv, D, nb)
        if G == 32 and nb * 32 == E * M:   # run (e, i) is group i·E + e: a view,
            # 44 µs against 127 µs for the gather below (quiet, 1 thread, 4096 tokens)
            sr = sT.view(Hkv, D, M // 32, E).transpose(2, 3).contiguous()
        else:
            sr = sT[:, :, chanpack.group_index(a, s1, bits, G, qg.device)]  # (Hkv, D, E, blocks)
        u.view(Hkv, D, E, M // 32, 32).mul_(sr[..., None])
        raw = torch.bmm(qg, u.view(Hkv, D, E * M))                       # (Hkv, R, E*M)
        sc = chanpack.to_token_order(raw, s0 - a, n, bits,
                                     self.ws.get("kc_sc", (Hkv, R, n), qg.device))
        b0 = s0 // G
        qz = torch.bmm(qg, st["zero"][:, b0:b0 + n // G].float().transpose(1, 2))  # (Hkv, R, n/G)
        sc.view(Hkv, R, n // G, G).add_(qz[..., None])
        return sc

    def mix(self, st, p, s0, s1):
        """V per token: the ng channel groups' scaled probabilities p ⊙ s_γ stacked as rows
        of one packed product per head; row block γ keeps channel group γ."""
        assert self.role == "v"
        Hkv, R, n = p.shape
        g = self.g
        s = st["scale"][:, s0:s1].float().transpose(1, 2).contiguous()    # (Hkv, ng, n)
        ng = s.shape[1]
        x = self.ws.get_as("mix_x", (Hkv, ng, R, n), torch.bfloat16, p.device)
        torch.mul(p[:, None], s[:, :, None], out=x)                      # bf16 straight away
        o = nibble.chan_mix(x.view(Hkv, ng * R, n), st["codes"], s0, s1, self.bits, self.D,
                            self.ws, centered=True)              # x·(C − c0): (Hkv, ng*R, D)
        o = o.view(Hkv, ng, R, ng, g).diagonal(0, 1, 3).permute(0, 1, 3, 2)  # (Hkv, R, ng, g)
        # per-token offsets in one product: Σ_t p_t (c0·s_tγ + z_tγ)
        w = s.mul_(nibble.center(self.bits)).add_(st["zero"][:, s0:s1].float().transpose(1, 2))
        off = torch.bmm(p, w.transpose(1, 2))                            # (Hkv, R, ng)
        out = torch.empty(Hkv, R, ng, g, device=p.device)
        return torch.add(o, off[..., None], out=out).view(Hkv, R, ng * g)
