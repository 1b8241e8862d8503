"""How far the native decode step's integer GEMVs move the next-token distribution from its
fp32 GEMVs (KVRUN_GEMV=int against fp32; kernels/native/decode_layer.py), on a text; with
`--switch attn`, how far the native attention's integer q.K over KIVI keys moves it from its
fp32 q.K (KVRUN_ATTN=int against fp32; use a KIVI --kv), both paths on the GEMVs `--gemv`
names: fp32 (the default) shows the attention's own effect; on the integer GEMVs a change
far below their input codes' steps still flips an activation's rounding now and then, and that
shows too.

    python tools/gemv_fidelity.py wiki.test.raw [-m MODEL] [-c 2048] [--windows 16] \
        [--kv fp16] [-t 2] [--switch gemv|attn] [--gemv fp32|int] [--cache own|shared] [--json]

`kvrun ppl` cannot tell: it feeds the scored tokens in chunks through the eager forward,
which never runs the native step, and it compares caches, not GEMV paths. Here the text is
cut into the windows `kvrun ppl -c` cuts (first half context, second half scored). Each
window's context is prefilled once by the eager forward and its cache copied, one copy per
path; then every scored token runs through the native decode step of each path
(NativeDecodeStep(model, gemv=...)), each on its own copy, so the K/V of the scored half are
that path's own. All windows are the rows of one call (NativeDecodeStep.rows; up to
MAX_ROWS windows at a time). Reported over the scored tokens: mean KL(P_fp32 || P_int) in
nats, top-1 agreement, and each path's perplexity.

`--cache own` (the default) lets each path write its own K/V, so a difference compounds
over the scored half as it would in use. Where the cache quantizes every token as it is
written (Gemma's 4-bit rings), that compounding is chaotic: a last-bit difference flips a
4-bit rounding now and then, and the flipped code moves later steps by far more than the
kernel that caused it (Gemma, kivi-4, `--switch attn`: KL 0.0078 with own caches, 2e-8
with one cache). `--cache shared` measures each step's own effect instead: the int path
runs on a copy of the fp32 path's cache, made before every step, and only the fp32 path's
writes are kept (its "ppl int" is then the int path's score of the fp32 path's context).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time

import torch

import kvrun
from kvrun.eval.ppl import windows_of
from kvrun.kernels.native.decode_layer import MAX_ROWS
from kvrun.kv.build import make_cache
from kvrun.model.native_step import NativeDecodeStep, supported

PATHS = ("fp32", "int")


@torch.inference_mode()
def compare(model, wins: list[list[int]], kv: str, progress=None, switch: str = "gemv",
            gemv: str = "fp32", shared: bool = False) -> dict:
    """Sums over the scored tokens of `wins` (at most MAX_ROWS windows): KL, top-1 matches,
    each path's negative log-likelihood; and the count. switch: which kernel's two paths;
    shared: the int path steps on a copy of the fp32 path's cache (module docstring)."""
    T = model.transformer
    steps = {p: NativeDecodeStep(T, gemv=p if switch == "gemv" else gemv) for p in PATHS}

    def run(p, x, c):
        if switch == "attn":              # each path's caches step on its own product path
            for ci in c:
                ci.attn = p
        return steps[p].rows(x, c)

    ctx, B = len(wins[0]), len(wins)
    half = ctx // 2
    caches = {p: [] for p in PATHS}
    for w in wins:                                           # context: the eager forward, once
        c = make_cache(model.cfg, ctx, kv)
        T(torch.tensor([w[:half]]), c, last_only=True)
        caches["fp32"].append(c)
        caches["int"].append(copy.deepcopy(c))
    ids = torch.tensor(wins)                                 # (B, ctx)
    assert all(steps[p].applies(ids[:1, :1], c) for p in PATHS for c in caches[p]), \
        "the native step does not cover this model and cache"
    s = dict(kld=0.0, top1=0, nll_fp32=0.0, nll_int=0.0, n=0)
    for t in range(half, ctx - 1):                           # token t predicts t + 1
        if shared:                                           # before the fp32 path writes
            caches["int"] = [copy.deepcopy(c) for c in caches["fp32"]]
        lp = {p: torch.log_softmax(run(p, ids[:, t:t + 1], caches[p])[:, 0].double(), -1)
              for p in PATHS}                                # (B, V)
        ref, got = lp["fp32"], lp["int"]
        s["kld"] += (ref.exp() * (ref - got)).sum().item()
        s["top1"] += (ref.argmax(-1) == got.argmax(-1)).sum().item()
        nxt = ids[:, t + 1:t + 2]
        s["nll_fp32"] -= ref.gather(1, nxt).sum().item()
        s["nll_int"] -= got.gather(1, nxt).sum().item()
        s["n"] += B
        if progress and (t - half) % 64 == 0:
            progress(f"  token {t - half + 1}/{ctx - 1 - half} of {B} windows, "
                     f"KLD so far {s['kld'] / s['n']:.5f}")
    return s


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("text")
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-c", "--ctx", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--kv", default="fp16")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--switch", choices=["gemv", "attn"], default="gemv")
    ap.add_argument("--gemv", choices=list(PATHS), default="fp32", help="GEMVs of --switch attn")
    ap.add_argument("--cache", choices=["own", "shared"], default="own",
                    help="each path on its own cache, or the int path on the fp32 path's")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    model = kvrun.load(a.model, ctx=a.ctx, kv=a.kv, threads=a.threads)
    if not supported(model.transformer):
        sys.exit(f"error: the native decode step does not cover {model.path} (int4/int8 weights)")
    with open(a.text, encoding="utf-8") as f:
        wins = windows_of(model.tokenize(f.read()), a.ctx, a.windows)
    t0 = time.perf_counter()
    tot = dict(kld=0.0, top1=0, nll_fp32=0.0, nll_int=0.0, n=0)
    for i in range(0, len(wins), MAX_ROWS):
        group = wins[i:i + MAX_ROWS]
        print(f"windows {i + 1}-{i + len(group)} of {len(wins)}", file=sys.stderr)
        for k, v in compare(model, group, a.kv, lambda m: print(m, file=sys.stderr), a.switch,
                            a.gemv, a.cache == "shared").items():
            tot[k] += v
    n = tot["n"]
    rec = dict(model=str(model.path), ctx=a.ctx, windows=len(wins), kv=a.kv, switch=a.switch,
               gemv=a.gemv if a.switch == "attn" else None, cache=a.cache, scored=n,
               kld=tot["kld"] / n, top1=tot["top1"] / n, ppl_fp32=math.exp(tot["nll_fp32"] / n),
               ppl_int=math.exp(tot["nll_int"] / n), seconds=time.perf_counter() - t0)
    if a.json:
        print(json.dumps(rec, indent=2))
    else:
        print(f"{rec['model']}: {len(wins)} windows of {a.ctx}, {n} scored tokens, --kv {a.kv}, "
              f"{a.switch} paths, {a.cache} caches\n"
              f"  KL(fp32 || int) {rec['kld']:.2e} nats   top-1 {100 * rec['top1']:.2f} %   "
              f"ppl fp32 {rec['ppl_fp32']:.4f}   int {rec['ppl_int']:.4f}   "
              f"({rec['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
