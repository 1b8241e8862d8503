"""runtime/machine.py: the memory a process may use is the smaller of the physical RAM and
a cgroup v2 limit; "max" (no limit) and an unreadable cgroup leave the RAM."""
import os

from kvrun import machine


def test_a_cgroup_limit_lowers_the_memory(monkeypatch, tmp_path):
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    f = tmp_path / "memory.max"
    monkeypatch.setattr(machine, "CGROUP_MEMORY_MAX", str(f))
    assert machine.memory_bytes() == ram                       # no cgroup file
    f.write_text("max\n")
    assert machine.memory_bytes() == ram
    f.write_text(f"{1 << 32}\n")
    assert machine.memory_bytes() == min(ram, 1 << 32)
    f.write_text(f"{ram * 2}\n")
    assert machine.memory_bytes() == ram                       # a limit above the RAM
