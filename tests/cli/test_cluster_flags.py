"""kvrun.cli.cluster_flags: `kvrun serve --ray`'s flags: refused without --ray, checked before
Ray is imported, and a local Ray kept on loopback."""
import os

import pytest

from kvrun.cli.cluster_flags import (RAY_LOOPBACK, cluster_only, local_ray_on_loopback,
                                     serve_on_ray)
from kvrun.errors import KvrunError

DEFAULTS = {"address": None, "replicas": 2, "replica_cpus": 1.0, "routing": "prefix",
            "load_bound": 4, "shared_mb": 1024.0}


def test_ray_only_flags_need_ray():
    cluster_only(DEFAULTS)                                  # nothing given: fine
    for k, v, flag in (("replicas", 3, "--replicas"), ("routing", "round-robin", "--routing"),
                       ("shared_mb", 0.0, "--shared-mb"), ("address", "auto", "--address")):
        with pytest.raises(KvrunError, match=f"^{flag} needs --ray$"):
            cluster_only({**DEFAULTS, k: v})


@pytest.mark.parametrize("cluster, cache_dir, match", [
    (DEFAULTS, "/tmp/x", "--cache-dir is one machine's second tier"),
    ({**DEFAULTS, "shared_mb": -1.0}, None, r"--shared-mb must be a finite number >= 0 MiB \(got -1\)"),
])
def test_serve_on_ray_refuses_before_ray_starts(cluster, cache_dir, match):
    with pytest.raises(KvrunError, match=match):
        serve_on_ray(dict(cluster), print, cache_dir, kv="fp16", ctx_policy=None)


def test_a_local_ray_stays_on_loopback(monkeypatch):
    name, value = RAY_LOOPBACK
    monkeypatch.delenv(name, raising=False)
    local_ray_on_loopback()
    assert os.environ[name] == value
    monkeypatch.setenv(name, "1")                           # an operator's own choice stays
    local_ray_on_loopback()
    assert os.environ[name] == "1"
