"""kvrun.cluster.store: PrefixStore's bookkeeping, the shared tier's actor, without a Ray
cluster."""
import pytest


def test_store_keeps_its_budget_least_recently_used_out(monkeypatch):
    """PrefixStore's bookkeeping (ray.put stood in for: the actor's logic, not Ray's)."""
    ray = pytest.importorskip("ray")
    from kvrun.cluster.store import PrefixStore
    monkeypatch.setattr(ray, "put", lambda blob: ("ref", blob))
    s = PrefixStore(budget=100)
    a, b, c = ("a" * 64 + ".kvpc", "b" * 64 + ".kvpc", "c" * 64 + ".kvpc")
    assert s.put(a, b"x" * 40) and s.put(b, b"y" * 40)
    assert s.get(a) == [("ref", b"x" * 40)]          # a used last: b goes first
    assert s.put(c, b"z" * 40)
    assert s.get(b) is None and s.get(a) is not None and s.stats()["bytes"] == 80
    assert not s.put("../etc/passwd", b"1") and not s.put(a.upper(), b"1")   # names only
    assert not s.put("d" * 64 + ".kvpc", b"w" * 101)                           # over budget
    s.drop(a)
    assert s.get(a) is None and s.stats() == {"entries": 1, "bytes": 40, "budget_bytes": 100,
                                              "puts": 3, "gets": 4, "hits": 2, "dropped": 1}
