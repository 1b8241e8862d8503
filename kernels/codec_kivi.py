"""KIVI: asymmetric 2/4-bit KV quantization, K per channel and V per token.

Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache" (described
in the GEAR paper, seeds/002_…). Keys have outlier *channels*, so K is quantized per channel
over a group of G tokens (one fp16 (scale, zero) per (head, channel, token group)); values
are quantized per token over groups of g channels. Round-to-nearest, min-max.

Read path, one block of up to `block` tokens at a time, zero points never applied per
element:
    K:  q·k̂_t = α_t q·(s ⊙ v_t) + β_t Σ(q ⊙ s_grp(t)) + q·z_grp(t)
    V:  p·V̂[:, γ] = (p ⊙ s_γ)·C[:, γ] + Σ_t p_t z_tγ          (per channel group γ)
K: v are the unpacked plane values and (α, β) the per-token plane fold (quant.py). V codes
live in the channel-major int4-GEMM nibble layout (nibble.py) and are multiplied packed:
the per-token scale goes into p, one op call per head for all channel groups stacked as
rows (the op's scales run along tokens per channel — the wrong axis for per-token V). The
per-channel K scale is the wrong axis for the op too (it would need one call per token
group), so K keeps the unpack path below. The
per-channel scale is applied to the reused unpack buffer in place (one pass) rather than
folded into q per token group: the fold needs one tiny GEMM per (head, group) — measured
~2x slower on CPU than one (R, D) x (D, n) product. Neither builds a dequantized copy of
the cache: the buffer holds one block and is reused for every block and layer.
"""
from __future__ import annotations

import torch

from . import nibble
from .codec_base import Codec, Slot
from .quant import asym_params, dequantize_asym, pack_codes, planes, plane_fold, quantize_asym, unpack_codes_into


class KiviCodec(Codec):
    def __init__(self, role: str, G: int, bits: int, v_group: int):
        super().__init__(role, G)
        assert bits in (2, 4, 8), bits
        self.bits, self.g = bits, v_group
        self.method = f"kivi-{bits}"

    def slots(self, Hkv, D, S):
        P = planes(self.bits)
        if self.role == "k":
            par = (Hkv, S // self.G, D)                       # per (head, token group, channel)
            unit = self.G
        else:
            par = (Hkv, S, D // self.g)                       # per (head, token, channel group)
            unit = 1
        codes = (Slot("codes", "codes", (Hkv, S // P, D), torch.int32, 1, P) if self.role == "k"
                 else self._nib_slot(Hkv, D, S, self.bits))
        return [codes,
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
            P = planes(self.bits)
            st["codes"][:, s0 // P:(s0 + n) // P] = pack_codes(codes.reshape(Hkv, n, D), self.bits, self.G)
        else:
            self._nib_write(st, codes.reshape(Hkv, n, D), s0, self.bits)
        return rec

    def codes(self, st, s0, s1, scale=None, view=None):
        """Unpacked values v (Hkv, n, D) in a reused buffer (optionally times `scale`, see
        quant.unpack_codes_into), and (α, β) (n,) with codes c = α v + β."""
        P = planes(self.bits)
        w = st["codes"][:, s0 // P:s1 // P]
        buf = self.ws.get("c", (w.shape[0], s1 - s0, w.shape[2]), w.device)
        v = unpack_codes_into(w, self.bits, self.G, buf, scale, view)
        return v, *plane_fold(s1 - s0, self.bits, self.G, w.device)

    def dequant(self, st, s0, s1):
        if self.role == "k":
            v, alpha, beta = self.codes(st, s0, s1)
            C = v * alpha[:, None] + beta[:, None]                       # integer codes
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
        """K per channel: the block buffer is unpacked *and* scaled in one pass (u = s ⊙ v),
        then one (R, D) x (D, n) product for all tokens; measured ~2x faster on CPU than
        folding s into q per token group (hundreds of tiny batched GEMMs). With
        k̂ = s (α v + β) + z:   q·k̂_t = α_t q·u_t + β_t Σ(q⊙s) + q·z."""
        assert self.role == "k"
        Hkv, R, D = qg.shape
        G, n = self.G, s1 - s0
        nb, b0 = n // G, s0 // G
        s = st["scale"][:, b0:b0 + nb].float()                           # (Hkv, nb, D)
        z = st["zero"][:, b0:b0 + nb].float()
        u, alpha, beta = self.codes(st, s0, s1, s[:, :, None], (Hkv, nb, G, D))
        sc = torch.bmm(qg, u.transpose(1, 2)).view(Hkv, R, nb, G)        # (Hkv, R, nb, G)
        qs = torch.bmm(qg, s.transpose(1, 2))                            # (Hkv, R, nb)
        qz = torch.bmm(qg, z.transpose(1, 2))                            # (Hkv, R, nb)
        sc.mul_(alpha[:G]).add_(qs[..., None] * beta[:G]).add_(qz[..., None])
        return sc.view(Hkv, R, n)

    def mix(self, st, p, s0, s1):
        """V per token: the ng channel groups' scaled probabilities p ⊙ s_γ stacked as rows
        of one packed product per head; row block γ keeps channel group γ."""
        assert self.role == "v"
        Hkv, R, n = p.shape
        g = self.g
        s = st["scale"][:, s0:s1].float()                                # (Hkv, n, ng)
        ng = s.shape[-1]
        x = (p[:, None] * s.transpose(1, 2)[:, :, None]).reshape(Hkv, ng * R, n)  # (Hkv, ng*R, n)
        o = nibble.chan_mix(x, st["codes"], s0, s1, self.bits, self.D, self.ws)  # (Hkv, ng*R, D)
        o = o.view(Hkv, ng, R, ng, g).diagonal(0, 1, 3)                  # (Hkv, R, g, ng)
        o = o.permute(0, 1, 3, 2).reshape(Hkv, R, ng * g)
        return o.add_(torch.bmm(p, st["zero"][:, s0:s1].float()).repeat_interleave(g, -1))
