"""A uvicorn server on a free loopback port, run in a thread, for the server tests."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager


def free_port() -> int:
    """A free loopback port for a server another process binds later, below the kernel's
    ephemeral range: a port the kernel picked (bind to 0) is free now, but the processes
    started before the server binds it take their own ports from that same range, and one
    took it (Ray's, before its proxy bound it: "Failed to bind to address")."""
    import random
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def run_in_thread(srv) -> tuple[int, threading.Thread]:
    """Start `srv` (a uvicorn.Server) on a free 127.0.0.1 port in a daemon thread; returns
    (port, thread) once it accepts connections."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert time.monotonic() < deadline and th.is_alive(), "server did not start"
        time.sleep(0.02)
    return port, th


@contextmanager
def served(model, name: str, **sched_kw):
    """`kvrun serve`'s app over a Scheduler(model, **sched_kw), model name `name`, running on
    a free port (run_in_thread): yields (port, scheduler), stops the server after."""
    import uvicorn

    from kvrun.cli.server import create_app
    from kvrun.engine.scheduler import Scheduler
    sched = Scheduler(model, **sched_kw)
    srv = uvicorn.Server(uvicorn.Config(create_app(model, sched, name), log_level="warning"))
    port, th = run_in_thread(srv)
    try:
        yield port, sched
    finally:
        srv.should_exit = True
        th.join(60)


def openai_client(port: int, timeout: float):
    """The official openai client on the server at `port` (no retries: a failure shows)."""
    import openai
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                         timeout=timeout, max_retries=0)


def default_model_server(name: str, ctx: int, timeout: float):
    """Fixtures `model` (the default model, an fp32 cache of ctx tokens; one per module),
    `server` (`kvrun serve`'s app over it: 4 parallel sequences, a queue of 16) and
    `client` (openai_client with `timeout`), for a test module to bind by those names:
    `model, server, client = default_model_server(NAME, CTX, TIMEOUT)`."""
    import pytest

    @pytest.fixture(scope="module")
    def model():
        import kvrun
        from kvrun.engine.pull import ensure_default_model
        return kvrun.load(ensure_default_model(progress=None), ctx=ctx, kv="fp32")

    @pytest.fixture(scope="module")
    def server(model):
        with served(model, name, parallel=4, max_queue=16, ctx=ctx, kv="fp32") as s:
            yield s

    @pytest.fixture()
    def client(server):
        return openai_client(server[0], timeout)

    return model, server, client


def kvrun_serve(*args: str, timeout: float = 120):
    """A `kvrun serve` process (`-t 1` plus `args`) on a free loopback port: returns
    (Popen with stderr piped, port) once /health answers 200."""
    import subprocess
    import sys

    from hostile_serving import call
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "kvrun.cli.main", "serve", "-t", "1",
                          "--port", str(port), *args], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while True:
        assert p.poll() is None, p.stderr.read()
        assert time.monotonic() < deadline, "kvrun serve did not start"
        try:
            if call(port, "GET", "/health", timeout=2)[0] == 200:
                return p, port
        except OSError:
            time.sleep(0.2)
