"""The native decode step's two routes side by side in one process: the one-call step
(kernels/native/decode_step.py) and the per-layer route (`NativeDecodeStep.one_call` set to
None), same model, same cache kind, same tokens, repetitions alternating between them.
Prints per (kv, depth) the median wall ms per step and the median CPU ms per step of the
calling thread: on one thread (-t 1, the default) that is all the step's work, and it moves
less than wall time on a machine other processes load. `--batch B`: B sequences, each its
own cache filled to the depth with random K/V (`ingest`; the values do not change the
work), decoded together (`NativeDecodeStep.rows`); a step is then one token of each.

    python tools/step_speed.py --kv fp16,auto -d 0,512 -r 5 -t 1
    python tools/step_speed.py --kv auto -d 2048 --batch 8 -r 3 -t 1
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import kvrun
from kvrun import threads
from kvrun.kv.config import parse_kv


def filled_caches(cfg, ctx: int, spec, B: int, depth: int, g: torch.Generator) -> list:
    """B caches of `spec` (parse_kv's), each holding `depth` tokens of random K and V from g."""
    caches = [kvrun.kv.make_cache(cfg, ctx, spec) for _ in range(B)]
    if depth:
        shape = (cfg.num_layers, cfg.num_kv_heads, depth, cfg.head_dim)
        for c in caches:
            c.ingest(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    return caches


def stream_gbs() -> float:
    """The rate one thread streams a 256 MB fp32 buffer (torch sum), GB/s, median of 7."""
    buf = torch.ones(64 << 20)
    rates = []
    for _ in range(7):
        t0 = time.perf_counter()
        buf.sum()
        rates.append(buf.nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--kv", default="fp16,auto")
    ap.add_argument("-d", "--depth", default="0,512")
    ap.add_argument("-n", type=int, default=32, help="timed decode steps per repetition")
    ap.add_argument("-r", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    a = ap.parse_args()
    depths = [int(x) for x in a.depth.split(",")]
    ctx = max(depths) + a.n + 64
    m = kvrun.load(a.model, ctx=ctx, threads=a.threads)
    threads.configure(a.threads)
    threads.governor.adapt = False                      # exactly -t threads
    tf = m.transformer
    probe = kvrun.kv.make_cache(m.cfg, ctx, parse_kv("fp16"))
    step = tf.native_step(torch.ones(1, 1, dtype=torch.long), probe)
    if step is None:
        raise SystemExit("error: this model has no native decode step here")
    one = step.one_call
    cfg, B = m.cfg, a.batch
    print(f"{cfg.architecture}, {a.threads} thread(s), batch {B}, {a.n} steps x {a.r} repetitions, median")
    print("| kv | depth | one call ms/step | per layer ms/step | ratio | one call CPU ms/step | per layer CPU ms/step | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for kv in a.kv.split(","):
            for d in depths:
                wall: dict = {"one": [], "layers": []}
                cpu: dict = {"one": [], "layers": []}
                for r in range(a.r):
                    for route in ("one", "layers"):
                        step.one_call = one if route == "one" else None
                        g = torch.Generator().manual_seed(r)
                        caches = filled_caches(cfg, ctx, parse_kv(kv), B, d, g)
                        toks = torch.randint(3, cfg.vocab_size, (a.n + 2, B, 1), generator=g)
                        for tk in toks[:2]:                                     # warm-up
                            step.rows(tk, caches)
                        t, t_cpu = time.perf_counter(), time.thread_time()
                        for tk in toks[2:]:
                            step.rows(tk, caches)
                        wall[route].append((time.perf_counter() - t) / a.n * 1e3)
                        cpu[route].append((time.thread_time() - t_cpu) / a.n * 1e3)
                w1, w2 = statistics.median(wall["one"]), statistics.median(wall["layers"])
                c1, c2 = statistics.median(cpu["one"]), statistics.median(cpu["layers"])
                print(f"| {kv} | {d} | {w1:.2f} | {w2:.2f} | {w1 / w2:.2f} | {c1:.2f} | {c2:.2f} | "
                      f"{c1 / c2:.2f} |", flush=True)
    step.one_call = one


if __name__ == "__main__":
    main()
