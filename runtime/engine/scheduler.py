"""The serving loop: requests in, token streams out, many sequences decoded together
(runtime/engine/batch.py), admitted under a KV memory budget. `kvrun serve` puts HTTP in front of
it (runtime/cli/server.py); `Model.generate_batch` runs it in the calling thread.

    sched = Scheduler(m, parallel=8, kv_budget_mb=256).start()     # a background thread
    req = sched.submit(m.tokenize("Once upon a time"), 64, SamplingParams(temp=0))
    for ev in req.events():                 # StreamEvent: text pieces, then the finish reason
        print(ev.text, end="")
    req.cancel()                            # or close the iterator: the slot is freed at once
    sched.shutdown()                        # drain: finish what runs, then stop

Admission. Each sequence gets its own cache (its own arena: window, tail, codec and
eviction state), so the KV method may differ per request. The cache is sized for what the
request can hold: prompt + max_tokens tokens, at most the per-sequence context `ctx` (all of
it under `--ctx-policy shift`, which keeps generating); its bytes are known before
allocation (`kv_bytes_at`). A request is admitted, oldest first, while fewer than
`parallel` sequences run and the caches' bytes stay within the budget; otherwise it waits
in a bounded queue: `max_queue` requests may wait beyond the free slots (`QueueFull`, HTTP
429, past that), so `max_queue=0` still serves a request on an idle loop. A request that could never fit
(longer than the context, or larger alone than the whole budget) is refused at submit.
Admitted requests never wait for memory again: a cache is allocated once for its request.

Isolation. Anything that goes wrong for one request (its cache cannot be built, its
sampling or its row of the batched forward raises) ends that request with finish reason
"error"; the others keep running (runtime/engine/batch.py).
"""
from __future__ import annotations

import collections
import itertools
import sys
import threading
import time
from typing import Callable, Iterator

from ..kv.build import make_cache
from .batch import Batch, Sequence, failure
from ..errors import KvrunError
from .generate import StreamEvent, Timings
from .grammar import Grammar
from ..kv.build import kv_bytes_at
from ..kv.config import KVConfig, parse_kv
from .sampling import MAX_TOP_LOGPROBS, SamplingParams
from .prefix_cache import PrefixCache
from .prefix_tier import PrefixTier
from .stops import check_stops

MiB = 1 << 20


class QueueFull(KvrunError):
    """The waiting queue is full: the caller should retry later (HTTP 429)."""


class Closed(KvrunError):
    """The loop takes no new requests (it is shutting down: HTTP 503)."""


SHUTTING_DOWN = "the server is shutting down"


def check_budget_mb(mb) -> None:
    """--kv-budget-mb: None (no limit) or a finite number of MiB > 0 (NaN passes `<= 0`)."""
    if mb is not None and not (isinstance(mb, (int, float)) and not isinstance(mb, bool)
                               and 0 < mb < float("inf")):
        raise KvrunError(f"--kv-budget-mb must be a finite number > 0 (got {mb!r})")


