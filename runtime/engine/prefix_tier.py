"""What the prefix cache (runtime/engine/prefix_cache.py) asks of its second-level store: the
disk tier (runtime/engine/prefix_disk.py, `--cache-dir`) and the cluster's shared tier
(runtime/cluster/shared_tier.py, `kvrun serve --ray`) both are one.

An entry is named by `paths` from (weights, dtype, KV config key, token ids), never by a
request; `get` returns an entry only after every check a session file passes (checksum,
model, dtype, KV config, the ids its name says) and refuses — drops — one that fails them.
A store that cannot be reached answers like an empty one: the RAM tier goes on alone."""
from __future__ import annotations

from typing import Protocol

from ..kv.snapshot import Snapshot


class PrefixTier(Protocol):
    def paths(self, key: str, ids, ns) -> dict:
        """{n: the name of the entry holding the first n of `ids`} for each n in `ns`, KV
        config `key`; a name whether or not the entry exists."""

    def get(self, name, key: str, ids: tuple, limit: int | None = None) -> "tuple[dict, Snapshot] | None":
        """(engine state, snapshot) of the entry `name` for `ids` under `key`; None when
        there is none, it fails its checks (then it is dropped), it holds more than `limit`
        bytes (the receiving cache cannot take it: kept, unread) or the store is away."""

    def put(self, name, key: str, state: dict, snap: Snapshot) -> bool:
        """Store an entry (an existing one is only marked used); whether it is (or is being)
        stored."""

    def remove(self, name, why: str) -> None:
        """Drop the entry `name`, which `get` returned but whose tensors the cache refused
        (`why`, logged): under its name it can never be restored."""

    def stats(self) -> dict:
        """Counters for /metrics: at least disk_bytes, disk_files, disk_hits,
        disk_budget_bytes (the names the disk tier's collector reads)."""
