"""Per-token latency at batch 1: the library (`m.stream`) against `kvrun serve` (SSE over
loopback, in this process on a free port), alternating, same prompt, greedy. Prints the
median gap between tokens of each and their ratio (what the server adds).

    python tools/serve_overhead.py [-n 64] [-r 4] [-t 1]
"""
from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import sys
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=64, help="tokens per generation")
    ap.add_argument("-r", type=int, default=4, help="repetitions of each")
    ap.add_argument("-t", type=int, default=None, help="torch threads")
    a = ap.parse_args()
    if a.n < 4 or a.r < 1 or (a.t is not None and a.t < 1):
        sys.exit("error: need -n >= 4, -r >= 1, -t >= 1")
    import uvicorn

    import kvrun
    from kvrun.engine.scheduler import Scheduler
    from kvrun.cli.server import create_app
    if a.t:
        from kvrun.threads import configure as configure_threads
        configure_threads(a.t)   # the cap kvrun's forwards keep (runtime/threads.py)
    m = kvrun.load(ctx=1024, kv="fp16")
    sched = Scheduler(m, parallel=4, ctx=1024, kv="fp16")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(create_app(m, sched, "m"), log_level="warning"))
    threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not srv.started:
        time.sleep(0.05)
    prompt = "Once upon a time, in a quiet village by the sea,"

    def library() -> list[float]:
        m.reset()
        gaps, t = [], time.perf_counter()
        for ev in m.stream(prompt, a.n, temp=0):
            if ev.token_id is not None:
                now = time.perf_counter()
                gaps.append(now - t)
                t = now
        return gaps[1:]                   # the first gap holds the prefill

    def served() -> list[float]:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        c.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                  body=json.dumps({"prompt": prompt, "max_tokens": a.n, "temperature": 0, "stream": True}))
        r = c.getresponse()
        gaps, t = [], time.perf_counter()
        while (line := r.readline()) and not line.startswith(b"data: [DONE]"):
            if line.startswith(b"data: "):
                now = time.perf_counter()
                gaps.append(now - t)
                t = now
        c.close()
        return gaps[2:-1]                 # no prefill, no final event

    res: dict[str, list[float]] = {"library": [], "server": []}
    for _ in range(a.r):
        res["library"] += library()
        res["server"] += served()
    for k, v in res.items():
        print(f"{k:8}: median {1e3 * statistics.median(v):.2f} ms/token ({len(v)} gaps)")
    print(f"server / library (median): {statistics.median(res['server']) / statistics.median(res['library']):.3f}")
    srv.should_exit = True


if __name__ == "__main__":
    main()
