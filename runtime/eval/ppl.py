"""`kvrun ppl`: perplexity and KL divergence of compressed KV caches (llama-perplexity style).

The text is tokenized once and cut into windows of `ctx` tokens. In each window the first
half is context and the second half is scored, as llama-perplexity does. The context half
is prefilled through the cache under test (tokens older than its residual window are
compressed as they arrive), and the scored half is fed in small chunks (default 32 = one
flush group), so every scored token really attends to the compressed past, as it would
in decode order. The uncompressed fp16 cache is always evaluated in the same run and on
the same windows; every other method reports against it: mean KL divergence
KL(P_fp16 ‖ P_method), top-1 agreement, Δppl, and its KV bytes per token.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from ..errors import KvrunError, PartialResults
from ..progress import format_duration

BASELINE = "fp16"


@dataclass
class PplRecord:
    method: str
    ppl: float
    dppl: float                 # relative change vs the fp16 baseline, percent
    kld: float                  # mean KL(P_fp16 || P_method) over scored tokens, nats
    top1: float                 # fraction of scored tokens whose argmax equals the baseline's
    bytes_per_token: float      # KV bytes per token at the evaluated context (window included)
    ratio: float                # vs fp16 at the evaluated context
    ratio_32k: float            # vs fp16 for the same configuration holding 32k tokens
    n_scored: int
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def windows_of(ids: list[int], ctx: int, n_windows: int | None) -> list[list[int]]:
    if n_windows is not None and n_windows < 1:
        raise KvrunError(f"--windows must be >= 1 (got {n_windows})")
    n = len(ids) // ctx
    if n == 0:
        raise KvrunError(f"text has {len(ids)} tokens: need at least -c {ctx} for one window")
    if n_windows is not None:
        n = min(n, n_windows)
    return [ids[i * ctx:(i + 1) * ctx] for i in range(n)]


@torch.inference_mode()
def prefill_context(transformer, cache, window: list[int], prefill_chunk: int) -> None:
    """The context half of `window` into `cache` (reset first), in prefill chunks: the
    prompt, so the scored half then runs as decoding does (`end_prompt`)."""
    cache.reset()
    half = len(window) // 2
    ids = torch.tensor([window])
    for s in range(0, half, prefill_chunk):
        transformer(ids[:, s:min(s + prefill_chunk, half)], cache, last_only=True)
    cache.end_prompt()


@torch.inference_mode()
def chunk_logprobs(transformer, cache, window: list[int], s: int, e: int) -> torch.Tensor:
    """Log-probs (e - s, V) of the next tokens of window[s:e] (predicting s+1 .. e), fed to
    `cache` as one chunk."""
    return torch.log_softmax(transformer(torch.tensor([window[s:e]]), cache)[0].float(), dim=-1)


def perplexity(model, text: str, ctx: int, methods: list[str], n_windows: int | None = None,
               chunk: int = 32, progress=None, evict: dict | None = None) -> list[PplRecord]:
    """Evaluate `methods` (KV specs) side by side; the fp16 baseline is always first.
    `evict` (KVConfig eviction fields, e.g. {"evict": "snapkv", "budget": 512}) applies to
    every listed method, fp16 included; the baseline stays the full fp16 cache.
    `progress(line)` gets a line per window with the elapsed time and an ETA. Ctrl-C after
    at least one window raises PartialResults carrying the records of the windows done."""
    from ..kv.build import make_cache
    from ..kv.config import parse_kv
    if ctx < 8 or ctx % 2:
        raise KvrunError(f"-c must be an even number >= 8 (got {ctx})")
    if chunk < 1:
        raise KvrunError(f"--chunk must be >= 1 (got {chunk})")
    # each spec parsed once: a profile file rewritten during the run changes neither the
    # caches nor the ratio columns
    specs = {BASELINE: parse_kv(BASELINE)}
    for m in methods:
        if evict:                                   # labelled with the policy, fp16 included
            spec = parse_kv(m, **evict)
            specs[spec.label()] = spec
        elif m != BASELINE:
            specs[m] = parse_kv(m)
    methods = list(specs)
    caches = {m: make_cache(model.cfg, ctx, specs[m]) for m in methods}     # validates every spec
    ids = model.tokenize(text)
    wins = windows_of(ids, ctx, n_windows)
    stats = {m: dict(nll=0.0, kld=0.0, top1=0, n=0, t=0.0) for m in methods}
    if progress:
        progress(f"[ppl] {len(wins)} window{'s' if len(wins) > 1 else ''} of {ctx} tokens "
                 f"({len(ids)} in the text), {len(methods)} caches each")
    t_start = time.perf_counter()
    done = 0
    try:
        for w_i, win in enumerate(wins):
            # a window counts only once every method has scored it: Ctrl-C in the middle
            # of one leaves `stats` over whole windows, the same windows for every method
            # the first window reports each eighth of its scored half (one window of many
            # caches at 16k+ tokens is minutes of silence otherwise), later ones once each
            def tell(frac):
                elapsed = time.perf_counter() - t_start
                eta = elapsed / frac * (len(wins) - frac)
                progress(f"[ppl] scoring window 1/{len(wins)}: {frac:.0%} | "
                         f"{format_duration(elapsed)} elapsed, ETA {format_duration(eta)}")
            add = _score_methods(model, caches, win, chunk, tell if progress and w_i == 0 else None)
            # one assignment: an interrupt while summing leaves the old totals whole
            stats = {m: {k: x + add[m][k] for k, x in stats[m].items()} for m in methods}
            done = w_i + 1
            if progress:
                b = stats[BASELINE]
                elapsed = time.perf_counter() - t_start
                eta = elapsed / done * (len(wins) - done)
                progress(f"[ppl] window {done}/{len(wins)}: fp16 ppl {math.exp(b['nll'] / b['n']):.3f} "
                         f"| {format_duration(elapsed)} elapsed, ETA {format_duration(eta)}")
    except KeyboardInterrupt:
        if done == 0:
            raise
        raise PartialResults(_records(model, specs, stats, ctx), done, len(wins)) from None
    return _records(model, specs, stats, ctx)


def _score_methods(model, caches: dict, win: list[int], chunk: int, tell=None) -> dict:
    """Per-method sums (nll, kld, top1, n, t) over one window; the baseline comes first.
    Each cache takes the context half, then the scored half runs chunk by chunk through
    every cache in turn, so only one chunk of log-probs per cache is ever held: a whole
    window's (tokens x vocabulary) did not fit in memory for Gemma's 262k vocabulary at
    16k tokens. `tell(fraction)` is called as each eighth of the scored half ends."""
    tr, half = model.transformer, len(win) // 2
    out = {m: dict(nll=0.0, kld=0.0, top1=0, n=0, t=0.0) for m in caches}
    for m, cache in caches.items():
        t0 = time.perf_counter()
        prefill_context(tr, cache, win, model.engine.prefill_chunk)
        out[m]["t"] += time.perf_counter() - t0
    starts = range(half, len(win) - 1, chunk)
    marks = {starts[max(0, len(starts) * k // 8 - 1)]: k / 8 for k in range(1, 9)} if tell else {}
    for s in starts:
        e = min(s + chunk, len(win) - 1)
        targets = torch.tensor(win[s + 1:e + 1])
        base = None
        for m, cache in caches.items():
            t0 = time.perf_counter()
            lp = chunk_logprobs(tr, cache, win, s, e)
            st = out[m]
            st["nll"] -= float(lp.gather(1, targets[:, None]).sum())
            st["n"] += len(targets)
            if base is None:
                base = lp
            else:
                st["kld"] += float((base.exp() * (base - lp)).sum())
                st["top1"] += int((base.argmax(-1) == lp.argmax(-1)).sum())
            st["t"] += time.perf_counter() - t0
        if s in marks:
            tell(marks[s])
    return out


def _records(model, specs: dict, stats: dict, ctx: int) -> list[PplRecord]:
    from ..kv.build import kv_bytes_per_token, kv_ratio_at
    base_ppl = math.exp(stats[BASELINE]["nll"] / stats[BASELINE]["n"])
    out = []
    for m, spec in specs.items():
        st = stats[m]
        ppl = math.exp(st["nll"] / st["n"])
        bpt = kv_bytes_per_token(model.cfg, spec, ctx)
        out.append(PplRecord(
            method=m, ppl=ppl, dppl=100.0 * (ppl / base_ppl - 1.0),
            kld=st["kld"] / st["n"] if m != BASELINE else 0.0,
            top1=st["top1"] / st["n"] if m != BASELINE else 1.0,
            bytes_per_token=bpt, ratio=kv_ratio_at(model.cfg, spec, ctx),
            # per 32k tokens against fp16 at 32k (not linear in n with sliding-window rings)
            ratio_32k=kv_ratio_at(model.cfg, spec, 32768),
            n_scored=st["n"], seconds=st["t"]))
    return out


def format_table(records: list[PplRecord]) -> str:
    w = max([18] + [len(r.method) for r in records])        # profile:NAME labels are long
    head = f"{'method':<{w}} {'ppl':>9} {'Δppl %':>8} {'KLD':>9} {'top-1':>7} {'B/tok':>9} {'ratio':>7} {'@32k':>7}"
    rows = [head, "-" * len(head)]
    for r in records:
        rows.append(f"{r.method:<{w}} {r.ppl:9.4f} {r.dppl:+8.2f} {r.kld:9.5f} {r.top1:7.4f} "
                    f"{r.bytes_per_token:9.0f} {r.ratio:7.3f} {r.ratio_32k:7.3f}")
    return "\n".join(rows)
