"""`kvrun needle`: needle-in-a-haystack retrieval under KV compression and token eviction.

A fact ("The secret number of <city> is <7 digits>.") is planted at a depth (fraction of
the context) of a filler text, the context is cut to `ctx` tokens, and the prompt ends with
a completion cue ("... The secret number of <city> is") so even a small model answers in
a few greedy tokens. A trial passes when the generated continuation contains the digits.
Accuracy is reported per depth and KV configuration (Kamradt's NIAH; the eviction papers
use it as their long-context retrieval probe). Every trial uses a fresh random number and
city, the same across configurations, so configurations differ only in their cache.

Beside the pass/fail, each trial has a lead: while the greedy answer follows the right
number (its own tokenization: " " and one token per digit on both shipped models), the
right token's probability minus the best other token's, at the step where it is lowest.
A found needle has a positive lead; a lost one shows how far the deciding step fell short.
A needle the fp16 cache finds by a lead of 0.01 is a coin toss for any cache (a 32k
needle on Gemma 3 flipped between the native and the torch fp16 kernels); one found by
0.8 that a codec loses is the codec's doing.
"""
from __future__ import annotations

import random
import re
import time
from dataclasses import asdict, dataclass, field

from ..errors import KvrunError, PartialResults
from ..progress import format_duration

CITIES = ("Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Quito", "Dakar", "Tbilisi", "Perth",
          "Montreal", "Valencia", "Gdansk", "Kyoto", "Accra", "Tartu", "Cusco")


@dataclass
class Needle:
    city: str
    number: str

    @property
    def fact(self) -> str:
        return f" The secret number of {self.city} is {self.number}. "

    @property
    def cue(self) -> str:
        return f"\n\nQuestion: what is the secret number of {self.city}?\nAnswer: The secret number of {self.city} is"

    def found(self, answer: str) -> bool:
        return self.number in re.sub(r"[\s,.]", "", answer)


@dataclass
class NeedleRecord:
    method: str
    depth: float
    accuracy: float
    trials: int
    seconds: float
    lead: float                 # mean over trials of each answer's lead (module docstring)
    found: list[bool] = field(default_factory=list)     # each trial's pass, in draw order
    leads: list[float] = field(default_factory=list)    # each trial's lead, in draw order

    def to_dict(self) -> dict:
        return asdict(self)


def make_needle(rng: random.Random) -> Needle:
    return Needle(rng.choice(CITIES), str(rng.randrange(1_000_000, 10_000_000)))


def trial_needles(seed: int, trials: int, n_filler: int, ctx: int) -> list[tuple[Needle, int]]:
    """Each trial's needle and filler offset (token index), as `kvrun needle -s SEED` draws
    them for a filler of n_filler tokens cut to ctx: the same in every configuration."""
    rng = random.Random(seed)
    needles = [make_needle(rng) for _ in range(trials)]
    return list(zip(needles, [rng.randrange(0, max(1, n_filler - ctx)) for _ in range(trials)]))


def build_prompt(tokenize, filler_ids: list[int], ctx: int, depth: float, needle: Needle,
                 offset: int = 0) -> tuple[list[int], int]:
    """Token ids of filler[offset:] with the needle at `depth` (0 = start, 1 = just before the
    question), `ctx` tokens in all (question included). Returns (ids, needle token index)."""
    if not 0.0 <= depth <= 1.0:
        raise KvrunError(f"needle depth must be in [0, 1], got {depth}")
    fact, cue = tokenize(needle.fact), tokenize(needle.cue)
    n_fill = ctx - len(fact) - len(cue)
    if n_fill < 1:
        raise KvrunError(f"-c {ctx} is too small for the needle and the question")
    if offset + n_fill > len(filler_ids):
        raise KvrunError(f"filler text has {len(filler_ids)} tokens: need {offset + n_fill}")
    fill = filler_ids[offset:offset + n_fill]
    at = round(depth * n_fill)
    return fill[:at] + fact + fill[at:] + cue, at


