"""Decode ms/token and 512-token prefill time per weight format, side by side in one process.

    python tools/weights_speed.py DIR_FP32 DIR_INT8 DIR_INT4 [--depth 512] [--steps 20]

Each model dir is loaded with `--dtype fp32` and `auto` (dense dirs) or `auto` (quantized);
the cache is prefilled to `--depth` tokens, then `--steps` single-token decode steps are
timed; rounds alternate between models so machine noise hits all of them alike. Medians.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import kvrun
from kvrun.threads import configure as configure_threads


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--depth", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        configure_threads(a.threads)   # the cap kvrun's forwards keep (runtime/threads.py)
    models = {}
    for d in a.dirs:
        cfg = kvrun.load(d, ctx=8).cfg
        for dt in (["fp32", "auto"] if cfg.weights == "float" else ["auto"]):
            models[f"{d.rstrip('/').split('/')[-1]} {cfg.weights} --dtype {dt}"] = \
                kvrun.load(d, dtype=dt, ctx=a.depth + a.steps + 8)
    ids = list(range(1000, 1000 + a.depth))
    dec = {k: [] for k in models}
    pre = {k: [] for k in models}
    for _ in range(a.rounds):
        for name, m in models.items():
            m.reset()
            t0 = time.perf_counter()
            m.engine.prefill(ids)
            pre[name].append(time.perf_counter() - t0)
            tok = 42
            for _ in range(a.steps):
                t0 = time.perf_counter()
                m.engine.decode_step(tok)
                dec[name].append(time.perf_counter() - t0)
    print(f"depth {a.depth}, {a.steps} steps x {a.rounds} rounds, {torch.get_num_threads()} threads")
    for name in models:
        print(f"{name:<56} decode {1e3 * statistics.median(dec[name]):7.2f} ms/tok   "
              f"prefill {a.depth} tok {1e3 * statistics.median(pre[name]):7.0f} ms")


if __name__ == "__main__":
    main()
