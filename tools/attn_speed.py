"""Time one decode step's attention (all layers) at a given depth, fp16 cache vs each codec.

    python tools/attn_speed.py --depth 4096 8192 --kv fp16 int8 kivi-4 kivi-2 tada-4 gear-l

SmolLM2-135M geometry by default (30 layers, H=9, Hkv=3, D=64), fp32 queries as the model
runs on CPU. The fp16 row is kvrun's DenseKVCache (what `--kv fp16` uses); the others are
the KVArena read path (decode_attention over the packed tail + window). The methods are
timed round-robin (one step each, repeated --steps times) so that load drift on a shared
machine hits all of them alike; median and min of the steps, after warm-up. On a shared
2-core box, use --threads 1 while anything else is running: with 2 OpenMP threads every
parallel op waits on a descheduled thread, so op *count* rather than bytes read decides.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvrun.runtime.config import ModelConfig
from kvrun.runtime.kv import build_cache, kv_ratio_at, parse_kv


def fill(cache, cfg, depth, chunk=1024):
    g = torch.Generator().manual_seed(0)
    for t0 in range(0, depth, chunk):
        T = min(chunk, depth - t0)
        cache.positions(T)
        for l in range(cfg.num_layers):
            k = torch.randn(1, cfg.num_kv_heads, T, cfg.head_dim, generator=g)
            v = torch.randn(1, cfg.num_kv_heads, T, cfg.head_dim, generator=g)
            if hasattr(cache, "_append"):
                cache._append(l, k[0].half(), v[0].half())
            else:
                cache.k[l, :, :, t0:t0 + T] = k.half()
                cache.v[l, :, :, t0:t0 + T] = v.half()
        cache.commit(T)


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
                                                "tada-2", "gear-l", "gear"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(num_layers=args.layers, num_heads=9, num_kv_heads=3, hidden_size=576,
                      head_dim=64, max_position=32768)
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q, k = torch.randn(1, H, 1, D), torch.randn(1, Hkv, 1, D)
    print(f"{'kv':10s} {'depth':>6s} {'med ms':>8s} {'min ms':>8s} {'fp16/x':>7s} {'bytes ratio':>11s}")
    for depth in args.depth:
        caches = {}
        for spec in args.kv:
            caches[spec] = build_cache(cfg, depth + args.steps + 8, parse_kv(spec))
            fill(caches[spec], cfg, depth)
        times = {spec: [] for spec in args.kv}
        for i in range(args.steps + 2):
            for spec, c in caches.items():
                t = step(c, cfg, q, k)
                if i >= 2:
                    times[spec].append(t)
        base = statistics.median(times[args.kv[0]])
        for spec in args.kv:
            med, mn = statistics.median(times[spec]), min(times[spec])
            print(f"{spec:10s} {depth:6d} {med:8.2f} {mn:8.2f} {base / med:6.2f}x "
                  f"{kv_ratio_at(cfg, parse_kv(spec), depth):11.3f}", flush=True)
        del caches


if __name__ == "__main__":
    main()