def answer_with_lead(engine, tokenizer, prompt: list[int], right: list[int], max_tokens: int,
                     stop_ids) -> tuple[str, float]:
    """The greedy continuation of `prompt` (at most max_tokens, up to a stop id) and its lead
    over the `right` token ids (module docstring): min over the steps i where the tokens so
    far equal right[:i] of p(right[i]) - max p(other)."""
    logits = engine.prefill(prompt)
    out, lead = [], 1.0
    for i in range(max_tokens):
        t = int(logits.argmax())
        if i < len(right) and out == right[:i]:
            p = logits.float().softmax(-1)
            pr = float(p[right[i]])
            p[right[i]] = -1.0
            lead = min(lead, pr - float(p.max()))
        if t in stop_ids:
            break
        out.append(t)
        if i + 1 < max_tokens:
            logits = engine.decode_step(t)
    return tokenizer.decode(out), lead


def run_needle(model, filler: str, ctx: int, depths: list[float], specs: dict, trials: int = 3,
               max_tokens: int = 10, seed: int = 0, progress=None) -> list[NeedleRecord]:
    """Accuracy per (spec label, depth). `specs`: label → KV spec (str or KVConfig).
    Ctrl-C after at least one (label, depth) cell raises PartialResults with the cells done."""
    from ..kv.build import make_cache
    from ..engine.generate import Engine
    if trials < 1:
        raise KvrunError(f"--trials must be >= 1 (got {trials})")
    tokenize = lambda s: model.tokenizer.encode(s, bos=False)    # noqa: E731 (no BOS mid-text)
    prefix = model.tokenizer.encode("")                          # the model's BOS, if any
    filler_ids = tokenize(filler)
    drawn = trial_needles(seed, trials, len(filler_ids), ctx)
    out = []
    cells, t_start = len(specs) * len(depths), time.perf_counter()
    try:
        for label, spec in specs.items():
            eng = Engine(model.transformer, model.tokenizer, make_cache(model.cfg, ctx + max_tokens, spec),
                         model.engine.prefill_chunk)
            if progress and not out:
                progress(estimate(eng, filler_ids, ctx, cells * trials, len(specs), len(depths),
                                  trials))
                t_start = time.perf_counter()
            for depth in depths:
                t0, found, leads = time.perf_counter(), [], []
                for nd, off in drawn:
                    ids, _ = build_prompt(tokenize, filler_ids, ctx - len(prefix), depth, nd, off)
                    eng.reset()
                    answer, lead = answer_with_lead(eng, model.tokenizer, prefix + ids,
                                                    tokenize(f" {nd.number}"), max_tokens, model.stop_ids)
                    found.append(nd.found(answer))
                    leads.append(lead)
                ok = sum(found)
                out.append(NeedleRecord(label, depth, ok / trials, trials, time.perf_counter() - t0,
                                        sum(leads) / trials, found, leads))
                if progress:
                    elapsed = time.perf_counter() - t_start
                    eta = elapsed / len(out) * (cells - len(out))
                    progress(f"[needle] {label} depth {depth:.2f}: {ok}/{trials}, lead {sum(leads) / trials:+.3f} "
                             f"| {format_duration(elapsed)} elapsed, ETA {format_duration(eta)}")
    except KeyboardInterrupt:
        if not out:
            raise
        raise PartialResults(list(out), len(out), cells, "cells (method × depth)") from None
    return out


def estimate(eng, filler_ids: list[int], ctx: int, n_trials: int, n_specs: int,
             n_depths: int, trials: int) -> str:
    """The line printed before a run: its size and a duration estimated from one timed
    prefill of up to one chunk (scaled linearly to `ctx`: long contexts run longer, their
    attention grows with the context; the progress lines' ETA is measured)."""
    n = max(1, min(ctx, eng.prefill_chunk, len(filler_ids)))
    t0 = time.perf_counter()
    eng.reset()
    eng.prefill(filler_ids[:n])
    per_trial = (time.perf_counter() - t0) * ctx / n
    eng.reset()
    return (f"[needle] {n_trials} trials of {ctx}-token prompts ({n_specs} KV configuration"
            f"{'s' if n_specs != 1 else ''} x {n_depths} depth{'s' if n_depths != 1 else ''} x "
            f"{trials} needle{'s' if trials != 1 else ''}): about {format_duration(per_trial * n_trials)} "
            f"at this machine's speed now (estimated from a {n}-token prefill)")


