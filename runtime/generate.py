"""Generation, layered: `prefill` → `decode_step` → `tokens` (a token generator) → `stream`
(text pieces as small dataclasses). The CLI and the library both sit on `stream`.

An `Engine` owns one sequence: the model, its tokenizer and one KV cache, plus the ids
whose K/V the cache holds. A new prompt that starts with those ids prefills only the
rest (multi-turn chat, repeated prompts).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .errors import KvrunError
from .sampling import SamplingParams, sample

DEFAULT_PREFILL_CHUNK = 512


@dataclass
class Timings:
    prompt_tokens: int = 0          # tokens actually prefilled (cache hits excluded)
    prompt_s: float = 0.0
    gen_tokens: int = 0
    gen_s: float = 0.0

    @property
    def prompt_tok_s(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def gen_tok_s(self) -> float:
        return self.gen_tokens / self.gen_s if self.gen_s > 0 else 0.0


@dataclass
class StreamEvent:
    """One step of a streamed generation."""
    text: str                       # newly completed text ('' while a character is partial)
    token_id: int | None            # the sampled token (None on the final event)
    timings: Timings = field(default_factory=Timings)
    finish_reason: str | None = None    # None while running; "stop" | "length" | "context"


class Engine:
    def __init__(self, model, tokenizer, cache, prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        if prefill_chunk < 1:
            raise KvrunError(f"prefill chunk must be >= 1 (got {prefill_chunk})")
        self.model, self.tokenizer, self.cache = model, tokenizer, cache
        self.prefill_chunk = prefill_chunk
        self.cached: list[int] = []         # ids whose K/V are in the cache, in order

    @property
    def max_ctx(self) -> int:
        return self.cache.max_ctx

    def reset(self) -> None:
        self.cache.reset()
        self.cached = []

    def reuse_prefix(self, ids: list[int]) -> int:
        """Keep the longest cached prefix of `ids` (at least one id left to feed)."""
        n = 0
        limit = min(len(self.cached), len(ids) - 1)
        while n < limit and self.cached[n] == ids[n]:
            n += 1
        if n < len(self.cached):
            n = self.cache.truncate(n)      # a cache may keep fewer (block boundaries)
            self.cached = self.cached[:n]
        return n

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Append `ids` to the cache in chunks; returns the last position's logits (V,)."""
        if not ids:
            raise KvrunError("empty prompt")
        if len(self.cached) + len(ids) > self.max_ctx:
            raise KvrunError(f"prompt too long: {len(self.cached) + len(ids)} tokens > context "
                             f"size {self.max_ctx} (raise -c/--ctx-size)")
        logits = None
        for s in range(0, len(ids), self.prefill_chunk):
            chunk = ids[s:s + self.prefill_chunk]
            logits = self._forward(chunk)
        return logits[0, -1]

    def decode_step(self, token: int) -> torch.Tensor:
        """Feed one token; returns next-token logits (V,)."""
        return self._forward([token])[0, -1]

    def _forward(self, ids: list[int]) -> torch.Tensor:
        """One forward that appends `ids` to the cache. A Ctrl-C in the middle (some layers
        written, others not) is repaired before it propagates: the cache is truncated back
        to the ids it fully holds (a compressed cache may keep fewer; they are dropped)."""
        try:
            logits = self.model(torch.tensor([ids]), self.cache, last_only=True)
        except KeyboardInterrupt:
            kept = self.cache.truncate(min(len(self.cached), self.cache.seq_len))
            del self.cached[kept:]
            raise
        self.cached.extend(ids)
        return logits

    def tokens(self, prompt: list[int], max_tokens: int, params: SamplingParams,
               stop_ids: set[int], timings: Timings) -> Iterator[tuple[int, str | None]]:
        """Yield (token, finish_reason): finish_reason is set on the last item only.

        A stop token is yielded (with reason "stop") but never fed to the model.
        """
        if max_tokens < 0:
            raise KvrunError(f"-n must be >= 0 (got {max_tokens})")
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        t0 = time.perf_counter()
        start = self.reuse_prefix(prompt)
        logits = self.prefill(prompt[start:])
        timings.prompt_tokens, timings.prompt_s = len(prompt) - start, time.perf_counter() - t0
        history = list(prompt)
        t0 = time.perf_counter()
        for i in range(max_tokens):
            tok = sample(logits, params, history, gen)
            history.append(tok)
            timings.gen_tokens, timings.gen_s = i + 1, time.perf_counter() - t0
            if tok in stop_ids:
                yield tok, "stop"
                return
            if i == max_tokens - 1:
                yield tok, "length"
                return
            if len(self.cached) >= self.max_ctx:
                yield tok, "context"
                return
            yield tok, None
            logits = self.decode_step(tok)
            timings.gen_s = time.perf_counter() - t0

    def stream(self, prompt: list[int], max_tokens: int, params: SamplingParams,
               stop_ids: set[int]) -> Iterator[StreamEvent]:
        """Text pieces as they complete; the last event carries the finish reason."""
        timings = Timings()
        dec = self.tokenizer.stream(skip_special=True)
        reason = "length"
        for tok, reason_now in self.tokens(prompt, max_tokens, params, stop_ids, timings):
            text = "" if tok in stop_ids else dec.push(tok)
            if reason_now is not None:
                reason = reason_now
                text += dec.flush()
            yield StreamEvent(text, tok, timings, None)
        yield StreamEvent(dec.flush(), None, timings, reason)
