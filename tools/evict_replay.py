"""Needle by needle: a codec + policy with its own selection, and with fp16 + policy's forced.

A codec + eviction pair can lose a needle that fp16 + the same policy finds in two ways: the
policy, scoring over the codec's keys, keeps other tokens (the selection), or it keeps the
same tokens and the codec reads them with too much error (the precision). This tool
separates them. For each `kvrun needle` prompt (the same needles and filler offsets, seed
-s) it prefills fp16 + POLICY and records, at every compaction of every layer, the
positions each KV head keeps; then each --kv codec + POLICY twice: as it runs, and with
every compaction forced to keep fp16's positions (ArenaEviction.choose replaced on the
instance). The fp16 cache takes each codec's window and group, which set the tail's blocks
and pyramidkv's per-layer budgets (a profile may use groups of 64). A replay is exact when
every compaction keeps exactly the policy's choice: always for per-token codecs and 4-bit
keys in a prefill chunk; 2- and 3-bit keys re-pack at most one block per G flushing tokens
(runtime/kv/arena_evict.py), and when that is too few the tool stops with an error (a
forced run must hold fp16's tokens after the prompt). It prints each cache's answer lead (`kvrun
needle`'s: the right digit's probability minus the best other token's, at its lowest;
> 0 = found) and counts the needles fp16 finds that the codec loses, and of those the ones
it finds with fp16's selection (lost to the selection) or not (lost to the precision). With
--own-last, one more run per codec takes fp16's selection at every compaction but each
layer's last, and its own there: which compaction a lost needle goes at. With
--k-layer L=METHOD or L0-L1=METHOD (repeatable) each codec's cache takes METHOD for the keys
of those arena layers: which layer's key precision a needle lost to the precision turns on.

    python tools/evict_replay.py essays.txt -c 2048 --depths 0.7,0.9 --trials 10 \\
        --evict pyramidkv --kv-budget 1024 --kv kivi-4,tada-4
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

from kvrun.engine.api import load
from kvrun.engine.generate import Engine
from kvrun.errors import KvrunError, read_text_file
from kvrun.eval.needle import answer_with_lead, build_prompt, trial_needles
from kvrun.kv.build import make_cache
from kvrun.kv.config import parse_kv
from kvrun.kv.layout import arena_layers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evict_overlap import needle_args  # noqa: E402  (a sibling script)

MAX_TOKENS = 10


def with_k_layers(spec, overrides: list[str], n_layers: int):
    """spec with the K method of each override "L=METHOD" or "L0-L1=METHOD" (layers L0..L1,
    inclusive) set in those arena layers."""
    layers = spec.layer_methods(n_layers)
    for o in overrides:
        at, sep, method = o.partition("=")
        lo, _, hi = at.strip().partition("-")
        hi = hi or lo
        if not (sep and lo.isdigit() and hi.isdigit() and int(lo) <= int(hi) < n_layers):
            raise KvrunError(f"--k-layer wants L=METHOD or L0-L1=METHOD with layers in [0, {n_layers}) "
                             f"(got {o!r})")
        for l in range(int(lo), int(hi) + 1):
            layers[l] = (method.strip(), layers[l][1])
    return replace(spec, layers=layers)


def recording(ev, log: dict) -> None:
    """Wrap ev.choose: append each compaction's kept positions (Hkv, K) to log[layer]."""
    own = ev.choose

    def choose(l, score, pos, K):
        keep = own(l, score, pos, K)
        log.setdefault(l, []).append(pos.gather(1, keep))
        return keep
    ev.choose = choose


def replaying(ev, log: dict, own_last: bool = False) -> None:
    """Replace ev.choose: the i-th compaction of layer l keeps log[l][i]'s positions (with
    own_last, each layer's last compaction is left to the cache's own choice)."""
    done: dict[int, int] = {}
    own = ev.choose

    def choose(l, score, pos, K):
        i = done.get(l, 0)
        done[l] = i + 1
        if own_last and i == len(log[l]) - 1:
            return own(l, score, pos, K)
        want = log[l][i]
        keep = torch.stack([torch.isin(p, w) for p, w in zip(pos, want)])    # per KV head
        if want.shape[1] != K or (keep.sum(1) != K).any():
            raise KvrunError(f"layer {l}, compaction {i}: fp16's kept positions are not among this "
                             f"cache's candidates (its keys re-pack at most one block per G flushing tokens)")
        return torch.stack([torch.nonzero(k)[:, 0] for k in keep])
    ev.choose = choose


def run(model, ids, right, spec, ctx, chunk, hook=None) -> tuple[float, list]:
    """The answer's lead with this cache, and the positions each layer holds after the prompt."""
    cache = make_cache(model.cfg, ctx + MAX_TOKENS, spec)
    if cache.ev is None:
        raise KvrunError("the cache does not evict: give --evict and --kv-budget")
    if hook:
        hook(cache.ev)
    eng = Engine(model.transformer, model.tokenizer, cache, chunk)
    held, prefill = [], eng.prefill

    def prefill_and_note(prompt):
        logits = prefill(prompt)
        held.extend(cache.ev.kept_positions(l) for l in range(cache.L))
        return logits
    eng.prefill = prefill_and_note
    lead = answer_with_lead(eng, model.tokenizer, ids, right, MAX_TOKENS, model.stop_ids)[1]
    return lead, held


