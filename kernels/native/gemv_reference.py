"""The integer GEMV's math in torch (kernels/native/gemv_quant.c, gemv_int.c): the input
quantizer and the GEMV over its codes, the oracle tests/kernels/test_native_decode_layer_gemv.py
holds the C paths to (the same codes, exact integer block sums, float64 after them)."""
from __future__ import annotations

import torch

QB = 32                          # gemv.h GI_KB: columns per input block, one fp32 scale
QMAX = 32767.0                   # gemv.h GI_QMAX: int16 codes in [-QMAX, QMAX]
TINY = 1e-30                     # gemv_quant.c TINY: a block below it quantizes to zeros


def quantize_input(x: torch.Tensor, qmax: float = QMAX,
                   block: int = QB) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, K) -> codes (B, K) int64 in [-qmax, qmax] and scales d (B, ceil(K / block))
    float32, as gi_quantize: per block of `block` columns d = max|x| / qmax and
    q = round(x * (qmax / max|x|)) in fp32, ties to even as rintf; a block whose max|x| is
    below TINY gets d = 0 and zero codes. The defaults are the shipped input (int16 per 32);
    other widths model other integer inputs (tools/act_quant_fidelity.py)."""
    B, K = x.shape
    nb = -(-K // block)
    xb = torch.nn.functional.pad(x.float(), (0, nb * block - K)).view(B, nb, block)
    amax = xb.abs().amax(-1)                                           # (B, nb)
    live = amax >= TINY
    inv = torch.where(live, torch.full_like(amax, qmax) / amax, torch.zeros_like(amax))  # one
    # rounding, as C's 32767.f / amax (torch computes scalar / tensor as a reciprocal times)
    q = torch.round(xb * inv[..., None]).view(B, nb * block)[:, :K]
    return q.long(), torch.where(live, amax / qmax, torch.zeros_like(amax))


def gemv_int_reference(w: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The integer path's value in float64: (y, mag), y (B, N) = x W^T on x quantized by
    quantize_input, exact int block sums, then per block s_g d_j (c . q)_j (+ sum_g m_g xs_g
    with xs_g the groups' d_j sum(q)_j) for int4, scale_n sum_j d_j (w . q)_j for int8, plus
    the bias; mag (B, N) the sum of the terms' magnitudes, what fp32 rounding scales with.
    w: decode_layer.weight_desc's stored form."""
    q, d = quantize_input(x)
    B, K = q.shape
    nb = d.shape[1]
    pad = nb * QB - K
    qb = torch.nn.functional.pad(q, (0, pad)).view(B, nb, QB).double()             # (B, nb, QB)
    if w["kind"] == "int4":
        G, qw = w["group"], w["qweight"]
        N = qw.shape[0]
        v = qw.view(N, K // G, G // 2)
        codes = torch.cat([v & 15, v >> 4], -1).view(N, nb, QB).double()           # (N, nb, QB)
        s = w["scales"].double().repeat_interleave(G // QB, 1)                      # (N, nb)
        isum = torch.einsum("njk,bjk->bnj", codes, qb)                             # (B, N, nb)
        terms = isum * s[None] * d.double()[:, None]
        xs = (d.double() * qb.sum(-1)).view(B, K // G, G // QB).sum(-1)             # (B, K/G)
        mins = w["mins"].double()[None] * xs[:, None]                               # (B, N, K/G)
        y, mag = terms.sum(-1) + mins.sum(-1), terms.abs().sum(-1) + mins.abs().sum(-1)
    else:
        wq = torch.nn.functional.pad(w["qweight"].long(), (0, pad))
        N = wq.shape[0]
        isum = torch.einsum("njk,bjk->bnj", wq.view(N, nb, QB).double(), qb)
        terms = isum * d.double()[:, None] * w["scales"].double()[None, :, None]
        y, mag = terms.sum(-1), terms.abs().sum(-1)
    if w.get("bias") is not None:
        y = y + w["bias"].double()
    return y, mag
