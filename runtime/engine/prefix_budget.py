"""The default RAM bounds of the prefix cache (runtime/engine/prefix_cache.py), computed from
the machine's memory: `kvrun serve --cache-ram` and a library `Model`'s `cache_ram_mb`.

The machine's memory is runtime/machine.py's: the smaller of the physical RAM and a cgroup
v2 limit, so a server in a 4 GiB container does not plan for the host's 256 GiB. No torch here: `kvrun serve --help` states the value."""
from __future__ import annotations

from ..machine import memory_bytes

MiB = 1 << 20

# kvrun serve: an eighth of the memory, at most llama-server's --cache-ram default (8 GiB)
SERVE_FRACTION, SERVE_CAP_MB = 8, 8192
# a library Model (one sequence, often several Models in one process): a 32nd, at most 1 GiB
MODEL_FRACTION, MODEL_CAP_MB = 32, 1024


def machine_memory_mb() -> float:
    """MiB of memory this process may use (machine.memory_bytes); 0 when it cannot be read."""
    return (memory_bytes() or 0) / MiB


def default_cache_ram_mb(fraction: int, cap_mb: float) -> float:
    """MiB: 1/fraction of `machine_memory_mb()`, at most `cap_mb`, rounded down to whole MiB
    (0 when the memory cannot be read: no cache rather than a guess)."""
    return float(int(min(machine_memory_mb() / fraction, cap_mb)))


def serve_default_mb() -> float:
    return default_cache_ram_mb(SERVE_FRACTION, SERVE_CAP_MB)


def model_default_mb() -> float:
    return default_cache_ram_mb(MODEL_FRACTION, MODEL_CAP_MB)
