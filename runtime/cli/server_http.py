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
- `Server`: uvicorn's server with a bounded drain on SIGINT / SIGTERM (running requests
  finish or end with "the server is shutting down"), and exit status 0 after it.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import threading

import h11
import uvicorn
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from .server_fields import ApiError

HEADER_TIMEOUT = 10.0           # seconds for a request line and its headers
BODY_TIMEOUT = 30.0             # seconds for a whole request body


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


async def read_body(http, limit: int, timeout: float = BODY_TIMEOUT) -> bytes:
    """The request body, at most `limit` bytes (ApiError 413), within `timeout` s (408)."""
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
    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"request body not received within {timeout:g} s",
                       code="request_timeout") from None
    except ClientDisconnect:                    # gone mid-body: nobody reads the reply
        raise ApiError(499, "client disconnected") from None
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
    """uvicorn.Server that stops well on SIGINT / SIGTERM: the scheduler takes no new
    requests, the running ones get `drain_timeout` seconds to finish, then end with an error
    event / HTTP 503 ("the server is shutting down") instead of a cut connection; a second
    Ctrl-C quits at once. A shutdown by signal exits 0 (uvicorn re-raises the signal after
    its shutdown, which made the exit status 130 or -15)."""

    def __init__(self, config, scheduler=None, drain_timeout: float = 30.0):
        # uvicorn's own deadline is the backstop: it cancels what still runs, uncleanly
        config.timeout_graceful_shutdown = drain_timeout + 10
        super().__init__(config)
        self.scheduler, self.drain_timeout = scheduler, drain_timeout

    async def shutdown(self, sockets=None) -> None:
        if self.scheduler is not None:
            from ..engine.scheduler import SHUTTING_DOWN
            self.scheduler.close()
            asyncio.get_running_loop().call_later(self.drain_timeout, self.scheduler.cancel_all,
                                                  SHUTTING_DOWN)
        await super().shutdown(sockets)

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
