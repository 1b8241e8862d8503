"""Time one decode step's attention (all layers) at given depths, kvrun's fp16 cache vs
each codec, side by side, for 1 and 2 threads.

    python tools/attn_speed.py --depth 4096 8192 --threads 1 2 --kv fp16 int8 kivi-4 tada-4

SmolLM2-135M geometry by default (30 layers, H=9, Hkv=3, D=64), fp32 queries as the model
runs on CPU. Every row is the KVArena read path (`--kv fp16`: an arena whose tail holds fp16
rows) on the backend dispatch picks (native C on CPU when it builds; KVRUN_BACKEND=torch for
the torch path). Caches are filled through their own write path (`ingest`). The methods are timed round-robin (one step each,
repeated --steps times) so that load drift on a shared machine hits all of them alike; the
table shows the median ms per step and fp16 time / method time (> 1: faster than fp16).
On a shared 2-core box, trust the 1-thread columns: with 2 OpenMP threads every parallel
op waits on a descheduled thread whenever something else runs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from kvrun.model.config import ModelConfig
from kvrun.kv import build_cache, kv_ratio_at, parse_kv


def fill(cache, cfg, depth, chunk=1024):
    g = torch.Generator().manual_seed(0)
    for t0 in range(0, depth, chunk):
        T = min(chunk, depth - t0)
        shape = (cfg.num_layers, cfg.num_kv_heads, T, cfg.head_dim)      # (L, Hkv, T, D)
        cache.ingest(torch.randn(shape, generator=g).half(), torch.randn(shape, generator=g).half())


def step(cache, cfg, q, k):
    cache.positions(1)
    t0 = time.perf_counter()
    for l in range(cfg.num_layers):
        cache.attend(l, q, k, k)
    dt = time.perf_counter() - t0
    cache.commit(1)
    return dt * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--kv", nargs="+", default=["fp16", "int8", "kivi-4", "kivi-2", "tada-4",
                                                "tada-2", "tada-8", "gear-l", "gear"])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    cfg = ModelConfig(num_layers=args.layers, num_heads=9, num_kv_heads=3, hidden_size=576,
                      head_dim=64, max_position=32768)
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q, k = torch.randn(1, H, 1, D), torch.randn(1, Hkv, 1, D)
    cols = [(d, t) for d in args.depth for t in args.threads]
    res: dict = {}
    for depth in args.depth:
        caches = {}
        for spec in args.kv:
            caches[spec] = build_cache(cfg, depth + len(args.threads) * (args.steps + 3), parse_kv(spec))
            fill(caches[spec], cfg, depth)
        for th in args.threads:
            torch.set_num_threads(th)
            times = {spec: [] for spec in args.kv}
            for i in range(args.steps + 3):
                for spec, c in caches.items():
                    t = step(c, cfg, q, k)
                    if i >= 3:
                        times[spec].append(t)
            for spec in args.kv:
                res[spec, depth, th] = statistics.median(times[spec])
            print(f"# depth {depth}, {th} thread(s) done, load {os.getloadavg()[0]:.2f}", flush=True)
        del caches
    base = args.kv[0]
    head = f"| {'kv':8s} | bytes@{args.depth[0]} | " + " | ".join(f"d{d} t{t} ms (x{base})" for d, t in cols) + " |"
    print(head)
    print("|" + "---|" * (2 + len(cols)))
    for spec in args.kv:
        cells = [f"{res[spec, d, t]:7.2f} ({res[base, d, t] / res[spec, d, t]:4.2f}x)" for d, t in cols]
        ratio = kv_ratio_at(cfg, parse_kv(spec), args.depth[0])
        print(f"| {spec:8s} | {ratio:.3f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
