"""The objective of `kvrun search` (search.py): mean KL(P_fp16 ‖ P_kv) of next-token
distributions on calibration windows, scored through the compressed read path the way
`kvrun ppl` scores. Each window's context sits in the cache under test (tokens older than the
residual window compressed), and the scored tokens are fed in chunks of G so each one attends
to the compressed past as in decode order. The context is prefilled once in fp16 and its K/V
ingested into every candidate cache through the arena's write path; that is exactly what a
single-chunk prefill stores (a prefill chunk attends to itself in full precision). The cache
under test is built from the KVConfig as given, so a codec that rotates its role (cb-*) is
scored rotated, as it will run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import KvrunError
from ..kv.build import build_cache
from ..kv.config import KVConfig


@dataclass
class _Window:
    ids: torch.Tensor           # (1, P + N) context then scored inputs
    k: torch.Tensor             # (L, Hkv, P, D) fp16 context K (rotated), from the fp16 prefill
    v: torch.Tensor
    p: torch.Tensor             # (N, V) fp16-cache next-token probabilities
    negent: torch.Tensor        # (N,) Σ p log p


class Objective:
    """Mean KLD vs the fp16 cache on calibration windows (prefix tokens + scored tokens)."""

    def __init__(self, model, text: str, n_windows: int = 2, prefix: int = 512,
                 n_score: int = 32, chunk: int = 32):
        if n_windows < 1 or prefix < 1 or n_score < 1 or chunk < 1:
            raise KvrunError("calibration windows, prefix, scored tokens and chunk must be >= 1")
        self.model, self.cfg, self.chunk = model, model.cfg, chunk
        self.prefix, self.n_score = prefix, n_score
        ids = model.tokenize(text)
        span = prefix + n_score
        if len(ids) < n_windows * span:
            raise KvrunError(f"calibration text has {len(ids)} tokens: {n_windows} windows of "
                             f"{prefix} + {n_score} tokens need {n_windows * span}")
        step = (len(ids) - span) // max(1, n_windows - 1) if n_windows > 1 else 0
        self.n_tokens = n_windows * span
        self.windows = [self._prepare(ids[i * step:i * step + span]) for i in range(n_windows)]
        self.evaluations = 0

    @torch.inference_mode()
    def _prepare(self, win: list[int]) -> _Window:
        cfg, P = self.cfg, self.prefix
        ids = torch.tensor([win])
        dense = build_cache(cfg, len(win), "fp16")
        self.model.transformer(ids[:, :P], dense, last_only=True)        # one chunk: see docstring
        k, v = dense.all_rows(torch.float16)                              # (L, Hkv, P, D)
        w = _Window(ids, k, v, None, None)
        lp = self._logprobs(dense, w)
        w.p = lp.exp()
        w.negent = (w.p * lp).sum(-1)
        return w

    def _logprobs(self, cache, w: _Window) -> torch.Tensor:
        cache.reset()
        cache.ingest(w.k, w.v)
        T = w.ids.shape[1]
        out = [self.model.transformer(w.ids[:, s:min(s + self.chunk, T)], cache)[0]
               for s in range(self.prefix, T, self.chunk)]
        return torch.log_softmax(torch.cat(out).float(), dim=-1)          # (N, V)

    @torch.inference_mode()
    def kld(self, kv: KVConfig) -> float:
        cache = build_cache(self.cfg, self.prefix + self.n_score, kv)
        tot = 0.0
        for w in self.windows:
            lq = self._logprobs(cache, w)
            tot += float((w.negent - (w.p * lq).sum(-1)).sum())
        self.evaluations += 1
        return max(0.0, tot / (len(self.windows) * self.n_score))
