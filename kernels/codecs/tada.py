"""TaDA: mean-centred KV quantization (seeds/000_…, §3.1–3.3).

Per token t the mean over the KV heads μ_t = mean_h x_{t,h} (K after RoPE, V after the
projection) is stored once, and the deviations d_{t,h} = μ̂_t − x_{t,h} are quantized
asymmetrically per (token, head) over the whole head dim (the paper's 2/128 scale overhead
= one fp16 scale + zero per head vector). Reconstruction x̂_{t,h} = μ̂_t − deq(d_{t,h}).

μ is stored in fp16, or (tada_mu="int8") symmetric int8 with one fp16 scale per token —
with GQA's few KV heads μ costs 1/Hkv of an fp16 cache (a third for SmolLM2), so the int8
option matters. Deviations are taken from the *stored* μ̂, so μ's rounding error is
absorbed into d rather than added on top of it.

Read path: q·x̂_t,h = q·μ̂_t − s_t,h (q·c_t,h) − z_t,h Σ_d q_d. The q·μ̂ term is one matmul of
all H query heads against the block's means (μ is read once per token for every head).
V: p·V̂ = p·μ̂ − (p ⊙ s)·C − p·z. The deviation codes live in the int4-GEMM nibble layout
(nibble.py: token-major for K, channel-major for V), so q·c and (p ⊙ s)·C run on the packed
codes; an 8-bit deviation is two nibble planes.
"""
from __future__ import annotations

import torch

from .. import nibble
from .base import Codec, Slot
from ..quant import (asym_params, dequantize_asym, pack_codes, plane_fold, quantize_asym,
                    quantize_sym_int8, sym_int8_params, unpack_codes_into)


class TadaCodec(Codec):
    kind = "tada"

    def __init__(self, role: str, G: int, bits: int, mu: str = "fp16"):
        super().__init__(role, G)
        assert bits in (2, 4, 8) and mu in ("fp16", "int8"), (bits, mu)
        self.bits, self.mu = bits, mu
        self.method = f"tada-{bits}"

    def slots(self, Hkv, D, S):
        sl = [self._nib_slot(Hkv, D, S, self.bits),
              Slot("scale", "scales_zeros", (Hkv, S), torch.float16, 1, 1),
              Slot("zero", "scales_zeros", (Hkv, S), torch.float16, 1, 1)]
        if self.mu == "fp16":
            sl.append(Slot("mu", "means", (S, D), torch.float16, 0, 1))
        else:
            sl += [Slot("mu", "means", (S // 4, D), torch.int32, 0, 4),
                   Slot("mu_scale", "means", (S,), torch.float16, 0, 1)]
        return sl

    def pack(self, st, x, s0, mu=None):
        """mu: optional (n, D) means to use instead of mean_h x (NaN rows: compute). Re-packing
        a reconstruction with its own stored means (token eviction's compaction) is then
        exact up to fp32 rounding: d = μ̂ − x̂ is the old deviation grid, whose min-max
        parameters and codes come back unchanged. Recomputing μ from x̂ instead shifts the
        deviations by mean_h(deq d) and re-grids them: ~0.07 mean drift per re-pack, which
        compounds over compactions."""
        Hkv, n, D = x.shape
        mu = x.mean(0) if mu is None else torch.where(torch.isnan(mu), x.mean(0), mu)  # (n, D)
        if self.mu == "fp16":
            st["mu"][s0:s0 + n] = mu
            mu_hat = st["mu"][s0:s0 + n].float()
        else:
            ms = sym_int8_params(mu, -1)                                 # (n, 1)
            cm = quantize_sym_int8(mu, ms)                               # (n, D) uint8, +128
            st["mu"][s0 // 4:(s0 + n) // 4] = pack_codes(cm, 8, self.G)
            st["mu_scale"][s0:s0 + n] = ms[:, 0]
            mu_hat = (cm.float() - 128) * ms.float()
        d = mu_hat[None] - x                                             # (Hkv, n, D)
        scale, zero = asym_params(d, 2, self.bits)                       # (Hkv, n, 1)
        codes = quantize_asym(d, scale, zero, self.bits)
        self._nib_write(st, codes, s0, self.bits)
        st["scale"][:, s0:s0 + n] = scale[..., 0]
        st["zero"][:, s0:s0 + n] = zero[..., 0]
        return mu_hat[None] - dequantize_asym(codes, scale, zero)

    def _mu(self, st, s0, s1):
        """μ̂ block as (values (n, D), per-token scale (n,) or None, offset (n,) or None):
        μ̂_t = scale_t · values_t + offset_t."""
        if self.mu == "fp16":
            m = st["mu"][s0:s1]
            return self.ws.get("mu", tuple(m.shape), m.device).copy_(m), None, None
        w = st["mu"][s0 // 4:s1 // 4]
        buf = self.ws.get("mu", (s1 - s0, w.shape[-1]), w.device)
        v = unpack_codes_into(w, 8, self.G, buf)
        alpha, beta = plane_fold(s1 - s0, 8, self.G, w.device)
        ms = st["mu_scale"][s0:s1].float()
        return v, ms * alpha, ms * (beta - 128.0)

    def means(self, st, s0, s1):
        """The stored means μ̂ of tokens [s0, s1) as (n, D) float32."""
        mv, ma, mb = self._mu(st, s0, s1)
        return mv.clone() if ma is None else mv * ma[:, None] + mb[:, None]

    def dequant(self, st, s0, s1):
        mu = self.means(st, s0, s1)
        c = self._nib_codes(st, s0, s1, self.bits, mu.shape[-1])        # (Hkv, n, D)
        s = st["scale"][:, s0:s1, None].float()
        return mu[None] - (c * s + st["zero"][:, s0:s1, None].float())

    def scores(self, st, qg, s0, s1):
        Hkv, R, D = qg.shape
        n = s1 - s0
        qf = qg.reshape(Hkv * R, D)
        mv, ma, mb = self._mu(st, s0, s1)
        qmu = torch.mm(qf, mv.t())                                       # (Hkv*R, n)
        if ma is not None:
            qmu.mul_(ma).addcmul_(qf.sum(-1, keepdim=True), mb)
        qc = nibble.tok_dot(qg, st["codes"], s0, s1, self.bits, self.ws)  # (Hkv, R, n)
        qc.mul_(st["scale"][:, None, s0:s1].float())
        qc.addcmul_(qg.sum(-1, keepdim=True), st["zero"][:, None, s0:s1].float())
        return torch.sub(qmu.view(Hkv, R, n), qc)

    def mix(self, st, p, s0, s1):
        Hkv, R, n = p.shape
        pm = p.reshape(Hkv * R, n)
        mv, ma, mb = self._mu(st, s0, s1)
        pmu = torch.mm(pm if ma is None else pm * ma, mv)                # (Hkv*R, D)
        if mb is not None:
            pmu.add_(torch.mv(pm, mb)[:, None])
        D = pmu.shape[-1]
        pc = nibble.chan_mix(p * st["scale"][:, None, s0:s1].float(), st["codes"], s0, s1, self.bits,
                             D, self.ws)                                 # (Hkv, R, D)
        pz = torch.bmm(p, st["zero"][:, s0:s1, None].float())            # (Hkv, R, 1)
        return pmu.view(Hkv, R, -1).sub_(pc).sub_(pz)
