"""The dense (uncompressed) cache: every token in full precision, one buffer per layer of
`max_ctx` tokens, a KVCache (the contract: contract.py). It holds the full-attention
layers; a model's sliding-window layers keep their window in a ring beside it (ring.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrun.kernels import dense_attention
from kvrun.kernels.codecs.base import FpCodec
from kvrun.kernels.dispatch import decode_attention, select
from kvrun.kernels.native.decode_attention import TILE
from ..errors import KvrunError
from .contract import KVCache

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


class DenseKVCache(KVCache):
    """Preallocated full-precision K/V of one sequence for `max_ctx` tokens, all layers in
    one tensor. Its rows never move, so a new prompt may keep any common prefix
    (resume_point); the arena's fp16 tails are for layers of mixed profiles."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_ctx: int,
                 dtype: torch.dtype = torch.float16, device="cpu"):
        shape = (n_layers, 1, n_kv_heads, max_ctx, head_dim)            # (L, 1, Hkv, S, D)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.n_layers, self.max_ctx = n_layers, max_ctx
        self.seq_len = 0
        # the native decode step's view of the cache: an uncompressed tail per layer
        self._tail = (FpCodec("k", TILE, dtype), FpCodec("v", TILE, dtype))
        self._tail_st = [({"x": self.k[l, 0]}, {"x": self.v[l, 0]}) for l in range(n_layers)]
        self.backend = select(device)

    def positions(self, T: int) -> torch.Tensor:
        if self.seq_len + T > self.max_ctx:
            raise KvrunError(f"context full: {self.seq_len} + {T} tokens > context size "
                             f"{self.max_ctx} (raise -c/--ctx-size)")
        return torch.arange(self.seq_len, self.seq_len + T)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (1, H, T, D); k, v: (1, Hkv, T, D), K already rotated. Returns (1, H, T, D).

        A decode step of one sequence on the native backend reads the cache through the
        native attention kernel (the cached tokens as an uncompressed tail of whole
        32-token tiles plus a window, fp32 accumulation): ~3x faster than SDPA over fp16
        K/V on CPU at 4k tokens. Everything else runs `dense_attention` (SDPA)."""
        S, T = self.seq_len, k.shape[2]
        self.k[layer, :, :, S:S + T] = k
        self.v[layer, :, :, S:S + T] = v
        if T == 1 and self.backend == "native":
            nt = S // TILE * TILE
            kl, vl = self.k[layer], self.v[layer]                          # (1, Hkv, S, D)
            return decode_attention(q, (self._tail[0], self._tail_st[layer][0]),
                                    (self._tail[1], self._tail_st[layer][1]), nt,
                                    kl[:, :, nt:S], vl[:, :, nt:S], kl[:, :, S:S + 1],
                                    vl[:, :, S:S + 1], backend="native")
        return dense_attention(q, self.k[layer, :, :, :S + T], self.v[layer, :, :, :S + T], S)

    def ingest(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append already-computed K/V for every layer: k, v: (L, Hkv, n, D), K rotated.
        (Benchmarks fill a cache to a depth this way without running the model.)"""
        S, n = self.seq_len, k.shape[2]
        self.positions(n)
        self.k[:, :, :, S:S + n] = k[:, None]
        self.v[:, :, :, S:S + n] = v[:, None]
        self.seq_len += n

    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer, 0, :, :self.seq_len].float(), self.v[layer, 0, :, :self.seq_len].float()

    def commit(self, T: int) -> None:
        self.seq_len += T

    def truncate(self, n: int) -> int:
        """Keep the first n tokens; returns how many were kept."""
        assert 0 <= n <= self.seq_len
        self.seq_len = n
        return n

    def reset(self) -> None:
        self.seq_len = 0

    def resume_point(self, n: int, chunk: int) -> int:
        """How many of the first n cached tokens a new prompt may keep: all of them (every
        token is held in full precision, as a fresh prefill would hold it)."""
        return min(n, self.seq_len)

    def canonical_tail(self, s: int) -> int:
        """Tokens a fresh prefill of s tokens holds compressed: none."""
        return 0

    def nbytes(self) -> dict[str, int]:
        return {"dense": self.k.nbytes + self.v.nbytes}    # every token, full precision

    def label(self) -> str:
        return next(name for name, dt in KV_DTYPES.items() if dt == self.k.dtype)
