"""The native decode layer's GEMV alone, integer path against fp32, in and out of cache.

    python tools/gemv_speed.py [-m MODEL] [--rows 1,8] [-t 1,2] [--reps 200] [--stat min]

For each weight of one layer of MODEL (default: the int4 default model; its int8 lm_head
too) it times kvrun_gemv (kernels/native/decode_layer.c: input preparation + GEMV, one
OpenMP region per call) on both paths, alternating, in two settings:
- "hot": the same weight every call, so it stays in cache (what a kernel-only loop measures);
- "cold": a buffer larger than the last-level cache is written before every call, so the
  call reads its weight from DRAM, as the decode step does (it streams ~95 MB a token).
Prints µs per call (median of --reps, or `--stat min`: the least, what the call costs
when nothing else runs, the steadier figure on a shared machine), GB/s of weight bytes
(as stored), and int / fp32.
`--clock cpu` times the calling thread's CPU time instead of wall time: on one thread
(-t 1) that is all the call's work, and it moves far less than wall time while other
processes load the machine.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

import kvrun
from kvrun.kernels.native import load
from kvrun.kernels.native.decode_layer import GEMV_PATHS, qrow_bytes, weight_desc
from kvrun.model.native_step import _stacked, _stored


class Call:
    """kvrun_gemv on one weight with its buffers made once (kernels/native/decode_layer.py
    gemv builds them per call, which would dominate a few-µs GEMV)."""

    def __init__(self, w: dict, x: torch.Tensor):
        self.keep: list = []
        self.d = weight_desc(w, self.keep)
        self.B, K = x.shape
        self.x, self.y = x.contiguous(), torch.empty(self.B, self.d.N)
        self.xq = torch.empty(self.B, qrow_bytes(K), dtype=torch.uint8)
        self.xs = torch.empty(self.B, K // 32)
        self.lib = load()

    def __call__(self, path: str, nthreads: int) -> None:
        p = ctypes.c_void_p
        rc = self.lib.kvrun_gemv(ctypes.byref(self.d), self.B, p(self.x.data_ptr()),
                                 ctypes.c_int64(self.x.stride(0)), p(self.y.data_ptr()),
                                 p(self.xq.data_ptr()), ctypes.c_int64(self.xq.stride(0)),
                                 p(self.xs.data_ptr()), GEMV_PATHS[path], nthreads)
        assert rc == 0, rc


def _weights(model) -> dict[str, dict]:
    """name -> the first layer's weight of that name in stored form, and the lm_head."""
    a, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    return {"qkv": _stacked([a.q_proj, a.k_proj, a.v_proj]), "o": _stored(a.o_proj),
            "gate": _stored(mlp.gate_proj), "down": _stored(mlp.down_proj),
            "lm_head": _stored(model.lm_head)}


def _nbytes(w: dict) -> int:
    return sum(w[k].numel() * w[k].element_size() for k in ("qweight", "scales", "mins") if k in w)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("-t", "--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--evict-mb", type=int, default=96, help="the buffer written before a cold call")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--stat", choices=("median", "min"), default="median")
    a = ap.parse_args()
    if a.clock == "cpu" and any(int(t) != 1 for t in a.threads.split(",")):
        raise SystemExit("error: --clock cpu counts only the calling thread: use it with -t 1")
    clock = time.thread_time if a.clock == "cpu" else time.perf_counter
    model = kvrun.load(a.model, ctx=8).transformer
    ws = _weights(model)
    g = torch.Generator().manual_seed(0)
    junk = torch.zeros(a.evict_mb * 2**20 // 4)
    print(f"{'weight':8} {'N x K':>12} {'B':>3} {'thr':>3} {'set':5} {'fp32 µs':>9} {'int µs':>9} "
          f"{'fp32 GB/s':>9} {'int GB/s':>9} {'int/fp32':>8}")
    for name, w in ws.items():
        q = w["qweight"]
        N, K = q.shape[0], q.shape[1] * (2 if w["kind"] == "int4" else 1)
        for B in map(int, a.rows.split(",")):
            x = torch.randn(B, K, generator=g)
            for nth in map(int, a.threads.split(",")):
                call = Call(w, x)
                for setting in ("hot", "cold"):
                    times: dict[str, list[float]] = {"fp32": [], "int": []}
                    reps = a.reps if name != "lm_head" else max(a.reps // 10, 5)
                    for r in range(reps + 2):
                        for path in ("fp32", "int"):                    # alternating
                            if setting == "cold":
                                junk.add_(1)
                            t0 = clock()
                            call(path, nth)
                            if r >= 2:
                                times[path].append(clock() - t0)
                    stat = statistics.median if a.stat == "median" else min
                    f, i = (stat(times[p]) * 1e6 for p in ("fp32", "int"))
                    nb = _nbytes(w)
                    print(f"{name:8} {f'{N} x {K}':>12} {B:>3} {nth:>3} {setting:5} {f:9.1f} {i:9.1f} "
                          f"{nb / f / 1e3:9.1f} {nb / i / 1e3:9.1f} {i / f:8.2f}")


if __name__ == "__main__":
    main()
