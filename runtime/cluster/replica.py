"""One kvrun replica on Ray Serve: what `kvrun serve` builds on one machine (the model, the
continuous-batching Scheduler, the HTTP app of runtime/cli/server.py), with the prefix
cache's second level the cluster's shared tier (shared_tier.py) instead of a directory.

`handle(Forward)` runs one HTTP request through the app and streams its ASGI messages back
(forward.call_app), with `x-kvrun-replica` / `x-kvrun-node` on the response saying who
served it. Every few seconds the replica reports its counters to the store actor
(registry.py) for the ingress's /metrics, after checking its
shared tier is reachable (shared_tier.SharedTier.refresh)."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import ray
from ray import serve

from ..cli.server import create_app
from ..engine.api import load
from ..engine.scheduler import Scheduler
from ..engine.session import model_record
from ..kv.config import parse_kv
from .forward import Forward, call_app
from .shared_tier import SharedTier
from .registry import REGISTRY_NAME

log = logging.getLogger("kvrun.cluster")
MiB = 1 << 20
REPORT_EVERY = 2.0          # seconds between a replica's reports to the store


@dataclass
class ReplicaSpec:
    """`kvrun serve`'s settings for every replica (runtime/cli/serve.py's flags)."""
    model: str | None = None
    ctx: int = 4096
    kv: str = "fp16"
    ctx_policy: str | None = None
    parallel: int = 4
    kv_budget_mb: float | None = None
    cache_ram: float = 0.0
    queue: int = 64
    alias: str | None = None
    dtype: str = "auto"
    chunk: int = 512
    threads: int | None = None
    api_key: str | None = None
    cors: tuple = ()
    max_body: int = 4 << 20
    shared_mb: float = 1024.0           # the shared tier's budget (0: no shared tier)
    namespace: str = "kvrun"            # the store actor's namespace


class Replica:
    """The replica deployment's class (module docstring)."""

    def __init__(self, spec: ReplicaSpec):
        spec_kv = parse_kv(spec.kv, **({"ctx_policy": spec.ctx_policy} if spec.ctx_policy else {}))
        m = load(spec.model, dtype=spec.dtype, ctx=1, kv="fp16", prefill_chunk=spec.chunk,
                 threads=spec.threads)
        self.tier = SharedTier(model_record(m), int(spec.shared_mb * MiB), spec.namespace) \
            if spec.shared_mb else None
        self.sched = Scheduler(m, parallel=spec.parallel, kv_budget_mb=spec.kv_budget_mb,
                               max_queue=spec.queue, ctx=spec.ctx, kv=spec_kv,
                               cache_ram_mb=spec.cache_ram, tier=self.tier)
        self.app = create_app(m, self.sched, spec.alias or m.path.name, api_key=spec.api_key,
                              cors_origins=tuple(spec.cors), max_body=spec.max_body)
        self.sched.start()
        self.id = serve.get_replica_context().replica_id.to_full_id_str()
        self.node = ray.get_runtime_context().get_node_id()
        self._headers = [(b"x-kvrun-replica", self.id.encode()), (b"x-kvrun-node", self.node.encode())]
        self._namespace, self._stop = spec.namespace, threading.Event()
        threading.Thread(target=self._report_loop, name="kvrun-report", daemon=True).start()

    async def handle(self, req: Forward):
        """The app's ASGI messages for `req` (forward.call_app)."""
        async for msg in call_app(self.app, req, self._headers):
            yield msg

    def stats(self) -> dict:
        """This replica's counters (the scheduler's, its prefix cache's and its tier's)."""
        st = self.sched.stats()
        return {"node": self.node, "running": st["running"], "waiting": st["waiting"],
                "kv_used_bytes": st["kv_used_bytes"], "prefix": st["prefix_cache"] or {}}

    def _report_loop(self) -> None:
        reg = None
        while not self._stop.wait(REPORT_EVERY):
            if self.tier is not None:
                self.tier.refresh()
            try:
                reg = reg or ray.get_actor(REGISTRY_NAME, namespace=self._namespace)
                reg.report.remote(self.id, self.stats())
            except Exception:                   # the registry away: try again
                reg = None

    def __del__(self):
        self._stop.set()
        sched = getattr(self, "sched", None)
        if sched is not None:
            sched.shutdown(drain=False, timeout=10)
        if getattr(self, "tier", None) is not None:
            self.tier.close()
