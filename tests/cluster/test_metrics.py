"""kvrun.cluster.metrics: the ingress's /metrics from its own counters, the store's stats and
the replicas' reports, with the actors stood in for (the scrape's logic, not Ray's)."""
import asyncio
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")
from kvrun.cluster import metrics  # noqa: E402
from kvrun.cluster.registry import REGISTRY_NAME  # noqa: E402
from kvrun.cluster.store import STORE_NAME  # noqa: E402


def _actor(**answers):
    """A stand-in actor handle: `handle.method.remote()` awaits to the given answer."""
    async def ready(v):
        return v
    return SimpleNamespace(**{m: SimpleNamespace(remote=lambda v=v: ready(v))
                              for m, v in answers.items()})


def _scrape(monkeypatch, actors: dict) -> set[str]:
    def get_actor(name, namespace):
        assert namespace == "ns"
        if name not in actors:
            raise ValueError(f"Failed to look up actor with name '{name}'")
        return actors[name]
    monkeypatch.setattr(metrics.ray, "get_actor", get_actor)
    m = metrics.ClusterMetrics("ns", timeout=1.0)
    m.requests[("r1", 200)] += 2
    m.failures["mid_stream"] += 1
    body, ctype = asyncio.run(m.exposition())
    assert ctype.startswith("text/plain")
    return {line for line in body.decode().splitlines() if not line.startswith("#")}


def test_scrape_shows_the_store_and_every_replica(monkeypatch):
    report = {"node": "n1", "running": 1, "waiting": 3,
              "prefix": {"prompt_tokens": 50, "hit_tokens": 20, "requests": 5, "hits": 2,
                         "shared_up": 1, "shared_hits": 4, "shared_bytes_out": 1024}}
    lines = _scrape(monkeypatch, {
        STORE_NAME: _actor(stats={"entries": 2, "bytes": 80, "budget_bytes": 100}),
        REGISTRY_NAME: _actor(replica_reports={"r1": report})})
    for want in ('kvrun_cluster_requests_total{replica="r1",status="200"} 2.0',
                 'kvrun_cluster_replica_failures_total{stage="before"} 0.0',
                 'kvrun_cluster_replica_failures_total{stage="mid_stream"} 1.0',
                 "kvrun_cluster_store_up 1.0", "kvrun_shared_tier_bytes 80.0",
                 "kvrun_shared_tier_budget_bytes 100.0",
                 'kvrun_replica_waiting{node="n1",replica="r1"} 3.0',
                 'kvrun_replica_prefix_cache_hits_total{node="n1",replica="r1"} 20.0',
                 'kvrun_replica_prefix_cache_requests_total{hit="false",node="n1",replica="r1"} 3.0',
                 'kvrun_replica_shared_tier_restores_total{node="n1",replica="r1"} 4.0',
                 'kvrun_replica_shared_tier_bytes_out_total{node="n1",replica="r1"} 1024.0'):
        assert want in lines, want


def test_scrape_without_the_actors_says_the_store_is_down(monkeypatch):
    lines = _scrape(monkeypatch, {})
    assert "kvrun_cluster_store_up 0.0" in lines
    assert not any(line.startswith(("kvrun_shared_tier_", "kvrun_replica_running{"))
                   for line in lines)
    assert 'kvrun_cluster_requests_total{replica="r1",status="200"} 2.0' in lines
