"""A prefix cache across requests: immutable snapshots of sequences' KV caches
(kv/snapshot.py), keyed by the token ids they hold, in host RAM under a byte budget, least
recently used out first (`kvrun serve --cache-ram`).

Which states are kept: the states a prompt's prefill passes through at each chunk
boundary (a multiple of the prefill chunk C), when the prefill began in such a state.
Prefill chunks are aligned to multiples of C, so a cold prefill of any prompt that starts
with those ids passes through exactly this state — the same compressed tail, the same
window, and every K/V row computed by the same full chunk of the same ids — whatever
follows. Every boundary, not only the last: requests that share a system prompt and differ
after it meet at the boundaries inside the shared part; a boundary already cached is only
marked used (no copy). Nothing else is kept, though the engine's prefix reuse within one
conversation would take it: a state cut inside a chunk, or holding generated ids, holds
K/V rows computed by other shapes of the same GEMMs (a shorter chunk, one-token decode
steps), equal only to rounding — and at a greedy near-tie that flips a token. From a
boundary state the rest of the prompt is prefilled in the same full chunks a cold request
runs, so the output equals the cold request's, bit for bit (on one thread count: torch's
GEMMs sum in another order on another).

A request starts from the entry, for its KV config, holding the longest prefix of its
prompt (at least one prompt id left to prefill) that its cache can hold: the snapshot is
copied into the request's own cache, and the engine's `reuse_prefix` checks it by the rule
it applies within one conversation (`KVCache.resume_point`).

What is not shared: the running sequences' caches themselves. Each sequence owns a
preallocated arena (window + tail sized for its request, its own codec scratch); sharing a
prefix between two running sequences would mean blocks referenced by several arenas and
copy-on-write at the window/tail boundary, which the arena's contiguous per-layer layout
does not have. A prefix is shared by copying its snapshot into each new cache instead
(a copy of the compressed bytes: for `auto` a third of fp16's).

With a disk tier (runtime/engine/prefix_disk.py, `--cache-dir`) every entry is also written
to a file when it is inserted, and a lookup that misses RAM at a boundary looks for that
boundary's file before trying a shorter prefix; a file found is restored and put back in RAM.
An entry whose tensors its cache cannot take back (a file whose header passes but whose
tensors do not match it) is dropped from RAM and its file removed, with one log line, and
the next shorter prefix is tried.
"""
from __future__ import annotations

import collections
import json
import logging
import threading
from dataclasses import dataclass

from ..errors import KvrunError
from ..kv.snapshot import OtherSize, Snapshot
from .session import EXTRA_LIMIT, engine_state, kv_record, restore_engine

log = logging.getLogger("kvrun.prefix_cache")


def kv_key(kv) -> str:
    """The KV config as the cache keys it: entries restore only into the same config."""
    return json.dumps(kv_record(kv), sort_keys=True)


@dataclass
class Entry:
    key: str                # kv_key of its cache
    tokens: tuple           # the ids it holds
    state: dict             # engine_state's: tokens, canon, shift counters
    snap: Snapshot
    nbytes: int
    name: object = None         # its name in the second-level tier, when it came from there


