"""What `kvrun serve` (runtime/cli/server.py) asks of HTTP before a request reaches the model: an
API key, a JSON content type, a bounded body read within a deadline, and connections that
cannot be held open by sending headers slowly.

- `Guard` (ASGI middleware): `Authorization: Bearer KEY` on every route but /health when the
  operator set `--api-key` (401 otherwise, as llama-server and vLLM; the scheme is
  case-insensitive, RFC 7235: `bearer KEY` is the same); POSTs must say
  `Content-Type: application/json` (415): a web page's cross-origin "simple" POST
  (text/plain, form data) is refused, and a JSON POST from a page needs a CORS preflight,
  which is only answered for the origins of `--cors-origin` (Starlette's CORSMiddleware).
- `read_body`: at most `limit` bytes (413 past it, before reading on when Content-Length
  says so), all of it within `timeout` seconds (408); a client gone mid-body is no error.
- `HeaderDeadline`: uvicorn's h11 protocol with a deadline for each request's headers,
  counted from the connection (or the previous response); uvicorn itself only times out
  idle keep-alive connections, so a client that sends a header byte now and then held its
  connection forever. h11 bounds the header size (16 KiB).
- `Drain` and `Server`: uvicorn's server with a bounded drain on SIGINT / SIGTERM. At the
  signal the server takes no new request and a body still arriving is answered 503 at once
  (it could never be submitted); running requests get `--shutdown-timeout` seconds to
  finish, then every one still waiting is answered at once — 503, or an SSE error event, in
  the API's JSON shape — without waiting for the batch's current step (a prefill chunk may
  take seconds); a second Ctrl-C does the same at once. The process exits 0 within the
  timeout plus GRACE seconds, and says on stderr when it starts and ends its shutdown.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import sys
import threading
import time
from typing import Callable

import h11
import uvicorn
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..engine.scheduler import SHUTTING_DOWN
from .server_fields import ApiError

HEADER_TIMEOUT = 10.0           # seconds for a request line and its headers
BODY_TIMEOUT = 30.0             # seconds for a whole request body
GRACE = 1.0                     # seconds past --shutdown-timeout to write the last replies


class Drain:
    """The HTTP layer's side of a shutdown, in the event loop's thread: `stopping` from the
    signal on (no body is read on), `expired` once the drain's time is up (nothing waits for
    the batch any more). `watch(fn)` calls fn at each of the two (a waiting request wakes)."""

    def __init__(self):
        self.stopping = self.expired = False
        self._watchers: set[Callable[[], None]] = set()

    def watch(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call `fn` at `begin()` and `expire()`; returns the function that stops it."""
        self._watchers.add(fn)
        return lambda: self._watchers.discard(fn)

    def begin(self) -> None:
        self.stopping = True
        self._wake()

    def expire(self) -> None:
        self.stopping = self.expired = True
        self._wake()

    def _wake(self) -> None:
        for fn in list(self._watchers):
            fn()


class Guard:
    """API key and content type checks in front of the app (module docstring)."""

    def __init__(self, app, api_key: str | None = None, open_paths=("/health",)):
        self.app, self.open_paths = app, set(open_paths)
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        err = None
        if self.key is not None and scope["path"] not in self.open_paths and \
                not hmac.compare_digest(_bearer(headers.get(b"authorization", b"")), self.key):
            err = ApiError(401, "invalid or missing API key: send 'Authorization: Bearer KEY'",
                           "authentication_error", code="invalid_api_key")
        elif scope["method"] == "POST":
            ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if ctype != b"application/json":
                err = ApiError(415, "Content-Type must be application/json (curl: -H "
                                    "'Content-Type: application/json')", code="unsupported_media_type")
        if err is None:
            return await self.app(scope, receive, send)
        extra = {"WWW-Authenticate": "Bearer"} if err.status == 401 else {}
        resp = err.response()
        resp.headers.update(extra)
        await resp(scope, receive, send)


def _bearer(value: bytes) -> bytes:
    """The token of an `Authorization: Bearer TOKEN` header (scheme in any case), else b""."""
    scheme, _, token = value.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


