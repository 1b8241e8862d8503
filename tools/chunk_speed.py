"""A short prompt's prefill on the native chunk route (runtime/model/native_step.py `chunk`:
the prompt's tokens are GEMV rows of the native layer kernels, MAX_ROWS a pass over the
weights) against the eager forward (each layer dequantized for a dense GEMM above 32 rows,
torch's weight-only op on bf16 inputs up to 32), same model, same cache kind, same tokens,
repetitions alternating between the two. Prints per prompt length the median wall ms of
the prefill (one forward of the whole prompt, a fresh cache each time; past
CHUNK_MAX_ROWS the native column feeds the prompt in chunks of CHUNK_MAX_ROWS, to show
where the eager forward's GEMM starts to win).

`--in-c`: a column more, the part of the native chunk's time spent inside the C calls of
the layer kernels, the attention and the logits (a timer around each ctypes call; flushes,
the embedding and RoPE tables, and the Python between layers are outside). What a chunk
spends outside them bounds what running it in the one-call decode step could save.

`--fidelity`: instead of times, each route's logits for the prompt (after a 100-token
prefix, so the chunk attends to a cache) against the eager forward with every linear layer
dequantized to fp32, the exact product of the stored weights: max KL over the positions and
top-1 agreement. `--text FILE` takes the tokens from a text file instead of random ids.

    python tools/chunk_speed.py --sizes 2,8,16,32,64,128,256 --kv kivi-4 -r 5 -t 2
    python tools/chunk_speed.py --sizes 2,8,32,64 --kv auto -r 7 -t 2 --in-c
    python tools/chunk_speed.py --sizes 2,7,32,64 --kv fp16 --fidelity --text wiki.test.raw
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import kvrun
import kvrun.model.qlinear as qlinear
from kvrun import threads
from kvrun.kernels import native as native_lib
from kvrun.errors import KvrunError, read_text_file
from kvrun.kv.config import parse_kv
from kvrun.model.native_step import CHUNK_MAX_ROWS

PREFIX = 100                    # --fidelity: tokens in the cache before the prompt
C_CALLS = ("kvrun_layer_pre", "kvrun_layer_post", "kvrun_logits", "kvrun_decode_attention",
           "kvrun_ring_attention")                # --in-c: the calls timed


def time_c_calls(lib) -> list:
    """Wrap the library's C_CALLS so each call adds its wall seconds to the returned [total]."""
    total = [0.0]
    for name in C_CALLS:
        fn = getattr(lib, name)

        def timed(*args, fn=fn):
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                total[0] += time.perf_counter() - t
        setattr(lib, name, timed)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--kv", default="kivi-4")
    ap.add_argument("--sizes", default="2,8,16,32,64,128,256", help="prompt lengths, tokens")
    ap.add_argument("-r", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--fidelity", action="store_true", help="KL / top-1 against fp32 weights")
    ap.add_argument("--text", default=None, help="take the tokens from this text file")
    ap.add_argument("--in-c", action="store_true", help="also the native chunk's time inside C calls")
    a = ap.parse_args()
    try:
        sizes = [int(x) for x in a.sizes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 2:
        raise SystemExit("error: --sizes takes prompt lengths of at least 2 tokens")
    try:
        measure(a, sizes)
    except KvrunError as e:                  # a bad -m, --kv or --text: one line
        sys.exit(f"error: {e}")


def measure(a, sizes: list) -> None:
    ctx = PREFIX + max(sizes) + 64
    m = kvrun.load(a.model, ctx=ctx, threads=a.threads)
    threads.configure(a.threads)
    threads.governor.adapt = False                      # exactly -t threads
    tf, cfg = m.transformer, m.cfg
    step = tf.native_step(torch.ones(1, 2, dtype=torch.long), kvrun.kv.make_cache(cfg, ctx, parse_kv(a.kv)))
    if step is None:
        raise SystemExit("error: this model and cache have no native chunk route here")
    native = step.applies_chunk
    n = PREFIX + max(sizes)
    if a.text:
        ids = torch.tensor([m.tokenize(read_text_file(a.text)[:16 * n])[:n]])
        if ids.shape[1] < n:
            raise SystemExit(f"error: {a.text} has fewer than {n} tokens")
    else:
        ids = torch.randint(3, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    if a.fidelity:
        fidelity(tf, cfg, ids, sizes, a.kv, ctx, step)
        return

    in_c = time_c_calls(native_lib.load()) if a.in_c else [0.0]

    def prefill(T: int, route: str) -> tuple[float, float]:
        """Wall seconds of the prompt's prefill, and of them inside the timed C calls."""
        step.applies_chunk = native if route == "native" else (lambda ids, cache: False)
        per = CHUNK_MAX_ROWS if route == "native" else T
        cache = kvrun.kv.make_cache(cfg, ctx, parse_kv(a.kv))
        in_c[0] = 0.0
        t = time.perf_counter()
        for s in range(0, T, per):
            tf(ids[:, s:min(T, s + per)], cache, last_only=True)
        return time.perf_counter() - t, in_c[0]

    print(f"{cfg.architecture}, kv {a.kv}, {a.threads} thread(s), {a.r} repetitions, median wall ms")
    extra = (" native in C ms |", "---|") if a.in_c else ("", "")
    print("| prompt tokens | eager ms | native ms | eager tok/s | native tok/s | eager / native |" + extra[0])
    print("|---|---|---|---|---|---|" + extra[1])
    prefill(2, "native")                                 # first use: the native step's buffers
    try:
        for T in sizes:
            t: dict = {"eager": [], "native": []}
            c = []
            for _ in range(a.r):
                for route in t:
                    wall, inside = prefill(T, route)
                    t[route].append(wall)
                    if route == "native":
                        c.append(inside)
            e, n = statistics.median(t["eager"]), statistics.median(t["native"])
            cell = f" {statistics.median(c) * 1e3:.1f} |" if a.in_c else ""
            print(f"| {T} | {e * 1e3:.1f} | {n * 1e3:.1f} | {T / e:.1f} | {T / n:.1f} | {e / n:.2f} |"
                  + cell, flush=True)
    finally:
        step.applies_chunk = native


def fidelity(tf, cfg, ids, sizes, kv, ctx, step) -> None:
    native, few = step.applies_chunk, qlinear.QUANT_OP_MAX_ROWS
    print(f"{cfg.architecture}, kv {kv}: after {PREFIX} tokens, against fp32 weights (max KL, top-1)")
    print("| prompt tokens | native chunk route | eager forward |")
    print("|---|---|---|")

    def logits(T: int, route: str) -> torch.Tensor:
        step.applies_chunk = native if route == "native" else (lambda ids, cache: False)
        qlinear.QUANT_OP_MAX_ROWS = 0 if route == "fp32" else few
        cache = kvrun.kv.make_cache(cfg, ctx, parse_kv(kv))
        try:
            tf(ids[:, :PREFIX], cache)
            return tf(ids[:, PREFIX:PREFIX + T], cache)[0]
        finally:
            step.applies_chunk, qlinear.QUANT_OP_MAX_ROWS = native, few

    for T in sizes:
        ref = logits(T, "fp32").log_softmax(-1)
        cells = []
        for route in ("native", "eager"):
            lp = logits(T, route).log_softmax(-1)
            kl = float((ref.exp() * (ref - lp)).sum(-1).max())
            top = float((lp.argmax(-1) == ref.argmax(-1)).float().mean())
            cells.append(f"{kl:.2g}, {100 * top:.1f} %")
        print(f"| {T} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
