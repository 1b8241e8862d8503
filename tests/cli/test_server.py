"""`kvrun serve` (runtime/cli/server.py) through the official `openai` client: a real uvicorn
server on a free loopback port, in this process (a thread), over the default model."""
from __future__ import annotations

import http.client
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

import kvrun  # noqa: E402
from kvrun.engine.scheduler import Scheduler  # noqa: E402
from kvrun.cli.server import create_app  # noqa: E402
from serving import run_in_thread  # noqa: E402

NAME = "smol"
CTX = 512
TIMEOUT = 120                               # seconds any one request may take


@pytest.fixture(scope="module")
def model():
    from kvrun.engine.pull import ensure_default_model
    return kvrun.load(ensure_default_model(progress=None), ctx=CTX, kv="fp16")


@pytest.fixture(scope="module")
def server(model):
    """(base url, scheduler) of a server on a free port; stopped (drained) at the end."""
    sched = Scheduler(model, parallel=8, max_queue=64, ctx=CTX, kv="fp16")
    srv = uvicorn.Server(uvicorn.Config(create_app(model, sched, NAME), log_level="warning"))
    port, th = run_in_thread(srv)
    yield port, sched
    srv.should_exit = True
    th.join(60)
    assert not th.is_alive(), "server did not stop"
    assert sched._thread is not None and not sched._thread.is_alive()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server[0]}/v1", api_key="none",
                         timeout=TIMEOUT, max_retries=0)


def raw(port: int, method: str, path: str, data: bytes | None = None):
    """(status, parsed JSON body) of a plain HTTP request."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        c.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, json.loads(r.read())
    finally:
        c.close()


def alone(model, prompt: str, n: int, **kw) -> str:
    model.reset()                           # a fresh prefill, as every served request gets
    return model.generate(prompt, n, temp=0, **kw)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [NAME]
    status, h = raw(server[0], "GET", "/health")
    assert status == 200 and h["status"] == "ok" and h["ctx_per_sequence"] == CTX


def test_completion_and_stream(client, model):
    p = "The capital of France is"
    ref = alone(model, p, 16)
    r = client.completions.create(model=NAME, prompt=p, max_tokens=16, temperature=0)
    assert r.choices[0].text == ref and r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == len(model.tokenize(p)) and r.usage.completion_tokens <= 16
    chunks = list(client.completions.create(model=NAME, prompt=p, max_tokens=16, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_chat_and_stream(client, model):
    msgs = [{"role": "user", "content": "Name three colours."}]
    model.reset()
    ref = model.chat(msgs, 24, temp=0)
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == ref and r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_stop(client, model):
    p = "Write a list of fruits:\n1."
    ref = alone(model, p, 40, stop=["\n3"])
    r = client.completions.create(model=NAME, prompt=p, max_tokens=40, temperature=0, stop=["\n3"])
    assert r.choices[0].text == ref and r.choices[0].finish_reason == "stop"
    assert "\n3" not in r.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt=p, max_tokens=40, temperature=0, stop="\n3", stream=True))
    assert streamed == ref


def test_kv_extension(client, model):
    p = "Once upon a time, in a quiet village,"
    m = kvrun.load(model.path, ctx=CTX, kv="kivi-4")
    ref = m.generate(p, 20, temp=0)
    r = client.completions.create(model=NAME, prompt=p, max_tokens=20, temperature=0,
                                  extra_body={"kv": "kivi-4"})
    assert r.choices[0].text == ref
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt=p, max_tokens=5, extra_body={"kv": "nope-3"})


def test_16_concurrent_clients(client):
    prompts = [f"Question {i}: what is {i} plus {i + 3}? Answer:" if i % 2 else
               f"Tell me a fact about the number {i}." for i in range(16)]

    def ask(p):
        r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": p}],
                                           max_tokens=20, temperature=0)
        return r.choices[0].message.content
    single = [ask(p) for p in prompts]                      # one at a time
    with ThreadPoolExecutor(16) as ex:
        together = list(ex.map(ask, prompts))
    assert together == single


def test_disconnect_frees_slot(server):
    port, sched = server
    body = {"prompt": "Count forever: 1, 2, 3,", "max_tokens": 400, "temperature": 0, "stream": True}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    c.request("POST", "/v1/completions", body=json.dumps(body),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    got = [r.readline() for _ in range(6)]                  # a few events arrive
    assert any(ln.startswith(b"data: ") for ln in got)
    assert sched.stats()["running"] == 1
    c.sock.shutdown(socket.SHUT_RDWR)                       # the client goes away mid-stream
    c.close()
    deadline = time.monotonic() + 30                       # freed within a few steps
    while sched.stats()["running"] or sched.stats()["kv_used_bytes"]:
        assert time.monotonic() < deadline, sched.stats()
        time.sleep(0.02)


def test_malformed_json(server):
    for data in (b'{"prompt": "x", ', b"[1, 2]", b'{"prompt": "x", "max_tokens": "many"}',
                 b'{"prompt": ""}', b'{"prompt": "x", "temperature": -1}'):
        status, body = raw(server[0], "POST", "/v1/completions", data)
        assert status == 400, data
        err = body["error"]
        assert err["type"] == "invalid_request_error" and err["message"]


def test_overlong_prompt(client):
    with pytest.raises(openai.BadRequestError, match="prompt too long"):
        client.completions.create(model=NAME, prompt="word " * (2 * CTX), max_tokens=4)


def test_unknown_model(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=4)


def test_unknown_route_is_json(server):
    status, body = raw(server[0], "GET", "/v1/nothing")
    assert status == 404 and body["error"]["message"]
