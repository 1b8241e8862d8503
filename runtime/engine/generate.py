"""Generation, layered: `prefill` → `decode_step` → `tokens` (a token generator) → `stream`
(text pieces as small dataclasses). The CLI and the library both sit on `stream`.

An `Engine` owns one sequence: the model, its tokenizer and one KV cache, plus the ids
whose K/V the cache holds.

Prefix reuse is exact: a new prompt keeps the cached tokens only as far as the cache holds
them in the form a fresh prefill of that prompt would (`cache.resume_point`): a compressed
cache cannot bring a token back to full precision once it has left the window, so a prompt
that a fresh prefill would keep in the window re-prefills from an earlier point (often 0).
Prefill chunks are aligned to multiples of the chunk size, so a resumed prefill cuts the
prompt where a fresh one does, and `canon` counts the leading tokens whose K/V were
computed as a fresh prefill computes them (prompt tokens, and generated tokens whose step
saw the same compressed tail). With `append=True` (a chat session's next turn) the
prompt continues the cache as it stands: the turn is prefilled over the compressed past,
which is how the conversation was built, so replaying the same turns after `reset()`
gives the same replies.

Context shift: with a cache that can shift (`--ctx-policy shift`), a step that would
overflow the context first shifts it (keep the first n_keep tokens, drop half of the rest)
and drops the same ids from `cached`, so generation and chat go on for ever.
"""
from __future__ import annotations

import numbers
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import torch

from ..errors import KvrunError
from .decoding import Decoding
from .grammar import Grammar
from .sampling import SamplingParams, TokenLogprob

DEFAULT_PREFILL_CHUNK = 512


