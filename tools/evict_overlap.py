"""Which tokens an evicting cache keeps, each codec against fp16, on one `kvrun needle` prompt.

The prompt is the one `kvrun needle FILE -c C --depths D --trials 1 -s SEED` builds (its
first needle and filler offset). It is prefilled into fp16 + POLICY and into each --kv
codec + POLICY, and for each cache the tool prints the share of fp16's kept (layer, KV
head, position) slots that the cache keeps too, how many of the needle's (layer, head,
token) slots it keeps, and the share per layer. That separates the two ways a codec +
policy pair can lose a needle fp16 + policy finds: a different selection (the share well
below 1), or the same tokens read with more error (the share near 1 while `kvrun needle`'s
lead shrinks).

    python tools/evict_overlap.py essays.txt -c 2048 --depth 0.9 --evict pyramidkv \\
        --kv-budget 1024 --kv int8,tada-4,kivi-4,auto
"""
from __future__ import annotations

import argparse
import sys

import torch

from kvrun.engine.api import load
from kvrun.engine.generate import Engine
from kvrun.errors import KvrunError, read_text_file
from kvrun.eval.needle import build_prompt, trial_needles
from kvrun.kv.build import make_cache
from kvrun.kv.config import parse_kv


def kept(model, ids: list[int], spec, chunk: int) -> list[list[set]]:
    """Per arena layer and KV head, the positions its tail keeps after prefilling ids."""
    cache = make_cache(model.cfg, len(ids) + 1, spec)
    Engine(model.transformer, model.tokenizer, cache, chunk).prefill(ids)
    if cache.ev is None:
        raise KvrunError("the cache does not evict: give --evict and --kv-budget")
    return [[set(cache.ev.pos_tail[l][h, :cache.n_tail[l]].tolist()) for h in range(cache.Hkv)]
            for l in range(cache.L)]


def needle_args(doc: str) -> argparse.ArgumentParser:
    """The options this tool and evict_replay.py share: the `kvrun needle` prompt, the codecs,
    the policy and its budget."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("file", help="filler text, as `kvrun needle FILE`")
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-c", "--ctx-size", type=int, default=2048)
    ap.add_argument("--kv", default="kivi-4", help="comma list of codecs, each beside fp16")
    ap.add_argument("--evict", required=True)
    ap.add_argument("--kv-budget", type=int, required=True)
    ap.add_argument("-b", "--batch-size", type=int, default=512, help="prefill chunk")
    ap.add_argument("-s", "--seed", type=int, default=0)
    ap.add_argument("-t", "--threads", type=int, default=2)
    return ap


def main(argv=None) -> None:
    ap = needle_args(__doc__)
    ap.add_argument("--depth", type=float, default=0.9)
    a = ap.parse_args(argv)
    try:
        specs = {kv: parse_kv(kv, evict=a.evict, budget=a.kv_budget) for kv in ["fp16", *a.kv.split(",")]}
        text = read_text_file(a.file)
        model = load(a.model, ctx=8, prefill_chunk=a.batch_size, threads=a.threads)
        tok = lambda s: model.tokenizer.encode(s, bos=False)     # noqa: E731 (no BOS mid-text)
        prefix, filler = model.tokenizer.encode(""), tok(text)
        needle, offset = trial_needles(a.seed, 1, len(filler), a.ctx_size)[0]
        ids, at = build_prompt(tok, filler, a.ctx_size - len(prefix), a.depth, needle, offset)
        fact = set(range(len(prefix) + at, len(prefix) + at + len(tok(needle.fact))))
        with torch.inference_mode():
            sets = {kv: kept(model, prefix + ids, spec, a.batch_size) for kv, spec in specs.items()}
    except KvrunError as e:
        sys.exit(f"error: {e}")
    ref = sets["fp16"]
    print(f"| cache + {a.evict} | kept as fp16 + {a.evict} | needle slots kept | per layer |")
    print("|---|---|---|---|")
    for kv, s in sets.items():
        same = [sum(len(r & k) for r, k in zip(rl, kl)) for rl, kl in zip(ref, s)]
        total = [sum(len(r) for r in rl) for rl in ref]
        needle_slots = sum(len(k & fact) for kl in s for k in kl)
        layers = " ".join(f"{x / max(n, 1):.2f}" for x, n in zip(same, total))
        print(f"| {kv} | {sum(same) / max(sum(total), 1):.3f} | {needle_slots} | {layers} |")


if __name__ == "__main__":
    main()
