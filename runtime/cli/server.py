"""`kvrun serve`: an OpenAI-compatible HTTP API over the serving loop (runtime/engine/scheduler.py),
on starlette + uvicorn + prometheus_client (the optional extra `kvrun[server]`).

Endpoints: POST /v1/chat/completions, POST /v1/completions (server-sent events with
`"stream": true`, one JSON body otherwise), GET /v1/models, GET /health, POST /tokenize and
/detokenize (llama-server's shape: runtime/cli/server_tokens.py), GET /metrics (Prometheus:
runtime/cli/server_metrics.py).

Request fields: `model` (the served name, or omitted), `messages` / `prompt` (a string or
token ids), `max_tokens` (chat also `max_completion_tokens`; default: until the sequence's
context is full), `temperature` (default 1), `top_p` (default 1), `seed`, `stop` (a string
or a list), `stream`, `stream_options.include_usage`, `logprobs` (chat: a boolean with
`top_logprobs` 0..20; completions: 0..5, the legacy format; runtime/cli/server_format.py:
the model's own log-softmax, before penalty, truncation and temperature, as vLLM reports
it; a stop token has none), completions' `echo` (the prompt before the text; with
`logprobs`, the prompt's tokens scored too, the first one null: `max_tokens: 0` scores a
text, as lm-eval-harness asks), `n` (1..min(16, --parallel) choices, each its own sequence;
choice i samples with `seed` + i; usage counts every choice's tokens; stream chunks carry
their choice's index); llama.cpp-style extensions `top_k`,
`min_p`, `repeat_penalty`, `repeat_last_n` (penalty off unless given), `response_format`
(`json_object` / `json_schema`: the reply is sampled under the schema's token mask,
runtime/engine/grammar.py; docs/serve.md). Extension `kv`: the
KV method of this request's cache, a method spec ("fp16", "kivi-4", "int8@64+rot", "auto")
or a shipped profile by name ("profile:smollm2-135m-0.25"); profile files are the
operator's `--kv`, never a request's. Every sequence has its own cache, so methods mix
freely in one batch; the request's cache bytes count against `--kv-budget-mb` like any
other (a cheaper method is admitted sooner). Default: `--kv`. Fields kvrun does not
implement (`tools`, `best_of` ...) are refused by name unless neutral
(runtime/cli/server_fields.py). Chat message text is tokenized as text: it cannot forge the
template's control tokens; a completion's `prompt` string is the model's raw input, where
special-token text is read as those tokens (as llama-server reads it).

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a
malformed body or a bad field (an over-long prompt included), 401 without the `--api-key`,
404 for an unknown model, 413 for a body over `--max-body-mb`, 415 for a body that is not
`application/json`, 429 when the waiting queue is full, 500 when generation failed, 503 while shutting down. A bad
value fails only its own request (runtime/engine/batch.py). A client that disconnects mid-stream
cancels its request: its sequence leaves the batch at the next step and its cache is
freed. HTTP-level limits (API key, content type, body size and deadline, header deadline,
CORS) are runtime/cli/server_http.py. On Ctrl-C or SIGTERM the server stops accepting
requests and lets the running ones finish for `--shutdown-timeout` seconds; those still
running then end with "the server is shutting down" (an SSE error event, or 503) at once,
without waiting for the batch's current step; the process exits 0 within the timeout
(runtime/cli/server_http.py). A second Ctrl-C ends them the same way at once. Every request
is logged on stderr in one line when its reply is done (runtime/cli/server_log.py), and the
shutdown says when it starts and ends.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, replace

from ..errors import KvrunError
from ..kv.profile import shipped_profiles
from ..engine.generate import StreamEvent
from ..engine.scheduler import SHUTTING_DOWN, Closed, QueueFull, Request, Scheduler
from . import server_format as fmt, server_tokens
from .server_fields import (ApiError, check_fields, field, grammar_from, logprobs_from,
                            max_tokens_from, messages_from, n_from, parse_body, prompt_from,
                            request_kv, sampling_from, stop_from, stream_from)

try:
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    from .server_http import GRACE, Drain, Guard, read_body
    from .server_log import RequestLog, log_tokens
    from .server_metrics import Metrics
except ImportError:                                 # the optional extra
    Starlette = None

DEFAULT_MAX_BODY = 4 << 20          # bytes: a full 4k-token chat is ~20 KB of JSON


class App:
    """The HTTP layer: parses requests, submits them to the scheduler, formats the replies.
    Parsing, tokenization and submission run in a worker thread (`_prepare`): a large prompt
    does not stall the event loop, /health or the other clients' streams."""

    def __init__(self, model, scheduler: Scheduler, name: str, max_body: int = DEFAULT_MAX_BODY):
        self.model, self.sched, self.name, self.max_body = model, scheduler, name, max_body
        self.created = int(time.time())
        self.shipped = {p.stem: p for p in shipped_profiles()}
        # more characters than this cannot fit in a sequence's context, whatever they are
        # (4x: a normalizer may fold characters): refused without tokenizing them
        self.max_chars = model.tokenizer.max_text_chars(scheduler.ctx)
        self.drain = Drain()                # the shutdown, as the HTTP layer sees it

    # -- parsing (a worker thread) ---------------------------------------------------------
    def _prepare(self, raw: bytes, chat: bool) -> "Job":
        """The submitted requests of a body (one per choice); ApiError if it is bad."""
        body = parse_body(raw)
        name = field(body, "model", str)
        if name is not None and name != self.name:
            raise ApiError(404, f"the model '{name:.80}' does not exist (this server has "
                                f"'{self.name}')", param="model", code="model_not_found")
        check_fields(body, chat)
        stream, usage = stream_from(body)
        params = sampling_from(body)
        n = n_from(body, self.sched.parallel, params.seed)
        max_tokens = max_tokens_from(body, chat)
        stop = stop_from(body)
        logprobs = logprobs_from(body, chat)
        kv = field(body, "kv", str)
        kv = None if kv is None else request_kv(kv, self.shipped)
        echo = False if chat else field(body, "echo", bool, False)
        grammar = grammar_from(body, self.model.grammars)
        ids = self._chat_ids(body) if chat else self._prompt_ids(body)     # the heavy part last
        reqs = []
        try:
            for i in range(n):          # choice i samples with seed + i: n requests reproduce it
                p = params if params.seed is None else replace(params, seed=params.seed + i)
                reqs.append(self.sched.submit(ids, max_tokens, p, stop, kv, logprobs,
                                              logprobs if echo else None, grammar))
        except (KvrunError, ApiError) as e:
            for r in reqs:
                r.cancel()
            if isinstance(e, QueueFull):
                raise ApiError(429, str(e), "rate_limit_error", code="queue_full") from None
            if isinstance(e, Closed):
                raise ApiError(503, str(e), "server_error", code="shutting_down") from None
            raise ApiError(400, str(e)) from None
        text = None
        if echo:                        # the prompt as given, or its ids' text
            p = body["prompt"][0] if isinstance(body["prompt"], list) and \
                isinstance(body["prompt"][0], (str, list)) else body["prompt"]
            text = p if isinstance(p, str) else self.model.tokenizer.decode(ids)
        return Job(chat, stream, usage, logprobs is not None, reqs, echo=text)

    def _prompt_ids(self, body: dict) -> list[int]:
        p = prompt_from(body, self.model.cfg.vocab_size)
        if isinstance(p, str):
            self._fits(len(p), "prompt")
            return self.model.tokenize(p)
        return p

    def _chat_ids(self, body: dict) -> list[int]:
        msgs = messages_from(body)
        self._fits(sum(len(m["content"]) for m in msgs), "messages")
        try:    # message text is tokenized as text: it cannot forge the template's markers
            return self.model.tokenizer.encode_parts(self.model.template.render_parts(msgs))
        except KvrunError as e:
            raise ApiError(400, str(e), param="messages") from None

    def _fits(self, n_chars: int, param: str) -> None:
        if n_chars > self.max_chars:
            raise ApiError(400, f"prompt too long: {n_chars} characters cannot fit in the "
                                f"context per sequence ({self.sched.ctx} tokens)", param=param)

    # -- events ------------------------------------------------------------------------------
    async def events(self, req: Request):
        """The request's StreamEvents, awaited without blocking the event loop; cancelling
        or closing this iterator (a client gone) cancels the request. Once the shutdown's
        drain has expired, a request still waiting ends at once with finish reason "error"
        (the server is shutting down), whatever the batch is computing."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        req.notify = lambda: loop.call_soon_threadsafe(ready.set)
        unwatch = self.drain.watch(ready.set)
        finished = False
        try:
            while True:
                ev = req.pop_event(on_empty=ready.clear)
                if ev is None and self.drain.expired:
                    req.cancel(SHUTTING_DOWN)
                    req.error = SHUTTING_DOWN
                    ev = StreamEvent("", None, req.timings, "error")
                if ev is None:
                    await ready.wait()
                    continue
                finished = ev.finish_reason is not None
                yield ev
                if finished:
                    return
        finally:
            req.notify = None
            unwatch()
            if not finished:
                req.cancel()

    # -- endpoints ---------------------------------------------------------------------------
    async def completions(self, http):
        return await self._complete(http, chat=False)

    async def chat_completions(self, http):
        return await self._complete(http, chat=True)

    async def _complete(self, http, chat: bool):
        try:
            raw = await read_body(http, self.max_body, drain=self.drain)
            job = await asyncio.to_thread(self._prepare, raw, chat)
        except ApiError as e:
            return e.response()
        job.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        log_tokens(http.scope, job.reqs)
        if job.stream:
            return StreamingResponse(self._sse(job), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        watch = asyncio.create_task(_cancel_on_disconnect(http, job.reqs))
        try:
            outs = await asyncio.gather(*(self._collect(r) for r in job.reqs))
        finally:
            watch.cancel()
        for r, (_, reason, _) in zip(job.reqs, outs):
            if reason == "cancelled":               # the client is gone: nobody reads this
                return ApiError(499, "client disconnected").response()
            if reason == "error":
                return _failure(r).response()
        if job.echo is not None:
            outs = [(job.echo + text, reason, (r.prompt_logprobs or []) + lps)
                    for r, (text, reason, lps) in zip(job.reqs, outs)]
        choices = [fmt.choice(chat, i, text, reason, self._logprobs(job, lps))
                   for i, (text, reason, lps) in enumerate(outs)]
        return JSONResponse({"id": job.id, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": self.name,
                             "choices": choices, "usage": _usage(job.reqs)})

    async def _collect(self, req: Request) -> tuple[str, str | None, list]:
        """(text, finish reason, TokenLogprobs) of a request, awaited."""
        text, reason, lps = "", None, []
        async with aclosing(self.events(req)) as evs:
            async for ev in evs:
                text += ev.text
                reason = ev.finish_reason
                if ev.logprob is not None:
                    lps.append(ev.logprob)
        return text, reason, lps

    def _logprobs(self, job: "Job", entries: list, legacy=None) -> dict | None:
        """The logprobs object of a choice's tokens (None when not asked for)."""
        if not job.logprobs:
            return None
        if job.chat:
            return fmt.chat_logprobs(self.model.tokenizer, entries)
        return (legacy or fmt.LegacyLogprobs(self.model.tokenizer))(entries)

    async def _merged(self, reqs: list[Request]):
        """(choice index, StreamEvent) of all the requests as they come; closing it cancels
        the requests still running."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, r: Request):
            async with aclosing(self.events(r)) as evs:
                async for ev in evs:
                    await queue.put((i, ev))
        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
        try:
            left = len(reqs)
            while left:
                i, ev = await queue.get()
                left -= ev.finish_reason is not None
                yield i, ev
        finally:
            for t in tasks:
                t.cancel()

    async def _sse(self, job: "Job"):
        chat, obj = job.chat, "chat.completion.chunk" if job.chat else "text_completion"
        created = int(time.time())
        pending = [[] for _ in job.reqs]             # TokenLogprobs not yet sent, per choice
        legacy = [fmt.LegacyLogprobs(self.model.tokenizer) for _ in job.reqs]

        def chunk(i: int, piece: str | None, reason: str | None, first: bool = False) -> str:
            lp = None if first else self._logprobs(job, pending[i], legacy[i])
            pending[i] = []
            c = fmt.chunk_choice(chat, i, piece, reason, lp, first)
            d = {"id": job.id, "object": obj, "created": created, "model": self.name, "choices": [c]}
            return f"data: {json.dumps(d)}\n\n"
        if chat:
            for i in range(len(job.reqs)):
                yield chunk(i, None, None, first=True)
        echoed = [job.echo is None] * len(job.reqs)
        async with aclosing(self._merged(job.reqs)) as events:
            async for i, ev in events:
                if not echoed[i] and ev.finish_reason != "error":     # the prefill is done
                    echoed[i] = True
                    pending[i] = list(job.reqs[i].prompt_logprobs or [])
                    yield chunk(i, job.echo, None)
                if ev.logprob is not None:
                    pending[i].append(ev.logprob)
                if ev.finish_reason == "error":
                    yield f"data: {json.dumps(_failure(job.reqs[i]).body())}\n\n"
                    return
                if ev.finish_reason is not None:
                    if ev.text:
                        yield chunk(i, ev.text, None)
                    yield chunk(i, None, ev.finish_reason)
                elif ev.text:
                    yield chunk(i, ev.text, None)
        if job.usage:
            d = {"id": job.id, "object": obj, "created": created, "model": self.name, "choices": [],
                 "usage": _usage(job.reqs)}
            yield f"data: {json.dumps(d)}\n\n"
        yield "data: [DONE]\n\n"

    async def tokenize(self, http):
        return await self._tokens(http, server_tokens.tokenize)

    async def detokenize(self, http):
        return await self._tokens(http, server_tokens.detokenize)

    async def _tokens(self, http, fn):
        try:
            raw = await read_body(http, self.max_body, drain=self.drain)
            return JSONResponse(await asyncio.to_thread(fn, self.model, raw))
        except ApiError as e:
            return e.response()

    async def metrics(self, http):
        body, ctype = self.prom.exposition()
        return Response(body, media_type=ctype)

    async def models(self, http):
        return JSONResponse({"object": "list", "data": [
            {"id": self.name, "object": "model", "created": self.created, "owned_by": "kvrun"}]})

    async def health(self, http):
        return JSONResponse({"status": "ok", **self.sched.stats()})


@dataclass
class Job:
    """One completion request: its choices' scheduler requests (choice i is reqs[i])."""
    chat: bool
    stream: bool
    usage: bool                 # stream_options.include_usage
    logprobs: bool
    reqs: list[Request]
    echo: str | None = None     # completions' `echo`: the prompt's text, put before each choice's
    id: str = ""


