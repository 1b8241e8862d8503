"""The thread governor (runtime/threads.py): fewer threads while other processes keep the
cores busy, the cap otherwise; and `-t` / `load(threads=)` set the cap."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from kvrun import threads as T


@pytest.fixture()
def gov(monkeypatch):
    """A fresh governor whose readings of other processes' demand come from a list."""
    g = T.Governor()
    g.host_cpus, g.adapt = 4, True
    g.configure(4)
    readings: list[int] = []
    monkeypatch.setattr(g, "_runnable_others", lambda: readings.pop(0))
    monkeypatch.setattr(T, "SAMPLE_S", 0.0)
    yield g, readings
    T.governor.configure(None)          # torch's count is process-wide: give it back


def test_cores_taken_by_others_lower_the_count_after_the_median(gov):
    g, readings = gov
    readings += [2, 2, 2, 0, 0, 0, 0]
    got = [g.tick() for _ in range(7)]
    # the median of the last 5 readings: one reading of 2 moves nothing, a majority does
    assert got == [2, 2, 2, 2, 2, 4, 4]
    assert torch.get_num_threads() == 4


def test_a_transient_process_moves_nothing(gov):
    g, readings = gov
    readings += [0, 0, 3, 0, 0, 3, 0]
    assert [g.tick() for _ in range(7)] == [4] * 7


def test_never_below_one_nor_above_the_cap(gov):
    g, readings = gov
    readings += [9, 9, 9, 0, 0, 0]
    assert min(g.tick() for _ in range(3)) == 1
    g.configure(2)
    assert max(g.tick() for _ in range(3)) == 2


def test_adaptation_can_be_switched_off(gov):
    g, readings = gov
    g.adapt = False
    readings += [9, 9, 9]
    assert [g.tick() for _ in range(3)] == [4, 4, 4]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_busy_process_is_seen_on_this_machine():
    """The real reading: a busy loop in another process counts as at least one runnable
    task beside this process's own threads (which are not counted)."""
    g = T.Governor()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        seen = []
        for _ in range(40):
            seen.append(g._runnable_others())
            time.sleep(0.005)
    finally:
        busy.kill()
        busy.wait()
    assert sorted(seen)[len(seen) // 2] >= 1, seen


def test_load_sets_the_cap(tiny_dir):
    import kvrun
    kvrun.load(tiny_dir, dtype="fp32", ctx=16, kv="fp32", threads=1)
    assert T.governor.cap == 1 and torch.get_num_threads() == 1
    with pytest.raises(kvrun.KvrunError, match="threads"):
        kvrun.load(tiny_dir, dtype="fp32", ctx=16, kv="fp32", threads=0)
    T.configure(None)
    assert T.governor.cap == T.available_cpus()


def test_load_takes_the_governors_count_before_the_weights(tiny_dir, monkeypatch):
    """The weights' repacks at load are torch ops: they run on the governed count, not on
    every core while other processes hold them (spinning waits made loads 7-12x slower)."""
    import kvrun
    import kvrun.engine.api as A
    seen = []
    real = A.load_transformer
    monkeypatch.setattr(T.governor, "tick", lambda: seen.append("tick") or 1)
    monkeypatch.setattr(A, "load_transformer", lambda *a, **k: seen.append("load") or real(*a, **k))
    kvrun.load(tiny_dir, dtype="fp32", ctx=16, kv="fp32")
    assert seen[:2] == ["tick", "load"]
