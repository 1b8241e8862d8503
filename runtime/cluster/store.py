"""The shared tier's store: a detached, named Ray actor that owns the compressed prefix
snapshots of every replica in Ray's object store, under a byte budget, least recently used
out first. It outlives any replica (a replica killed, a node removed: the entries stay while
the actor's node lives); the actor itself restarts empty if its process dies.

An entry is an opaque blob (a session file's bytes, runtime/engine/session.py) under a name
(64 hex digits, prefix_disk.DiskTier.paths): the store neither reads nor trusts it; every
reader checks what it gets (shared_tier.py). The actor `ray.put`s each blob itself, so it is
the owner: the object lives as long as the actor keeps the reference, not as long as the
replica that computed it.
"""
from __future__ import annotations

import collections
import re

import ray

NAME = re.compile(r"^[0-9a-f]{64}\.kvpc$")
STORE_NAME = "kvrun-prefix-store"       # the actor's name in its namespace


class PrefixStore:
    """Blobs under `budget` bytes (module docstring). Methods run one at a time (a plain
    actor): no locks."""

    def __init__(self, budget: int):
        assert budget >= 0
        self.budget = budget
        self.refs: collections.OrderedDict[str, tuple] = collections.OrderedDict()  # name -> (ref, nbytes)
        self.used = 0
        self.puts = self.gets = self.hits = self.dropped = 0

    def ping(self) -> bool:
        return True

    def put(self, name: str, blob: bytes) -> bool:
        """Keep `blob` under `name` (a name already held is only marked used); False when
        the name is malformed or the blob is larger than the whole budget."""
        if not NAME.match(name) or len(blob) > self.budget:
            return False
        self.puts += 1
        if name in self.refs:
            self.refs.move_to_end(name)
            return True
        while self.used + len(blob) > self.budget:
            _, (_, n) = self.refs.popitem(last=False)
            self.used -= n
        self.refs[name] = (ray.put(blob), len(blob))
        self.used += len(blob)
        return True

    def get(self, name: str):
        """[the blob's ObjectRef] (a list: Ray hands a nested reference over unresolved, so
        the reader fetches the bytes from the object store directly), or None."""
        self.gets += 1
        e = self.refs.get(name)
        if e is None:
            return None
        self.refs.move_to_end(name)
        self.hits += 1
        return [e[0]]

    def drop(self, name: str) -> None:
        """Forget an entry a reader refused (corrupt, foreign): under its name it can never
        be valid."""
        e = self.refs.pop(name, None)
        if e is not None:
            self.used -= e[1]
            self.dropped += 1

    def stats(self) -> dict:
        return {"entries": len(self.refs), "bytes": self.used, "budget_bytes": self.budget,
                "puts": self.puts, "gets": self.gets, "hits": self.hits, "dropped": self.dropped}
