"""How many CPU threads the compute uses, adapted to the cores other processes leave free.

A decode step runs ~100 short OpenMP regions (three per layer in the native layer kernels,
one per attention call, more in torch's ops). libgomp's threads spin at the end of each
region while they wait for the others; when another process holds one of the cores, the
thread that lost its core finishes late and its partner spins through its own time slice
waiting for it, so a 2-thread step on a 2-core machine beside one busy process ran 10-30x
slower than a 1-thread step. Sleeping instead of spinning (OMP_WAIT_POLICY=PASSIVE) costs
~10 % on an idle machine, so kvrun keeps the spin and uses fewer threads while the cores
are taken.

`tick()` runs before every forward. At most every `SAMPLE_S` seconds it reads how many
tasks are runnable on the machine (/proc/loadavg's 4th field, a snapshot the kernel keeps)
and subtracts this process's own runnable threads (/proc/self/task/*/stat); the other
processes' demand is the median of the last `HISTORY` readings, and the thread count is
the cores left free by them, between 1 and the cap. Where /proc is missing (not Linux),
the cap is used as is.

The cap is `-t`/`load(threads=N)`, or by default the CPUs this process may run on.
`KVRUN_THREADS_ADAPT=0` keeps exactly the cap (benchmarks on a machine known to be quiet).
torch's thread count is process-wide, so this state is too.
"""
from __future__ import annotations

import os
import statistics
import time
from collections import deque

import torch

from . import knobs

SAMPLE_S = 0.002            # at most one reading per 2 ms: a tiny model's step is ~1 ms
HISTORY = 5                 # a transient process (a shell command) moves no decision
MAX_THREADS = 1024          # -t beyond this overflowed inside torch


def available_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _own_runnable() -> int:
    """This process's threads in state R (running or waiting for a CPU)."""
    n = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 1
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/stat", "rb") as f:
                s = f.read()
        except OSError:                 # the thread ended between listdir and open
            continue
        i = s.rfind(b")")               # the command name may hold spaces and parentheses
        if s[i + 2:i + 3] == b"R":
            n += 1
    return max(n, 1)                    # the thread reading is running


class Governor:
    """The process's compute thread count (see the module docstring)."""

    def __init__(self):
        self.cap = available_cpus()
        self.adapt = knobs.threads_adapt()
        self.current = None             # the count last given to torch
        self.others: deque[int] = deque(maxlen=HISTORY)
        self.last = 0.0
        self._fd = None
        self.host_cpus = os.cpu_count() or 1

    def configure(self, threads: int | None) -> None:
        """Set the cap: `threads` (>= 1), or None for the CPUs this process may run on."""
        self.cap = threads if threads is not None else available_cpus()
        self.others.clear()
        self._set(self.cap, force=True)

    def _set(self, n: int, force: bool = False) -> None:
        if force or n != self.current:
            torch.set_num_threads(n)
            self.current = n

    def _runnable_others(self) -> int | None:
        """Runnable tasks of other processes now, or None where /proc cannot tell."""
        try:
            if self._fd is None:
                self._fd = os.open("/proc/loadavg", os.O_RDONLY)
            field = os.pread(self._fd, 128, 0).split()[3]      # b"running/total"
            running = int(field.split(b"/")[0])
        except (OSError, IndexError, ValueError):
            self.adapt = False
            return None
        if running <= 1:                # only the thread reading: skip the task scan
            return 0
        return max(0, running - _own_runnable())

    def tick(self) -> int:
        """Before a forward: the thread count to use now (torch's is set to it)."""
        if self.current is None:
            self._set(self.cap)
        if not self.adapt or self.cap <= 1:
            return self.current
        now = time.monotonic()
        if now - self.last < SAMPLE_S:
            return self.current
        self.last = now
        r = self._runnable_others()
        if r is None:
            self._set(self.cap)
            return self.current
        self.others.append(r)
        busy = int(statistics.median_low(self.others))
        self._set(max(1, min(self.cap, self.host_cpus - busy)))
        return self.current


governor = Governor()


def configure(threads: int | None) -> None:
    """The cap for every model in this process: -t N / load(threads=N), None for the CPUs
    this process may run on."""
    governor.configure(threads)


def tick() -> int:
    return governor.tick()
