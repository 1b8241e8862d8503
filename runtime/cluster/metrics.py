"""The ingress's GET /metrics (Prometheus text, prometheus_client): the router's and the
ingress's own counters, every replica's last report (registry.py, labelled `replica` and
`node`) and the shared tier's store.

    kvrun_cluster_requests_total{replica, status}      requests the ingress relayed, by the
                                                       replica that answered and its status
    kvrun_cluster_replica_failures_total{stage}        calls whose replica failed "before"
                                                       answering (retried once elsewhere) or
                                                       "mid_stream" (the client got an error event)
    kvrun_cluster_route_decisions_total{kind}          router.py: affinity / spill / cold /
                                                       round-robin / other
    kvrun_cluster_store_up                             1 when the store actor answered this scrape
    kvrun_shared_tier_entries / _bytes / _budget_bytes the store's entries
    kvrun_replica_running / _waiting                   each replica's sequences
    kvrun_replica_prefix_cache_queries_total           prompt tokens it looked up
    kvrun_replica_prefix_cache_hits_total              of them, restored (RAM or shared tier)
    kvrun_replica_prefix_cache_requests_total{hit}     requests looked up, by whether any hit
    kvrun_replica_shared_tier_up                       whether its shared tier is reachable
    kvrun_replica_shared_tier_restores_total           entries it restored from the shared tier
    kvrun_replica_shared_tier_refused_total            entries it refused (corrupt, foreign)
    kvrun_replica_shared_tier_bytes_in_total / _out_total   bytes fetched / shipped

A replica's own /metrics (runtime/cli/server_metrics.py) is its app's; through the ingress a
path other than /metrics reaches one replica, so this is the cluster's view."""
from __future__ import annotations

import asyncio
import collections

import ray
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from ray.exceptions import RayError

from . import affinity
from .registry import REGISTRY_NAME
from .store import STORE_NAME

REPLICA_SHARED = (("shared_hits", "restores", "Entries restored from the shared tier"),
                  ("shared_refused", "refused", "Shared-tier entries refused (corrupt or foreign)"),
                  ("shared_bytes_in", "bytes_in", "Bytes fetched from the shared tier"),
                  ("shared_bytes_out", "bytes_out", "Bytes shipped to the shared tier"))


class ClusterMetrics:
    """The ingress's counters and the scrape (module docstring)."""

    def __init__(self, namespace: str, timeout: float = 5.0):
        self.namespace, self.timeout = namespace, timeout
        self.requests: collections.Counter = collections.Counter()     # (replica, status)
        self.failures: collections.Counter = collections.Counter()     # stage

    async def _ask(self, name: str, method: str):
        """What the actor `name`'s `method` returns, or None when it does not answer."""
        try:
            actor = ray.get_actor(name, namespace=self.namespace)
            return await asyncio.wait_for(getattr(actor, method).remote(), self.timeout)
        except (RayError, ValueError, asyncio.TimeoutError):
            return None

    async def exposition(self) -> tuple[bytes, str]:
        store, reports = await asyncio.gather(self._ask(STORE_NAME, "stats"),
                                              self._ask(REGISTRY_NAME, "replica_reports"))
        reg = CollectorRegistry()
        reg.register(_Snapshot(self, store, reports or {}))
        return generate_latest(reg), CONTENT_TYPE_LATEST


class _Snapshot:
    """One scrape's values as metric families."""

    def __init__(self, m: ClusterMetrics, store: dict | None, reports: dict):
        self.m, self.store, self.reports = m, store, reports

    def collect(self):
        req = CounterMetricFamily("kvrun_cluster_requests", "Requests the ingress relayed",
                                  labels=["replica", "status"])
        for (r, s), n in sorted(self.m.requests.items()):
            req.add_metric([r, str(s)], n)
        yield req
        fail = CounterMetricFamily("kvrun_cluster_replica_failures", "Replica calls that failed",
                                   labels=["stage"])
        for stage in ("before", "mid_stream"):
            fail.add_metric([stage], self.m.failures[stage])
        yield fail
        dec = CounterMetricFamily("kvrun_cluster_route_decisions", "Routing decisions",
                                  labels=["kind"])
        for k, n in sorted(affinity.DECISIONS.items()):
            dec.add_metric([k], n)
        yield dec
        yield GaugeMetricFamily("kvrun_cluster_store_up", "Whether the store actor answered",
                                value=int(self.store is not None))
        if self.store is not None:
            for k in ("entries", "bytes", "budget_bytes"):
                yield GaugeMetricFamily(f"kvrun_shared_tier_{k}", f"Shared tier {k}",
                                        value=self.store[k])
        yield from _replicas(self.reports)


def _replicas(reports: dict):
    labels = ["replica", "node"]
    fams = {k: GaugeMetricFamily(f"kvrun_replica_{k}", f"Sequences {k}", labels=labels)
            for k in ("running", "waiting")}
    q = CounterMetricFamily("kvrun_replica_prefix_cache_queries", "Prompt tokens looked up",
                            labels=labels)
    h = CounterMetricFamily("kvrun_replica_prefix_cache_hits", "Prompt tokens restored",
                            labels=labels)
    rq = CounterMetricFamily("kvrun_replica_prefix_cache_requests", "Requests looked up",
                             labels=labels + ["hit"])
    up = GaugeMetricFamily("kvrun_replica_shared_tier_up", "Shared tier reachable", labels=labels)
    shared = {k: CounterMetricFamily(f"kvrun_replica_shared_tier_{name}", doc, labels=labels)
              for k, name, doc in REPLICA_SHARED}
    for r, st in sorted(reports.items()):
        lv = [r, st.get("node", "")]
        for k, f in fams.items():
            f.add_metric(lv, st.get(k, 0))
        p = st.get("prefix") or {}
        q.add_metric(lv, p.get("prompt_tokens", 0))
        h.add_metric(lv, p.get("hit_tokens", 0))
        rq.add_metric(lv + ["true"], p.get("hits", 0))
        rq.add_metric(lv + ["false"], p.get("requests", 0) - p.get("hits", 0))
        if "shared_up" in p:
            up.add_metric(lv, p["shared_up"])
            for k, f in shared.items():
                f.add_metric(lv, p.get(k, 0))
    yield from fams.values()
    yield from (q, h, rq, up)
    yield from shared.values()
