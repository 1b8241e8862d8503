"""A prefix cache across requests: immutable snapshots of sequences' KV caches
(kv/snapshot.py), keyed by the token ids they hold, in host RAM under a byte budget, least
recently used out first (`kvrun serve --cache-ram`).

Which states are kept. A compressed cache cannot hand a prefix back in full precision, so
a new prompt may resume from a cached state only where a fresh prefill of that prompt
would be in the same state (the engine's prefix-reuse rule: `KVCache.resume_point`). The
states that qualify are taken where they arise:
- in a prompt's prefill, at its last chunk boundary (a multiple of the prefill chunk C,
  before the prompt's last token): prefill chunks are aligned to multiples of C, so a
  fresh prefill of any prompt that starts with those ids passes through exactly this state
  (same tail, same window), whatever follows;
- a finished sequence (prompt + generated ids) when its whole cache is such a state (an
  uncompressed cache always is: any prefix of it is kept as is; a compressed one only
  while nothing it holds was compressed differently from a fresh prefill).
A request then starts from the entry, for its KV config, that covers the longest prefix of
its prompt: an entry whose ids are all a prefix of the prompt, or, for an entry holding
nothing compressed, the common prefix. The snapshot is copied into the request's own
cache and the engine's `reuse_prefix` decides how much of it to keep, by the same rule as
within one conversation — so the output equals a cold request's, bit for bit.

What is not shared: the running sequences' caches themselves. Each sequence owns a
preallocated arena (window + tail sized for its request, its own codec scratch); sharing a
prefix between two running sequences would mean blocks referenced by several arenas and
copy-on-write at the window/tail boundary, which the arena's contiguous per-layer layout
does not have. A prefix is shared by copying its snapshot into each new cache instead
(a copy of the compressed bytes: for `auto` a third of fp16's).
"""
from __future__ import annotations

import collections
import json
import threading
from dataclasses import dataclass

from ..errors import KvrunError
from ..kv.snapshot import Snapshot
from .session import engine_state, kv_record, restore_engine


def kv_key(kv) -> str:
    """The KV config as the cache keys it: entries restore only into the same config."""
    return json.dumps(kv_record(kv), sort_keys=True)


@dataclass
class Entry:
    key: str                # kv_key of its cache
    tokens: tuple           # the ids it holds
    state: dict             # engine_state's: tokens, canon, shift counters
    snap: Snapshot
    any_prefix: bool        # holds nothing compressed: any common prefix is kept as is
    nbytes: int


def common_prefix(a, b) -> int:
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


class PrefixCache:
    """Snapshots under `budget` bytes, LRU (module docstring). The scheduler's loop thread
    adds and looks up; `stats()` may be read from any thread."""

    def __init__(self, budget: int):
        if budget < 0:
            raise KvrunError(f"--cache-ram must be >= 0 MiB (got {budget / (1 << 20):g})")
        self.budget = budget
        self.entries: collections.OrderedDict[tuple, Entry] = collections.OrderedDict()
        self.used = 0
        self.queried = self.hit_tokens = 0          # prompt tokens looked up / not prefilled
        self.requests = self.hits = 0               # requests looked up / that resumed
        self._lock = threading.Lock()

    # -- adding ---------------------------------------------------------------------------------
    def add(self, kv, engine, canonical: bool = False) -> bool:
        """Keep the state of `engine` (its cache and ids) if it is one a fresh prefill of its
        ids reaches (module docstring) and fits the budget; returns whether it was kept.
        `canonical`: the caller knows it is (a prefill that began in such a state, stopped
        at a chunk boundary), else the engine's `canon` must cover every id. Refreshes an
        entry already holding the same ids."""
        cache, ids = engine.cache, tuple(engine.cached)
        n = len(ids)
        if not n or not (canonical or engine.canon == n) or engine.n_shifts \
                or cache.resume_point(n, engine.prefill_chunk) != n:
            return False
        k = (kv_key(kv), ids)
        with self._lock:
            if k in self.entries:
                self.entries.move_to_end(k)
                return True
        try:
            snap, state = engine_state(engine)
        except KvrunError:                          # a cache that cannot be saved (eviction)
            return False
        state["canon"] = n
        e = Entry(k[0], ids, state, snap, cache.n_compressed() == 0, snap.nbytes())
        if e.nbytes > self.budget:
            return False
        with self._lock:
            while self.used + e.nbytes > self.budget:
                _, old = self.entries.popitem(last=False)
                self.used -= old.nbytes
            self.entries[k] = e
            self.used += e.nbytes
        return True

    # -- using ----------------------------------------------------------------------------------
    def best(self, kv, prompt: list[int], max_ctx: int) -> Entry | None:
        """The entry for `kv` covering the longest prefix of `prompt` (at least one prompt
        id is left to prefill) that a cache of `max_ctx` tokens can hold, or None."""
        key, best, best_n = kv_key(kv), None, 0
        with self._lock:
            for e in self.entries.values():
                if e.key != key or len(e.tokens) > max_ctx:
                    continue
                m = common_prefix(e.tokens, prompt)
                n = min(m, len(prompt) - 1) if e.any_prefix else \
                    (len(e.tokens) if m == len(e.tokens) < len(prompt) else 0)
                if n > best_n:
                    best, best_n = e, n
            if best is not None:
                self.entries.move_to_end((best.key, best.tokens))
        return best

    def resume(self, kv, engine, prompt: list[int]) -> int:
        """Restore into `engine` (a new sequence's, empty) the best entry for `prompt` and
        keep what the prefix-reuse rule allows; returns how many prompt ids need no
        prefill (0: a cold start, the engine empty)."""
        e = self.best(kv, prompt, engine.max_ctx)
        kept = 0
        if e is not None:
            try:
                restore_engine(engine, e.snap, e.state, engine.model.cfg.vocab_size)
                kept = engine.reuse_prefix(prompt)
            except KvrunError:                      # does not fit this request's cache size
                engine.reset()
                kept = 0
        with self._lock:
            self.requests += 1
            self.queried += len(prompt)
            self.hits += kept > 0
            self.hit_tokens += kept
        return kept

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self.entries), "bytes": self.used, "budget_bytes": self.budget,
                    "requests": self.requests, "hits": self.hits,
                    "prompt_tokens": self.queried, "hit_tokens": self.hit_tokens}
