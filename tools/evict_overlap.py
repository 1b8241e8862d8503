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

With --key-error it also prints, per layer, how far each codec's kept keys are from the
exact ones: the relative error ||K^ - K|| / ||K|| of its tail against fp16 + POLICY's rows
at the same (head, position) (a prompt's chunks attend over exact rows while it is
prefilled, so both caches saw the same prompt), beside the error of the same positions
when the fp16 cache's rows without eviction are packed by the codec in contiguous blocks.
A ratio above 1 is what re-packing kept tokens into blocks with gaps costs keys quantized
per channel over a block. --trial T of --trials N picks `kvrun needle --trials N`'s
needle T (default: the first of one).
"""
from __future__ import annotations

import argparse
import sys

import torch

from kvrun.engine.api import load
from kvrun.engine.generate import Engine
from kvrun.errors import KvrunError, read_text_file
from kvrun.eval.needle import build_prompt, trial_needles
from kvrun.kernels.hadamard import rotate_k, unrotate_k
from kvrun.kv.build import make_cache
from kvrun.kv.config import parse_kv


def prefilled(model, ids: list[int], spec, chunk: int):
    """A cache for spec with ids prefilled."""
    cache = make_cache(model.cfg, len(ids) + 1, spec)
    Engine(model.transformer, model.tokenizer, cache, chunk).prefill(ids)
    return cache


def kept(cache) -> list[list[set]]:
    """Per arena layer and KV head, the positions an evicting cache's tail keeps."""
    if cache.ev is None:
        raise KvrunError("the cache does not evict: give --evict and --kv-budget")
    return [[set(cache.ev.pos_tail[l][h, :cache.n_tail[l]].tolist()) for h in range(cache.Hkv)]
            for l in range(cache.L)]


def tail_keys(cache, l: int) -> torch.Tensor:
    """Layer l's tail keys (Hkv, n_tail, D) float32, decoded and un-rotated."""
    k = cache.tail_rows(l, [(0, cache.n_tail[l])], values=False)[0]
    return k if cache.rot_k[l] is None else unrotate_k(k, cache.rot_k[l])


def key_error(ev, ref_ev, full, ref_full) -> list[tuple[int, float, float]]:
    """Per layer: (kept tail tokens, relative K error of the evicting cache ev against ref_ev's
    rows at the same head and position, the same positions' error when ref_full's rows, which
    no eviction touched, are packed into full's tail, contiguous blocks). ev and ref_ev saw the
    same prompt (its chunks attend over exact rows), so both errors are the codec's alone.
    Re-packs full's tail. Positions ref_ev does not keep are left out of the first."""
    out = []
    for l in range(ev.L):
        nt, nf = ev.n_tail[l], full.n_tail[l]
        pos, ref_pos = ev.ev.pos_tail[l][:, :nt], ref_ev.ev.pos_tail[l][:, :ref_ev.n_tail[l]]
        exact = tail_keys(ref_full, l)                               # (Hkv, nf, D), slot t = position t
        rk = full.rot_k[l]
        full.pack_tail(l, exact if rk is None else rotate_k(exact, rk),
                       full.tail_rows(l, [(0, nf)], keys=False)[1], 0)
        k, kr, kf = tail_keys(ev, l), tail_keys(ref_ev, l), tail_keys(full, l)
        num = den = num_f = den_f = 0.0
        for h in range(ev.Hkv):
            both = torch.cat([pos[h], ref_pos[h]])
            slot = torch.full((int(both.max()) + 1 if both.numel() else 1,), -1)
            slot[ref_pos[h]] = torch.arange(ref_pos.shape[1])
            at = slot[pos[h]]
            ok = at >= 0
            x = kr[h, at[ok]]
            num += float((k[h, ok] - x).norm() ** 2)
            den += float(x.norm() ** 2)
            p = pos[h][pos[h] < nf]
            num_f += float((kf[h, p] - exact[h, p]).norm() ** 2)
            den_f += float(exact[h, p].norm() ** 2)
        out.append((nt, (num / max(den, 1e-30)) ** 0.5, (num_f / max(den_f, 1e-30)) ** 0.5))
    return out


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
    ap.add_argument("--trial", type=int, default=0, help="which needle of --trials")
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--key-error", action="store_true",
                    help="per layer, the kept keys' error, evicting and in contiguous blocks")
    a = ap.parse_args(argv)
    if not 0 <= a.trial < a.trials:
        sys.exit(f"error: --trial must be in [0, --trials) (got {a.trial} of {a.trials})")
    try:
        kvs = ["fp16", *a.kv.split(",")]
        specs = {kv: parse_kv(kv, evict=a.evict, budget=a.kv_budget) for kv in kvs}
        text = read_text_file(a.file)
        model = load(a.model, ctx=8, prefill_chunk=a.batch_size, threads=a.threads)
        tok = lambda s: model.tokenizer.encode(s, bos=False)     # noqa: E731 (no BOS mid-text)
        prefix, filler = model.tokenizer.encode(""), tok(text)
        needle, offset = trial_needles(a.seed, a.trials, len(filler), a.ctx_size)[a.trial]
        ids, at = build_prompt(tok, filler, a.ctx_size - len(prefix), a.depth, needle, offset)
        fact = set(range(len(prefix) + at, len(prefix) + at + len(tok(needle.fact))))
        with torch.inference_mode():
            caches = {kv: prefilled(model, prefix + ids, spec, a.batch_size) for kv, spec in specs.items()}
            sets = {kv: kept(c) for kv, c in caches.items()}
            if a.key_error:
                full = {kv: prefilled(model, prefix + ids, parse_kv(kv), a.batch_size) for kv in kvs}
                errors = {kv: key_error(caches[kv], caches["fp16"], full[kv], full["fp16"])
                          for kv in kvs[1:]}
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
    if a.key_error:
        print(f"\nkept keys' relative error: evicting (against fp16 + {a.evict}) / the same positions "
              "packed in contiguous blocks, and their ratio, per layer")
        print("| layer | kept | " + " | ".join(f"{kv}: evicting / without / ratio" for kv in errors) + " |")
        print("|---|---|" + "---|" * len(errors))
        for l in range(len(next(iter(errors.values())))):
            cells = [f"{e[l][1]:.4f} / {e[l][2]:.4f} / {e[l][1] / max(e[l][2], 1e-30):.2f}" for e in errors.values()]
            print(f"| {l} | {next(iter(errors.values()))[l][0]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
