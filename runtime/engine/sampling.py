"""Token sampling: greedy, temperature, top-k, top-p, min-p and repetition penalty.

Order follows llama.cpp's default chain: repetition penalty → top-k → top-p → min-p →
temperature → draw. `temp <= 0` is greedy. A constrained sequence (runtime/engine/grammar.py)
masks the tokens its grammar forbids after the penalty, so every later step sees only the
allowed ones. Randomness comes only from the
`torch.Generator` passed in, so the same seed gives the same text.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from ..errors import KvrunError


@dataclass
class SamplingParams:
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self):
        # the one check of sampling values, shared by the CLI, the library and the server:
        # NaN passes every `<` test, so finiteness is checked first, and a seed must fit the
        # generator's 64 bits (a larger one raised inside the batch step)
        for name, flag in (("temp", "--temp"), ("top_p", "--top-p"), ("min_p", "--min-p"),
                           ("repeat_penalty", "--repeat-penalty")):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                raise KvrunError(f"{flag} must be a finite number (got {x!r})")
            setattr(self, name, float(x))
        for name, flag in (("top_k", "--top-k"), ("repeat_last_n", "--repeat-last-n")):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int):
                raise KvrunError(f"{flag} must be an integer (got {x!r})")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 1 << 64):
            raise KvrunError(f"--seed must be an integer in [0, 2^64) (got {self.seed!r})")
        if self.temp < 0:
            raise KvrunError(f"--temp must be >= 0 (got {self.temp})")
        if self.top_k < 0:
            raise KvrunError(f"--top-k must be >= 0 (got {self.top_k})")
        if not 0.0 < self.top_p <= 1.0:
            raise KvrunError(f"--top-p must be in (0, 1] (got {self.top_p})")
        if not 0.0 <= self.min_p < 1.0:
            raise KvrunError(f"--min-p must be in [0, 1) (got {self.min_p})")
        if self.repeat_penalty <= 0:
            raise KvrunError(f"--repeat-penalty must be > 0 (got {self.repeat_penalty})")
        if self.repeat_last_n < 0:
            raise KvrunError(f"--repeat-last-n must be >= 0 (got {self.repeat_last_n})")


def sampling_params(options: dict) -> SamplingParams:
    """SamplingParams from keyword options (the library's **sampling), an unknown name
    being a KvrunError that lists the known ones (not a TypeError)."""
    known = [f.name for f in fields(SamplingParams)]
    bad = [k for k in options if k not in known]
    if bad:
        raise KvrunError(f"unknown sampling option {bad[0]!r} (known: {', '.join(known)})")
    return SamplingParams(**options)


def apply_repetition_penalty(logits: torch.Tensor, recent: list[int], penalty: float) -> torch.Tensor:
    """CTRL-style penalty: positive logits divided, negative multiplied (logits: (V,))."""
    if penalty == 1.0 or not recent:
        return logits
    ids = torch.tensor(sorted(set(recent)), dtype=torch.long)
    picked = logits[ids]
    logits = logits.clone()
    # kept finite: a penalty of 1e-300 (or 1e300) overflows float32 to ±inf, and the
    # sampler's inf - inf is NaN
    big = torch.finfo(logits.dtype).max
    logits[ids] = torch.where(picked > 0, picked / penalty, picked * penalty).clamp(-big, big)
    return logits


def sample(logits: torch.Tensor, p: SamplingParams, history: list[int],
           gen: torch.Generator | None, allowed: torch.Tensor | None = None) -> int:
    """Pick the next token from float32 logits (V,); with `allowed` ((V,) bool, at least one
    True), only among the allowed tokens."""
    logits = apply_repetition_penalty(logits, history[-p.repeat_last_n:] if p.repeat_last_n else [],
                                      p.repeat_penalty)
    if allowed is not None:
        # -inf, not a large negative: a forbidden token keeps probability 0 after any
        # temperature; the penalty's clamp ran before, so nothing turns -inf finite again
        logits = logits.masked_fill(~allowed, float("-inf"))
    if p.temp <= 0:
        return int(torch.argmax(logits))
    if p.top_k > 0 and p.top_k < logits.numel():
        vals, idx = torch.topk(logits, p.top_k)
    else:
        vals, idx = torch.sort(logits, descending=True)
    probs = torch.softmax(vals, dim=-1)                     # sorted, descending
    keep = torch.ones_like(probs, dtype=torch.bool)
    if p.top_p < 1.0:
        cum = torch.cumsum(probs, dim=-1)
        keep &= (cum - probs) < p.top_p                     # keep the token that crosses top_p
    if p.min_p > 0.0:
        keep &= probs >= p.min_p * probs[0]
    keep[0] = True
    # relative to the best logit (sorted first) over a temperature no smaller than the
    # dtype's tiniest normal, so a tiny temperature gives the best token 1 and the rest 0
    # (vals / 1e-300 divided by a float32 zero: NaN)
    vals = (vals[keep] - vals[0]) / max(p.temp, torch.finfo(vals.dtype).tiny)
    choice = torch.multinomial(torch.softmax(vals, dim=-1), 1, generator=gen)
    return int(idx[keep][choice])


MAX_TOP_LOGPROBS = 20           # alternatives per token a request may ask for (OpenAI's bound)


@dataclass
class TokenLogprob:
    """A sampled token's log-probability under the model's own distribution (the
    log-softmax of its raw logits: before repetition penalty, top-k/p, min-p and
    temperature, as vLLM reports by default), and the `top` most likely tokens
    [(id, logprob)], best first."""
    token_id: int
    logprob: float | None           # None: a prompt's first token (nothing predicts it)
    top: list[tuple[int, float]] | None


def token_logprob(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """TokenLogprob of `token` from float32 logits (V,), with k in [0, MAX_TOP_LOGPROBS]."""
    assert 0 <= k <= MAX_TOP_LOGPROBS, k
    lp = torch.log_softmax(logits.float(), dim=-1)
    vals, idx = torch.topk(lp, k) if k else (lp[:0], lp[:0].long())
    return TokenLogprob(token, float(lp[token]), [(int(i), float(v)) for i, v in zip(idx, vals)])


def next_logprobs(rows: torch.Tensor, next_ids: list[int], k: int) -> list[TokenLogprob]:
    """TokenLogprob of next_ids[j] under row j of float32 logits (T, V), len(next_ids) <= T:
    a prompt's tokens scored by the positions before them."""
    assert 0 <= k <= MAX_TOP_LOGPROBS and len(next_ids) <= rows.shape[0], (k, len(next_ids))
    n = len(next_ids)
    lp = torch.log_softmax(rows[:n].float(), dim=-1)                # (n, V)
    picked = lp[torch.arange(n), torch.tensor(next_ids, dtype=torch.long)].tolist()
    vals, idx = torch.topk(lp, k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    return [TokenLogprob(t, p, list(zip(i, v))) for t, p, i, v in
            zip(next_ids, picked, idx.tolist(), vals.tolist())]
