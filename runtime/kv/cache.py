"""What the caches share: the float dtypes of the uncompressed methods, and `NewKV`, the
form one step's K/V takes on the fused-write route (KVCache.write_attend)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


KV_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class NewKV:
    """One step's K/V in the form the fused write ops take (kernels/fused_compress.py): K
    before RoPE with the cos/sin of its positions, and V either as the projection's operands
    (v_x, v_weight, v_bias: the op runs the GEMM in its epilogue) or as rows `v` (a
    weight-quantized v_proj ran its own op)."""
    k: torch.Tensor                          # (1, Hkv, T, D) before RoPE
    cos: torch.Tensor                        # (T, D)
    sin: torch.Tensor                        # (T, D)
    v: torch.Tensor | None = None            # (1, Hkv, T, D) V rows, or
    v_x: torch.Tensor | None = None          # (T, hidden) the V projection's input,
    v_weight: torch.Tensor | None = None     # (Hkv·D, hidden)
    v_bias: torch.Tensor | None = None       # (Hkv·D,) or None

    def __post_init__(self):
        assert (self.v is None) != (self.v_weight is None), "V as rows or as x @ Wvᵀ, not both"
