"""What this machine gives the process, read from the OS (no torch): its memory, the
smaller of the physical RAM and a cgroup v2 limit (a container's `memory.max`), so a cache
or a default bound sized from it does not plan for the host's RAM inside a 4 GiB container.
Used by the KV cache's fit check (kv/build.py), the benchmarks' size check and the prefix
caches' default bounds (engine/prefix_budget.py)."""
from __future__ import annotations

import os

CGROUP_MEMORY_MAX = "/sys/fs/cgroup/memory.max"


def memory_bytes() -> int | None:
    """Bytes of memory this process may use, or None where neither the OS nor a cgroup
    says."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        total = None
    try:
        with open(CGROUP_MEMORY_MAX) as f:
            limit = f.read().strip()            # "max" when unlimited
        if limit.isdigit():
            total = min(total, int(limit)) if total else int(limit)
    except OSError:
        pass
    return total