async def read_body(http, limit: int, timeout: float = BODY_TIMEOUT,
                    drain: Drain | None = None) -> bytes:
    """The request body, at most `limit` bytes (ApiError 413), within `timeout` s (408);
    ApiError 503 as soon as the server is stopping (`drain`)."""
    too_big = ApiError(413, f"request body larger than {limit} bytes (kvrun serve "
                            f"--max-body-mb)", code="request_too_large")
    length = http.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_big
    chunks, n = [], 0

    async def read():
        nonlocal n
        async for c in http.stream():
            n += len(c)
            if n > limit:
                raise too_big
            chunks.append(c)
    stopping = ApiError(503, SHUTTING_DOWN, "server_error", code="shutting_down")
    if drain is not None and drain.stopping:
        raise stopping
    task = asyncio.ensure_future(asyncio.wait_for(read(), timeout))
    unwatch = drain.watch(task.cancel) if drain is not None else lambda: None
    try:
        await task
    except asyncio.CancelledError:
        if drain is None or not drain.stopping or not task.cancelled():
            raise
        raise stopping from None
    except asyncio.TimeoutError:
        raise ApiError(408, f"request body not received within {timeout:g} s",
                       code="request_timeout") from None
    except ClientDisconnect:                    # gone mid-body: nobody reads the reply
        raise ApiError(499, "client disconnected") from None
    finally:
        unwatch()
    return b"".join(chunks)


class HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol; a request whose line and headers are not complete within
    HEADER_TIMEOUT seconds of the connection (or of the previous response) is dropped."""

    header_timeout = HEADER_TIMEOUT
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._deadline = self.loop.call_later(self.header_timeout, self._expire)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._rearm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:        # the headers are in
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _rearm(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self._deadline = self.loop.call_later(self.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


class Server(uvicorn.Server):
    """uvicorn.Server that stops well on SIGINT / SIGTERM (module docstring): the scheduler
    takes no new requests, `drain` stops body reads, the running requests get
    `drain_timeout` seconds to finish, then are cancelled and answered at once ("the server
    is shutting down"); a second Ctrl-C expires the drain at once. uvicorn's own deadline
    (the drain's + GRACE) is the backstop. A shutdown by signal exits 0 (uvicorn re-raises
    the signal after its shutdown, which made the exit status 130 or -15)."""

    def __init__(self, config, scheduler=None, drain_timeout: float = 30.0,
                 drain: Drain | None = None):
        config.timeout_graceful_shutdown = drain_timeout + GRACE
        super().__init__(config)
        self.scheduler, self.drain_timeout = scheduler, drain_timeout
        self.drain = drain if drain is not None else Drain()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._t0 = 0.0

    async def shutdown(self, sockets=None) -> None:
        self._loop, self._t0 = asyncio.get_running_loop(), time.monotonic()
        running = self.scheduler.stats()["running"] if self.scheduler is not None else 0
        print(f"kvrun serve: shutting down ({running} running; they may take "
              f"{self.drain_timeout:g} s, Ctrl-C again to stop them now)", file=sys.stderr,
              flush=True)
        if self.scheduler is not None:
            self.scheduler.close()
        self.drain.begin()
        expiry = self._loop.call_later(self.drain_timeout, self._expire)
        try:
            await super().shutdown(sockets)
        finally:
            expiry.cancel()
        print(f"kvrun serve: stopped after {time.monotonic() - self._t0:.1f} s", file=sys.stderr,
              flush=True)

    def _expire(self) -> None:
        """The drain's time is up: cancel what runs and answer every waiting client now."""
        if self.drain.expired:
            return
        if self.scheduler is not None:
            self.scheduler.cancel_all(SHUTTING_DOWN)
        self.drain.expire()

    def handle_exit(self, sig, frame) -> None:
        import signal
        if self.should_exit and sig == signal.SIGINT and self._loop is not None:
            # a second Ctrl-C: answer everyone now (JSON 503s, not uvicorn's plain-text 500
            # of a forced exit), then stop once they are written
            self._loop.call_soon_threadsafe(self._expire)
            self._loop.call_soon_threadsafe(self._loop.call_later, GRACE, self._force)
            return
        super().handle_exit(sig, frame)

    def _force(self) -> None:
        self.force_exit = True

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        import signal
        sigs = (signal.SIGINT, signal.SIGTERM)
        before = {s: signal.signal(s, self.handle_exit) for s in sigs}
        try:
            yield
        finally:
            for s, h in before.items():
                signal.signal(s, h)
