"""`kvrun serve`: an OpenAI-compatible HTTP API over the serving loop (runtime/engine/scheduler.py),
on starlette + uvicorn (the optional extra `kvrun[server]`).

Endpoints: POST /v1/chat/completions, POST /v1/completions (server-sent events with
`"stream": true`, one JSON body otherwise), GET /v1/models, GET /health.

Request fields: `model` (the served name, or omitted), `messages` / `prompt` (a string or
token ids), `max_tokens` (chat also `max_completion_tokens`; default: until the sequence's
context is full), `temperature` (default 1), `top_p` (default 1), `seed`, `stop` (a string
or a list), `stream`, `stream_options.include_usage`; llama.cpp-style extensions `top_k`,
`min_p`, `repeat_penalty`, `repeat_last_n` (penalty off unless given). Extension `kv`: the
KV method of this request's cache, a method spec ("fp16", "kivi-4", "int8@64+rot", "auto")
or a shipped profile by name ("profile:smollm2-135m-0.25"); profile files are the
operator's `--kv`, never a request's. Every sequence has its own cache, so methods mix
freely in one batch; the request's cache bytes count against `--kv-budget-mb` like any
other (a cheaper method is admitted sooner). Default: `--kv`. Fields kvrun does not
implement (`logprobs`, `tools`, `n` > 1 ...) are refused by name unless neutral
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
running then end with "the server is shutting down" (an SSE error event, or 503); the
process exits 0. A second Ctrl-C quits at once.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid

from ..errors import KvrunError
from ..kv.profile import shipped_profiles
from ..engine.scheduler import SHUTTING_DOWN, Closed, QueueFull, Request, Scheduler
from .server_fields import (ApiError, check_fields, field, max_tokens_from, messages_from,
                            parse_body, prompt_from, request_kv, sampling_from, stop_from,
                            stream_from)

try:
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from .server_http import Guard, read_body
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
        self.max_chars = scheduler.ctx * model.tokenizer.max_token_chars() * 4

    # -- parsing (a worker thread) ---------------------------------------------------------
    def _prepare(self, raw: bytes, chat: bool) -> tuple[bool, bool, Request]:
        """(stream, include_usage, the submitted request) of a body; ApiError if it is bad."""
        body = parse_body(raw)
        name = field(body, "model", str)
        if name is not None and name != self.name:
            raise ApiError(404, f"the model '{name:.80}' does not exist (this server has "
                                f"'{self.name}')", param="model", code="model_not_found")
        check_fields(body, chat)
        stream, usage = stream_from(body)
        params = sampling_from(body)
        max_tokens = max_tokens_from(body, chat)
        stop = stop_from(body)
        kv = field(body, "kv", str)
        kv = None if kv is None else request_kv(kv, self.shipped)
        ids = self._chat_ids(body) if chat else self._prompt_ids(body)     # the heavy part last
        try:
            return stream, usage, self.sched.submit(ids, max_tokens, params, stop, kv)
        except QueueFull as e:
            raise ApiError(429, str(e), "rate_limit_error", code="queue_full") from None
        except Closed as e:
            raise ApiError(503, str(e), "server_error", code="shutting_down") from None
        except KvrunError as e:
            raise ApiError(400, str(e)) from None

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
    @staticmethod
    async def events(req: Request):
        """The request's StreamEvents, awaited without blocking the event loop; cancelling
        or closing this iterator (a client gone) cancels the request."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        req.notify = lambda: loop.call_soon_threadsafe(ready.set)
        finished = False
        try:
            while True:
                with req._cond:
                    ev = req._events.popleft() if req._events else None
                    if ev is None:
                        ready.clear()
                if ev is None:
                    await ready.wait()
                    continue
                finished = ev.finish_reason is not None
                yield ev
                if finished:
                    return
        finally:
            req.notify = None
            if not finished:
                req.cancel()

    # -- endpoints ---------------------------------------------------------------------------
    async def completions(self, http):
        return await self._complete(http, chat=False)

    async def chat_completions(self, http):
        return await self._complete(http, chat=True)

    async def _complete(self, http, chat: bool):
        try:
            raw = await read_body(http, self.max_body)
            stream, usage, req = await asyncio.to_thread(self._prepare, raw, chat)
        except ApiError as e:
            return e.response()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if stream:
            return StreamingResponse(self._sse(req, rid, chat, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        text, reason = "", None
        watch = asyncio.create_task(_cancel_on_disconnect(http, req))
        try:
            async for ev in self.events(req):
                text += ev.text
                reason = ev.finish_reason
        finally:
            watch.cancel()
        if reason == "cancelled":                   # the client is gone: nobody reads this
            return ApiError(499, "client disconnected").response()
        if reason == "error" and req.error == SHUTTING_DOWN:
            return ApiError(503, SHUTTING_DOWN, "server_error", code="shutting_down").response()
        if reason == "error":
            return ApiError(500, f"generation failed: {req.error}", "server_error").response()
        choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                   "logprobs": None, "finish_reason": _reason(reason)} if chat else
                  {"index": 0, "text": text, "logprobs": None, "finish_reason": _reason(reason)})
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": self.name,
                             "choices": [choice], "usage": _usage(req)})

    async def _sse(self, req: Request, rid: str, chat: bool, usage: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        def chunk(piece: str | None, reason: str | None, first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else \
                        ({} if piece is None else {"content": piece})
                c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                c = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": reason}
            d = {"id": rid, "object": obj, "created": created, "model": self.name, "choices": [c]}
            return f"data: {json.dumps(d)}\n\n"
        if chat:
            yield chunk(None, None, first=True)
        async for ev in self.events(req):
            if ev.finish_reason == "error":
                err = ApiError(503, SHUTTING_DOWN, "server_error", code="shutting_down") \
                    if req.error == SHUTTING_DOWN else \
                    ApiError(500, f"generation failed: {req.error}", "server_error")
                yield f"data: {json.dumps(err.body())}\n\n"
                return
            if ev.finish_reason is not None:
                if ev.text:
                    yield chunk(ev.text, None)
                yield chunk(None, _reason(ev.finish_reason))
            elif ev.text:
                yield chunk(ev.text, None)
        if usage:
            d = {"id": rid, "object": obj, "created": created, "model": self.name, "choices": [],
                 "usage": _usage(req)}
            yield f"data: {json.dumps(d)}\n\n"
        yield "data: [DONE]\n\n"

    async def models(self, http):
        return JSONResponse({"object": "list", "data": [
            {"id": self.name, "object": "model", "created": self.created, "owned_by": "kvrun"}]})

    async def health(self, http):
        return JSONResponse({"status": "ok", **self.sched.stats()})


async def _cancel_on_disconnect(http, req: Request, every: float = 0.25) -> None:
    """A non-streaming request's client may leave while it waits: cancel it then."""
    while not await http.is_disconnected():
        await asyncio.sleep(every)
    req.cancel()


def _reason(r: str | None) -> str | None:
    """kvrun's finish reasons in OpenAI's words (a full context is "length")."""
    return {"context": "length", "cancelled": "stop"}.get(r, r)


def _usage(req: Request) -> dict:
    p = len(req.prompt)
    return {"prompt_tokens": p, "completion_tokens": req.n_tokens, "total_tokens": p + req.n_tokens}


def create_app(model, scheduler: Scheduler, name: str, *, api_key: str | None = None,
               cors_origins: tuple[str, ...] = (), max_body: int = DEFAULT_MAX_BODY):
    """The ASGI app. The scheduler's loop starts with the app and drains when it stops.
    api_key: required as `Authorization: Bearer KEY` on every route but /health (None: no
    key); cors_origins: origins a browser page may call from (none: no CORS headers at all);
    max_body: most bytes of a request body."""
    if Starlette is None:
        raise KvrunError("kvrun serve needs starlette and uvicorn: pip install 'kvrun[server]'")
    from contextlib import asynccontextmanager
    app = App(model, scheduler, name, max_body)

    @asynccontextmanager
    async def lifespan(_):
        if scheduler._thread is None:
            scheduler.start()
        yield
        # uvicorn has drained the connections: what still runs has no reader
        await asyncio.get_running_loop().run_in_executor(None, scheduler.shutdown, False)

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
              Route("/health", app.health, methods=["GET"])]
    middleware = [Middleware(CORSMiddleware, allow_origins=list(cors_origins),
                             allow_methods=["GET", "POST"],
                             allow_headers=["Authorization", "Content-Type"])] if cors_origins else []
    middleware.append(Middleware(Guard, api_key=api_key))
    return Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                     exception_handlers={404: not_found, 405: bad_method, Exception: internal})
