"""Bytes moved per decode step by the Triton decode_attention, per KV codec, and the time
that traffic implies at a memory bandwidth: the roofline the GPU path aims at.

    python tools/roofline.py --geometry llama-3.1-70b --ctx 32k
    python tools/roofline.py --geometry 64,8,128 --ctx 128k --bw 2.0 --kv fp16 kivi-2 tada-2

One attention layer (TaDA's Table 3 set-up), T = 1 query per head. The context is split
like the arena's: the window keeps R .. R+G-1 newest tokens in fp16, everything older sits
in the compressed tail. Tail bytes come from each codec's exact bytes_per_token (packed
codes, scales/zeros, means, low-rank factors, outliers); window, q / new K,V / output and
the split-K partials are added as the kernel moves them (kernels/triton/decode_attention.py
bytes_per_step). Decode at batch 1 is memory-bound, so time ≈ bytes / bandwidth; the real
kernel can only be slower (launch latency ~ a few µs per launch, 4 launches per layer).

The last column is the cache-write side of the step, averaged over G steps: the window
write (kernels/triton/window_write.py: write_k + write_v) every step, and the arena's flush
every G steps (window read and compacted, G tokens packed by `pack`): window and tail bytes
only — the new rows' sources (K rows, cos/sin, and for V the hidden state and the Wv weight,
16 MiB at 70B) belong to the projections and are not counted. It is not part of the total.
"""
from __future__ import annotations

import argparse

from kvrun.kernels import METHODS, make_codec
from kvrun.kernels.triton.decode_attention import bytes_per_step
from kvrun.kernels.triton.window_write import bytes_per_step as write_bytes_per_step
from kvrun.eval.bench import parse_count, parse_geometry
from kvrun.kv.config import KVConfig

H100_TBS = 3.35                  # H100 SXM HBM3, TB/s


def roofline(geometry: str, ctx: int, methods, bw_tbs: float = H100_TBS, kv: KVConfig = None,
             layers: int = 1) -> list[dict]:
    """One row per method: bytes per step by item (all `layers`), total, µs at bw_tbs."""
    kv = kv or KVConfig()
    _, (H, Hkv, D) = parse_geometry(geometry)
    R, G = kv.residual, kv.group
    n_tail = max(0, ctx - R) // G * G
    W = ctx - n_tail
    rows = []
    for m in methods:
        k_m, _, v_m = m.partition("/")
        kc, vc = (make_codec(x, role, G, kv.v_group, kv.rank, kv.sparsity, kv.tada_mu)
                  for x, role in ((k_m, "k"), (v_m or k_m, "v")))
        items = {k: v * layers for k, v in bytes_per_step(kc, vc, H, Hkv, D, n_tail, W).items()}
        total = sum(items.values())
        write = 0.0
        for c in (kc, vc):
            flush = 2 * Hkv * D * ((R + G - 1) + R) + G * sum(c.bytes_per_token(Hkv, D).values())
            write += (write_bytes_per_step(Hkv, D)["window"] + flush / G) * layers
        rows.append(dict(method=m, **items, total=total, us=total / (bw_tbs * 1e12) * 1e6,
                         write=write))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", default="llama-3.1-70b", help="a bench geometry name or H,HKV,D")
    ap.add_argument("--ctx", default="32k", help="tokens in the cache (e.g. 4096, 32k)")
    ap.add_argument("--bw", type=float, default=H100_TBS, help="memory bandwidth in TB/s (H100: 3.35)")
    ap.add_argument("--kv", nargs="+", default=list(METHODS), help="methods, or K/V pairs like kivi-4/kivi-2")
    ap.add_argument("--layers", type=int, default=1, help="attention layers per step")
    ap.add_argument("--window", type=int, default=KVConfig.residual, help="residual window R")
    ap.add_argument("--group", type=int, default=KVConfig.group, help="flush group G")
    ap.add_argument("--tada-mu", default="fp16", choices=["fp16", "int8"])
    a = ap.parse_args(argv)
    ctx = parse_count(a.ctx)
    kv = KVConfig(residual=a.window, group=a.group, tada_mu=a.tada_mu)
    rows = roofline(a.geometry, ctx, a.kv, a.bw, kv, a.layers)
    _, (H, Hkv, D) = parse_geometry(a.geometry)
    print(f"# {a.geometry} (H {H}, Hkv {Hkv}, D {D}), {ctx} tokens (window R={kv.residual}, "
          f"G={kv.group}), {a.layers} layer(s), T=1, at {a.bw} TB/s")
    fp16 = next((r["total"] for r in rows if r["method"] == "fp16"), None)
    print(f"{'method':<18}{'tail K MiB':>11}{'tail V MiB':>11}{'window':>9}{'parts':>9}"
          f"{'total MiB':>11}{'µs/step':>10}{'x fp16':>8}{'write KiB':>11}")
    for r in rows:
        mib = lambda x: x / 2**20                                       # noqa: E731
        ratio = f"{fp16 / r['total']:.2f}" if fp16 else "-"
        print(f"{r['method']:<18}{mib(r['tail_k']):>11.2f}{mib(r['tail_v']):>11.2f}"
              f"{mib(r['window']):>9.2f}{mib(r['parts']):>9.2f}{mib(r['total']):>11.2f}"
              f"{r['us']:>10.1f}{ratio:>8}{r['write'] / 1024:>11.1f}")


if __name__ == "__main__":
    main()