class PrefixCache:
    """Snapshots under `budget` bytes, LRU (module docstring). The scheduler's loop thread
    adds and looks up; `stats()` may be read from any thread."""

    def __init__(self, budget: int, disk=None):
        if budget < 0:
            raise KvrunError(f"--cache-ram must be >= 0 MiB (got {budget / (1 << 20):g})")
        self.budget, self.disk = budget, disk       # disk: a prefix_disk.DiskTier or None
        self.entries: collections.OrderedDict[tuple, Entry] = collections.OrderedDict()
        self.used = 0
        self.queried = self.hit_tokens = 0          # prompt tokens looked up / not prefilled
        self.requests = self.hits = 0               # requests looked up / that resumed
        self._lock = threading.Lock()

    # -- adding ---------------------------------------------------------------------------------
    def add(self, kv, engine) -> bool:
        """Keep the state of `engine` (its cache and ids): the caller's prefill stands at a
        chunk boundary it reached from such a state (module docstring). Returns whether it
        is kept (it must fit the budget); an entry already holding the same ids is only
        marked used."""
        cache, ids = engine.cache, tuple(engine.cached)
        n = len(ids)
        if not n or n % engine.prefill_chunk or engine.n_shifts \
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
        e = Entry(k[0], ids, state, snap, snap.nbytes())
        on_disk = self.disk is not None and \
            self.disk.put(self.disk.paths(k[0], ids, [n])[n], k[0], state, snap)
        return self._keep(e) or on_disk

    def _keep(self, e: Entry) -> bool:
        """Put `e` in RAM, dropping the least recently used until it fits."""
        if e.nbytes > self.budget:
            return False
        k = (e.key, e.tokens)
        with self._lock:
            if k in self.entries:
                self.entries.move_to_end(k)
                return True
            while self.used + e.nbytes > self.budget:
                _, old = self.entries.popitem(last=False)
                self.used -= old.nbytes
            self.entries[k] = e
            self.used += e.nbytes
        return True

    # -- using ----------------------------------------------------------------------------------
    def best(self, kv, prompt: list[int], max_ctx: int, chunk: int) -> Entry | None:
        """The entry for `kv` holding the longest prefix of `prompt` that ends on a multiple
        of `chunk` (every entry does), leaves at least one prompt id to prefill and fits a
        cache of `max_ctx` tokens; None when there is none."""
        return next(self.candidates(kv, prompt, max_ctx, chunk), None)

    def candidates(self, kv, prompt: list[int], max_ctx: int, chunk: int,
                   limit: int | None = None):
        """The entries `best` may return, longest prefix first, found lazily: one dict
        lookup per boundary, and a boundary's file (read then) on a RAM miss; `limit`: the
        most bytes a file may hold to be read (the receiving cache's, `_file_limit`)."""
        key = kv_key(kv)
        ns = range(min(len(prompt) - 1, max_ctx) // chunk * chunk, 0, -chunk)
        files = self.disk.paths(key, prompt, ns) if self.disk is not None and ns else {}
        for n in ns:
            ids = tuple(prompt[:n])
            with self._lock:
                e = self.entries.get((key, ids))
                if e is not None:
                    self.entries.move_to_end((key, ids))
            if e is not None:
                yield e
                continue
            if n in files:                          # a RAM miss: this boundary's file
                got = self.disk.get(files[n], key, ids, limit)
                if got is not None:
                    state, snap = got
                    e = Entry(key, ids, state, snap, snap.nbytes(), files[n])
                    self._keep(e)
                    yield e

    def resume(self, kv, engine, prompt: list[int]) -> int:
        """Restore into `engine` (a new sequence's, empty) the best entry for `prompt` that
        its cache takes back, and keep what the prefix-reuse rule allows; returns how many
        prompt ids need no prefill (0: a cold start, the engine empty). An entry the cache
        refuses is dropped (module docstring) and the next shorter one tried."""
        kept = 0
        for e in self.candidates(kv, prompt, engine.max_ctx, engine.prefill_chunk,
                                 _file_limit(engine)):
            try:
                restore_engine(engine, e.snap, e.state, engine.model.cfg.vocab_size)
                kept = engine.reuse_prefix(prompt)
                break
            except OtherSize:                       # sound, for a bigger cache: kept
                engine.reset()
            except KvrunError as why:               # its tensors do not fit its own config
                engine.reset()
                self._drop(e, str(why))
        with self._lock:
            self.requests += 1
            self.queried += len(prompt)
            self.hits += kept > 0
            self.hit_tokens += kept
        return kept

    def _drop(self, e: Entry, why: str) -> None:
        """Forget an entry that cannot be restored: from RAM, and from the second-level
        tier (which logs it) when it came from there."""
        with self._lock:
            if self.entries.pop((e.key, e.tokens), None) is not None:
                self.used -= e.nbytes
        if e.name is not None and self.disk is not None:
            self.disk.remove(e.name, why)
        else:
            log.warning("prefix cache: dropping the %d-token entry: it cannot be restored (%s)",
                        len(e.tokens), why)

    def stats(self) -> dict:
        with self._lock:
            st = {"entries": len(self.entries), "bytes": self.used, "budget_bytes": self.budget,
                  "requests": self.requests, "hits": self.hits,
                  "prompt_tokens": self.queried, "hit_tokens": self.hit_tokens}
        return st if self.disk is None else {**st, **self.disk.stats()}


def _file_limit(engine) -> int:
    """The most bytes an entry file that `engine`'s cache can take back may hold: a snapshot
    holds a filled part of the cache's allocated tensors, beside a header (session.py)."""
    return sum(engine.cache.nbytes().values()) + EXTRA_LIMIT
