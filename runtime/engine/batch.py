"""Batched decoding: many sequences, each on its own KV cache, one forward per step
(continuous batching as in Orca / vLLM, llama.cpp's server slots; docs/architecture.md).

A `Sequence` is one generation: its own `Engine` (its cache: window, tail, positions,
codec and eviction state; the ids it holds), its sampling state and its text. A `Batch`
holds the live sequences and advances them together, one `step()` at a time:

1. one prefill chunk of the oldest sequence still reading its prompt (the engine's own
   chunked prefill, on its own cache), so a long prompt delays the others by one chunk
   per step, not by its whole prefill;
2. every sequence with next-token logits samples a token through the same bookkeeping
   as `Engine.tokens` (decoding.py `Decoding`: one order of checks, stop token,
   max_tokens, full context), and emits it;
   finished sequences leave the batch at once;
3. one forward of the rest, `batch_forward`: B rows through every norm and GEMV (each
   weight read once per step), RoPE at each row's own position, attention per row on
   its own cache.

A sequence whose own step raises (its prefill chunk, its sampling, its row of the
forward) finishes with reason "error"; the other sequences go on. When the batched forward
raises, the rows are repaired and re-run one at a time, so only the row at fault fails.

Greedy output of every sequence is identical to running it alone: each row of the native
step is computed independently of the others (native_step.py), and where the native step
does not cover a cache or a model (other weights, the torch backend) the rows run one by
one through the model's own forward, which is what a lone sequence runs.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from ..errors import KvrunError
from .generate import DEFAULT_PREFILL_CHUNK, Engine, StreamEvent, Timings
from .grammar import Grammar
from .decoding import Decoding
from .sampling import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprob, next_logprobs, token_logprob
from .stops import StopStrings, check_stops


def failure(e: Exception) -> str:
    """One line for a sequence's failure: a user error as is, anything else as internal."""
    return str(e) if isinstance(e, KvrunError) else f"internal error: {type(e).__name__}: {e}"


@torch.inference_mode()
def batch_forward(model, tokens: list[int], caches: list) -> torch.Tensor:
    """One decode step of B sequences: tokens[b] is appended to caches[b] (each cache one
    sequence). Returns float32 next-token logits (B, V)."""
    B = len(tokens)
    assert B == len(caches) and B > 0, (B, len(caches))
    return model.decode_rows(torch.tensor(tokens)[:, None], caches)


