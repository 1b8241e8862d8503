"""The replicas' last counters, for the ingress's /metrics (metrics.py): a detached, named
Ray actor each replica reports to every few seconds (replica.py), so the ingress shows every
replica without reaching each one. It is apart from the shared tier's store (store.py), so
the store down is still seen in every replica's counters."""
from __future__ import annotations

import time

REGISTRY_NAME = "kvrun-registry"        # the actor's name in its namespace


class Registry:
    """replica id -> its last report."""

    def __init__(self):
        self.reports: dict[str, dict] = {}

    def report(self, replica: str, stats: dict) -> None:
        self.reports[replica] = {**stats, "reported_at": time.time()}

    def replica_reports(self, max_age: float = 30.0) -> dict:
        """The reports of the replicas that reported within `max_age` seconds (a replica
        gone stops reporting and drops out)."""
        now = time.time()
        return {r: s for r, s in self.reports.items() if now - s["reported_at"] <= max_age}