def format_table(records: list[NeedleRecord], depths: list[float] | None = None,
                 labels: list[str] | None = None, ref: str | None = None) -> str:
    """Accuracy by method (rows) and depth (columns), then the mean lead the same way, then
    with `ref` (a method's label) every other method's needles against ref's (`paired`);
    `depths`/`labels` give the full grid of an interrupted run, whose missing cells show
    as "-"."""
    depths = sorted(set(depths or []) | {r.depth for r in records})
    labels = list(dict.fromkeys(list(labels or []) + [r.method for r in records]))
    acc = _grid(records, depths, labels, "method", lambda r: r.accuracy, "6.2f")
    lead = _grid(records, depths, labels, "lead", lambda r: r.lead, "+6.3f")
    out = acc + "\n\n" + lead
    if ref in labels and len(labels) > 1:
        out += "\n\n" + paired(records, depths, labels, ref)
    return out


def paired(records: list[NeedleRecord], depths: list[float], labels: list[str], ref: str) -> str:
    """Trial by trial against `ref` (the same needles in every method), two rows per method:
    "lost", the needles ref finds that the method misses, and "gained", the ones it finds
    that ref misses, per depth and in total ("." for none), then on the lost row the
    largest lead ref had on a needle the method lost. A needle ref found by a lead of 0.01
    is a coin toss for any cache; one found by 0.5 and lost is the method's doing (module
    docstring)."""
    at = {(r.method, r.depth): r for r in records}
    w = max([22] + [len(m) for m in labels])
    head = (f"{'method':<{w}} {'needles':<7}" + "".join(f" {d:>6.2f}" for d in depths)
            + "  total  ref lead")
    rows = [f"needle by needle against {ref}: lost = {ref} finds it, the method misses it; "
            f"gained = the other way round;",
            f"ref lead = {ref}'s largest lead on a needle the method lost (near 0: a coin toss)",
            "", head, "-" * len(head)]
    n = lambda k: f" {k if k else '.':>6}"          # noqa: E731
    for m in labels:
        if m == ref:
            continue
        lost_row, gained_row, lost, gained, worst = [], [], 0, 0, None
        for d in depths:
            a, b = at.get((ref, d)), at.get((m, d))
            if a is None or b is None:
                lost_row.append(f" {'-':>6}")
                gained_row.append(f" {'-':>6}")
                continue
            lo = [i for i, (x, y) in enumerate(zip(a.found, b.found)) if x and not y]
            ga = sum(1 for x, y in zip(a.found, b.found) if y and not x)
            lost, gained = lost + len(lo), gained + ga
            for i in lo:
                worst = a.leads[i] if worst is None else max(worst, a.leads[i])
            lost_row.append(n(len(lo)))
            gained_row.append(n(ga))
        tail = f"{'-' if worst is None else f'{worst:+.3f}':>10}"
        rows.append(f"{m:<{w}} {'lost':<7}" + "".join(lost_row) + n(lost) + tail)
        rows.append(f"{'':<{w}} {'gained':<7}" + "".join(gained_row) + n(gained))
    return "\n".join(rows)


def _grid(records, depths, labels, title, value, fmt) -> str:
    at = {(r.method, r.depth): value(r) for r in records}
    w = max([22] + [len(m) for m in labels])                 # profile:NAME labels are long
    head = f"{title:<{w}}" + "".join(f" {d:>6.2f}" for d in depths) + "   mean"
    rows = [head, "-" * len(head)]
    for m in labels:                      # a cell missing (interrupted run) shows as "-"
        a = [at.get((m, d)) for d in depths]
        got = [x for x in a if x is not None]
        mean = f" {sum(got) / len(got):{fmt}}" if got else f" {'-':>6}"
        rows.append(f"{m:<{w}}" + "".join(f" {'-':>6}" if x is None else f" {x:{fmt}}" for x in a)
                    + mean)
    return "\n".join(rows)
