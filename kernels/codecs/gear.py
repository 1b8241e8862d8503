"""GEAR / GEAR-L: a KIVI backbone plus a low-rank (and, for GEAR, sparse) error correction.

Kang et al. 2024, "GEAR: An Efficient KV Cache Compression Recipe" (seeds/002_…, §3, App. 8):
    X ≈ D̂ + L + S,   S = Filter_s(X),   D̂ = Quant_b(X − S),   L = A Bᵀ ≈ SVD_r(X − D̂ − S)
- S (GEAR only): the top and bottom s/2 % entries of each vector kept in full precision —
  per channel for K (vectors of the G tokens of a block), per token for V (vectors of D
  channels). To preallocate, the count per vector is fixed: k = max(1, round(s/200 · len))
  per side, so at small lengths the effective sparsity exceeds s (G=32, s=2 → 2 of 32).
  Stored as (uint8 position in the vector, fp16 value).
- L: per KV head and per flushed block of G tokens, rank r by GEAR's power iteration
  (Algorithm 2; fixed start matrix so packing is deterministic and chunking-independent);
  A: (G, r), B: (D, r), fp16.
Read path: q·L_tᵀ = (q B) A_tᵀ and p·L = (p A) Bᵀ — the low-rank matrix is never built;
outliers are gathered/scattered against q or p.
"""
from __future__ import annotations

import torch

from .base import Slot
from .kivi import KiviCodec

POWER_ITERS = 3


def outliers_per_side(sparsity: float, length: int) -> int:
    return max(1, round(sparsity / 200.0 * length))


def power_lowrank(X: torch.Tensor, B0: torch.Tensor, iters: int = POWER_ITERS):
    """X: (N, m, d) → A: (N, m, r) orthonormal columns, B: (N, d, r), A Bᵀ ≈ rank-r of X."""
    B = B0.expand(X.shape[0], *B0.shape)
    A = None
    for i in range(iters):
        if i == iters - 1:
            B = torch.linalg.qr(B).Q
        A = torch.bmm(X, B)                                              # (N, m, r)
        if i == iters - 1:
            A = torch.linalg.qr(A).Q
        B = torch.bmm(X.transpose(1, 2), A)                              # (N, d, r)
    return A, B


