"""kvrun's Ray Serve request router (`request_router_config` of the replica deployment):
prefix affinity with a load bound (affinity.py), or round robin (the baseline the benchmark
compares it with: tools/cluster_bench.py).

It runs in the ingress's process, one per handle. The request's routing key is the
`blocks` of its Forward (forward.py); "in flight" is this router's own count of requests
it sent a replica that have not completed. Decisions are counted in `affinity.DECISIONS`
(kind -> count), which the ingress's /metrics reports: read through the module (Ray
ships this class to the ingress by value, so a global of this file would be a copy). Ray's own PrefixCacheAffinityRouter
is not used: in Ray 2.60 it imports ray.llm, which needs pyarrow (and is built for vLLM's
requests), and it matches characters of message contents without their roles."""
from __future__ import annotations

import collections
import itertools

from ray.serve.request_router import (FIFOMixin, LocalityMixin, MultiplexMixin,
                                      PendingRequest, ReplicaID, RequestRouter, RunningReplica)

from . import affinity
from .affinity import Owners, choose
from .forward import Forward


def _forward(req: PendingRequest | None) -> Forward | None:
    if req is None:
        return None
    return next((a for a in req.args if isinstance(a, Forward)), None)


class KvrunRouter(FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter):
    """policy "prefix" (load bound `bound` requests) or "round-robin"."""

    def initialize_state(self, policy: str = "prefix", bound: int = 4, capacity: int = 200_000):
        assert policy in ("prefix", "round-robin"), policy
        self.policy, self.bound = policy, bound
        self.owners = Owners(capacity)
        self.in_flight: collections.Counter = collections.Counter()
        self._turn = itertools.count()
        self._by_request: dict[str, str] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None):
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        ids = sorted(by_id)
        fwd = _forward(pending_request)
        if self.policy == "round-robin" or fwd is None:
            first = ids[next(self._turn) % len(ids)]
            affinity.DECISIONS["round-robin" if fwd is not None else "other"] += 1
        else:
            c = choose(fwd.blocks, {r: self.in_flight[r] for r in ids}, self.owners, self.bound)
            affinity.DECISIONS[c.kind] += 1
            first = c.replica
        # the chosen replica first; the others (least loaded first) if it refuses
        rest = sorted((r for r in ids if r != first), key=lambda r: self.in_flight[r])
        return [[by_id[first]]] + ([[by_id[r] for r in rest]] if rest else [])

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result):
        rid = replica_id.to_full_id_str()
        self.in_flight[rid] += 1
        self._by_request[pending_request.metadata.internal_request_id] = rid
        fwd = _forward(pending_request)
        if fwd is not None and fwd.blocks:
            self.owners.record(fwd.blocks, rid)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str):
        rid = self._by_request.pop(internal_request_id, None)
        if rid is not None and self.in_flight[rid] > 0:
            self.in_flight[rid] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        rid = replica_id.to_full_id_str()
        self.owners.forget(rid)
        self.in_flight.pop(rid, None)
