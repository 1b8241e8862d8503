"""Where a decode step's attention time goes, phase by phase: the native library built with
a clock per attention phase (KVRUN_NATIVE=clock: decode_attention.c KVRUN_PHASE_CLOCK), the
one-call decode step of a model on one thread, B rows each with its own cache of `depth`
random tokens, so every layer's cache comes from DRAM as in real decoding (the weights and
the other layers pass through the caches between two visits of a layer).

Per layer and row, µs: preparing the queries and appending the new token, q.K over the
compressed tail, q.K over the window and the new token, the softmax, p.V (tail and window),
the output; then the bytes one layer's cache holds at that depth (`kv_bytes_at`: the packed
tail with its scales and zeros, and the window) and the rate the phases read them at,
beside the rate one thread streams a 256 MB buffer (torch `sum`). Sliding-window ring
layers run another kernel and are not counted.

    python tools/attn_phases.py --kv kivi-4,auto,fp16 -d 2048,4096 --batch 1,8
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from pathlib import Path

os.environ["KVRUN_NATIVE"] = "clock"        # before kvrun loads the library

import torch  # noqa: E402

import kvrun  # noqa: E402
from kvrun import threads  # noqa: E402
from kvrun.kernels import native  # noqa: E402
from kvrun.kv.build import kv_bytes_at  # noqa: E402
from kvrun.kv.layout import arena_layers  # noqa: E402
from kvrun.errors import KvrunError  # noqa: E402
from kvrun.kv.config import parse_kv  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_speed import filled_caches, stream_gbs  # noqa: E402  (a sibling script)

PHASES = ("prepare", "tail q.K", "window q.K", "softmax", "p.V", "output")


def tsc_per_us(lib) -> float:
    """The clock's ticks per µs, against perf_counter over 0.2 s."""
    lib.kvrun_phase_now.restype = ctypes.c_uint64
    t0, c0 = time.perf_counter(), lib.kvrun_phase_now()
    time.sleep(0.2)
    return (lib.kvrun_phase_now() - c0) / ((time.perf_counter() - t0) * 1e6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--kv", default="kivi-4,auto")
    ap.add_argument("-d", "--depth", default="2048")
    ap.add_argument("--batch", default="1", help="rows decoded together, comma-separated")
    ap.add_argument("-n", type=int, default=16, help="timed decode steps")
    a = ap.parse_args()
    try:
        depths = [int(x) for x in a.depth.split(",")]
        batches = [int(x) for x in a.batch.split(",")]
    except ValueError:
        raise SystemExit(f"error: -d {a.depth!r} / --batch {a.batch!r}: expected comma-separated integers")
    if a.n < 1 or min(depths) < 0 or min(batches) < 1:
        raise SystemExit("error: -n and --batch must be >= 1, -d >= 0")
    try:
        kvs = {kv: parse_kv(kv) for kv in a.kv.split(",")}
    except KvrunError as e:
        raise SystemExit(f"error: --kv {a.kv!r}: {e}")
    ctx = max(depths) + a.n + 68
    m = kvrun.load(a.model, ctx=ctx, threads=1)
    threads.configure(1)
    threads.governor.adapt = False
    lib = native.load()
    if lib is None or not hasattr(lib, "kvrun_phase_ticks"):
        raise SystemExit(f"error: no clocked native build here ({native.error() or 'not an x86-64 CPU'})")
    ticks = (ctypes.c_uint64 * len(PHASES)).in_dll(lib, "kvrun_phase_ticks")
    per_us = tsc_per_us(lib)
    cfg, tf = m.cfg, m.transformer
    step = tf.native_step(torch.ones(1, 1, dtype=torch.long), kvrun.kv.make_cache(cfg, ctx, parse_kv("fp16")))
    if step is None:
        raise SystemExit("error: this model has no native decode step here")
    L = arena_layers(cfg)
    rate = stream_gbs()
    print(f"{cfg.architecture}, one thread, {a.n} steps, µs per layer and row; one thread streams "
          f"{rate:.1f} GB/s")
    print("| kv | depth | batch | " + " | ".join(PHASES) + " | total | MB per layer | GB/s | of stream |")
    print("|---|---|---|" + "---|" * (len(PHASES) + 4))
    with torch.inference_mode():
        for kv, spec in kvs.items():
            for d in depths:
                for B in batches:
                    g = torch.Generator().manual_seed(0)
                    caches = filled_caches(cfg, ctx, spec, B, d, g)
                    toks = torch.randint(3, cfg.vocab_size, (a.n + 4, B, 1), generator=g)
                    for tk in toks[:4]:                                 # warm-up
                        step.rows(tk, caches)
                    for i in range(len(PHASES)):
                        ticks[i] = 0
                    for tk in toks[4:]:
                        step.rows(tk, caches)
                    us = [ticks[i] / per_us / (a.n * L * B) for i in range(len(PHASES))]
                    total = sum(us)
                    nb = sum(v for k, v in kv_bytes_at(cfg, spec, d).items() if k != "ring") / L
                    gbs = nb / total / 1e3
                    print(f"| {kv} | {d} | {B} | " + " | ".join(f"{x:.1f}" for x in us)
                          + f" | {total:.1f} | {nb / 1e6:.3f} | {gbs:.1f} | {gbs / rate:.0%} |", flush=True)


if __name__ == "__main__":
    main()