class Request:
    """A submitted generation. `events()` streams its StreamEvents (the last carries the
    finish reason: "stop" | "length" | "context" | "cancelled" | "error"); `result()` waits
    for the whole text."""

    def __init__(self, rid: int, prompt: list[int], max_tokens: int, params: SamplingParams,
                 stop: list[str], kv: KVConfig, n_ctx: int, kv_bytes: int,
                 logprobs: int | None = None, prompt_logprobs: int | None = None,
                 grammar: Grammar | None = None):
        self.id, self.prompt, self.max_tokens, self.params = rid, prompt, max_tokens, params
        self.grammar = grammar                      # output constraint (shared, immutable)
        self.logprobs = logprobs                    # top alternatives per token; None: off
        self.prompt_k = prompt_logprobs             # the same for the prompt's tokens
        self.stop, self.kv, self.n_ctx, self.kv_bytes = stop, kv, n_ctx, kv_bytes
        self.seq: Sequence | None = None            # set at admission
        self.text = ""
        self.n_tokens = 0                           # generated tokens
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.timings = Timings()
        self.t_submit = time.monotonic()
        self.ttft: float | None = None              # seconds from submit to the first token
        self._events: collections.deque[StreamEvent] = collections.deque()
        self._cond = threading.Condition()
        self._cancelled = False
        self._cancel_error: str | None = None
        self.notify = None          # called (in the loop's thread) after each event: async waiters

    def _push(self, ev: StreamEvent) -> None:       # the loop's thread
        with self._cond:
            self.text += ev.text
            self.n_tokens += ev.token_id is not None
            if self.ttft is None and ev.token_id is not None:
                self.ttft = time.monotonic() - self.t_submit
            self.timings = ev.timings
            if ev.finish_reason is not None:
                self.finish_reason = ev.finish_reason
                self.error = self.seq.error if self.seq is not None else self.error
            self._events.append(ev)
            self._cond.notify_all()
        notify = self.notify
        if notify is not None:
            try:
                notify()
            except RuntimeError:                    # the waiter's event loop is closed
                self.notify = None

    def pop_event(self, on_empty=None) -> StreamEvent | None:
        """The next event without waiting, or None; `on_empty()` runs under the request's
        lock when there is none, so an event pushed after it is never missed by a waiter
        that `notify` wakes."""
        with self._cond:
            if self._events:
                return self._events.popleft()
            if on_empty is not None:
                on_empty()
            return None

    def _fail(self, reason: str, error: str | None = None) -> None:
        """End a request that never ran (cancelled or failed while queued)."""
        if self.finish_reason is None:
            self.error = error
            self._push(StreamEvent("", None, self.timings, reason))

    def cancel(self, error: str | None = None) -> None:
        """Stop generating; the sequence leaves the batch (its cache is freed) at the next step
        with finish reason "cancelled", or "error" saying `error`."""
        self._cancel_error = error
        self._cancelled = True
        if self.seq is not None:
            self.seq.cancel(error)

    @property
    def prompt_logprobs(self) -> list | None:
        """The prompt's TokenLogprobs when asked for (complete once any event arrived)."""
        return self.seq.prompt_logprobs if self.seq is not None else None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def events(self, timeout: float | None = None) -> Iterator[StreamEvent]:
        """The events as they come. Closing the iterator early cancels the request.
        `timeout`: seconds to wait for any one event (TimeoutError past it)."""
        finished = False
        try:
            while True:
                with self._cond:
                    if not self._events and not self._cond.wait_for(lambda: self._events, timeout):
                        raise TimeoutError(f"request {self.id}: no event in {timeout} s")
                    ev = self._events.popleft()
                finished = ev.finish_reason is not None
                yield ev
                if finished:
                    return
        finally:
            if not finished:
                self.cancel()

    def result(self, timeout: float | None = None) -> str:
        """The whole text once the request is done."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.finish_reason is not None, timeout):
                raise TimeoutError(f"request {self.id}: not done in {timeout} s")
        return self.text


class Scheduler:
    """Continuous batching over one loaded `Model` (module docstring).

    parallel: most sequences decoded together; kv_budget_mb: most MiB of KV caches at once
    (None: no limit); max_queue: most requests waiting beyond the free slots; ctx: tokens per
    sequence (default: the model's context); kv: the default KV method (default: the
    model's); cache_ram_mb: MiB of host RAM for the prefix cache across requests
    (runtime/engine/prefix_cache.py; 0: none); cache_dir, cache_disk_mb: its disk tier, a
    directory and the most MiB its files hold (runtime/engine/prefix_disk.py; None: none);
    tier: a second-level store built by the caller instead of the directory (a PrefixTier,
    runtime/engine/prefix_tier.py: the cluster's shared tier), not with cache_dir."""

    def __init__(self, model, parallel: int = 4, kv_budget_mb: float | None = None,
                 max_queue: int = 64, ctx: int | None = None, kv: "str | KVConfig | None" = None,
                 cache_ram_mb: float = 0, cache_dir=None, cache_disk_mb: float = 1024,
                 tier: "PrefixTier | None" = None):
        if parallel < 1:
            raise KvrunError(f"--parallel must be >= 1 (got {parallel})")
        check_budget_mb(kv_budget_mb)
        if max_queue < 0:
            raise KvrunError(f"queue size must be >= 0 (got {max_queue})")
        self.model = model
        self.parallel, self.max_queue = parallel, max_queue
        self.budget = None if kv_budget_mb is None else int(kv_budget_mb * MiB)
        self.ctx = ctx or model.ctx
        if self.ctx < 2:
            raise KvrunError(f"context per sequence must be >= 2 tokens (got {self.ctx})")
        self.kv = self.parse_kv(kv if kv is not None else getattr(model, "kv", "fp16"))
        if not (isinstance(cache_ram_mb, (int, float)) and 0 <= cache_ram_mb < float("inf")):
            raise KvrunError(f"--cache-ram must be a finite number >= 0 MiB (got {cache_ram_mb!r})")
        if not (isinstance(cache_disk_mb, (int, float)) and 0 <= cache_disk_mb < float("inf")):
            raise KvrunError(f"--cache-disk-mb must be a finite number >= 0 MiB (got {cache_disk_mb!r})")
        assert tier is None or cache_dir is None, "one second-level tier: a directory or a store"
        disk = tier
        if cache_dir is not None:
            from .prefix_disk import DiskTier
            from .session import model_record
            disk = DiskTier(cache_dir, int(cache_disk_mb * MiB), model_record(model))
        self.prefix = PrefixCache(int(cache_ram_mb * MiB), disk) if cache_ram_mb or disk else None
        self.batch = Batch(model.transformer)
        self.pending: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.kv_used = 0                            # bytes of the running sequences' caches
        self._ids = itertools.count(1)
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False                       # no new requests
        self._stop = False                          # the loop exits
        # called in the loop's thread with each request whose sequence left the batch
        self.on_done: Callable[[Request], None] | None = None

    # -- requests --------------------------------------------------------------------------
    def parse_kv(self, kv: "str | KVConfig") -> KVConfig:
        """A --kv spec checked against the model (KvrunError when it does not apply)."""
        kv = kv if isinstance(kv, KVConfig) else parse_kv(kv)
        kv.check_profile(self.model.cfg)
        kv.check_model(self.model.cfg.head_dim, self.model.cfg.num_layers)
        return kv

    def plan(self, n_prompt: int, max_tokens: int | None, kv: KVConfig) -> tuple[int, int, int]:
        """(max_tokens, cache tokens, cache bytes) of a request; KvrunError if it can never run."""
        if n_prompt < 1:
            raise KvrunError("empty prompt")
        if n_prompt >= self.ctx:
            raise KvrunError(f"prompt too long: {n_prompt} tokens, the context per sequence is "
                             f"{self.ctx} (prompt + at least one generated token)")
        if max_tokens is None:
            max_tokens = self.ctx - n_prompt
        if max_tokens < 0:
            raise KvrunError(f"max_tokens must be >= 0 (got {max_tokens})")
        n_ctx = self.ctx if kv.context.on_full == "shift" else min(self.ctx, n_prompt + max_tokens)
        nbytes = sum(kv_bytes_at(self.model.cfg, kv, n_ctx).values())
        if self.budget is not None and nbytes > self.budget:
            raise KvrunError(f"request needs {nbytes / MiB:.1f} MiB of KV cache ({n_ctx} tokens, "
                             f"{kv.label()}), more than the whole budget "
                             f"{self.budget / MiB:.1f} MiB")
        return max_tokens, n_ctx, nbytes

    def submit(self, prompt: list[int], max_tokens: int | None = None,
               params: SamplingParams | None = None, stop=None,
               kv: "str | KVConfig | None" = None, logprobs: int | None = None,
               prompt_logprobs: int | None = None, grammar: Grammar | None = None) -> Request:
        """Queue a generation of up to max_tokens tokens (None: until the context is full)
        after the token ids `prompt`; `logprobs` = k: each token's event carries its
        log-probability and the k best alternatives, `prompt_logprobs` = k: the request's
        `prompt_logprobs` holds the prompt's (runtime/engine/batch.py); `grammar`: the
        output is constrained to it (runtime/engine/grammar.py). Raises
        KvrunError for a request that cannot run, and QueueFull when the queue is full.
        Any thread may call it."""
        kv = self.kv if kv is None else self.parse_kv(kv)
        max_tokens, n_ctx, nbytes = self.plan(len(prompt), max_tokens, kv)
        for k in (logprobs, prompt_logprobs):
            if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
                raise KvrunError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}] (got {k})")
        req = Request(next(self._ids), list(prompt), max_tokens, params or SamplingParams(),
                      check_stops(stop), kv, n_ctx, nbytes, logprobs, prompt_logprobs, grammar)
        with self._lock:
            if self._closing:
                raise Closed(SHUTTING_DOWN)
            free = max(0, self.parallel - len(self.running))
            if len(self.pending) - free >= self.max_queue:
                raise QueueFull(f"too many requests waiting ({len(self.pending)}, "
                                f"{len(self.running)} running): retry later")
            self.pending.append(req)
            self._lock.notify_all()
        return req

    # -- the loop ----------------------------------------------------------------------------
    def busy(self) -> bool:
        return bool(self.pending or self.running)

    def _admit(self) -> None:
        """Start the oldest waiting requests that fit. A request's slot and bytes are taken
        under the lock, its sequence is built outside it: a prefix-cache file is read there,
        and /health and /metrics, which take the lock, must not wait for a disk."""
        while True:
            with self._lock:
                for r in [r for r in self.pending if r._cancelled]:
                    self.pending.remove(r)
                    r._fail("error", r._cancel_error) if r._cancel_error else r._fail("cancelled")
                if not self.pending or len(self.running) >= self.parallel:
                    return
                r = self.pending[0]
                if self.budget is not None and self.kv_used + r.kv_bytes > self.budget:
                    return                              # oldest first: wait for memory
                self.pending.popleft()
                self.running.append(r)
                self.kv_used += r.kv_bytes
            try:
                cache = make_cache(self.model.cfg, r.n_ctx, r.kv, backend=self.model.transformer.kernels)
                resume, checkpoint = self._prefix_hooks(r)
                r.seq = Sequence(self.model.transformer, self.model.tokenizer, cache, r.prompt,
                                 r.max_tokens, r.params, self.model.stop_ids, r.stop,
                                 self.model.engine.prefill_chunk, on_event=r._push,
                                 logprobs=r.logprobs, prompt_logprobs=r.prompt_k,
                                 grammar=r.grammar, resume=resume, checkpoint=checkpoint)
            except Exception as e:                      # noqa: BLE001 - this request only
                with self._lock:
                    self.running.remove(r)
                    self.kv_used -= r.kv_bytes
                r._fail("error", failure(e))
                continue
            if r._cancelled:
                r.seq.cancel(r._cancel_error)
            self.batch.add(r.seq)

    def _prefix_hooks(self, r: Request):
        """The prefix cache's hooks for a new sequence (Sequence's `resume`, `checkpoint`)."""
        if self.prefix is None:
            return None, None
        kv, prefix, prompt = r.kv, self.prefix, r.prompt
        return (lambda eng: prefix.resume(kv, eng, prompt),
                lambda eng: prefix.add(kv, eng))

    def step(self) -> bool:
        """Admit what fits, run one batch step; returns whether work remains."""
        self._admit()
        if self.running:
            try:
                self.batch.step()
            except KvrunError as e:                     # a step the batch could not run
                self._fail_running(str(e))
            with self._lock:
                done = [r for r in self.running if r.seq.finish_reason is not None]
                for r in done:
                    self.running.remove(r)
                    self.kv_used -= r.kv_bytes
            if self.on_done is not None:
                for r in done:
                    self.on_done(r)
        return self.busy()

    def _fail_running(self, why: str) -> None:
        for r in self.running:
            r.seq.finish("error", why)
        self.batch.seqs = []

    def run(self) -> None:
        """Step in the calling thread until every submitted request is done."""
        while self.step():
            pass

    @property
    def started(self) -> bool:
        """Whether `start` has run (the loop's thread exists)."""
        return self._thread is not None

    def start(self) -> "Scheduler":
        """Run the loop in a background thread; returns self."""
        assert self._thread is None, "already started"
        self._thread = threading.Thread(target=self._loop, name="kvrun-scheduler", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._stop or self.busy())
                if self._stop and not self.busy():
                    return
            try:
                self.step()
            except Exception as e:                      # noqa: BLE001 - keep serving
                # the batch isolates each request's failures; this is a bug in the loop itself
                print(f"error: batch step failed: {type(e).__name__}: {e}", file=sys.stderr)
                self._fail_running(f"internal error: {type(e).__name__}: {e}")
                with self._lock:
                    self.running, self.kv_used = [], 0

    def close(self) -> None:
        """Take no new requests (submit raises Closed); those submitted go on."""
        with self._lock:
            self._closing = True

    def cancel_all(self, error: str | None = None) -> None:
        """Cancel every submitted request: finish reason "cancelled", or "error" saying
        `error` (any thread may call it)."""
        with self._lock:
            for r in list(self.pending) + self.running:
                r.cancel(error)
            self._lock.notify_all()

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; with `drain` finish those already submitted, else cancel
        them (finish reason "error": SHUTTING_DOWN); then stop the loop's thread (waits up
        to `timeout` s)."""
        self.close()
        if not drain:
            self.cancel_all(SHUTTING_DOWN)
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def stats(self) -> dict:
        """Counts and bytes for /health and logs."""
        with self._lock:
            return {"running": len(self.running), "waiting": len(self.pending),
                    "parallel": self.parallel, "kv_used_bytes": self.kv_used,
                    "kv_budget_bytes": self.budget, "ctx_per_sequence": self.ctx,
                    "kv": self.kv.label(),
                    "prefix_cache": None if self.prefix is None else self.prefix.stats()}
