"""The tests' oracle cache: every token in full precision in one (L, B, Hkv, max_ctx, D)
buffer of the cache dtype, attention by torch SDPA (`dense_attention`) in the query's dtype, a sliding-window layer by its mask
over the whole buffer. It shares nothing with the arena and ring it checks except the
contract (kv/contract.py), and it takes B rows of one batch where they hold one sequence."""
from __future__ import annotations

import torch

from kvrun.kernels import dense_attention
from kvrun.kv import KVCache
from kvrun.kv.snapshot import Snapshot


class RefCache(KVCache):
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_ctx: int,
                 dtype: torch.dtype = torch.float32, batch: int = 1, windows: list[int] | None = None):
        shape = (n_layers, batch, n_kv_heads, max_ctx, head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.n_layers, self.max_ctx, self.seq_len = n_layers, max_ctx, 0
        self.windows = list(windows) if windows else [0] * n_layers

    def positions(self, T: int) -> torch.Tensor:
        assert self.seq_len + T <= self.max_ctx, "context full"
        return torch.arange(self.seq_len, self.seq_len + T)

    def attend(self, layer, q, k, v):
        S, T, w = self.seq_len, k.shape[2], self.windows[layer]
        self.k[layer, :, :, S:S + T] = k
        self.v[layer, :, :, S:S + T] = v
        lo = max(0, S + 1 - w) if w else 0              # the first query's oldest key
        # rows stored in the cache dtype, attended in q's (fp32): an oracle that does not
        # depend on how the CPU's library rounds inside half-precision SDPA
        return dense_attention(q, self.k[layer, :, :, lo:S + T].to(q.dtype),
                               self.v[layer, :, :, lo:S + T].to(q.dtype), S - lo, window=w)

    def commit(self, T: int) -> None:
        self.seq_len += T

    def truncate(self, n: int) -> int:
        self.seq_len = n
        return n

    def reset(self) -> None:
        self.seq_len = 0

    def resume_point(self, n: int, chunk: int) -> int:
        return min(n, self.seq_len)

    def canonical_tail(self, s: int) -> int:
        return 0

    def ingest(self, k, v) -> None:
        S, n = self.seq_len, k.shape[2]
        self.k[:, :, :, S:S + n] = k[:, None]
        self.v[:, :, :, S:S + n] = v[:, None]
        self.seq_len += n

    def rows(self, layer: int):
        w = self.windows[layer]
        lo = max(0, self.seq_len - w) if w else 0
        return self.k[layer, 0, :, lo:self.seq_len].float(), self.v[layer, 0, :, lo:self.seq_len].float()

    def nbytes(self) -> dict[str, int]:
        return {"dense": self.k.nbytes + self.v.nbytes}

    def label(self) -> str:
        return "reference"

    def snapshot(self) -> Snapshot:
        S = self.seq_len
        return Snapshot({"kind": "reference", "seq_len": S},
                        {"k": self.k[..., :S, :].clone(), "v": self.v[..., :S, :].clone()})

    def restore(self, snap: Snapshot) -> None:
        S = snap.meta["seq_len"]
        assert snap.meta["kind"] == "reference" and S <= self.max_ctx
        self.k[..., :S, :] = snap.tensors["k"]
        self.v[..., :S, :] = snap.tensors["v"]
        self.seq_len = S
