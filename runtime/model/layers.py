"""Building blocks: RMSNorm, RoPE's identity tables, the logits' last scaling, and a Linear that can hold a second, decode-friendly copy.

Decode on CPU is bound by reading the weights: a single-row GEMV over fp16 weights reads
half the bytes of fp32, while a many-row prefill GEMM is fastest in fp32 (no AMX/bf16
units on the reference machine). `Linear` therefore keeps its `weight` in the model's
compute dtype and, when `set_gemv_dtype` was called, a copy in the GEMV dtype that is
used whenever the input has few rows. Activations keep the compute dtype throughout:
only the GEMV input is cast, so norms, RoPE and softmax never run in half precision.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Inputs with at most this many rows use the GEMV copy (decode, speculative-style steps).
GEMV_MAX_ROWS = 4


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)

    def multiplier(self) -> torch.Tensor:
        """The fp32 vector the normalized rows are multiplied by (the native step's norm)."""
        return self.weight.detach().float()


class NoRope:
    """RoPE tables that rotate nothing (cos 1, sin 0: apply_rope returns its input bit for
    bit), for layers without positional encoding (SmolLM3's NoPE layers). Same interface
    as kernels/rope.py `Rope`, so every path that takes RoPE tables takes these."""

    def __init__(self, head_dim: int):
        self.head_dim = head_dim

    def tables(self, positions: torch.Tensor, dtype: torch.dtype):
        shape = (positions.shape[0], self.head_dim)                      # (T, D)
        return torch.ones(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


def final_logits(logits: torch.Tensor, scaling: float, cap: float | None) -> torch.Tensor:
    """lm_head's output divided by `scaling` (Granite's logits_scaling), then soft-capped
    to cap·tanh(x / cap) where `cap` is set; both the eager forward and the native step
    end here."""
    if scaling != 1.0:
        logits = logits / scaling
    return logits if cap is None else torch.tanh(logits / cap) * cap


class Linear(nn.Module):
    """y = x Wᵀ + b with W: (out, in), named like `nn.Linear` so HF weights load strictly."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.gemv_weight: torch.Tensor | None = None     # not in the state dict

    def set_gemv_dtype(self, dtype: torch.dtype | None) -> None:
        if dtype is None or dtype == self.weight.dtype:
            self.gemv_weight = None
        else:
            self.gemv_weight = self.weight.detach().to(dtype)

    def weight_for(self, rows: int) -> torch.Tensor:
        """The weight `rows` input rows are multiplied by: the GEMV copy for few rows (a
        fused op that runs this projection itself, e.g. the cache's write_v, reads
        the same bytes)."""
        w = self.gemv_weight
        return w if w is not None and rows <= GEMV_MAX_ROWS else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight_for(x.numel() // x.shape[-1])
        if w is not self.weight:
            y = F.linear(x.to(w.dtype), w).to(x.dtype)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)).

    `linear(in, out)` builds each projection (dense `Linear`, or a quantized layer from
    qlinear.make_linear)."""

    def __init__(self, hidden: int, intermediate: int, linear=Linear):
        super().__init__()
        self.gate_proj = linear(hidden, intermediate)
        self.up_proj = linear(hidden, intermediate)
        self.down_proj = linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
