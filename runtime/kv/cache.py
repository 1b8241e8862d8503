"""What the caches share: the float dtypes of the uncompressed methods, and `NewKV`, the
form one step's K/V takes from the model's attention (KVCache.attend_new)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvrun.kernels.backend import Backend, named


KV_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class NewKV:
    """One step's K/V as the model's attention hands it to the cache: in the form the fused
    write ops take (kernels/window_write.py) — K before RoPE with the cos/sin of its
    positions, and V either as the projection's operands (v_x, v_weight, v_bias: the op runs
    the GEMM in its epilogue) or as rows `v` (a weight-quantized v_proj ran its own op) —
    and `rows()`, the same step as K after RoPE and V rows, for every other route."""
    k: torch.Tensor                          # (1, Hkv, T, D) before RoPE
    cos: torch.Tensor                        # (T, D)
    sin: torch.Tensor                        # (T, D)
    v: torch.Tensor | None = None            # (1, Hkv, T, D) V rows, or
    v_x: torch.Tensor | None = None          # (T, hidden) the V projection's input,
    v_weight: torch.Tensor | None = None     # (Hkv·D, hidden)
    v_bias: torch.Tensor | None = None       # (Hkv·D,) or None
    rotated: Callable[[], tuple] | None = None   # () -> (K after RoPE, V rows), as attend takes them

    def __post_init__(self):
        assert (self.v is None) != (self.v_weight is None), "V as rows or as x @ Wvᵀ, not both"

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) (1, Hkv, T, D): K after RoPE and the V rows, computed as the model's
        attention computes them for `attend`."""
        if self.rotated is not None:
            return self.rotated()
        from kvrun.kernels.rope import apply_rope
        assert self.v is not None, "V given as operands needs `rotated`"
        return apply_rope(self.k, self.cos, self.sin), self.v


class OnBackend:
    """A cache (or a cache's part) bound to a kernels backend (kernels/backend.py): `bind`
    holds it in `kernels` and resolves the routes the part runs; `backend` is its name,
    which tests and tools comparing backends may set (the routes are resolved again)."""
    kernels: Backend

    def bind(self, backend: Backend) -> None:
        raise NotImplementedError

    @property
    def backend(self) -> str:
        """The backend's name (native | triton | torch)."""
        return self.kernels.name

    @backend.setter
    def backend(self, name: str) -> None:
        self.bind(named(name))
