"""kvrun.cli.server_http: `kvrun serve`'s HTTP limits against a hostile client, on the tiny
model: JSON only, no CORS unless the operator allows an origin, the API key, a bounded body,
slow or silent headers dropped, a client gone mid-body, and `--queue 0` on an idle server;
then its pieces alone (Guard, read_body, Drain) on hand-made ASGI messages."""
from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time

import pytest

pytest.importorskip("uvicorn")
pytest.register_assert_rewrite("hostile_serving")   # its asserts report as a test's do

from hostile_serving import NAME, call, chat, openai_error, server, start, tiny_m  # noqa: E402
from kvrun.cli.server_fields import ApiError  # noqa: E402
from kvrun.cli.server_http import Drain, Guard, read_body  # noqa: E402


def test_content_type_is_json_only(server):
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None):
        h = {"Content-Type": ctype} if ctype else {"Content-Type": ""}
        status, _, body = call(server[0], "POST", "/v1/chat/completions",
                               json.dumps(chat()).encode(), headers=h)
        openai_error(status, body, 415)
    status, _, _ = call(server[0], "POST", "/v1/chat/completions", json.dumps(chat()).encode(),
                        headers={"Content-Type": "application/json; charset=utf-8"})
    assert status == 200


def test_no_cors_unless_the_operator_allows_an_origin(server, tiny_m):
    pre = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "content-type"}
    status, headers, _ = call(server[0], "OPTIONS", "/v1/chat/completions", headers=pre)
    assert status >= 400 and "access-control-allow-origin" not in {k.lower() for k in headers}
    port, _, stop = start(tiny_m, cors_origins=("http://ok.example",))
    try:
        status, headers, _ = call(port, "OPTIONS", "/v1/chat/completions",
                                  headers={**pre, "Origin": "http://ok.example"})
        assert status == 200 and headers["access-control-allow-origin"] == "http://ok.example"
        status, headers, _ = call(port, "OPTIONS", "/v1/chat/completions", headers=pre)
        assert headers.get("access-control-allow-origin") is None
    finally:
        stop()


def test_api_key(tiny_m):
    port, _, stop = start(tiny_m, api_key="s3cret")
    try:
        for h in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}):
            for method, path, body in (("POST", "/v1/chat/completions", chat()),
                                       ("GET", "/v1/models", None)):
                status, headers, got = call(port, method, path, body, headers=h)
                openai_error(status, got, 401)
                assert got["error"]["type"] == "authentication_error"
        ok = {"Authorization": "Bearer s3cret"}
        assert call(port, "POST", "/v1/chat/completions", chat(), headers=ok)[0] == 200
        for scheme in ("bearer", "BEARER", "bEaReR"):       # RFC 7235: case-insensitive
            h = {"Authorization": f"{scheme} s3cret"}
            assert call(port, "GET", "/v1/models", headers=h)[0] == 200, scheme
        assert call(port, "GET", "/v1/models", headers=ok)[0] == 200
        assert call(port, "GET", "/health")[0] == 200               # open for probes
        openai = pytest.importorskip("openai")
        url = f"http://127.0.0.1:{port}/v1"
        ok_client = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0)
        assert ok_client.chat.completions.create(model=NAME, max_tokens=2, messages=[
            {"role": "user", "content": "hi"}]).choices[0].finish_reason in ("length", "stop")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    finally:
        stop()


def test_body_size_is_bounded(tiny_m):
    port, _, stop = start(tiny_m, max_body=64 << 10)
    try:
        big = json.dumps(chat("word " * 20000)).encode()            # ~100 KB
        status, _, body = call(port, "POST", "/v1/chat/completions", big)
        openai_error(status, body, 413)
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)    # no Content-Length
        c.request("POST", "/v1/chat/completions", body=iter([big[i:i + 8192]
                  for i in range(0, len(big), 8192)]),
                  headers={"Content-Type": "application/json"}, encode_chunked=True)
        r = c.getresponse()
        assert r.status == 413 and json.loads(r.read())["error"]["message"]
        c.close()
    finally:
        stop()


