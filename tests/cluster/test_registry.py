"""kvrun.cluster.registry: the replicas' last reports, for the ingress's /metrics."""


def test_registry_forgets_silent_replicas(monkeypatch):
    from kvrun.cluster import registry
    r = registry.Registry()
    now = [1000.0]
    monkeypatch.setattr(registry.time, "time", lambda: now[0])
    r.report("r1", {"running": 1})
    now[0] += 20
    r.report("r2", {"running": 0})
    assert set(r.replica_reports(max_age=30)) == {"r1", "r2"}
    now[0] += 15
    assert set(r.replica_reports(max_age=30)) == {"r2"}
