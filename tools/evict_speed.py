"""Selection time of each eviction policy vs the number of candidates n (runtime/kv/evict.py).

    python tools/evict_speed.py --n 2048 4096 8192 16384 --heads 9 --kv-heads 3

KVCrush's grouping is meant to be linear in n (a counting sort over the H+1 Hamming
distances, no k-means): the "x prev" column is time(n) / time(n/2) — about 2 when
linear. The policies' top-k (torch.topk) is n log k; for SnapKV the pooling is linear.
One thread, median of --reps runs; a loose check for a shared machine, not a timed test.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvrun.kv.evict import POLICIES, crush_anchor, crush_bits, crush_buckets, select


def timed(fn, reps):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--keep", type=float, default=0.5, help="kept fraction of the candidates")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    print(f"{'policy':<14} {'n':>7} {'ms':>9} {'x prev':>7}")
    for pol in [p for p in POLICIES if p != "none"] + ["crush-grouping"]:
        prev = None
        for n in a.n:
            score = torch.rand(a.heads, n, generator=g)
            pos = torch.arange(n).expand(a.kv_heads, n)
            k = int(a.keep * n)
            if pol == "crush-grouping":          # the grouping step alone, 25 % of k representatives
                bits = crush_bits(score, k)
                anc = crush_anchor(bits, "mean")
                t = timed(lambda: crush_buckets(bits, anc, k // 4), a.reps)
            else:
                t = timed(lambda: select(pol, score, pos, k), a.reps)
            ratio = f"{t / prev:7.2f}" if prev else f"{'':>7}"
            print(f"{pol:<14} {n:>7} {t * 1e3:9.2f} {ratio}")
            prev = t


if __name__ == "__main__":
    main()
