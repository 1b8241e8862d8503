"""KV caches for models whose layers differ in what they attend to (Gemma 3: every 6th layer
attends to everything, the others to their last 512 tokens; DESIGN §3, issue 17).

`SlidingWindowKV` holds the sliding-window layers: a ring of W = min(window, max_ctx) slots
per layer, in the window dtype. A token at position p lives in slot p mod W. A query at
position p sees the keys p − window + 1 .. p (its own included: HF's and llama.cpp's
convention), so the ring never holds more than the layer can read, whatever -c: its bytes
are 2 · layers · Hkv · W · D · itemsize.
- One token (decode): it is written into its slot — overwriting position p − W, which no
  later query can see — and attends over every filled slot. Slot order does not matter
  for one query, so this is one call over a contiguous (Hkv, min(p + 1, W), D) block.
- A chunk of T tokens at positions s .. s+T−1 attends over the ring's positions
  max(0, s − window + 1) .. s − 1, gathered oldest first, followed by its own rows, with
  the causal sliding-window mask; then its last min(T, W) rows are written.
The ring layers have no compressed tail: 512 tokens of fp16 per layer are already small
beside a 32k global layer, and a codec's window (R + G tokens) would hold most of them.

`LayeredKVCache` puts the two kinds behind the one cache interface the model and engine
use (runtime/kv/cache.py): sliding layers go to the ring, full-attention layers to `inner`
(DenseKVCache or the compressed KVArena, built for the full layers only, which it indexes
0 .. n_full − 1 in model order: a per-layer profile for such a model lists its full layers).
Limits, each refused with one clear line where it is asked for:
- context shift: the ring would have to drop and re-rotate the middle of a window that
  other layers keep whole; llama.cpp refuses it for sliding-window models too;
- truncation (prefix reuse, a Ctrl-C between layers) keeps n tokens only while the ring
  still holds every key position n's query needs, i.e. n >= seq_len − 1 or nothing has
  wrapped yet; otherwise it keeps 0 (the next prompt is prefilled again).
"""
from __future__ import annotations

import torch

from ...kernels import dense_attention
from ..errors import KvrunError


class SlidingWindowKV:
    """Ring K/V of the sliding-window layers (module docstring)."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, window: int,
                 max_ctx: int, dtype: torch.dtype = torch.float16, device="cpu"):
        if window < 1:
            raise KvrunError(f"sliding window must be >= 1 token (got {window})")
        self.window, self.W = window, min(window, max_ctx)
        shape = (n_layers, n_kv_heads, self.W, head_dim)                  # (Ls, Hkv, W, D)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.seq_len = 0
        self.torn = False           # a chunk overwrote ring slots before its commit

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, H, T, D); k, v (1, Hkv, T, D) after RoPE. Returns (1, H, T, D)."""
        s, T, W = self.seq_len, k.shape[2], self.W
        kr, vr = self.k[layer], self.v[layer]                             # (Hkv, W, D)
        if T == 1:
            kr[:, s % W] = k[0, :, 0]
            vr[:, s % W] = v[0, :, 0]
            n = min(s + 1, W)
            return dense_attention(q, kr[None, :, :n], vr[None, :, :n], n - 1)
        lo = max(0, s - self.window + 1)                 # the oldest key the chunk can see
        idx = torch.arange(lo, s, device=kr.device) % W
        K = torch.cat([kr[:, idx], k[0].to(kr.dtype)], 1)[None]           # (1, Hkv, s-lo+T, D)
        V = torch.cat([vr[:, idx], v[0].to(vr.dtype)], 1)[None]
        o = dense_attention(q, K, V, s - lo, window=self.window)
        m = min(T, W)
        slots = torch.arange(s + T - m, s + T, device=kr.device) % W
        kr[:, slots] = k[0, :, T - m:].to(kr.dtype)
        vr[:, slots] = v[0, :, T - m:].to(vr.dtype)
        self.torn = True
        return o

    def commit(self, T: int) -> None:
        self.seq_len += T
        self.torn = False

    def keeps(self, n: int) -> bool:
        """Whether truncating to n tokens leaves every key position n's query needs."""
        if n == 0:
            return True
        if n == self.seq_len:
            return not self.torn        # a torn chunk overwrote keys of the committed state
        return max(0, n - self.window + 1) >= max(0, self.seq_len - self.W) and not self.torn

    def truncate(self, n: int) -> int:
        n = n if self.keeps(n) else 0
        self.seq_len, self.torn = n, False
        return n

    def reset(self) -> None:
        self.seq_len, self.torn = 0, False

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class LayeredKVCache:
    """Sliding-window layers in a ring, full-attention layers in `inner` (module docstring)."""

    can_shift = False

    def __init__(self, windows: list[int], inner, ring: SlidingWindowKV):
        self.windows = list(windows)
        self.inner, self.ring = inner, ring
        # model layer -> (is sliding, index in its cache)
        full = [i for i, w in enumerate(self.windows) if not w]
        slide = [i for i, w in enumerate(self.windows) if w]
        self.route = {i: (False, j) for j, i in enumerate(full)}
        self.route.update({i: (True, j) for j, i in enumerate(slide)})
        self.max_ctx = inner.max_ctx
        self.kv = getattr(inner, "kv", None)

    # -- the cache interface -------------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        return self.inner.seq_len

    @property
    def n_tail(self) -> list[int]:
        return getattr(self.inner, "n_tail", [0])

    def positions(self, T: int) -> torch.Tensor:
        return self.inner.positions(T)

    def attend(self, layer: int, q, k, v):
        sliding, j = self.route[layer]
        return (self.ring if sliding else self.inner).attend(j, q, k, v)

    def takes_new_kv(self, layer: int, T: int) -> bool:
        sliding, j = self.route[layer]
        takes = getattr(self.inner, "takes_new_kv", None)
        return not sliding and takes is not None and takes(j, T)

    def write_attend(self, layer: int, q, new):
        return self.inner.write_attend(self.route[layer][1], q, new)

    def commit(self, T: int) -> None:
        self.inner.commit(T)
        self.ring.commit(T)

    def truncate(self, n: int) -> int:
        """Keep the first n tokens where both kinds can (fewer: see the module docstring)."""
        while True:
            kept = self.inner.truncate(n)
            if self.ring.keeps(kept):
                self.ring.truncate(kept)
                return kept
            n = 0

    def reset(self) -> None:
        self.inner.reset()
        self.ring.reset()

    def resume_point(self, n: int, chunk: int) -> int:
        m = self.inner.resume_point(n, chunk)
        return m if m == self.seq_len or self.ring.keeps(m) else 0

    def canonical_tail(self, s: int) -> int:
        return self.inner.canonical_tail(s)

    def ingest(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (L, Hkv, n, D), all model layers: full layers' rows go to `inner`, the
        sliding layers keep their last W rows."""
        full = [i for i, w in enumerate(self.windows) if not w]
        slide = [i for i, w in enumerate(self.windows) if w]
        s, n, r = self.seq_len, k.shape[2], self.ring
        self.inner.ingest(k[full], v[full])
        m = min(n, r.W)
        slots = torch.arange(s + n - m, s + n) % r.W
        for j, i in enumerate(slide):
            r.k[j][:, slots] = k[i, :, n - m:].to(r.k.dtype)
            r.v[j][:, slots] = v[i, :, n - m:].to(r.v.dtype)
        r.commit(n)

    def nbytes(self) -> dict[str, int]:
        out = dict(self.inner.nbytes())
        out["window"] = out.get("window", 0) + self.ring.nbytes()
        return out

    def bytes_per_token(self) -> float:
        return sum(self.nbytes().values()) / self.max_ctx