@dataclass
class Timings:
    prompt_tokens: int = 0          # tokens actually prefilled (cache hits excluded)
    prompt_s: float = 0.0
    gen_tokens: int = 0             # tokens sampled
    gen_s: float = 0.0              # from the first sample to the last
    decode_tokens: int = 0          # one-token forwards (the first token needs none: it is
    decode_s: float = 0.0           # sampled from the prompt's logits)

    @property
    def prompt_tok_s(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def gen_tok_s(self) -> float:
        """Decode speed: one-token forwards per second (llama.cpp's eval rate); 0.0 when
        none ran (-n 1), where a rate over one sample's microseconds meant nothing."""
        return self.decode_tokens / self.decode_s if self.decode_tokens and self.decode_s > 0 else 0.0


@dataclass
class StreamEvent:
    """One step of a streamed generation."""
    text: str                       # newly completed text ('' while a character is partial)
    token_id: int | None            # the sampled token (None on the final event)
    timings: Timings = field(default_factory=Timings)
    finish_reason: str | None = None    # None while running; "stop" | "length" | "context"
    logprob: TokenLogprob | None = None   # the token's, when asked for (runtime/engine/batch.py)


class PromptTooLong(KvrunError):
    """A prompt that does not fit the context beside what the cache holds: `cached` tokens
    held (0 when the cache shifts), `new` to prefill, `ctx` the context size."""

    def __init__(self, msg: str, cached: int, new: int, ctx: int):
        super().__init__(msg)
        self.cached, self.new, self.ctx = cached, new, ctx


def check_ids(ids: list, vocab_size: int) -> None:
    """Token ids given by a caller are integers in [0, vocab_size): a negative id indexed
    the embedding from its end, a large one raised IndexError."""
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab_size:
            raise KvrunError(f"token id {t!r} is not in the vocabulary [0, {vocab_size})")


class PrefixHooks(Protocol):
    """A prefix cache across generations behind one Engine (runtime/engine/model_prefix.py,
    a library Model's): asked before a prompt is prefilled, told at each chunk boundary."""

    def resume(self, engine: "Engine", prompt: list[int], have: int) -> int:
        """How many prompt ids need no prefill, given that the engine's own reuse kept
        `have`; may restore a longer cached state into the engine first."""

    def checkpoint(self, engine: "Engine") -> None:
        """The prefill stands at a chunk boundary it reached from a fresh prefill's state."""


class Engine:
    """One sequence (module docstring). `prefix`: PrefixHooks, or None (a batch's
    sequences, which the scheduler's prefix cache serves instead)."""

    def __init__(self, model, tokenizer, cache, prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        if prefill_chunk < 1:
            raise KvrunError(f"prefill chunk must be >= 1 (got {prefill_chunk})")
        self.model, self.tokenizer, self.cache = model, tokenizer, cache
        self.prefill_chunk = prefill_chunk
        self.cached: list[int] = []         # ids whose K/V are in the cache, in order
        self.canon = 0                      # leading cached ids with a fresh prefill's K/V
        self.n_shifts = 0                   # context shifts so far
        self.n_dropped = 0                  # ids they dropped
        self._busy = threading.Lock()       # held by the one generation using the cache
        self._holder: int | None = None     # the thread that holds it
        self.prefix: PrefixHooks | None = None

    @contextmanager
    def exclusive(self):
        """Hold the cache (and the model's decode scratch) for one generation: another
        thread waits until the generation ends; the same thread starting a second one while
        the first is still open (two interleaved `stream()` iterators) gets a KvrunError,
        since both would write one sequence's cache."""
        me = threading.get_ident()
        if not self._busy.acquire(blocking=False):
            if self._holder == me:
                raise KvrunError("this Model is already streaming a generation: finish that "
                                 "iterator or call its .close() first (a Model holds one "
                                 "sequence; generate_batch runs several)")
            self._busy.acquire()
        self._holder = me
        try:
            yield
        finally:
            self._holder = None
            self._busy.release()

    @property
    def max_ctx(self) -> int:
        return self.cache.max_ctx

    def reset(self) -> None:
        self.cache.reset()
        self.cached = []
        self.canon = 0

    @property
    def can_shift(self) -> bool:
        return self.cache.can_shift

    def reuse_prefix(self, ids: list[int], append: bool = False) -> int:
        """Keep the longest cached prefix of `ids` that gives what a fresh prefill gives
        (at least one id left to feed); with `append`, the longest common prefix as the
        cache holds it. Returns how many ids are kept."""
        n = 0
        limit = min(len(self.cached), len(ids) - 1)
        while n < limit and self.cached[n] == ids[n]:
            n += 1
        if not append:
            n = self.cache.resume_point(min(n, self.canon), self.prefill_chunk)
        if n < len(self.cached):
            n = self.cache.truncate(n)      # a cache may keep fewer (block boundaries)
            self.cached = self.cached[:n]
            self.canon = min(self.canon, n)
        return n

    def prefill(self, ids: list[int], checkpoint: bool = False) -> torch.Tensor:
        """Append `ids` to the cache in chunks aligned to multiples of the chunk size;
        returns the last position's logits (V,). `checkpoint`: tell `prefix` each chunk
        boundary reached from a fresh prefill's state (a generation does; a caller timing
        a prefill does not)."""
        logits = None
        for logits, _ in self.prefill_chunks(ids, checkpoint=checkpoint):
            pass
        return logits

    def prefill_chunks(self, ids: list[int], rows: bool = False,
                       checkpoint: bool = False) -> Iterator[tuple[torch.Tensor, int]]:
        """`prefill` one chunk per `next()` (a batch interleaves them with the decode steps
        of other sequences): yields (the chunk's last-position logits (V,), ids still to
        prefill); with `rows`, the logits of every position of the chunk (T, V) instead.
        The prompt is checked at the call, not at the first `next()`."""
        if not ids:
            raise KvrunError("empty prompt")
        room = self.max_ctx - (self.cache.shift_keep() if self.can_shift else len(self.cached))
        if len(ids) > room:
            held = "" if self.can_shift else f"{len(self.cached)} cached + "
            keep = (f" (a context shift keeps {self.cache.shift_keep()} tokens)"
                    if self.can_shift else "")
            raise PromptTooLong(f"prompt too long: {held}{len(ids)} new tokens > context size "
                                f"{self.max_ctx}{keep} (raise -c/--ctx-size)",
                                0 if self.can_shift else len(self.cached), len(ids), self.max_ctx)
        return self._prefill_chunks(ids, rows, checkpoint and self.prefix is not None)

    def _prefill_chunks(self, ids: list[int], rows: bool = False,
                        checkpoint: bool = False) -> Iterator[tuple[torch.Tensor, int]]:
        exact = self.canon == len(self.cached)          # resumed where a fresh prefill would be
        shifts = self.n_shifts
        s, C = 0, self.prefill_chunk
        while s < len(ids):
            e = s + C - (len(self.cached) % C)          # the next multiple of C
            logits = self._forward(ids[s:e], last_only=not rows)
            s = e
            if s >= len(ids):
                self.cache.end_prompt()
                if exact and shifts == self.n_shifts:
                    self.canon = len(self.cached)
            if checkpoint and exact and shifts == self.n_shifts and len(self.cached) % C == 0:
                self.prefix.checkpoint(self)
            yield (logits[0] if rows else logits[0, -1]), len(ids) - s

    def decode_step(self, token: int) -> torch.Tensor:
        """Feed one token; returns next-token logits (V,)."""
        state = self.decode_begin()
        logits = self._forward([token])[0, -1]
        self.decode_end(state)
        return logits

    def decode_begin(self) -> tuple[int, int]:
        """Before a one-token forward: the state decode_end needs (a batch runs the forward
        of many engines in one call between the two; runtime/engine/batch.py)."""
        return len(self.cached), self._tail()

    def decode_end(self, state: tuple[int, int]) -> None:
        """After the one-token forward that followed decode_begin (the token is in `cached`)."""
        j, before = state
        # the token's K/V are a fresh prefill's when its step saw the tail that prefill's
        # chunk would have shown it (decode runs the same ops as a one-token chunk)
        fresh_tail = self.cache.canonical_tail(j // self.prefill_chunk * self.prefill_chunk)
        if self.canon == j and before == self._tail() == fresh_tail and len(self.cached) == j + 1:
            self.canon = j + 1

    def _tail(self) -> int:
        """Tokens the cache holds compressed (the arena's compressed tail)."""
        return self.cache.n_compressed()

    def make_room(self, T: int) -> None:
        """Shift the context (when the cache can) until T more tokens fit; the discarded
        ids leave `cached` too."""
        while len(self.cached) + T > self.max_ctx and self.can_shift:
            a, nd = self.cache.shift_plan()
            self.cache.shift()
            del self.cached[a:a + nd]
            self.canon = min(self.canon, a)
            self.n_shifts += 1
            self.n_dropped += nd

    def _forward(self, ids: list[int], last_only: bool = True) -> torch.Tensor:
        """One forward that appends `ids` to the cache; logits (1, 1, V), or (1, T, V)
        without `last_only`. A Ctrl-C in the middle (some layers written, others not) is
        repaired before it propagates: the cache is truncated back to the ids it fully
        holds (a compressed cache may keep fewer; they are dropped)."""
        self.make_room(len(ids))
        try:
            logits = self.model(torch.tensor([ids]), self.cache, last_only=last_only)
        except KeyboardInterrupt:
            self.repair()
            raise
        self.cached.extend(ids)
        return logits

    def repair(self) -> None:
        """Make the cache consistent with `cached` after an interrupted forward."""
        kept = self.cache.truncate(min(len(self.cached), self.cache.seq_len))
        del self.cached[kept:]
        self.canon = min(self.canon, kept)

    def tokens(self, prompt: list[int], max_tokens: int, params: SamplingParams,
               stop_ids: set[int], timings: Timings, append: bool = False,
               grammar: Grammar | None = None) -> Iterator[tuple[int, str | None]]:
        """Yield (token, finish_reason): finish_reason is set on the last item only.

        A stop token is yielded (with reason "stop") but never fed to the model.
        `append`: the prompt continues the cache as it stands (see reuse_prefix).
        `grammar`: every token is sampled among those it allows (runtime/engine/grammar.py).
        """
        with self.exclusive():
            yield from self._tokens(prompt, max_tokens, params, stop_ids, timings, append, grammar)

    def _tokens(self, prompt, max_tokens, params, stop_ids, timings, append, grammar=None):
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise KvrunError(f"-n must be an integer >= 0 (got {max_tokens!r})")
        check_ids(prompt, self.model.cfg.vocab_size)
        dec = Decoding(prompt, max_tokens, params, stop_ids, grammar)     # as a batch's Sequence
        t0 = time.perf_counter()
        start = self.reuse_prefix(prompt, append)
        use_prefix = self.prefix is not None and not append
        if use_prefix:
            start = self.prefix.resume(self, prompt, start)
        logits = self.prefill(prompt[start:], checkpoint=use_prefix)
        timings.prompt_tokens, timings.prompt_s = len(prompt) - start, time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(max_tokens):
            tok = dec.sample(logits)
            timings.gen_tokens, timings.gen_s = i + 1, time.perf_counter() - t0
            reason = dec.finish_reason(tok, self)
            yield tok, reason
            if reason is not None:
                return
            t1 = time.perf_counter()
            logits = self.decode_step(tok)
            t2 = time.perf_counter()
            timings.decode_tokens += 1
            timings.decode_s += t2 - t1
            timings.gen_s = t2 - t0

    def stream(self, prompt: list[int], max_tokens: int, params: SamplingParams,
               stop_ids: set[int], append: bool = False,
               grammar: Grammar | None = None) -> Iterator[StreamEvent]:
        """Text pieces as they complete; the last event carries the finish reason."""
        timings = Timings()
        dec = self.tokenizer.stream(skip_special=True)
        reason = "length"
        for tok, reason_now in self.tokens(prompt, max_tokens, params, stop_ids, timings, append,
                                           grammar):
            text = "" if tok in stop_ids else dec.push(tok)
            if reason_now is not None:
                reason = reason_now
                text += dec.flush()
            yield StreamEvent(text, tok, timings, None)
        yield StreamEvent(dec.flush(), None, timings, reason)
