"""Relative reconstruction error |x̂ − x|² / |x|² of the codebook codecs on a model's real K
and V (after the Hadamard rotation they are stored in), beside kivi-4 and beside cb with
each 32-token block's per-channel mean taken out first (what a zero point would buy), for
a few arena layers after a 1024-token prefill of FILE.

    python tools/codebook_error.py -m MODEL_DIR FILE

"token-varying share" is the part of |x|² left after each channel's mean over the tokens
is removed: where it is small, most of a key is a direction every token shares, and a
per-token code spends its levels on that shared part.
"""
from __future__ import annotations

import argparse

import torch

import kvrun
from kvrun.kernels.codecs import make_codec
from kvrun.kernels.hadamard import rotation_matrix


def rel(rec, x):
    return float(((rec - x) ** 2).sum() / (x ** 2).sum())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-n", type=int, default=1024)
    args = ap.parse_args()
    torch.set_num_threads(1)
    m = kvrun.load(args.model, ctx=args.n + 64, kv="fp16")
    ids = torch.tensor(m.tokenize(open(args.file).read()[:8 * args.n])[:args.n])
    m.transformer(ids[None], m.engine.cache)
    arena = getattr(m.engine.cache, "inner", m.engine.cache)
    D = m.cfg.head_dim
    R = rotation_matrix(D)
    print("| layer | role | cb-4 | cb-4 centred | cb-3 | cb-3 centred | kivi-4 | token-varying share |")
    print("|---|---|---|---|---|---|---|---|")
    for layer in range(0, arena.L, max(1, arena.L // 4)):
        for role, x0 in zip("kv", arena.rows(layer)):
            n = x0.shape[1] // 32 * 32
            x0 = x0[:, :n].float().contiguous()                          # (Hkv, n, D)
            x = x0 @ R
            mu = x.view(-1, n // 32, 32, D).mean(2, keepdim=True).expand(-1, -1, 32, -1).reshape(x.shape)
            cells = []
            for bits in (4, 3):
                c = make_codec(f"cb-{bits}", role, 32)
                st = c.alloc(x.shape[0], D, n)
                cells += [rel(c.pack(st, x, 0), x), rel(c.pack(st, (x - mu).contiguous(), 0) + mu, x)]
            kc = make_codec("kivi-4", role, 32)
            cells.append(rel(kc.pack(kc.alloc(x.shape[0], D, n), x0, 0), x0))
            share = float(((x - x.mean(1, keepdim=True)) ** 2).sum() / (x ** 2).sum())
            print(f"| {layer} | {role.upper()} | " + " | ".join(f"{e:.4f}" for e in cells) + f" | {share:.2f} |")


if __name__ == "__main__":
    main()
