"""`kvrun serve`'s exit: SIGINT / SIGTERM end a real `kvrun serve` process with
status 0 and no traceback (IPv6 too), and a shutdown drains the running requests for a
while, then ends what still runs with a 503 or a stream error event.
"""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

pytest.importorskip("uvicorn")
pytest.register_assert_rewrite("hostile_serving")   # its asserts report as a test's do

from hostile_serving import call, chat, openai_error, start, tiny_m  # noqa: E402


def _serve(tiny_dir, host="127.0.0.1", *extra):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-m", "kvrun.cli.main", "serve", "-m", str(tiny_dir),
                          "-t", "1", "-c", "128", "--dtype", "fp32", "--port", str(port),
                          "--host", host, *extra], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while True:
        assert p.poll() is None, p.stderr.read()
        assert time.monotonic() < deadline, "kvrun serve did not start"
        try:
            if call(port, "GET", "/health", timeout=2, host=host)[0] == 200:
                return p, port
        except OSError:
            time.sleep(0.2)


def _has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_shutdown_exits_0(tiny_dir, sig):
    host = "::1" if sig == signal.SIGTERM and _has_ipv6() else "127.0.0.1"
    p, port = _serve(tiny_dir, host)
    try:
        assert call(port, "POST", "/v1/chat/completions", chat(seed=1 << 70), host=host)[0] == 400
        t0 = time.monotonic()
        p.send_signal(sig)
        assert p.wait(30) == 0
        assert time.monotonic() - t0 < 10
        err = p.stderr.read()
        assert "Traceback" not in err, err
        # a request is one log line (issue 55), and the shutdown says when it starts and ends
        assert " POST /v1/chat/completions 400 " in err, err
        assert "kvrun serve: shutting down" in err and "kvrun serve: stopped after" in err, err
        if host == "::1":                               # the banner's URL can be pasted
            assert f"http://[::1]:{port}/v1" in err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_shutdown_drains_then_ends_what_still_runs(tiny_m, monkeypatch):
    from kvrun.engine import batch as batch_mod
    real = batch_mod.batch_forward

    def slow(*a):                                       # 100 tokens take 5 s
        time.sleep(0.05)
        return real(*a)
    monkeypatch.setattr(batch_mod, "batch_forward", slow)
    port, sched, stop = start(tiny_m, drain=1.0, parallel=3)
    got = {}

    def ask(key, body, path="/v1/completions"):
        got[key] = call(port, "POST", path, body, timeout=30)
    # greedy from these prompts, the tiny model samples no stop token in 100 tokens
    short = threading.Thread(target=ask, args=("short", {"prompt": list(range(3, 20)),
                                                         "max_tokens": 3, "temperature": 0}))
    long = threading.Thread(target=ask, args=("long", {"prompt": list(range(3, 20)),
                                                       "max_tokens": 100, "temperature": 0}))
    streamed = threading.Thread(target=ask, args=("stream", {"prompt": list(range(4, 20)),
                                                             "max_tokens": 100, "temperature": 0,
                                                             "stream": True}))
    for t in (short, long, streamed):
        t.start()
    deadline = time.monotonic() + 20                    # all three admitted, however slow the machine
    while len(sched.running) + ("short" in got) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)                                     # the short one has finished by now or during the drain
    t0 = time.monotonic()
    stop()                                              # as SIGINT does: should_exit
    for t in (short, long, streamed):
        t.join(30)
    assert time.monotonic() - t0 < 5
    assert got["short"][0] == 200 and got["short"][2]["choices"][0]["finish_reason"] == "length"
    openai_error(got["long"][0], got["long"][2], 503)
    events = [json.loads(ln[6:]) for ln in got["stream"][2].decode().splitlines()
              if ln.startswith("data: {")]
    assert events[-1]["error"]["message"] == "the server is shutting down"
    assert not sched.busy() and sched.kv_used == 0


# -- the exit stays within --shutdown-timeout (issue 56) -------------------------------------------

@contextmanager
def _slow_body(port):
    """A connection that sent a chat request's headers and the first 5 bytes of its body,
    0.3 s ago, and sends no more."""
    body = json.dumps(chat()).encode()
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:5])
        time.sleep(0.3)
        yield c


