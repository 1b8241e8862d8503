"""kvrun.cluster.deploy: the Serve app builder's arguments, checked before anything is
deployed."""
import pytest


def test_app_builder_arguments():
    """`import_path: kvrun.cluster.deploy:build` (a Serve config, KubeRay): strings from
    `serve run … key=value` typed by the settings' fields; unknown names and non-numbers
    refused in one line, before anything is deployed."""
    pytest.importorskip("ray.serve")
    from kvrun.cluster.deploy import ClusterSpec, _typed, build
    from kvrun.cluster.replica import ReplicaSpec
    from kvrun.errors import KvrunError
    assert _typed(ReplicaSpec, "ctx", "256") == 256
    assert _typed(ReplicaSpec, "kv_budget_mb", "3.5") == 3.5
    assert _typed(ReplicaSpec, "cors", "a,b") == ("a", "b")
    assert _typed(ClusterSpec, "replicas", 3) == 3
    with pytest.raises(KvrunError, match="unknown kvrun app argument 'replcias'"):
        build({"replcias": 2})
    with pytest.raises(KvrunError, match="not a number"):
        build({"ctx": "lots"})
    with pytest.raises(KvrunError, match="--replicas must be >= 1"):
        build({"replicas": "0"})
