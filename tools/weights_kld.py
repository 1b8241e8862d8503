"""How far a conversion's stored weights move the next-token distribution from a reference
conversion of the same model (e.g. a GGUF converted at its own bits against its exact fp32
dequantization), on a text.

    python tools/weights_kld.py wiki.test.raw REF_DIR DIR [DIR ...] [-c 2048] [--windows 4] [--json]

The text is cut into the windows `kvrun ppl -c` cuts (first half context, second half
scored). Each model runs each whole window through its eager forward (`Model.logits`: fp32
compute and cache, chunks of 512 rows, where a quantized layer dequantizes its stored
weights), so the difference is the weights' alone, not a kernel's. Reported per DIR over the
scored tokens: mean KL(P_ref || P_dir) in nats, top-1 agreement with REF, and both
perplexities.
"""
from __future__ import annotations

import argparse
import json
import math

import torch

import kvrun
from kvrun.eval.ppl import windows_of


def _scored(m, window: list[int]) -> torch.Tensor:
    """(T/2, V) log-probabilities of the scored half's next tokens."""
    half = len(window) // 2
    return torch.log_softmax(m.logits(window)[half - 1:-1].float(), -1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("text")
    ap.add_argument("ref")
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("-c", "--ctx", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    ref = kvrun.load(a.ref, dtype="fp32", ctx=a.ctx, cache_ram_mb=0)
    wins = windows_of(ref.tokenize(open(a.text, encoding="utf-8").read()), a.ctx, a.windows)
    targets = [torch.tensor(w[len(w) // 2:]) for w in wins]
    ref_lp = [_scored(ref, w) for w in wins]
    del ref
    rows = []
    for d in a.dirs:
        m = kvrun.load(d, dtype="fp32", ctx=a.ctx, cache_ram_mb=0)
        kl = top1 = nll_ref = nll = n = 0.0
        for w, t, p in zip(wins, targets, ref_lp):
            q = _scored(m, w)
            kl += (p.exp() * (p - q)).sum().item()
            top1 += (p.argmax(-1) == q.argmax(-1)).sum().item()
            nll_ref -= p.gather(1, t[:, None]).sum().item()
            nll -= q.gather(1, t[:, None]).sum().item()
            n += len(t)
        rows.append({"dir": d, "kl": kl / n, "top1": top1 / n, "ppl_ref": math.exp(nll_ref / n),
                     "ppl": math.exp(nll / n), "tokens": int(n)})
        del m
    if a.json:
        print(json.dumps(rows, indent=2))
        return
    for r in rows:
        print(f"{r['dir']}: KL {r['kl']:.6f} nats, top-1 {100 * r['top1']:.2f} %, "
              f"ppl {r['ppl_ref']:.4f} -> {r['ppl']:.4f} ({r['tokens']} tokens)")


if __name__ == "__main__":
    main()
