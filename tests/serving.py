"""A uvicorn server on a free loopback port, run in a thread, for the server tests."""
from __future__ import annotations

import socket
import threading
import time


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
