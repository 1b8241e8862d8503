"""`kvrun serve`'s request log: one line on stderr for each HTTP request when its reply is
done (a stream: after its last event), as llama-server and vLLM log theirs:

    kvrun serve: 127.0.0.1 POST /v1/chat/completions 200 1.52 s, 25 prompt + 8 completion tokens

A completion's line counts its prompt's tokens and every choice's generated tokens; other
routes have none. Successful GET /health and /metrics are not logged (probes and scrapers
call them every few seconds; llama-server leaves them out too). A client gone before any
reply logs status 499."""
from __future__ import annotations

import sys
import time

_REQS = "kvrun.requests"            # the scope key the endpoint leaves its requests under
QUIET = {"/health", "/metrics"}


def log_tokens(scope: dict, reqs: list) -> None:
    """Tell the log the scheduler requests (runtime/engine/scheduler.py) of this HTTP
    request, so its line counts their tokens."""
    scope[_REQS] = reqs


class RequestLog:
    """ASGI middleware writing the module's line for each request to `out`."""

    def __init__(self, out=None):
        self.out = out

    def middleware(self, app):
        async def logged(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            t0, status = time.perf_counter(), [499]

            async def send_logged(msg):
                if msg["type"] == "http.response.start":
                    status[0] = msg["status"]
                await send(msg)
            try:
                await app(scope, receive, send_logged)
            finally:
                self.line(scope, status[0], time.perf_counter() - t0)
        return logged

    def line(self, scope: dict, status: int, seconds: float) -> None:
        if status == 200 and scope["method"] == "GET" and scope["path"] in QUIET:
            return
        client = (scope.get("client") or ("-",))[0]
        text = f"kvrun serve: {client} {scope['method']} {scope['path'][:200]} {status} {seconds:.2f} s"
        reqs = scope.get(_REQS)
        if reqs:
            text += (f", {len(reqs[0].prompt)} prompt + {sum(r.n_tokens for r in reqs)} "
                     f"completion tokens")
        print(text, file=self.out or sys.stderr, flush=True)
