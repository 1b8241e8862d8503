"""kvrun.cluster.ingress: one HTTP request carried to a replica and its reply relayed, the
replica failing before its reply (retried once, then 503) and the body limit, with the
replica deployment's handle stood in for (the ingress's logic, not Ray Serve's)."""
import asyncio
import json

import pytest

pytest.importorskip("ray.serve")
from ray.exceptions import RayError  # noqa: E402
from starlette.requests import Request  # noqa: E402

from kvrun.cluster.ingress import Ingress  # noqa: E402

REPLY = [{"type": "http.response.start", "status": 200,
          "headers": [(b"content-type", b"application/json"), (b"x-kvrun-replica", b"r7")]},
         {"type": "http.response.body", "body": b'{"ok": true}', "more_body": False}]


class Call:
    """What `handle.remote(fwd)` returns with stream=True: an async generator of the app's
    ASGI messages, or one that raises `error` at once."""

    def __init__(self, msgs, error=None):
        self.msgs, self.error, self.cancelled = iter(msgs), error, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.error:
            raise self.error
        try:
            return next(self.msgs)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self):
        self.cancelled = True


class Replicas:
    def __init__(self, *calls):
        self.calls, self.sent = list(calls), []

    def options(self, stream):
        assert stream is True
        return self

    @property
    def handle(self):
        return self

    def remote(self, fwd):
        self.sent.append(fwd)
        return self.calls.pop(0)


def _serve(ingress: Ingress, body: bytes, path="/v1/completions"):
    """(status, body) of one POST through the ingress."""
    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"",
             "headers": [(b"content-length", str(len(body)).encode())], "client": ("1.2.3.4", 5)}
    given = False

    async def receive():
        nonlocal given
        if given:
            return {"type": "http.disconnect"}
        given = True
        return {"type": "http.request", "body": body, "more_body": False}
    out = []

    async def send(msg):
        out.append(msg)

    async def run():
        resp = await ingress(Request(scope, receive))
        await resp(scope, receive, send)
    asyncio.run(run())
    return out[0]["status"], b"".join(m.get("body", b"") for m in out[1:])


def test_a_reply_is_relayed_and_counted_by_its_replica():
    reps = Replicas(Call(REPLY))
    ing = Ingress(reps, max_body=1 << 10, api_key=None, namespace="ns")
    assert _serve(ing, b'{"prompt": "hello"}') == (200, b'{"ok": true}')
    assert reps.sent[0].prompt == "hello" and reps.sent[0].client == ("1.2.3.4", 5)
    assert ing.prom.requests == {("r7", 200): 1}


def test_a_failing_replica_is_retried_once_then_503():
    reps = Replicas(Call([], RayError("node gone")), Call(REPLY))
    ing = Ingress(reps, max_body=1 << 10, api_key=None, namespace="ns")
    assert _serve(ing, b'{"prompt": "x"}')[0] == 200 and ing.prom.failures["before"] == 1
    calls = (Call([], RayError("node gone")), Call([], RayError("again")))
    ing = Ingress(Replicas(*calls), max_body=1 << 10, api_key=None, namespace="ns")
    status, body = _serve(ing, b'{"prompt": "x"}')
    assert status == 503 and json.loads(body)["error"]["code"] == "replica_unavailable"
    assert ing.prom.failures["before"] == 2 and all(c.cancelled for c in calls)


def test_the_body_limit_is_the_ingress_own():
    reps = Replicas()
    ing = Ingress(reps, max_body=8, api_key=None, namespace="ns")
    status, body = _serve(ing, b'{"prompt": "longer than eight"}')
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert reps.sent == []                          # no replica was asked
