"""The KV-cache contract: what the model, the engine and the evaluations may ask of a cache.

Every cache `make_cache` builds — `KVArena` (arena.py) and `LayeredKVCache` (ring.py:
sliding-window layers in a ring beside an arena) — subclasses
`KVCache`. The abstract methods are what each must implement; the rest have the defaults a
plain cache wants, so callers never probe with `getattr`.

One step, for a decode token or a prefill chunk of T tokens, is
`positions(T)` → per layer `attend(layer, q, k, v)` (or `attend_new(layer, q, NewKV)`,
the same step from K before RoPE) → `commit(T)`. `attend` is the one write path: it
appends k, v (K already RoPE-rotated) to the layer and attends q over everything the layer
holds, causally among the new tokens; a compressed tail cannot be returned as (k, v), hence
the inverted call.

A cache is storage and bookkeeping: which kernel serves a layer was resolved when it was
built, from the backend it was given (kernels/backend.py); nothing here says how a step is
computed. The model's one-call native step drives the caches it knows kernels for by their
storage (model/native_rows.py: a cache as a row of that step), and every other cache by
this contract.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import torch

from .cache import NewKV
from .snapshot import Snapshot


class KVCache(ABC):
    """A sequence's KV cache: `max_ctx` tokens preallocated, `seq_len` of them cached."""

    max_ctx: int                        # tokens the cache was allocated for (-c)
    n_layers: int                       # model layers it holds
    seq_len: int                        # tokens cached (evicted ones included: positions stay absolute)
    kv = None                           # the KVConfig it was built for
    can_shift = False                   # a full context shifts (the arena's shift()) or errors
    n_tail: Sequence[int] = (0,)        # tokens each full-attention layer holds in its tail
    backend: str = "torch"              # the kernels' backend's name, chosen once at
                                        # construction (kernels/backend.py)

    @abstractmethod
    def positions(self, T: int) -> torch.Tensor:
        """(T,) RoPE positions of T new tokens; KvrunError when the context is full."""

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, H, T, D); k, v (B, Hkv, T, D), K rotated → o (B, H, T, D)."""

    @abstractmethod
    def commit(self, T: int) -> None:
        """After every layer ran: the T new tokens are cached."""

    @abstractmethod
    def truncate(self, n: int) -> int:
        """Keep the first n tokens; returns how many were kept (a cache may keep fewer)."""

    @abstractmethod
    def reset(self) -> None:
        """Empty the cache (its memory stays allocated)."""

    @abstractmethod
    def resume_point(self, n: int, chunk: int) -> int:
        """How many of the first n cached tokens a new prompt may keep and still get what
        a fresh prefill in chunks of `chunk` gives."""

    @abstractmethod
    def canonical_tail(self, s: int) -> int:
        """Tokens a fresh prefill of s tokens holds compressed."""

    @abstractmethod
    def ingest(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append already-computed K/V of every model layer, (L, Hkv, n, D) each, K rotated
        (benchmarks fill a cache to a depth without running the model)."""

    @abstractmethod
    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V rows `layer` holds, (Hkv, n, D) float32 each, oldest first, in the
        model's space (K after RoPE, stored rotations undone, codes dequantized): all
        seq_len tokens, a sliding layer its last min(seq_len, window)."""

    @abstractmethod
    def nbytes(self) -> dict[str, int]:
        """Exact allocated bytes by component."""

    @abstractmethod
    def snapshot(self) -> "Snapshot":
        """A copy of the state held (kv/snapshot.py): the compressed bytes as stored, the
        window, rings and counters; KvrunError for a cache that cannot be saved."""

    @abstractmethod
    def restore(self, snap: "Snapshot") -> None:
        """Replace the state with `snap`, taken from a cache of the same KV config (any
        max_ctx that holds it); KvrunError, the cache unchanged, when it does not fit."""

    @abstractmethod
    def label(self) -> str:
        """The method as --kv names it: fp16, kivi-4/kivi-2, auto, profile:NAME, …"""

    # -- with defaults ------------------------------------------------------------------------
    def all_rows(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every layer, (L, Hkv, seq_len, D) in `dtype`: `rows` one layer at a
        time into the output (one layer's float32 rows at most beside it), the positions a
        sliding layer no longer holds zero. What `ingest` takes back (it reads a sliding
        layer's last window only)."""
        out = None
        for layer in range(self.n_layers):
            k, v = self.rows(layer)
            if out is None:
                out = [k.new_zeros(self.n_layers, k.shape[0], self.seq_len, k.shape[2], dtype=dtype)
                       for _ in range(2)]
            n = k.shape[1]
            out[0][layer, :, self.seq_len - n:] = k
            out[1][layer, :, self.seq_len - n:] = v
        return out[0], out[1]

    def bytes_per_token(self) -> float:
        """Allocated bytes per token of context, all layers, K and V."""
        return sum(self.nbytes().values()) / self.max_ctx

    def n_compressed(self) -> int:
        """Tokens held compressed (the most over layers): the ones a new prompt's prefix
        reuse must find where a fresh prefill would have put them (resume_point)."""
        return max(self.n_tail)

    def attend_new(self, layer: int, q: torch.Tensor, new: "NewKV") -> torch.Tensor:
        """`attend` with the step's K before RoPE and V as the model computed them
        (kv/cache.py NewKV): a cache whose layer has a fused window write (the arena on
        torch and Triton) runs RoPE and V's projection inside it; every other takes
        `new.rows()` to `attend`. The same step contract either way."""
        return self.attend(layer, q, *new.rows())

    def end_prompt(self) -> None:
        """The prompt is prefilled; decoding (or a scored continuation) follows. A cache that
        holds something for the prompt's chunks only frees it here (an evicting arena: the
        exact rows its policy attends and scores them over). Callers that never say so lose
        nothing but that memory until the first one-token step."""

    def report(self) -> list[str]:
        """Lines `/kv` adds about this cache's structure (rings, eviction)."""
        return []

    # -- context shift (llama.cpp's): only a cache whose `can_shift` is True does it ----------
    def shift_keep(self) -> int:
        """The most tokens a shift keeps at the start (the engine's room for a prompt is
        max_ctx less this); a cache that cannot shift keeps nothing it could shift."""
        return 0

    def shift_plan(self) -> tuple[int, int]:
        """(a, nd) of the next shift: keep tokens [0, a), drop [a, a + nd), keep the rest at
        positions moved down by nd (the engine moves its token ids the same way)."""
        raise NotImplementedError(f"{type(self).__name__} cannot shift its context")

    def shift(self) -> int:
        """Do the shift `shift_plan` describes; returns the number of tokens dropped."""
        raise NotImplementedError(f"{type(self).__name__} cannot shift its context")
