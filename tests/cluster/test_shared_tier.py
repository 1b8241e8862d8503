"""kvrun.cluster.shared_tier: the shared prefix tier while its store actor is away (lookups
miss, nothing is shipped), and back once the actor answers, with Ray's calls stood in for."""
from pathlib import Path
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")
from ray.exceptions import RayError  # noqa: E402

from kvrun.cluster import shared_tier  # noqa: E402

MODEL = {"sha256": "0" * 64, "dtype": "fp32"}


class Store:
    """A stand-in store actor handle: `.remote()` returns the answer, `ray.get` passes it on
    (raising it when it is an error)."""

    def __init__(self):
        self.ping = SimpleNamespace(remote=lambda: self.pong)
        self.get = SimpleNamespace(remote=lambda name: None)      # holds nothing
        self.pong = "pong"


@pytest.fixture
def ray_stub(monkeypatch):
    actors = {}

    def get_actor(name, namespace):
        if name not in actors:
            raise ValueError(f"Failed to look up actor with name '{name}'")
        return actors[name]

    def get(v, timeout=None):
        if isinstance(v, Exception):
            raise v
        return v
    monkeypatch.setattr(shared_tier.ray, "get_actor", get_actor)
    monkeypatch.setattr(shared_tier.ray, "get", get)
    return actors


def test_store_away_then_back(ray_stub, tmp_path):
    tier = shared_tier.SharedTier(MODEL, 1 << 20, "ns", retry=3600)
    try:
        assert not tier.up and tier.stats()["shared_up"] == 0 and tier.errors == 1
        name = tier.paths("fp16", (1, 2, 3), [3])[3]
        assert name == tier.local.paths("fp16", (1, 2, 3), [3])[3]       # the disk tier's names
        assert tier.get(name, "fp16", (1, 2, 3)) is None                 # away: a miss, no call
        assert tier.put(name, "fp16", {}, None) is False
        ray_stub[shared_tier.STORE_NAME] = Store()
        assert tier.get(name, "fp16", (1, 2, 3)) is None and not tier.up  # retry not yet due
        tier.retry = 0
        assert tier.get(name, "fp16", (1, 2, 3)) is None                 # reconnected, empty
        st = tier.stats()
        assert (st["shared_up"], st["shared_misses"], st["shared_errors"]) == (1, 1, 1)
        ray_stub[shared_tier.STORE_NAME].pong = RayError("actor died")
        assert tier.refresh() is False and tier.stats()["shared_up"] == 0 and tier.errors == 3
    finally:
        tier.close()
    assert not Path(tier._dir).exists()