def test_slow_headers_are_dropped(server):
    port = server[0]
    s = socket.create_connection(("127.0.0.1", port))
    t0 = time.monotonic()
    closed = False
    try:
        for ch in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
            s.sendall(bytes([ch]))
            time.sleep(0.1)
            if time.monotonic() - t0 > 5:
                break
    except (BrokenPipeError, ConnectionResetError):
        closed = True
    s.settimeout(5)
    try:
        closed = closed or s.recv(1) == b""
    except (ConnectionResetError, socket.timeout):
        closed = closed or False
    s.close()
    assert closed and time.monotonic() - t0 < 4
    idle = socket.create_connection(("127.0.0.1", port))            # says nothing at all
    idle.settimeout(5)
    t0 = time.monotonic()
    assert idle.recv(1) == b"" and time.monotonic() - t0 < 3
    idle.close()


def test_queue_zero_serves_an_idle_server(tiny_m):
    port, _, stop = start(tiny_m, parallel=1, queue=0)
    try:
        assert call(port, "POST", "/v1/chat/completions", chat())[0] == 200
    finally:
        stop()


def test_client_gone_mid_body_is_quiet(server, capfd):
    s = socket.create_connection(("127.0.0.1", server[0]))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
              b"\r\nContent-Length: 100\r\n\r\n{\"messages\":")
    time.sleep(0.2)
    s.close()
    time.sleep(0.5)
    assert call(server[0], "GET", "/health")[0] == 200
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ClientDisconnect" not in err, err


# -- the pieces alone ------------------------------------------------------------------------
def _asgi(app, method="POST", path="/v1/completions", headers=(), chunks=(b"{}",), gap=0.0):
    """(status, headers, body) of `app` for one request whose body arrives in `chunks`,
    `gap` seconds apart."""
    scope = {"type": "http", "method": method, "path": path, "query_string": b"",
             "headers": [(k.lower(), v) for k, v in headers]}
    pending, out = list(chunks), []

    async def receive():
        await asyncio.sleep(gap)
        c = pending.pop(0) if pending else b""
        return {"type": "http.request", "body": c, "more_body": bool(pending)}

    async def send(msg):
        out.append(msg)
    asyncio.run(app(scope, receive, send))
    return out[0]["status"], dict(out[0]["headers"]), b"".join(m.get("body", b"") for m in out[1:])


async def _ok(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


JSON = (b"content-type", b"application/json; charset=utf-8")


def test_guard_checks_the_key_then_the_content_type():
    g = Guard(_ok, api_key="s3cret")
    status, hdrs, body = _asgi(g, headers=[JSON])
    assert status == 401 and hdrs[b"www-authenticate"] == b"Bearer"
    assert json.loads(body)["error"]["code"] == "invalid_api_key"
    assert _asgi(g, headers=[JSON, (b"authorization", b"Bearer s3cretX")])[0] == 401
    assert _asgi(g, headers=[JSON, (b"authorization", b"bearer  s3cret ")])[2] == b"ok"
    assert _asgi(g, method="GET", path="/health")[2] == b"ok"             # open without a key
    status, _, body = _asgi(Guard(_ok), headers=[(b"content-type", b"text/plain")])
    assert status == 415 and json.loads(body)["error"]["code"] == "unsupported_media_type"
    assert _asgi(Guard(_ok), method="GET", path="/v1/models")[2] == b"ok"  # no body, no type


def _read(limit, timeout=5.0, drain=None, **kw):
    """read_body's bytes, or the ApiError's (status, code), behind a stand-in endpoint."""
    from starlette.requests import Request
    from starlette.responses import Response
    got = []

    async def app(scope, receive, send):
        try:
            got.append(await read_body(Request(scope, receive), limit, timeout, drain))
        except ApiError as e:
            got.append((e.status, e.code))
        await Response(b"")(scope, receive, send)
    _asgi(app, **kw)
    return got[0]


def test_read_body_bounds_size_and_time():
    assert _read(10, chunks=(b"12345", b"67890")) == b"1234567890"
    assert _read(9, chunks=(b"12345", b"67890")) == (413, "request_too_large")
    assert _read(9, headers=[(b"content-length", b"1000")]) == (413, "request_too_large")
    assert _read(100, timeout=0.05, chunks=(b"1", b"2"), gap=0.1)[0] == 408
    stopping = Drain()
    stopping.begin()
    assert _read(100, drain=stopping) == (503, "shutting_down")


def test_drain_wakes_its_watchers_until_unwatched():
    d, woke = Drain(), []
    unwatch = d.watch(lambda: woke.append("a"))
    d.watch(lambda: woke.append("b"))
    d.begin()
    assert (d.stopping, d.expired, sorted(woke)) == (True, False, ["a", "b"])
    unwatch()
    d.expire()
    assert (d.expired, sorted(woke)) == (True, ["a", "b", "b"])
