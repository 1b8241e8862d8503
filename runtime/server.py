"""`kvrun serve`: an OpenAI-compatible HTTP API over the serving loop (runtime/scheduler.py),
on starlette + uvicorn (the optional extra `kvrun[server]`).

Endpoints: POST /v1/chat/completions, POST /v1/completions (server-sent events with
`"stream": true`, one JSON body otherwise), GET /v1/models, GET /health.

Request fields: `model` (the served name, or omitted), `messages` / `prompt` (a string or
token ids), `max_tokens` (chat also `max_completion_tokens`; default: until the sequence's
context is full), `temperature` (default 1), `top_p` (default 1), `seed`, `stop` (a string
or a list), `stream`, `stream_options.include_usage`; llama.cpp-style extensions `top_k`,
`min_p`, `repeat_penalty` (off unless given). Extension `kv`: the KV method of this
request's cache, any `--kv` spec ("fp16", "kivi-4", "auto" ...). Every sequence has its
own cache, so methods mix freely in one batch; the request's cache bytes count against
`--kv-budget-mb` like any other (a cheaper method is admitted sooner). Default: `--kv`.

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a
malformed body or a bad field (an over-long prompt included), 404 for an unknown model,
429 when the waiting queue is full, 500 when generation failed. A client that disconnects
mid-stream cancels its request: its sequence leaves the batch at the next step and its
cache is freed. On Ctrl-C uvicorn stops accepting connections and lets the open ones
finish; then the loop drains and the process exits.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from .errors import KvrunError
from .sampling import SamplingParams
from .scheduler import QueueFull, Request, Scheduler

try:
    from starlette.applications import Starlette
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route
except ImportError:                                 # the optional extra
    Starlette = None


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> "JSONResponse":
        return JSONResponse({"error": {"message": self.message, "type": self.type,
                                       "param": self.param, "code": self.code}}, self.status)


def _field(body: dict, name: str, kinds, default=None):
    """body[name] checked against `kinds` (bool is not a number here)."""
    x = body.get(name, default)
    if x is None:
        return default
    if isinstance(x, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise ApiError(400, f"'{name}' must be {_kind_names(kinds)}, got {json.dumps(x)}", param=name)
    if not isinstance(x, kinds):
        raise ApiError(400, f"'{name}' must be {_kind_names(kinds)}, got {json.dumps(x)[:80]}", param=name)
    return x


def _kind_names(kinds) -> str:
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
             list: "a list", dict: "an object"}
    return " or ".join(dict.fromkeys(names[k] for k in kinds))


def sampling_from(body: dict) -> SamplingParams:
    """OpenAI's sampling fields (and llama.cpp's extensions) as SamplingParams: OpenAI's
    defaults (temperature 1, top_p 1, no top-k / min-p)."""
    try:
        return SamplingParams(temp=float(_field(body, "temperature", (int, float), 1.0)),
                              top_p=float(_field(body, "top_p", (int, float), 1.0)),
                              top_k=_field(body, "top_k", int, 0),
                              min_p=float(_field(body, "min_p", (int, float), 0.0)),
                              repeat_penalty=float(_field(body, "repeat_penalty", (int, float), 1.0)),
                              seed=_field(body, "seed", int))
    except KvrunError as e:
        raise ApiError(400, str(e).replace("--", "")) from None


def _message_text(m, i: int) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ApiError(400, f"messages[{i}] must be an object with a 'role'", param="messages")
    content = m.get("content")
    if isinstance(content, list):                   # content parts: the text ones
        try:
            content = "".join(p["text"] for p in content if p.get("type") == "text")
        except (TypeError, KeyError, AttributeError):
            raise ApiError(400, f"messages[{i}].content parts must be objects with 'type' and "
                                f"'text'", param="messages") from None
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be a string", param="messages")
    return {"role": m["role"], "content": content}


class App:
    """The HTTP layer: parses requests, submits them to the scheduler, formats the replies."""

    def __init__(self, model, scheduler: Scheduler, name: str):
        self.model, self.sched, self.name = model, scheduler, name
        self.created = int(time.time())

    # -- parsing ----------------------------------------------------------------------------
    async def _body(self, http: "HttpRequest") -> dict:
        raw = await http.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"malformed JSON body: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        name = body.get("model")
        if name is not None and name != self.name:
            raise ApiError(404, f"the model '{name}' does not exist (this server has "
                                f"'{self.name}')", param="model", code="model_not_found")
        if body.get("n", 1) != 1:
            raise ApiError(400, "only n = 1 is supported", param="n")
        return body

    def _submit(self, body: dict, ids: list[int], max_key: tuple[str, ...]) -> Request:
        mt = None
        for k in max_key:
            mt = _field(body, k, int, mt)
        stop = body.get("stop")
        if stop is not None and not (isinstance(stop, str) or
                                     (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
            raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
        kv = _field(body, "kv", str)
        params = sampling_from(body)
        try:
            return self.sched.submit(ids, mt, params, stop or None, kv)
        except QueueFull as e:
            raise ApiError(429, str(e), "rate_limit_error") from None
        except KvrunError as e:
            raise ApiError(400, str(e)) from None

    def _prompt_ids(self, body: dict) -> list[int]:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]                                        # a batch of one
        if isinstance(p, str):
            return self.model.tokenize(p)
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            if max(p) >= self.model.cfg.vocab_size or min(p) < 0:
                raise ApiError(400, f"token ids must be in [0, {self.model.cfg.vocab_size})", param="prompt")
            return p
        raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids "
                            "(one prompt per request)", param="prompt")

    def _chat_ids(self, body: dict) -> list[int]:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "'messages' must be a non-empty list", param="messages")
        msgs = [_message_text(m, i) for i, m in enumerate(msgs)]
        try:
            return self.model.tokenize(self.model.template.render(msgs), bos=False)
        except KvrunError as e:
            raise ApiError(400, str(e), param="messages") from None

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
            body = await self._body(http)
            ids = self._chat_ids(body) if chat else self._prompt_ids(body)
            req = self._submit(body, ids, ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",))
        except ApiError as e:
            return e.response()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if _field(body, "stream", bool, False):
            opts = body.get("stream_options") or {}
            usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
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
                err = {"error": {"message": f"generation failed: {req.error}", "type": "server_error",
                                 "param": None, "code": None}}
                yield f"data: {json.dumps(err)}\n\n"
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


def create_app(model, scheduler: Scheduler, name: str):
    """The ASGI app. The scheduler's loop starts with the app and drains when it stops."""
    if Starlette is None:
        raise KvrunError("kvrun serve needs starlette and uvicorn: pip install 'kvrun[server]'")
    from contextlib import asynccontextmanager
    app = App(model, scheduler, name)

    @asynccontextmanager
    async def lifespan(_):
        if scheduler._thread is None:
            scheduler.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, scheduler.shutdown)

    async def not_found(http, exc):
        return ApiError(404, f"no route {http.method} {http.url.path}", code="not_found").response()

    async def bad_method(http, exc):
        return ApiError(405, f"method {http.method} not allowed on {http.url.path}").response()

    routes = [Route("/v1/chat/completions", app.chat_completions, methods=["POST"]),
              Route("/v1/completions", app.completions, methods=["POST"]),
              Route("/v1/models", app.models, methods=["GET"]),
              Route("/health", app.health, methods=["GET"])]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={404: not_found, 405: bad_method})
