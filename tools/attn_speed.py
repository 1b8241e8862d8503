"""Time one decode step's attention (all layers) at given depths, kvrun's fp16 cache vs
each codec, side by side, for 1 and 2 threads.

    python tools/attn_speed.py --depth 4096 8192 --threads 1 2 --kv fp16 int8 kivi-4 tada-4
    python tools/attn_speed.py --depth 64 2048 --threads 1 --kv fp16 kivi-4 --general

`--attn int fp32` times each method on both paths of the native attention's KIVI q.K
(KVRUN_ATTN, kernels/dispatch.py `attn_path`), the `name [path]` rows, in the same
round-robin. `--clock cpu` times the process's CPU time instead of the wall clock (on a
machine other programs share, a descheduled step costs wall time but no CPU time).

`--general` adds each method on the general native route (`attend_append`, its C arguments
rebuilt per call) beside the default one-token route (`FusedStep`, built once per layer),
the `name (general)` rows: at small depths the difference is the Python per layer.

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

from kvrun.kernels.dispatch import attend_append
from kvrun.model.config import ModelConfig
from kvrun.kv import build_cache, kv_ratio_at, parse_kv


def fill(cache, cfg, depth, chunk=1024):
    g = torch.Generator().manual_seed(0)
    for t0 in range(0, depth, chunk):
        T = min(chunk, depth - t0)
        shape = (cfg.num_layers, cfg.num_kv_heads, T, cfg.head_dim)      # (L, Hkv, T, D)
        cache.ingest(torch.randn(shape, generator=g).half(), torch.randn(shape, generator=g).half())


def attend_general(cache, l, q, k, v):
    """Layer l's step on the arena's general native route: `attend_append`, its C arguments
    rebuilt per call (what KVArena.attend runs where its one-token route does not apply),
    then the arena's own bookkeeping (`wrote`: count the row, flush)."""
    nt, w, T = cache.n_tail[l], cache.n_win[l], k.shape[2]
    kt, vt = (cache.k_codecs[l], cache.k_store[l]), (cache.v_codecs[l], cache.v_store[l])
    o = attend_append(q, kt, vt, nt, cache.win_k[l][None, :, :w], cache.win_v[l][None, :, :w],
                      k, v, cache.win_k[l][:, w:w + T], cache.win_v[l][:, w:w + T],
                      cache.rot_k[l], cache.rot_v[l], attn=cache.attn,
                      softcap=cache.softcap)
    cache.wrote(l, T)
    return o


def step(cache, cfg, q, k, general=False, attn=None, clock=time.perf_counter):
    cache.positions(1)
    if attn:
        cache.attn = attn                   # the arena's product path (read from KVRUN_ATTN when built)
    run = (lambda l: attend_general(cache, l, q, k, k)) if general else (lambda l: cache.attend(l, q, k, k))
    t0 = clock()
    for l in range(cfg.num_layers):
        run(l)
    dt = clock() - t0
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
    ap.add_argument("--attn", nargs="+", choices=["int", "fp32"], default=[None],
                    help="KVRUN_ATTN paths to time side by side (default: the environment's)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--general", action="store_true",
                    help="also time each method on the general native route (module docstring)")
    args = ap.parse_args()
    rows = [(spec, g, a) for g in (False, True)[:1 + args.general] for spec in args.kv for a in args.attn]
    name = {(spec, g, a): spec + (" (general)" if g else "") + (f" [{a}]" if len(args.attn) > 1 else "")
            for spec, g, a in rows}
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    cfg = ModelConfig(num_layers=args.layers, num_heads=9, num_kv_heads=3, hidden_size=576,
                      head_dim=64, max_position=32768)
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q, k = torch.randn(1, H, 1, D), torch.randn(1, Hkv, 1, D)
    cols = [(d, t) for d in args.depth for t in args.threads]
    res: dict = {}
    for depth in args.depth:
        caches = {}
        for row in rows:
            caches[row] = build_cache(cfg, depth + len(args.threads) * (args.steps + 3),
                                      parse_kv(row[0]))
            fill(caches[row], cfg, depth)
        for th in args.threads:
            torch.set_num_threads(th)
            times = {row: [] for row in rows}
            for i in range(args.steps + 3):
                for row, c in caches.items():
                    t = step(c, cfg, q, k, general=row[1], attn=row[2], clock=clock)
                    if i >= 3:
                        times[row].append(t)
            for row in rows:
                res[row, depth, th] = statistics.median(times[row])
            print(f"# depth {depth}, {th} thread(s) done, load {os.getloadavg()[0]:.2f}", flush=True)
        del caches
    base = rows[0]
    w = max(8, *(len(x) for x in name.values()))
    head = (f"| {'kv':{w}s} | bytes@{args.depth[0]} | "
            + " | ".join(f"d{d} t{t} ms (x{base[0]})" for d, t in cols) + " |")
    print(head)
    print("|" + "---|" * (2 + len(cols)))
    for row in rows:
        cells = [f"{res[row, d, t]:7.2f} ({res[base, d, t] / res[row, d, t]:4.2f}x)" for d, t in cols]
        ratio = kv_ratio_at(cfg, parse_kv(row[0]), args.depth[0])
        print(f"| {name[row]:{w}s} | {ratio:.3f} | " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
