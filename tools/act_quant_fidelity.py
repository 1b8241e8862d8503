"""How far rounding the GEMVs' inputs to integers moves the next-token distribution, matrix
kind by matrix kind, before an integer kernel is written for them.

The eager forward runs every int4/int8 weight as an fp32 GEMV over its stored values (a
prefill chunk with more rows than the native chunk step and the fused torch ops take). A
forward pre-hook rounds the input of each chosen matrix to `--bits`-bit integers, one scale
per block of `--block` columns (amax / (2^(bits-1) - 1), round to nearest, as the native
input quantizer's torch twin does for 16 bits), which is what an integer GEMV computes
up to the order of its sums: 16 bits per 32 is the native step's shipped input (gemv_quant.c),
8 bits the input AVX512-VNNI's vpdpbusd would take (64 products an instruction, twice the
16-bit vpdpwssd's). Each window runs twice, rounded and not, each run on its own cache, so
the rounded run's keys and values come from its own activations, as they would in use; the
second half of each window is scored (`kvrun ppl -c`'s windows): mean KL(exact || rounded)
and top-1 agreement.

    python tools/act_quant_fidelity.py wiki.test.raw -c 2048 --windows 4 --bits 8 --block 32 \
        --sets all,q_proj+k_proj+v_proj+gate_proj+up_proj,down_proj,lm_head
"""
from __future__ import annotations

import argparse
import sys

import torch

import kvrun
from kvrun.errors import KvrunError
from kvrun.kernels.native.gemv_reference import quantize_input
from kvrun.eval.ppl import windows_of
from kvrun.kv.build import make_cache
from kvrun.kv.config import parse_kv
from kvrun.model.native_step import CHUNK_MAX_ROWS
from kvrun.model.qlinear import QUANT_OP_MAX_ROWS, Int4Linear, Int8Linear

CHUNK = 512                                # prefill rows a call


def rounded(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """x (..., K) with each block of `block` columns rounded to signed `bits`-bit integers
    times one scale, by the native input quantizer's torch twin (gemv_reference.py
    quantize_input; a trailing short block has its own scale, a zero block stays zero)."""
    K = x.shape[-1]
    q, d = quantize_input(x.reshape(-1, K), float((1 << (bits - 1)) - 1), block)  # (M, K), (M, nb)
    return (q.float() * d.repeat_interleave(block, 1)[:, :K]).view(x.shape).to(x.dtype)


@torch.inference_mode()
def window_logprobs(model, win: list[int], chunk: int = CHUNK) -> torch.Tensor:
    """Log-probs (ctx/2, V) of the tokens of win's second half, the window run in `chunk`
    rows: more than the native chunk step and the fused int4/int8 ops take, so the eager
    forward runs and its GEMVs are fp32 over the stored weights."""
    assert chunk > max(CHUNK_MAX_ROWS, QUANT_OP_MAX_ROWS) and len(win) % chunk == 0, chunk
    ctx = len(win)
    cache = make_cache(model.cfg, ctx, parse_kv("fp16"))
    ids = torch.tensor([win])
    out = [model.transformer(ids[:, c0:c0 + chunk], cache)[0] for c0 in range(0, ctx, chunk)]
    return torch.cat(out)[ctx // 2 - 1:ctx - 1].double().log_softmax(-1)


def gemv_modules(model) -> dict[str, list]:
    """The int4/int8 GEMV weights by module name (q_proj, ..., lm_head), every layer's."""
    mods: dict[str, list] = {}
    for name, m in model.transformer.named_modules():
        if isinstance(m, (Int4Linear, Int8Linear)):
            mods.setdefault(name.rsplit(".", 1)[-1], []).append(m)
    return mods


def compare(model, wins: list[list[int]], exact: list[torch.Tensor], modules: list,
            bits: int, block: int, chunk: int = CHUNK) -> tuple[float, float]:
    """(mean KL(exact || rounded), top-1 agreement) over the scored tokens of `wins`, the
    inputs of `modules` rounded (a pre-hook each, removed before returning); exact: each
    window's window_logprobs without rounding."""
    hooks = [m.register_forward_pre_hook(lambda _m, args: (rounded(args[0], bits, block),))
             for m in modules]
    try:
        kl = top = n = 0
        for w, ref in zip(wins, exact):
            got = window_logprobs(model, w, chunk)
            kl += (ref.exp() * (ref - got)).sum().item()
            top += (ref.argmax(-1) == got.argmax(-1)).sum().item()
            n += ref.shape[0]
    finally:
        for h in hooks:
            h.remove()
    return kl / n, top / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("text")
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-c", "--ctx", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--bits", type=int, default=8)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--sets", default="all",
                    help="comma-separated; each a '+'-joined set of module names (q_proj, "
                         "down_proj, lm_head, ...) or 'all'")
    ap.add_argument("-t", "--threads", type=int, default=None)
    a = ap.parse_args()
    try:
        if not 2 <= a.bits <= 16 or a.block < 1 or a.ctx < 2 * CHUNK or a.ctx % CHUNK:
            raise KvrunError(f"need 2 <= --bits <= 16, --block >= 1 and -c a multiple of {CHUNK} "
                             f">= {2 * CHUNK} (got {a.bits}, {a.block}, {a.ctx})")
        model = kvrun.load(a.model, ctx=a.ctx, threads=a.threads)
        mods = gemv_modules(model)
        if not mods:
            raise KvrunError(f"{model.path} has no int4/int8 GEMV weights")
        sets = [s.split("+") for s in a.sets.split(",")]
        for s in sets:
            bad = [k for k in s if k != "all" and k not in mods]
            if bad:
                raise KvrunError(f"no module named {bad[0]!r} (the model's: {', '.join(mods)})")
        with open(a.text, encoding="utf-8", errors="replace") as f:
            wins = windows_of(model.tokenize(f.read()), a.ctx, a.windows)
    except (KvrunError, OSError) as e:
        sys.exit(f"error: {e}")

    print(f"{model.path}: {len(wins)} windows of {a.ctx}, inputs rounded to {a.bits} bits "
          f"per {a.block} columns", file=sys.stderr)
    exact = [window_logprobs(model, w) for w in wins]
    print("| rounded inputs | KL(exact ‖ rounded) | top-1 |\n|---|---|---|")
    for s in sets:
        mod_list = [m for k in (list(mods) if "all" in s else s) for m in mods[k]]
        kl, top1 = compare(model, wins, exact, mod_list, a.bits, a.block)
        print(f"| {'+'.join(s)} | {kl:.5f} | {100 * top1:.2f} % |", flush=True)


if __name__ == "__main__":
    main()
