"""The native decode attention of two builds side by side in one process: one layer's
`kvrun_decode_attention` call from build A and from build B, alternating, on the same
random cache, one thread, CPU time, medians. A build is the shared object
`kvrun.kernels.native` compiles from a tree; for another commit's:

    git worktree add /tmp/old <commit>
    (cd /tmp/old && python -c 'import sys; sys.path.insert(0, "."); \
        from kernels.native import _build; print(_build(()))')
    python tools/attn_ab.py /path/to/A.so /path/to/B.so --depth 4096

Rows: K/V methods; columns: µs per call of A and B, B/A, the bytes the call reads (the
packed tail's storage, scales and zeros included, and the fp16 window) and B's rate over them;
then the rate one thread streams a 256 MB fp32 buffer (torch `sum`), the floor to compare with.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from attention_cases import attention_case  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_speed import stream_gbs  # noqa: E402  (a sibling script)
from kvrun import threads  # noqa: E402
from kvrun.kernels.native import decode_attention as nda  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--kv", nargs="+", default=["kivi-4/kivi-4", "kivi-2/kivi-2", "int8/kivi-4"])
    ap.add_argument("--geom", default="3,3,64", help="Hkv,Gq,D (SmolLM2: 3,3,64; Gemma 3: 1,4,256)")
    ap.add_argument("--group", type=int, default=32, help="K token group and V channel group")
    ap.add_argument("-r", type=int, default=40, help="alternations")
    ap.add_argument("--calls", type=int, default=10, help="calls per timing")
    ap.add_argument("--attn", default="int", choices=["int", "fp32"])
    ap.add_argument("--spare", type=int, default=0,
                    help="storage slots beyond the tail (a multiple of 256: channel rows then are "
                         "not a power of two bytes apart, as in an arena sized for -c plus a prompt)")
    a = ap.parse_args()
    libs = {}
    for name, path in (("A", a.a), ("B", a.b)):
        try:
            lib = ctypes.CDLL(path)
            lib.kvrun_decode_attention.restype = ctypes.c_int
        except (OSError, AttributeError) as e:
            raise SystemExit(f"error: {path}: not a kvrun native build ({e})")
        libs[name] = lib
    torch.set_num_threads(1)
    threads.configure(1)
    if a.spare < 0 or a.spare % 256:
        raise SystemExit(f"error: --spare {a.spare}: expected a non-negative multiple of 256")
    try:
        Hkv, Gq, D = (int(x) for x in a.geom.split(","))
    except ValueError:
        raise SystemExit(f"error: --geom {a.geom!r}: expected Hkv,Gq,D, e.g. 3,3,64")
    print(f"| K/V | A µs | B µs | B/A | MB read | B GB/s |   (depth {a.depth}, Hkv {Hkv}, Gq {Gq}, D {D}, one thread)")
    print("|---|---|---|---|---|---|")
    for spec in a.kv:
        try:
            km, vm = spec.split("/")
            q, kt, vt, kw, vw, kn, vn = attention_case(km, vm, Hkv, Gq, D, a.depth, 64, 1,
                                                       G=a.group, v_group=a.group, spare=a.spare)
        except (ValueError, AssertionError, KeyError) as e:
            raise SystemExit(f"error: --kv {spec!r}: expected K/V codecs such as kivi-4/kivi-4 ({e})")
        args = (q, kt, vt, a.depth, kw, vw, kn, vn)
        nbytes = sum(t.nbytes for _, st in (kt, vt) for t in st.values()) + kw.nbytes + vw.nbytes
        times: dict = {"A": [], "B": []}
        for _ in range(a.r):
            for name, lib in libs.items():
                nda.load = lambda lib=lib: lib
                t0 = time.thread_time_ns()
                for _ in range(a.calls):
                    nda.decode_attention(*args, attn=a.attn)
                times[name].append((time.thread_time_ns() - t0) / a.calls / 1e3)
        ta, tb = statistics.median(times["A"]), statistics.median(times["B"])
        print(f"| {spec} | {ta:.1f} | {tb:.1f} | {tb / ta:.3f} | {nbytes / 1e6:.2f} | "
              f"{nbytes / tb / 1e3:.1f} |", flush=True)
    print(f"one thread streams {stream_gbs():.1f} GB/s (torch sum of 256 MB fp32, median of 7)")


if __name__ == "__main__":
    main()
