"""The cluster's OpenAI ingress: a Ray Serve deployment behind Ray's HTTP proxy that moves
each HTTP request to a replica's app (forward.py) and relays the reply as it comes. It holds
no HTTP semantics of its own — routes, fields, errors, the API key, content type and body
checks are the replica's app (runtime/cli/server.py) — except two things only it can do:

- the body is read here within `--max-body-mb` (server_http.read_body: 413, 408 as on one
  machine), since the router needs the prompt before a replica is picked;
- GET /metrics is the cluster's (metrics.py), behind the same API key check
  (server_http.Guard).

Faults: a replica that fails before its reply starts (killed, its node gone) is retried once,
as nothing was sent (the router no longer offers a replica Ray reports dead); if that fails
too the client gets 503. One that
fails mid-stream ends its stream with an OpenAI error event (`data: {"error": …}`), as a
failed generation does on one machine, and the other requests go on."""
from __future__ import annotations

import json
import logging

from ray.exceptions import RayError
from starlette.responses import Response

from ..cli.server_fields import ApiError
from ..cli.server_http import Guard, read_body
from .forward import Forward, blocks_of, routing_text
from .metrics import ClusterMetrics

log = logging.getLogger("kvrun.cluster")
ROUTER_CHARS = 4096         # of the routing text, what a Forward carries as `prompt`


class Asgi(Response):
    """A Response that is an ASGI app run as is."""

    def __init__(self, app):
        self.app = app
        self.background = None

    async def __call__(self, scope, receive, send):
        await self.app(scope, receive, send)


class Ingress:
    """The ingress deployment's class. replicas: the replica deployment's handle."""

    def __init__(self, replicas, max_body: int, api_key: str | None, namespace: str):
        self.replicas, self.max_body = replicas.options(stream=True), max_body   # one router
        self.prom = ClusterMetrics(namespace)
        self._metrics = Guard(self._metrics_app, api_key=api_key)

    async def _metrics_app(self, scope, receive, send):
        body, ctype = await self.prom.exposition()
        await Response(body, media_type=ctype)(scope, receive, send)

    async def __call__(self, http):
        if http.url.path == "/metrics" and http.method == "GET":
            return Asgi(self._metrics)
        try:
            body = await read_body(http, self.max_body) if http.method == "POST" else b""
        except ApiError as e:
            return e.response()
        text = routing_text(http.url.path, body)
        fwd = Forward(http.method, http.url.path, http.url.query.encode(),
                      [(k.lower(), v) for k, v in http.headers.raw], body,
                      tuple(http.client) if http.client else None,
                      prompt=text[:ROUTER_CHARS], blocks=blocks_of(text))
        for attempt in (0, 1):
            gen = self.replicas.handle.remote(fwd)
            try:
                start = await gen.__anext__()
                break
            except StopAsyncIteration:
                return ApiError(502, "the replica sent no reply", "server_error").response()
            except RayError as e:
                self.prom.failures["before"] += 1
                gen.cancel()
                log.warning("replica call failed before its reply (%s)%s", _line(e),
                            "; retrying it" if not attempt else "")
        else:
            return ApiError(503, "no replica could serve the request", "server_error",
                            code="replica_unavailable").response()
        return Asgi(lambda scope, receive, send: self._relay(start, gen, send))

    async def _relay(self, start: dict, gen, send) -> None:
        """Send the replica's reply on: `start`, then the rest of `gen`'s messages."""
        headers = dict(start.get("headers", []))
        replica = headers.get(b"x-kvrun-replica", b"?").decode()
        self.prom.requests[(replica, start["status"])] += 1
        sse = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        await send(start)
        done = False
        try:
            async for msg in gen:
                await send(msg)
                done = not msg.get("more_body", False)
            if not done:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except RayError as e:
            self.prom.failures["mid_stream"] += 1
            log.warning("replica %s failed mid-reply (%s)", replica, _line(e))
            err = ApiError(503, f"the replica serving this request failed ({_line(e)})",
                           "server_error", code="replica_failed")
            tail = f"data: {json.dumps(err.body())}\n\n".encode() if sse else b""
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        finally:
            gen.cancel()


def _line(e: Exception) -> str:
    s = str(e).strip().splitlines()
    return (s[0] if s else type(e).__name__)[:200]