class Sequence:
    """One generation in a batch. `on_event(StreamEvent)` receives its text pieces (stop
    strings applied) and, last, an event with the finish reason: "stop" | "length" |
    "context" | "cancelled" (cancel()) | "error" (`error` then says why). With `logprobs`
    = k (0..MAX_TOP_LOGPROBS), each event of a sampled token carries its TokenLogprob with
    the k best alternatives, except a stop token's (EOS is not part of the text). With
    `prompt_logprobs` = k, the prefill keeps every row's logits and `prompt_logprobs` holds
    one TokenLogprob per prompt token (the first one's logprob is None), complete before
    the first event. With `grammar` (runtime/engine/grammar.py) every token is sampled among
    those the grammar allows; the sequence starts its own state in it (a Grammar is shared,
    a state never is). Logprobs stay the model's own, unmasked. A prefix cache
    (runtime/engine/prefix_cache.py) hooks in twice: `resume(engine)` fills the new engine
    from a cached state and returns how many prompt ids need no prefill (not with
    `prompt_logprobs`: every row is scored); `checkpoint(engine)` is called at each chunk
    boundary the prefill reaches, when the prefill began in a fresh prefill's state (so each
    of those states is one too)."""

    def __init__(self, model, tokenizer, cache, prompt: list[int], max_tokens: int,
                 params: SamplingParams, stop_ids: set[int], stop=None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 on_event: Callable[[StreamEvent], None] | None = None,
                 logprobs: int | None = None, prompt_logprobs: int | None = None,
                 grammar: Grammar | None = None,
                 resume: Callable[[Engine], int] | None = None,
                 checkpoint: Callable[[Engine], None] | None = None):
        if max_tokens < 0:
            raise KvrunError(f"max_tokens must be >= 0 (got {max_tokens})")
        for k in (logprobs, prompt_logprobs):
            if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
                raise KvrunError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}] (got {k})")
        self.logprobs, self._prompt_k = logprobs, prompt_logprobs
        self.prompt_logprobs: list[TokenLogprob] | None = None
        if prompt_logprobs is not None and prompt:
            self.prompt_logprobs = [TokenLogprob(prompt[0], None, None)]
        self.engine = Engine(model, tokenizer, cache, prefill_chunk)
        self.prompt, self.max_tokens, self.params = list(prompt), max_tokens, params
        self.start = resume(self.engine) if resume is not None and prompt_logprobs is None else 0
        # chunk boundaries are reached as a fresh prefill reaches them when the prefill
        # starts in such a state (chunks are aligned to multiples of the chunk)
        self._checkpoint = checkpoint if self.engine.canon == len(self.engine.cached) else None
        self.stop_ids = stop_ids
        self.stops = StopStrings(check_stops(stop))
        self.on_event = on_event or (lambda ev: None)
        self.decoding = Decoding(prompt, max_tokens, params, stop_ids, grammar)   # as Engine.tokens
        self.timings = Timings()
        # checks the prompt's length
        self.chunks = self.engine.prefill_chunks(self.prompt[self.start:], rows=prompt_logprobs is not None)
        self.logits: torch.Tensor | None = None     # next-token logits (V,) once prefilled
        self.token: int | None = None               # the sampled token the next forward feeds
        self.tokens: list[int] = []                 # generated ids
        self.text = ""                              # emitted text
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.cancelled = False
        self.cancel_error: str | None = None
        self._dec = tokenizer.stream(skip_special=True)
        self._t0 = 0.0

    @property
    def cache(self):
        return self.engine.cache

    @property
    def prefilling(self) -> bool:
        return self.logits is None and self.finish_reason is None

    def cancel(self, error: str | None = None) -> None:
        """Ask the batch to drop this sequence at its next step (any thread may call it):
        finish reason "cancelled", or "error" saying `error` (e.g. the server is stopping)."""
        self.cancel_error = error
        self.cancelled = True

    # -- the steps, called by Batch ----------------------------------------------------------
    def prefill_next(self) -> None:
        """Prefill one chunk of the prompt."""
        t0 = time.perf_counter()
        logits, left = next(self.chunks)
        if self.prompt_logprobs is not None:            # rows (T, V): row j scores token s + j + 1
            end = len(self.prompt) - max(left, 0)
            s = end - logits.shape[0]
            self.prompt_logprobs += next_logprobs(logits, self.prompt[s + 1:end + 1], self._prompt_k)
            logits = logits[-1]
        self.timings.prompt_s += time.perf_counter() - t0
        n = len(self.engine.cached)
        if self._checkpoint is not None and n % self.engine.prefill_chunk == 0:
            self._checkpoint(self.engine)
        if left <= 0:                                               # the prompt's last chunk
            self.logits = logits
            self.timings.prompt_tokens = len(self.prompt) - self.start
            self._t0 = time.perf_counter()
            if self.max_tokens == 0:
                self.finish("length")

    def sample_next(self) -> bool:
        """Sample the next token and emit it; True if the sequence goes on (its token is to
        be fed by the next forward)."""
        tok = self.decoding.sample(self.logits)
        lp = None if self.logprobs is None or tok in self.stop_ids else \
            token_logprob(self.logits, tok, self.logprobs)
        self.tokens.append(tok)
        self.timings.gen_tokens = len(self.tokens)
        self.timings.gen_s = time.perf_counter() - self._t0
        reason = self.decoding.finish_reason(tok, self.engine)
        text = "" if tok in self.stop_ids else self._dec.push(tok)
        if reason is not None:
            text += self._dec.flush()
        out, matched = self.stops.push(text)
        self._emit(StreamEvent(out, tok, self.timings, None, lp))
        if matched:
            reason = "stop"
        if reason is not None:
            self.finish(reason)
            return False
        self.token, self.logits = tok, None
        return True

    def finish(self, reason: str, error: str | None = None) -> None:
        """End the sequence with `reason`: the last event carries it."""
        if self.finish_reason is not None:
            return
        out = ""
        if reason in ("stop", "length", "context") and self.stops.matched is None:
            out, _ = self.stops.push(self._dec.flush(), last=True)
        self.finish_reason, self.error = reason, error
        self._emit(StreamEvent(out, None, self.timings, reason))

    def _emit(self, ev: StreamEvent) -> None:
        self.text += ev.text
        self.on_event(ev)


class Batch:
    """The live sequences of one model, advanced together by `step()` (module docstring).
    Single-threaded: one thread calls add / step (runtime/engine/scheduler.py serialises)."""

    def __init__(self, model):
        self.model = model                      # the Transformer
        self.seqs: list[Sequence] = []

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: Sequence) -> None:
        self.seqs.append(seq)

    def step(self) -> list[Sequence]:
        """One step (module docstring); returns the sequences that finished in it."""
        for s in self.seqs:
            if s.cancelled:
                s.finish("error", s.cancel_error) if s.cancel_error else s.finish("cancelled")
        pre = next((s for s in self.seqs if s.prefilling), None)
        if pre is not None:
            self._guard(pre, pre.prefill_next)
        feed = [s for s in self.seqs if s.logits is not None and s.finish_reason is None
                and self._guard(s, s.sample_next)]
        if feed:
            self._decode(feed)
        done = [s for s in self.seqs if s.finish_reason is not None]
        self.seqs = [s for s in self.seqs if s.finish_reason is None]
        return done

    def _decode(self, feed: list[Sequence]) -> None:
        states = []
        for s in feed:
            states.append(s.engine.decode_begin())
            s.engine.make_room(1)                      # a context shift, where the cache can
        try:
            logits = batch_forward(self.model, [s.token for s in feed], [s.cache for s in feed])
        except KeyboardInterrupt:
            for s in feed:
                s.engine.repair()
            raise
        except Exception as e:                          # noqa: BLE001 - find the row at fault
            for s in feed:
                s.engine.repair()
            if len(feed) == 1:
                feed[0].finish("error", failure(e))
                return
            for s in feed:                              # each row alone: the others go on
                self._guard(s, lambda s=s: self._decode([s]))
            return
        for s, st, lg in zip(feed, states, logits):
            s.engine.cached.append(s.token)
            s.engine.decode_end(st)
            s.logits = lg

    @staticmethod
    def _guard(seq: Sequence, fn):
        """Run one sequence's step and return its result; if it raises, that sequence ends
        with reason "error" (a user error's message, or the internal error's type), not the
        batch, and the result is False."""
        try:
            return fn()
        except Exception as e:                          # noqa: BLE001 - this sequence only
            seq.finish("error", failure(e))
            return False
