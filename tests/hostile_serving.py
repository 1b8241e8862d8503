"""Shared by the `kvrun serve` tests against a hostile client (test_serve_hostile.py,
test_server_http.py, test_serve_shutdown.py): a server on the tiny model with a 1 s header
deadline, one HTTP request, a chat body, and the check of OpenAI's error shape."""
from __future__ import annotations

import http.client
import json

import pytest
import uvicorn

import kvrun
from kvrun.engine.scheduler import Scheduler
from kvrun.cli.server import create_app
from serving import run_in_thread
from kvrun.cli.server_http import HeaderDeadline, Server

CTX = 128
NAME = "tiny"


@pytest.fixture(scope="module")
def tiny_m(tiny_dir):
    return kvrun.load(tiny_dir, dtype="fp32", ctx=CTX, kv="fp32")


@pytest.fixture(scope="module")
def server(tiny_m):
    port, sched, stop = start(tiny_m)
    yield port, sched
    stop()


class QuickDeadline(HeaderDeadline):
    header_timeout = 1.0


def start(model, drain=30.0, **app_kw):
    """(port, scheduler, stop()) of a server on a free loopback port."""
    sched = Scheduler(model, parallel=app_kw.pop("parallel", 2), max_queue=app_kw.pop("queue", 8),
                      ctx=CTX, kv="fp32")
    app = create_app(model, sched, NAME, **app_kw)
    srv = Server(uvicorn.Config(app, log_level="critical", http=QuickDeadline), sched, drain,
                 app.state.drain)
    port, th = run_in_thread(srv)

    def stop():
        srv.should_exit = True
        th.join(30)
        assert not th.is_alive()
    stop.server = srv                                   # its signal handler, for the tests
    return port, sched, stop


def call(port, method, path, body=None, headers=None, timeout=30, host="127.0.0.1"):
    """(status, headers, parsed JSON or raw bytes) of one request; a dict body is JSON."""
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        h = {"Content-Type": "application/json"} if data is not None else {}
        h.update(headers or {})
        c.request(method, path, body=data, headers=h)
        r = c.getresponse()
        raw = r.read()
        try:
            return r.status, r.headers, json.loads(raw)
        except ValueError:
            return r.status, r.headers, raw
    finally:
        c.close()


def openai_error(status, body, want_status, param=None):
    assert status == want_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    msg = body["error"]["message"]
    assert msg and "\n" not in msg and "Traceback" not in msg and len(msg) <= 400
    if param is not None:
        assert body["error"]["param"] == param, body
    return msg


def chat(content="hi", **kw):
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}