def _read_to_close(c) -> str:
    """Everything the server sends until it closes the connection (headers and body can come
    in separate segments)."""
    got = b""
    try:
        while chunk := c.recv(65536):
            got += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return got.decode()


def test_a_slow_body_does_not_hold_the_exit(tiny_m):
    """A client sending its body slowly kept a server with a 3 s timeout up for 14 s, then
    a CancelledError traceback; its request could never have run: a 503 at once."""
    port, _, stop = start(tiny_m, drain=1.0)
    with _slow_body(port) as c:
        t0 = time.monotonic()
        stop()
        assert time.monotonic() - t0 < 1.0 + 1.5
        c.settimeout(5)
        reply = _read_to_close(c)
    assert reply.startswith("HTTP/1.1 503") and "the server is shutting down" in reply, reply


def _slow_after_stop(monkeypatch, stopping: threading.Event, seconds: float):
    """Every batch step sleeps 0.05 s, and one step after `stopping` sleeps `seconds`
    (a long prefill chunk in flight when the drain ends)."""
    from kvrun.engine import batch as batch_mod
    real = batch_mod.batch_forward

    def slow(*a):
        time.sleep(seconds if stopping.is_set() else 0.05)
        return real(*a)
    monkeypatch.setattr(batch_mod, "batch_forward", slow)


def _request_running(port, sched, max_tokens: int):
    """A completion request on its own thread, returned once the scheduler runs it: (thread,
    dict whose "r" is call()'s answer when it comes)."""
    got = {}
    t = threading.Thread(target=lambda: got.update(r=call(port, "POST", "/v1/completions", {
        "prompt": list(range(3, 20)), "max_tokens": max_tokens, "temperature": 0}, timeout=30)))
    t.start()
    while not sched.running:
        time.sleep(0.01)
    return t, got


def test_a_long_step_does_not_hold_the_exit(tiny_m, monkeypatch):
    """A step still computing when the drain ends (a prefill chunk: ~4 s) delayed the
    replies and the exit; now the waiting clients get their 503 at the deadline."""
    stopping = threading.Event()
    _slow_after_stop(monkeypatch, stopping, 6.0)
    port, sched, stop = start(tiny_m, drain=1.0)
    t, got = _request_running(port, sched, 100)
    time.sleep(0.2)
    stopping.set()
    t0 = time.monotonic()
    stop()
    t.join(10)
    assert time.monotonic() - t0 < 1.0 + 1.5 + 0.5
    openai_error(got["r"][0], got["r"][2], 503)


def test_a_second_ctrl_c_answers_in_json(tiny_m, monkeypatch):
    """A second Ctrl-C gave non-streaming clients uvicorn's plain-text 500."""
    stopping = threading.Event()
    _slow_after_stop(monkeypatch, stopping, 0.05)
    port, sched, stop = start(tiny_m, drain=30.0)
    t, got = _request_running(port, sched, 1000)
    srv = stop.server
    srv.handle_exit(signal.SIGINT, None)
    time.sleep(0.5)
    t0 = time.monotonic()
    srv.handle_exit(signal.SIGINT, None)
    t.join(10)
    assert time.monotonic() - t0 < 3
    openai_error(got["r"][0], got["r"][2], 503)
    stop()


def test_a_slow_body_client_does_not_hold_a_real_server(tiny_dir):
    """The probe's case: --shutdown-timeout 3 and a client sending its body slowly kept
    `kvrun serve` up 14.1 s and printed a CancelledError traceback."""
    p, port = _serve(tiny_dir, "127.0.0.1", "--shutdown-timeout", "3")
    try:
        with _slow_body(port) as c:
            t0 = time.monotonic()
            p.send_signal(signal.SIGINT)
            c.settimeout(10)
            reply = _read_to_close(c)
            assert p.wait(30) == 0
            assert time.monotonic() - t0 < 3 + 1.5
        assert reply.startswith("HTTP/1.1 503") and "shutting down" in reply, reply
        err = p.stderr.read()
        assert "Traceback" not in err and "CancelledError" not in err, err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