def exact(kept, ref) -> None:
    """A forced run must hold fp16's tokens after the prompt: a compaction of 2- or 3-bit keys
    may re-pack too few blocks to keep the choice. (A decode compaction during the answer,
    at most one in MAX_TOKENS tokens, re-packs one block of per-channel keys of any width and
    may keep a few other tokens: not checked.)"""
    for l, (a, b) in enumerate(zip(kept, ref)):
        if not torch.equal(a, b):
            raise KvrunError(f"layer {l}: the replay kept other tokens than fp16 (its keys re-pack at most "
                             f"one block per G flushing tokens)")


def main(argv=None) -> None:
    ap = needle_args(__doc__)
    ap.add_argument("--depths", default="0.7,0.9")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--own-last", action="store_true",
                    help="one more run: fp16's selection at every compaction but each layer's last "
                         "(the question's, from the same candidates), the codec's own there")
    ap.add_argument("--k-layer", action="append", default=[], metavar="L[-L1]=METHOD",
                    help="each codec's keys of arena layer L (to L1) in METHOD instead (repeatable)")
    a = ap.parse_args(argv)
    try:
        depths = [float(d) for d in a.depths.split(",")]
        codecs = a.kv.split(",")
        specs = {kv: parse_kv(kv, evict=a.evict, budget=a.kv_budget) for kv in codecs}
        # fp16 + policy in each codec's geometry: the window and group set the tail's blocks
        # (and pyramidkv's per-layer budgets), which a replay must share; one run per geometry
        geom = {kv: (sp.residual, sp.group) for kv, sp in specs.items()}
        refs = {g: parse_kv("fp16", evict=a.evict, budget=a.kv_budget, residual=g[0], group=g[1])
                for g in dict.fromkeys(geom.values())}
        text = read_text_file(a.file)
        model = load(a.model, ctx=8, prefill_chunk=a.batch_size, threads=a.threads)
        if a.k_layer:
            specs = {kv: with_k_layers(sp, a.k_layer, arena_layers(model.cfg)) for kv, sp in specs.items()}
            print(f"each codec with the keys of layer {', '.join(a.k_layer)}\n")
        tok = lambda s: model.tokenizer.encode(s, bos=False)     # noqa: E731 (no BOS mid-text)
        prefix, filler = model.tokenizer.encode(""), tok(text)
        drawn = trial_needles(a.seed, a.trials, len(filler), a.ctx_size)
        lost = {kv: [0, 0, 0] for kv in codecs}                  # lost, of them to the selection, found
        last = " | fp16's until the last" if a.own_last else ""
        print("| depth | trial | " + " | ".join(f"fp16 @{specs[kv].group} | {kv} | {kv}, fp16's selection{last}"
                                                for kv in codecs) + " |")
        print("|---|---|" + ("---|---|---|" + "---|" * a.own_last) * len(codecs))
        with torch.inference_mode():
            for d in depths:
                for t, (needle, offset) in enumerate(drawn):
                    ids, _ = build_prompt(tok, filler, a.ctx_size - len(prefix), d, needle, offset)
                    ids, right = prefix + ids, tok(f" {needle.number}")
                    logs = {g: {} for g in refs}
                    done = {g: run(model, ids, right, spec, a.ctx_size, a.batch_size,
                                   lambda ev, log=logs[g]: recording(ev, log)) for g, spec in refs.items()}
                    row = []
                    for kv in codecs:
                        log, (ref, ref_kept) = logs[geom[kv]], done[geom[kv]]
                        own, _ = run(model, ids, right, specs[kv], a.ctx_size, a.batch_size)
                        forced, kept = run(model, ids, right, specs[kv], a.ctx_size, a.batch_size,
                                           lambda ev: replaying(ev, log))
                        exact(kept, ref_kept)
                        row += [f"{ref:+.3f}", f"{own:+.3f}", f"{forced:+.3f}"]
                        if a.own_last:
                            mixed, _ = run(model, ids, right, specs[kv], a.ctx_size, a.batch_size,
                                           lambda ev: replaying(ev, log, own_last=True))
                            row.append(f"{mixed:+.3f}")
                        if ref > 0:
                            lost[kv][2] += 1
                            if own <= 0:
                                lost[kv][0] += 1
                                lost[kv][1] += forced > 0
                    print(f"| {d} | {t} | " + " | ".join(row) + " |", flush=True)
    except KvrunError as e:
        sys.exit(f"error: {e}")
    print()
    for kv, (n, sel, found) in lost.items():
        print(f"{kv} + {a.evict}: of {found} needles fp16 + {a.evict} finds, loses {n}: "
              f"{sel} found with fp16's selection (lost to the selection), "
              f"{n - sel} not (lost to the precision)")

if __name__ == "__main__":
    main()
