"""Compile the Triton decode_attention kernels for an H100 (sm_90) on a machine without a
GPU, and report registers and spills per launch configuration.

    python tools/sm90_check.py [--head-dim 128] [--gq 8] [--t 1] [--kv fp16 kivi-4/kivi-2 ...] [--softcap]

Triton's interpreter (the CPU tests) accepts programs that do not compile for a GPU and
says nothing about register pressure; this runs the real compiler pipeline (TTIR → TTGIR →
PTX → ptxas, bundled with the triton wheel) on exactly the launches `decode_attention`
would make (its `_plan`) and reads the cubin's resource usage with the bundled cuobjdump.
Exit status 1 if a configuration fails to compile or spills registers. Must run without
TRITON_INTERPRET (the interpreter replaces the kernels).
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile

import torch

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
          torch.uint8: "u8", torch.int32: "i32"}


def signature(fn, args, cx):
    names = fn.arg_names
    sig = {}
    for name, a in zip(names, args):
        sig[name] = ("*" + DTYPES[a.dtype] if isinstance(a, torch.Tensor) else
                     "fp32" if isinstance(a, float) else "i1" if isinstance(a, bool) else "i32")
    for name in names[len(args):]:
        sig[name] = "constexpr"
    return sig


def check(method: str, H: int, Hkv: int, D: int, T: int, dtype=torch.float16,
          softcap: float = 0.0) -> list[dict]:
    """Compile every launch of one decode_attention call (stage 1 per part, stage 2) for
    sm_90; one dict per launch (registers, spilled stack bytes). softcap > 0: stage 1 with
    its logits soft-capped (Gemma 2)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kvrun.kernels import make_codec
    da = importlib.import_module("kvrun.kernels.triton.decode_attention")
    k_m, _, v_m = method.partition("/")
    G, S = 32, 256
    kc, vc = make_codec(k_m, "k", G), make_codec(v_m or k_m, "v", G)
    ks, vs = kc.alloc(Hkv, D, S), vc.alloc(Hkv, D, S)
    q = torch.zeros(1, H, T, D, dtype=dtype)
    win = torch.zeros(1, Hkv, 40, D, dtype=torch.float16)
    new = torch.zeros(1, Hkv, T, D, dtype=dtype)
    grid, args, cx, n_parts = da._plan(q, (kc, ks), (vc, vs), S, win, win, new, new, None, softcap)
    launches = [(grid, args, dict(cx, SOFTCAP=True) if softcap else cx)]
    mid = torch.zeros(1, dtype=torch.float32)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    R = (H // Hkv) * T
    stage2 = ((Hkv, 1), [mid, mid, q, 1, 1, 1, n_parts, T, H // Hkv, R, D], da._stage2_config(R, D))
    out = []
    for fn, grid, a, cx in ([(da._stage1_kernel, g, args(mid, mid), c) for g, args, c in launches]
                            + [(da._stage2_kernel, *stage2)]):
        cx = dict(cx)
        nw = cx.pop("num_warps")
        src = ASTSource(fn, signature(fn, a, cx), cx)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=nw))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name],
                                   capture_output=True, text=True, check=True).stdout
        reg = int(re.search(r"REG:(\d+)", usage).group(1))
        stack = int(re.search(r"STACK:(\d+)", usage).group(1))
        out.append(dict(method=method, kernel=fn.__name__,
                        kinds=(cx["K_KIND"], cx["V_KIND"]) if "K_KIND" in cx else "-", grid=grid,
                        block=(cx["BLOCK_R"], cx.get("BLOCK_N", "-"), cx["BLOCK_D"]), warps=nw,
                        regs=reg, spill_bytes=stack))
    return out


def check_pack(D: int) -> list[dict]:
    """Compile kivi_pack's kernels (K and V, 2 and 4 bits) for sm_90 as the launcher does
    (no FP fusion); `fma` says whether the PTX still holds a fused multiply-add, which would
    break bit-exactness with the torch pack."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    kp = importlib.import_module("kvrun.kernels.triton.kivi_pack")
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    common = dict(X="*fp32", sx_h="i32", sx_t="i32", CODES="*u8", sc_h="i32", SCALE="*fp16",
                  ZERO="*fp16", s0="i32", n="i32", D="i32", BITS="constexpr", BLOCK_D="constexpr")
    bd = max(64, triton.next_power_of_2(D))
    out = []
    for bits in (2, 4):
        for fn, sig, cx, nw in ((kp._kivi_k_kernel, dict(common, sc_d="i32", n_groups="i32", G="constexpr"),
                                 dict(BITS=bits, G=32, BLOCK_D=bd), kp.k_warps(D)),
                                (kp._kivi_v_kernel, dict(common, sc_c="i32", sp_h="i32", NG="constexpr",
                                                         VG="constexpr"),
                                 dict(BITS=bits, NG=D // 32, VG=32, BLOCK_D=bd), kp.V_WARPS)):
            sig = {name: sig[name] for name in fn.arg_names}
            k = triton.compile(ASTSource(fn, sig, cx), target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=nw, enable_fp_fusion=False))
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(k.asm["cubin"])
                f.flush()
                usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name],
                                       capture_output=True, text=True, check=True).stdout
            out.append(dict(kernel=fn.__name__, bits=bits, fma="fma.rn.f32" in k.asm["ptx"],
                            regs=int(re.search(r"REG:(\d+)", usage).group(1)),
                            spill_bytes=int(re.search(r"STACK:(\d+)", usage).group(1))))
    return out


def main(argv=None) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("error: unset TRITON_INTERPRET (the interpreter replaces the kernels)", file=sys.stderr)
        return 2
    from kvrun.kernels import METHODS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv", nargs="+", default=list(METHODS))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--gq", type=int, default=8, help="query heads per KV head")
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--t", type=int, default=1, help="new tokens (queries per head)")
    ap.add_argument("--softcap", action="store_true",
                    help="stage 1 with soft-capped logits (Gemma 2's attn_logit_softcapping)")
    a = ap.parse_args(argv)
    bad = 0
    for m in a.kv:
        for r in check(m, a.gq * a.hkv, a.hkv, a.head_dim, a.t, softcap=50.0 if a.softcap else 0.0):
            flag = "" if r["spill_bytes"] == 0 else "  SPILLS"
            bad += bool(flag)
            print(f"{r['method']:<16} {r['kernel']:<15} kinds {r['kinds']} grid {r['grid']} block {r['block']} "
                  f"warps {r['warps']}: {r['regs']} regs, {r['spill_bytes']} B stack{flag}")
    for r in check_pack(a.head_dim):
        flag = "  SPILLS" if r["spill_bytes"] else "  FMA" if r["fma"] else ""
        bad += bool(flag)
        print(f"kivi_pack {r['kernel']:<15} bits {r['bits']}: {r['regs']} regs, "
              f"{r['spill_bytes']} B stack, fma {r['fma']}{flag}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
