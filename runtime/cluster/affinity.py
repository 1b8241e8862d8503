"""Prefix affinity with a load bound: the routing policy of router.py, without Ray.

The router remembers, for each prompt block hash (forward.blocks_of), the replica it last
sent a prompt holding that prefix to (`Owners`, least recently used forgotten past
`capacity` blocks). A new prompt goes to the owner of its longest remembered block — the
replica whose RAM tier most likely holds the longest prefix — unless that replica has more
than `bound` requests in flight beyond the least loaded candidate: then it goes to the least
loaded one (which restores the prefix from the shared tier, or computes it). So one hot
system prompt spreads over replicas once it has more than `bound` requests ahead of it,
instead of queueing on one."""
from __future__ import annotations

import collections
from dataclasses import dataclass

# routing decisions by kind (router.py counts, the ingress's /metrics reads)
DECISIONS: collections.Counter = collections.Counter()


class Owners:
    """block hash -> replica id, LRU-bounded."""

    def __init__(self, capacity: int = 200_000):
        self.capacity = capacity
        self.map: collections.OrderedDict[str, str] = collections.OrderedDict()

    def record(self, blocks: list[str], replica: str) -> None:
        for b in blocks:
            self.map[b] = replica
            self.map.move_to_end(b)
        while len(self.map) > self.capacity:
            self.map.popitem(last=False)

    def longest(self, blocks: list[str], candidates) -> tuple[str | None, int]:
        """(the candidate owning the longest of `blocks`, how many blocks) or (None, 0)."""
        for i in range(len(blocks) - 1, -1, -1):
            r = self.map.get(blocks[i])
            if r is not None and r in candidates:
                return r, i + 1
        return None, 0

    def forget(self, replica: str) -> None:
        for b in [b for b, r in self.map.items() if r == replica]:
            del self.map[b]


@dataclass
class Choice:
    replica: str
    kind: str                   # "affinity", "spill" (the owner over the bound) or "cold"
    blocks: int                 # blocks of the prompt its owner was known to hold


def choose(blocks: list[str], load: dict[str, int], owners: Owners, bound: int) -> Choice:
    """The replica (a key of `load`: replica id -> requests in flight) for a prompt with
    `blocks` (module docstring). Ties among the least loaded go to the lowest id."""
    assert load, "no candidate replicas"
    least = min(sorted(load), key=lambda r: load[r])
    owner, n = owners.longest(blocks, load)
    if owner is None:
        return Choice(least, "cold", 0)
    if load[owner] - load[least] > bound:
        return Choice(least, "spill", n)
    return Choice(owner, "affinity", n)
