"""Cost of the Hadamard rotation per decode step: the ops `KVArena.attend` adds when K and V
are rotated (rotate q, k and v, un-rotate the output), timed in isolation, median of many.

    python tools/rot_speed.py                      # SmolLM2-135M: 30 layers, H 9, Hkv 3, D 64
    python tools/rot_speed.py --geometry 32,8,128 --layers 32 --threads 2

End-to-end A/B runs of `kvrun bench` on a shared VM vary by ±10 %, more than the effect
being measured; timing only the added ops bounds the overhead directly (the packed read
path does the same work rotated or not).
"""
from __future__ import annotations

import argparse
import time

import torch

from kvrun.kernels.hadamard import rotate, rotation_matrix, unrotate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--geometry", default="9,3,64", help="H,HKV,D")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3000)
    a = ap.parse_args()
    H, Hkv, D = (int(x) for x in a.geometry.split(","))
    torch.set_num_threads(a.threads)
    r = rotation_matrix(D)
    q, o = torch.randn(1, H, 1, D), torch.randn(1, H, 1, D)
    k, v = torch.randn(1, Hkv, 1, D).half(), torch.randn(1, Hkv, 1, D).half()

    def added():                          # what attend() does on top of the unrotated path
        rotate(q, r), rotate(k.float(), r)
        rotate(v.float(), r)
        unrotate(o, r)
    ts = []
    for _ in range(a.iters):
        t = time.perf_counter()
        added()
        ts.append(time.perf_counter() - t)
    ts.sort()
    med = ts[len(ts) // 2]
    print(f"H {H}, Hkv {Hkv}, D {D}, {a.threads} thread(s): rotation adds {med * 1e6:.1f} µs per "
          f"layer (p90 {ts[len(ts) * 9 // 10] * 1e6:.1f}), {med * a.layers * 1e3:.2f} ms per step "
          f"of {a.layers} layers")


if __name__ == "__main__":
    main()