async def _cancel_on_disconnect(http, reqs: list[Request], every: float = 0.25) -> None:
    """A non-streaming request's client may leave while it waits: cancel it then."""
    while not await http.is_disconnected():
        await asyncio.sleep(every)
    for r in reqs:
        r.cancel()


def _failure(req: Request) -> ApiError:
    """The error reply of a request that ended with finish reason "error"."""
    if req.error == SHUTTING_DOWN:
        return ApiError(503, SHUTTING_DOWN, "server_error", code="shutting_down")
    return ApiError(500, f"generation failed: {req.error}", "server_error")


def _usage(reqs: list[Request]) -> dict:
    """One prompt, every choice's completion tokens."""
    return fmt.usage(len(reqs[0].prompt), sum(r.n_tokens for r in reqs))


def create_app(model, scheduler: Scheduler, name: str, *, api_key: str | None = None,
               cors_origins: tuple[str, ...] = (), max_body: int = DEFAULT_MAX_BODY):
    """The ASGI app. The scheduler's loop starts with the app and drains when it stops.
    api_key: required as `Authorization: Bearer KEY` on every route but /health (None: no
    key); cors_origins: origins a browser page may call from (none: no CORS headers at all);
    max_body: most bytes of a request body."""
    if Starlette is None:
        raise KvrunError("kvrun serve needs starlette, uvicorn and prometheus_client: "
                         "pip install 'kvrun[server]'")
    from contextlib import asynccontextmanager
    app = App(model, scheduler, name, max_body)

    @asynccontextmanager
    async def lifespan(_):
        if not scheduler.started:
            scheduler.start()
        yield
        # uvicorn has drained the connections: what still runs has no reader; a batch step
        # still computing (a prefill chunk) is not waited for past GRACE (the thread is a
        # daemon: the process ends without it)
        await asyncio.get_running_loop().run_in_executor(None, scheduler.shutdown, False, GRACE)

    async def not_found(http, exc):
        return ApiError(404, f"no route {http.method} {http.url.path:.200}", code="not_found").response()

    async def bad_method(http, exc):
        return ApiError(405, f"method {http.method} not allowed on {http.url.path:.200}").response()

    async def internal(http, exc):
        print(f"error: {http.method} {http.url.path:.200}: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return ApiError(500, f"internal error: {type(exc).__name__}", "server_error").response()

    routes = [Route("/v1/chat/completions", app.chat_completions, methods=["POST"]),
              Route("/v1/completions", app.completions, methods=["POST"]),
              Route("/v1/models", app.models, methods=["GET"]),
              Route("/tokenize", app.tokenize, methods=["POST"]),
              Route("/detokenize", app.detokenize, methods=["POST"]),
              Route("/health", app.health, methods=["GET"]),
              Route("/metrics", app.metrics, methods=["GET"])]
    app.prom = Metrics(scheduler, {r.path for r in routes})
    request_log = RequestLog()
    scheduler.on_done = app.prom.done
    middleware = [Middleware(CORSMiddleware, allow_origins=list(cors_origins),
                             allow_methods=["GET", "POST"],
                             allow_headers=["Authorization", "Content-Type"])] if cors_origins else []
    middleware.append(Middleware(Guard, api_key=api_key))
    middleware.insert(0, Middleware(app.prom.middleware))       # outermost: counts 401s too
    middleware.insert(0, Middleware(request_log.middleware))
    web = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={404: not_found, 405: bad_method, Exception: internal})
    web.state.drain = app.drain         # for server_http.Server: the shutdown's side here
    return web