class GearCodec(KiviCodec):
    kind = "gear"

    def __init__(self, role: str, G: int, bits: int, v_group: int, rank: int,
                 sparsity: float | None):
        super().__init__(role, G, bits, v_group)
        self.rank, self.sparsity = rank, sparsity
        self.method = ("gear" if sparsity else "gear-l") + f"-{bits}"
        self._B0: dict[int, torch.Tensor] = {}

    def outliers_per_row(self, D: int) -> int:
        """Outliers kept per side of one row (a token block of G for K, a row of D for V)."""
        length = self.G if self.role == "k" else D
        return outliers_per_side(self.sparsity, length)

    def slots(self, Hkv, D, S):
        G, r = self.G, self.rank
        sl = super().slots(Hkv, D, S)
        sl += [Slot("lr_a", "lowrank", (Hkv, S, r), torch.float16, 1, 1),
               Slot("lr_b", "lowrank", (Hkv, S // G, D, r), torch.float16, 1, G)]
        if self.sparsity:
            k2 = 2 * self.outliers_per_row(D)
            if self.role == "k":                                         # per (block, channel)
                shp, unit = (Hkv, S // G, D, k2), G
            else:                                                        # per token
                shp, unit = (Hkv, S, k2), 1
            sl += [Slot("out_idx", "outliers", shp, torch.uint8, 1, unit),
                   Slot("out_val", "outliers", shp, torch.float16, 1, unit)]
        return sl

    # -- pack ---------------------------------------------------------------------------
    def store(self, st, x, s0):
        self.pack(st, x, s0, want_rec=False)

    def pack(self, st, x, s0, want_rec=True):
        Hkv, n, D = x.shape
        G = self.G
        nb, b0 = n // G, s0 // G
        sparse = torch.zeros_like(x)
        if self.sparsity:
            k = self.outliers_per_row(D)
            if self.role == "k":
                xv = x.view(Hkv, nb, G, D)
                hi = xv.topk(k, dim=2).indices
                lo = (-xv).topk(k, dim=2).indices
                idx = torch.cat([hi, lo], 2)                             # (Hkv, nb, 2k, D)
                val = xv.gather(2, idx)
                sparse.view(Hkv, nb, G, D).scatter_(2, idx, val)
                st["out_idx"][:, b0:b0 + nb] = idx.transpose(2, 3)       # (Hkv, nb, D, 2k)
                st["out_val"][:, b0:b0 + nb] = val.transpose(2, 3)
            else:
                hi = x.topk(k, dim=2).indices
                lo = (-x).topk(k, dim=2).indices
                idx = torch.cat([hi, lo], 2)                             # (Hkv, n, 2k)
                val = x.gather(2, idx)
                sparse.scatter_(2, idx, val)
                st["out_idx"][:, s0:s0 + n] = idx
                st["out_val"][:, s0:s0 + n] = val
            # the stored (fp16) outliers are what the read path adds back
            sparse = torch.where(sparse != 0, sparse.half().float(), sparse)
        rec = super().pack(st, x - sparse, s0)                           # quantized backbone D̂
        res = (x - sparse - rec).view(Hkv * nb, G, D)                    # residual per (head, block)
        A, B = power_lowrank(res, self._start(D, res.device))
        st["lr_a"][:, s0:s0 + n] = A.reshape(Hkv, n, self.rank)
        st["lr_b"][:, b0:b0 + nb] = B.view(Hkv, nb, D, self.rank)
        return self.dequant(st, s0, s0 + n) if want_rec else None

    def _start(self, D, device):
        if D not in self._B0:
            g = torch.Generator().manual_seed(0)
            self._B0[D] = torch.randn(D, self.rank, generator=g)
        return self._B0[D].to(device)

    def _factors(self, st, s0, s1):
        """Low-rank factors of the blocks in [s0, s1): A (Hkv, nb, G, r), B (Hkv, nb, D, r)."""
        G, b0, nb = self.G, s0 // self.G, (s1 - s0) // self.G
        A = st["lr_a"][:, s0:s1].float().view(-1, nb, G, self.rank)
        return A, st["lr_b"][:, b0:b0 + nb].float()

    def dequant(self, st, s0, s1):
        x = super().dequant(st, s0, s1)                                  # (Hkv, n, D)
        Hkv, n, D = x.shape
        G, nb, b0 = self.G, n // self.G, s0 // self.G
        A, B = self._factors(st, s0, s1)
        x += torch.matmul(A, B.transpose(-1, -2)).view(Hkv, n, D)
        if self.sparsity:
            if self.role == "k":
                idx = st["out_idx"][:, b0:b0 + nb].long().transpose(2, 3)   # (Hkv, nb, 2k, D)
                val = st["out_val"][:, b0:b0 + nb].float().transpose(2, 3)
                x.view(Hkv, nb, G, D).scatter_add_(2, idx, val)
            else:
                x.scatter_add_(2, st["out_idx"][:, s0:s1].long(), st["out_val"][:, s0:s1].float())
        return x

    # -- read path ------------------------------------------------------------------------
    def scores(self, st, qg, s0, s1):
        sc = super().scores(st, qg, s0, s1)                              # (Hkv, R, n)
        Hkv, R, n = sc.shape
        G = self.G
        nb, b0 = n // G, s0 // G
        sb = sc.view(Hkv, R, nb, G)
        A, B = self._factors(st, s0, s1)
        qB = torch.matmul(qg[:, None], B)                                # (Hkv, nb, R, r)
        sb.add_(torch.matmul(qB, A.transpose(-1, -2)).transpose(1, 2))  # (Hkv, R, nb, G)
        if self.sparsity:
            idx = st["out_idx"][:, b0:b0 + nb].long()                    # (Hkv, nb, D, 2k)
            val = st["out_val"][:, b0:b0 + nb].float()
            D, k2 = idx.shape[2], idx.shape[3]
            qv = qg[:, :, None, :, None] * val[:, None]                  # (Hkv, R, nb, D, 2k)
            ix = idx[:, None].expand(Hkv, R, nb, D, k2)
            sb.scatter_add_(3, ix.reshape(Hkv, R, nb, D * k2), qv.reshape(Hkv, R, nb, D * k2))
        return sc

    def mix(self, st, p, s0, s1):
        o = super().mix(st, p, s0, s1)                                   # (Hkv, R, D)
        Hkv, R, n = p.shape
        G = self.G
        nb = n // G
        A, B = self._factors(st, s0, s1)
        pA = torch.matmul(p.view(Hkv, R, nb, G).transpose(1, 2), A)      # (Hkv, nb, R, r)
        o += torch.einsum("hbrk,hbdk->hrd", pA, B)
        if self.sparsity:
            idx = st["out_idx"][:, s0:s1].long()                         # (Hkv, n, 2k)
            val = st["out_val"][:, s0:s1].float()
            k2 = idx.shape[2]
            pv = p[..., None] * val[:, None]                             # (Hkv, R, n, 2k)
            ix = idx[:, None].expand(Hkv, R, n, k2)
            o.scatter_add_(2, ix.reshape(Hkv, R, n * k2), pv.reshape(Hkv, R, n * k2))
        return o
