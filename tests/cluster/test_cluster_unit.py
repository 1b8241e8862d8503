"""The cluster's pieces that need no Ray cluster (runtime/cluster/): the affinity policy with
its load bound, the routing key of a request, and that Ray stays out of `import kvrun` and of
`kvrun serve` without --ray."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvrun.cluster.affinity import Owners, choose
from kvrun.cluster.forward import BLOCK_CHARS, blocks_of, routing_text


def test_blocks_name_shared_prefixes():
    a = "s" * (3 * BLOCK_CHARS) + "user one"
    b = "s" * (3 * BLOCK_CHARS) + "user two, longer" + "x" * BLOCK_CHARS
    ba, bb = blocks_of(a), blocks_of(b)
    assert len(ba) == 3 and len(bb) == 4
    assert ba == bb[:3]                             # the shared system prompt's blocks
    assert blocks_of("t" + a[1:])[0] != ba[0]       # one character differs: another chain
    assert blocks_of("short") == []


def test_routing_text_of_chat_and_completion():
    chat = json.dumps({"messages": [{"role": "system", "content": "S"},
                                    {"role": "user", "content": "U"}]}).encode()
    assert routing_text("/v1/chat/completions", chat) == "\0system\0S\0user\0U"
    assert routing_text("/v1/completions", b'{"prompt": "abc"}') == "abc"
    assert routing_text("/v1/completions", b'{"prompt": [1, 2]}') == "[1, 2]"
    for bad in (b"", b"{", b"[1]", b'{"messages": 3}'):
        assert routing_text("/v1/chat/completions", bad) == ""
    assert routing_text("/health", chat) == ""


def test_affinity_follows_the_longest_owned_prefix():
    owners = Owners()
    sys_a, sys_b = blocks_of("a" * 4 * BLOCK_CHARS), blocks_of("b" * 2 * BLOCK_CHARS)
    idle = {"r1": 0, "r2": 0, "r3": 0}
    assert choose(sys_a, idle, owners, bound=2).kind == "cold"
    owners.record(sys_a, "r3")                      # r3 holds the longer prefix
    owners.record(sys_a[:2], "r2")                  # the last to take a block owns it
    c = choose(sys_a, idle, owners, bound=2)
    assert (c.replica, c.kind, c.blocks) == ("r3", "affinity", 4)
    assert choose(sys_a, {"r1": 0, "r2": 0}, owners, 2).replica == "r2"    # r3 gone
    assert choose(sys_b, idle, owners, 2).kind == "cold"
    owners.forget("r3")
    assert choose(sys_a, idle, owners, 2).replica == "r2"
    assert choose(sys_a, {"r1": 0}, owners, 2).kind == "cold"


def test_load_bound_spills_a_hot_prefix():
    owners = Owners()
    blocks = blocks_of("h" * 2 * BLOCK_CHARS)
    owners.record(blocks, "r1")
    assert choose(blocks, {"r1": 2, "r2": 0}, owners, bound=2).replica == "r1"   # at the bound
    c = choose(blocks, {"r1": 3, "r2": 0}, owners, bound=2)                       # past it
    assert (c.replica, c.kind) == ("r2", "spill")
    assert choose(blocks, {"r1": 1, "r2": 0}, owners, bound=0).replica == "r2"


def test_owners_forget_the_least_recently_used():
    owners = Owners(capacity=3)
    owners.record(["a", "b"], "r1")
    owners.record(["c", "d"], "r2")
    assert list(owners.map) == ["b", "c", "d"]


@pytest.mark.parametrize("argv", [[], ["serve", "--port", "0"], ["serve", "--replicas", "3"]])
def test_ray_stays_out(argv):
    """`import kvrun`, and `kvrun serve` without --ray (here stopped by a bad flag after its
    options are parsed), never import ray."""
    code = ("import sys, kvrun, kvrun.cli.main as m\n"
            f"argv = {argv!r}\n"
            "if argv:\n"
            "    try:\n"
            "        m.main(argv, standalone_mode=False)\n"
            "    except BaseException as e:\n"
            "        print('failed:', repr(e))\n"
            "print('ray' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout
    if argv:
        assert "failed:" in out.stdout


def test_router_wiring_without_a_cluster():
    """KvrunRouter (Ray Serve's RequestRouter API) on stand-in replicas: affinity after the
    first request, the load bound counted from routed / completed requests, round robin."""
    pytest.importorskip("ray.serve")
    import asyncio
    from types import SimpleNamespace

    from kvrun.cluster import affinity
    from kvrun.cluster.forward import Forward
    from kvrun.cluster.router import KvrunRouter

    class Rid:
        def __init__(self, s):
            self.s = s

        def to_full_id_str(self):
            return self.s
    reps = [SimpleNamespace(replica_id=Rid(s)) for s in ("r1", "r2")]
    fwd = Forward("POST", "/v1/completions", b"", [], b"", blocks=blocks_of("p" * 3 * BLOCK_CHARS))

    def pending(i):
        return SimpleNamespace(args=[fwd], metadata=SimpleNamespace(internal_request_id=str(i)))

    def route(router, i):
        ranks = asyncio.run(router.choose_replicas(reps, pending(i)))
        chosen = ranks[0][0].replica_id
        router.on_request_routed(pending(i), chosen, None)
        return chosen.to_full_id_str(), [r.replica_id.s for rank in ranks for r in rank]

    r = KvrunRouter.__new__(KvrunRouter)
    r.initialize_state(policy="prefix", bound=1)
    first, order = route(r, 0)
    assert sorted(order) == ["r1", "r2"]            # every replica ranked, chosen first
    before = affinity.DECISIONS["affinity"]
    assert route(r, 1)[0] == first                  # its prefix's replica (1 in flight: at the bound)
    assert affinity.DECISIONS["affinity"] == before + 1
    spill = route(r, 2)[0]                          # 2 in flight there: over the bound
    assert spill != first
    r.on_request_completed(Rid(first), "0")
    r.on_request_completed(Rid(first), "1")
    assert route(r, 3)[0] == spill                  # the last replica sent the prefix owns it
    rr = KvrunRouter.__new__(KvrunRouter)
    rr.initialize_state(policy="round-robin")
    assert [route(rr, i)[0] for i in range(4)] == ["r1", "r2", "r1", "r2"]


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
