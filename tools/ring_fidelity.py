"""Gemma's sliding rings on the native one-token kernel against the torch step, in logits.

Teacher-forced decode steps (one token at a time, the decode step's route) over a stretch
of WikiText-2 longer than the ring, in lockstep on several caches: a reference (fp32 rows,
rings on the torch step: fp32 SDPA) and, per --kv, the same cache twice — its rings on
the native kernel (ring_attention.c: the one-call step, C rotations, fp32 attention) and on
the torch step (hadamard.rotate_step, SDPA in the ring dtype, the route fp16 rings took
before the kernel served them). Prints per (kv, ring route) the mean KL divergence of the
reference's next-token distribution to the route's, and the share of steps whose top-1
token equals the reference's. The global layers' arena runs natively in every cache.

    python tools/ring_fidelity.py -m gemma-3-270m --kv fp16,kivi-4,kivi-4+rot-v -n 640
"""
from __future__ import annotations

import argparse
import os

import torch

import kvrun
from kvrun.kv.config import parse_kv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="gemma-3-270m")
    ap.add_argument("--kv", default="fp16,kivi-4")
    ap.add_argument("-n", type=int, default=640, help="decode steps (tokens of the text)")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--text", default=os.environ.get("KVRUN_WIKITEXT", ""),
                    help="the text (default $KVRUN_WIKITEXT)")
    a = ap.parse_args()
    if not a.text:
        raise SystemExit("error: give --text or set KVRUN_WIKITEXT")
    m = kvrun.load(a.model, ctx=a.n + 16, threads=a.threads)
    cfg = m.cfg
    with open(a.text, encoding="utf-8") as f:
        ids = m.tokenizer.encode(f.read(200_000))[:a.n]
    if len(ids) < a.n:
        raise SystemExit(f"error: the text has {len(ids)} tokens, -n asks for {a.n}")
    toks = torch.tensor(ids).view(-1, 1, 1)                            # (n, 1, 1)

    def cache(kv: str, torch_ring: bool):
        c = kvrun.kv.make_cache(cfg, a.n + 16, parse_kv(kv))
        if torch_ring:
            c.ring.backend = "torch"            # its route: the ring's torch step
        return c

    runs = {("fp32", "torch"): cache("fp32", True)}
    for kv in a.kv.split(","):
        runs[(kv, "native")], runs[(kv, "torch")] = cache(kv, False), cache(kv, True)
    step = m.transformer.native_step(toks[0], runs[("fp32", "torch")])
    if step is None:
        raise SystemExit("error: this model has no native decode step here")
    kld = {k: 0.0 for k in runs}
    top1 = {k: 0 for k in runs}
    with torch.inference_mode():
        for tok in toks:
            logp = {k: step(tok, c)[0, 0].float().log_softmax(-1) for k, c in runs.items()}
            ref = logp[("fp32", "torch")]
            for k, lp in logp.items():
                kld[k] += float((ref.exp() * (ref - lp)).sum())
                top1[k] += int(lp.argmax() == ref.argmax())
    print(f"{a.model}, {a.n} teacher-forced decode steps, reference: fp32 cache, rings on the torch step")
    print("| kv | ring route | mean KLD to the reference | top-1 agreement |")
    print("|---|---|---|---|")
    for k in runs:
        if k != ("fp32", "torch"):
            print(f"| {k[0]} | {k[1]} | {kld[k] / a.n:.3g} | {top1[k] / a.n:.4f} |")


if __name__ == "__main__":
    main()
