"""kvrun.engine.prefix_budget: the prefix cache's default RAM bounds, a fraction of the memory
this process may use, capped, whole MiB, and 0 when the memory cannot be read."""
import pytest

from kvrun import machine
from kvrun.engine import prefix_budget


def test_the_serve_default_follows_it(monkeypatch, tmp_path):
    from kvrun.engine import prefix_budget
    f = tmp_path / "memory.max"
    f.write_text(f"{4 << 30}\n")                              # a 4 GiB container
    monkeypatch.setattr(machine, "CGROUP_MEMORY_MAX", str(f))
    assert prefix_budget.serve_default_mb() == 512.0          # an eighth


@pytest.mark.parametrize("memory, serve, model", [
    (4 << 30, 512.0, 128.0),                    # an eighth, a 32nd
    (1 << 40, 8192.0, 1024.0),                  # both capped
    ((3 << 30) + 12345, 384.0, 96.0),           # whole MiB
    (None, 0.0, 0.0),                           # unreadable: no cache rather than a guess
])
def test_defaults_from_the_machines_memory(monkeypatch, memory, serve, model):
    monkeypatch.setattr(prefix_budget, "memory_bytes", lambda: memory)
    assert (prefix_budget.serve_default_mb(), prefix_budget.model_default_mb()) == (serve, model)
    assert prefix_budget.machine_memory_mb() == (memory or 0) / (1 << 20)
