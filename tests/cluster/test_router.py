"""kvrun.cluster.router: KvrunRouter, Ray Serve's RequestRouter, on stand-in replicas (no
Ray cluster)."""
import pytest

from kvrun.cluster.forward import BLOCK_CHARS, blocks_of


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
