"""kvrun.kernels — one op per module: the Triton kernel, its launcher and the torch
implementation (used on CPU and as the test oracle). Nothing here imports kvrun.runtime."""
from .dense_attention import causal_mask, dense_attention

__all__ = ["causal_mask", "dense_attention"]
