"""Re-measure the figures the code's design rests on, which its docstrings cite
(docs/measurements.md, "Figures behind the code"): each row says which module relies on it.

    python tools/design_figures.py            # 1 thread; -t N for more

- qlinear.py: torch's fused weight-only ops (`_weight_int8pack_mm`,
  `_weight_int4pack_mm_for_cpu`) with bf16 against fp32 activations, one row of a
  1536×576 layer (SmolLM2's gate); and at 512 rows, the fused ops against dequantizing the
  layer and one dense fp32 GEMM (prefill's path).
- quant.py: torch's uint8 → fp32 conversion against fp16 → fp32 and an int32 mask + convert,
  over 4096 tokens × 3 heads × 64 channels.
- native/pack.py: a 32-token KIVI-4 flush of SmolLM2's K (3 heads, D 64), the codec's torch
  `store` against the C `kvrun_kivi_pack_k`.
- quantize.py: the fused int4 op's bf16 scale and zero against the stored fp16 scale and
  min, as a relative RMS error of the default model's int4 weights.

Medians of --reps timed calls, ms.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvrun.convert.quantize import quantize_int4, quantize_int8
from kvrun.kernels import make_codec
from kvrun.kernels.native import pack as native_pack
from kvrun.model.qlinear import Int4Linear, Int8Linear, dequantize_int4


def ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def linears(N: int = 1536, K: int = 576):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g) / K ** 0.5
    i8 = Int8Linear(K, N)
    for name, t in quantize_int8(w).items():
        getattr(i8, name).copy_(t)
    i4 = Int4Linear(K, N, 32)
    for name, t in quantize_int4(w, 32).items():
        getattr(i4, name).copy_(t)
    i8.prepare()
    i4.prepare()
    return i8, i4


def weight_ops(reps: int) -> list[tuple[str, float]]:
    i8, i4 = linears()
    K = i8.in_features
    rows = []
    for M in (1, 512):
        x = torch.randn(M, K)
        for dt in (torch.bfloat16, torch.float32):
            xs, s8 = x.to(dt), i8.scales.to(dt)
            rows.append((f"int8 op, {M} rows, {dt}",
                         ms(lambda: torch.ops.aten._weight_int8pack_mm(xs, i8.qweight, s8), reps)))
            sz = i4._scale_zero.to(dt)
            rows.append((f"int4 op, {M} rows, {dt}", ms(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                xs, i4._packed, 32, sz), reps)))
        rows.append((f"dequantize int4 + fp32 GEMM, {M} rows", ms(lambda: torch.nn.functional.linear(
            x, dequantize_int4(i4.qweight, i4.scales, i4.mins)), reps)))
    return rows


def conversions(reps: int) -> list[tuple[str, float]]:
    n = 4096 * 3 * 64
    u8 = torch.randint(0, 256, (n,), dtype=torch.uint8)
    f16 = torch.randn(n).half()
    i32 = torch.randint(0, 1 << 30, (n,), dtype=torch.int32)
    return [("uint8 → fp32", ms(lambda: u8.float(), reps)),
            ("fp16 → fp32", ms(lambda: f16.float(), reps)),
            ("int32 & 15 → fp32", ms(lambda: (i32 & 15).float(), reps))]


def flush(reps: int) -> list[tuple[str, float]]:
    c = make_codec("kivi-4", "k", 32)
    st = c.alloc(3, 64, 4096)
    x = torch.randn(3, 32, 64)
    rows = [("KIVI-4 K flush, torch store", ms(lambda: c.store(st, x, 0), reps))]
    if native_pack.supports(c):
        rows.append(("KIVI-4 K flush, C pack", ms(lambda: native_pack.store(c, st, x, 0), reps)))
    return rows


def scale_error() -> list[tuple[str, float]]:
    """The fused op's bf16 (scale, zero = min + 8·scale) against the stored fp16 scale and
    min, over every int4 weight of the default model: relative RMS error, in %."""
    from safetensors.torch import load_file
    from kvrun.engine.pull import ensure_default_model
    state = load_file(f"{ensure_default_model(progress=None)}/model.safetensors")
    err = ref = 0.0
    for name, q in state.items():
        if not name.endswith(".qweight") or q.dtype != torch.uint8:
            continue
        base = name[:-len("qweight")]
        s, m = state[base + "scales"].float(), state[base + "mins"].float()
        exact = dequantize_int4(q, s.half(), m.half())
        sb = s.bfloat16().float()
        zb = (m + 8 * s).bfloat16().float()
        bf = dequantize_int4(q, sb, zb - 8 * sb)         # what the op's values give, in fp32
        err += float(((bf - exact) ** 2).sum())
        ref += float((exact ** 2).sum())
    return [("bf16 scale/zero, relative RMS error of the int4 weights (%)", 100 * (err / ref) ** 0.5)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("| figure | value |\n|---|---|")
    for name, v in weight_ops(args.reps) + conversions(args.reps) + flush(args.reps):
        print(f"| {name} | {v:.3f} ms |")
    for name, v in scale_error():
        print(f"| {name} | {v:.3f} |")


if __name__ == "__main__":
    main()
