"""The prefix cache's shared tier: a PrefixTier (runtime/engine/prefix_tier.py) over the
cluster's store actor (store.py), so a prefix one replica computed is restored by any other.

Format and checks are the disk tier's, by construction: each entry goes through a
prefix_disk.DiskTier in a private scratch directory. `put` writes the session file there
and ships its bytes to the store; `get` fetches the bytes, writes them there and lets
DiskTier.get read and check them (checksum, weights, dtype, KV config, the ids the name
says) — a blob that fails is logged, refused, and dropped from the store. Names are
DiskTier.paths' (weights sha256, dtype, KV config, token ids).

Faults: every call to the store has a deadline (`timeout`). A call that fails or times out
marks the tier down with one log line; while down, lookups miss and nothing is shipped (the
replica runs on its RAM tier alone, and /metrics says `up 0`), and every `retry` seconds
the next call looks the named actor up again; found and answering, the tier is up again
(logged); the replica also checks every few seconds without traffic (`refresh`). Writes
are sent without waiting (the scheduler's loop must not stall on the network); a failed
write is seen at the next call. A store that hangs costs a lookup `timeout` seconds once
per `retry` while it is down."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import ray
from ray.exceptions import RayError

from ..engine.prefix_disk import DiskTier
from ..kv.snapshot import Snapshot
from .store import STORE_NAME

log = logging.getLogger("kvrun.cluster")


class SharedTier:
    """The store actor `name` in `namespace` as a prefix tier for model `model`
    (session.model_record); entries up to `budget` bytes."""

    def __init__(self, model: dict, budget: int, namespace: str, name: str = STORE_NAME,
                 timeout: float = 5.0, retry: float = 5.0):
        self.namespace, self.name, self.timeout, self.retry = namespace, name, timeout, retry
        # the system's temporary directory, not /dev/shm: containers often give that 64 MiB,
        # less than one long fp16 prefix; a file written and read at once stays in page cache
        self._dir = tempfile.mkdtemp(prefix="kvrun-tier-")
        self.local = DiskTier(self._dir, budget, model)      # the format, the checks
        self.budget = budget
        self.store = None
        self.up, self._down_at, self._pending = False, 0.0, []
        self.hits = self.misses = self.refused = self.puts = self.errors = 0
        self.bytes_in = self.bytes_out = 0                   # bytes fetched / shipped
        self._lock = threading.Lock()                        # the counters: /metrics reads them
        self._state = threading.RLock()                      # up, store, pending writes
        self._connect()

    # -- the store ----------------------------------------------------------------------------
    def _connect(self) -> bool:
        try:
            store = ray.get_actor(self.name, namespace=self.namespace)
            ray.get(store.ping.remote(), timeout=self.timeout)
        except (RayError, ValueError, TimeoutError) as e:
            self._fail(e)
            return False
        if not self.up and self._down_at:
            log.warning("shared prefix tier: reachable again")
        self.store, self.up, self._pending = store, True, []
        return True

    def _fail(self, e: Exception) -> None:
        self.errors += 1
        if self.up or not self._down_at:
            log.warning("shared prefix tier unreachable (%s): using the local prefix cache only",
                        str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
        self.up, self._down_at = False, time.monotonic()

    def _usable(self) -> bool:
        """Whether to call the store now (reconnecting when a retry is due)."""
        with self._state:
            if self.up and self._pending:                   # writes sent earlier: any failed?
                done, self._pending = ray.wait(self._pending, num_returns=len(self._pending),
                                               timeout=0)
                try:
                    ray.get(done, timeout=self.timeout)
                except (RayError, TimeoutError) as e:
                    self._fail(e)
            if self.up:
                return True
            return time.monotonic() - self._down_at >= self.retry and self._connect()

    def refresh(self) -> bool:
        """Check the store now (a replica calls this every few seconds, so `up` is current
        without traffic); whether it is up."""
        if self.up:
            try:
                ray.get(self.store.ping.remote(), timeout=self.timeout)
            except (RayError, TimeoutError) as e:
                with self._state:
                    self._fail(e)
        return self._usable()

    # -- PrefixTier ---------------------------------------------------------------------------
    def paths(self, key: str, ids, ns) -> dict:
        return self.local.paths(key, ids, ns)

    def get(self, path: Path, key: str, ids: tuple, limit: int | None = None) -> "tuple[dict, Snapshot] | None":
        if not self._usable():
            return None
        try:
            ref = ray.get(self.store.get.remote(path.name), timeout=self.timeout)
            blob = None if ref is None else ray.get(ref[0], timeout=self.timeout)
        except (RayError, TimeoutError) as e:
            self._fail(e)
            return None
        if blob is None:
            self.misses += 1
            return None
        if limit is not None and len(blob) > limit:     # not for this cache's size: kept
            return None
        path.write_bytes(blob)
        got = self.local.get(path, key, ids, limit)   # checked; a refused file is removed, logged
        self._unlink(path)
        with self._lock:
            if got is None:
                self.refused += 1
            else:
                self.hits += 1
                self.bytes_in += len(blob)
        if got is None:
            self.store.drop.remote(path.name)
        return got

    def put(self, path: Path, key: str, state: dict, snap: Snapshot) -> bool:
        if not self._usable() or not self.local.put(path, key, state, snap):
            return False
        try:
            blob = path.read_bytes()
        except OSError:
            return False
        finally:
            self._unlink(path)
        with self._state:
            self._pending.append(self.store.put.remote(path.name, blob))
        with self._lock:
            self.puts += 1
            self.bytes_out += len(blob)
        return True

    def remove(self, path: Path, why: str) -> None:
        """Drop from the store an entry `get` returned whose tensors the cache refused."""
        log.warning("shared prefix tier: dropping %s: %s", path.name, why)
        with self._lock:
            self.hits -= 1                      # get counted it; it restored nothing
            self.refused += 1
        if self._usable():
            self.store.drop.remote(path.name)

    def _unlink(self, p: Path) -> None:
        try:
            os.unlink(p)
        except OSError:
            pass

    def stats(self) -> dict:
        with self._lock:
            return {"disk_bytes": 0, "disk_files": 0, "disk_hits": self.hits,
                    "disk_budget_bytes": self.budget,
                    "shared_up": int(self.up), "shared_hits": self.hits,
                    "shared_misses": self.misses, "shared_refused": self.refused,
                    "shared_puts": self.puts, "shared_errors": self.errors,
                    "shared_bytes_in": self.bytes_in, "shared_bytes_out": self.bytes_out}

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)
