"""kvrun.cluster.replica: what a replica reports and how it answers a forwarded request (the
response marked with who served it), on a replica built without Ray Serve or a model."""
import asyncio
import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")
from kvrun.cluster.forward import Forward  # noqa: E402
from kvrun.cluster.replica import Replica  # noqa: E402


def _replica(app=None, prefix=None) -> Replica:
    r = Replica.__new__(Replica)          # the fields __init__ sets, without a model or Serve
    r.sched = SimpleNamespace(stats=lambda: {"running": 2, "waiting": 1, "kv_used_bytes": 4096,
                                             "prefix_cache": prefix, "queued": 9},
                              shutdown=lambda drain, timeout: None)      # __del__ calls it
    r.node, r.app, r.tier, r._stop = "n1", app, None, threading.Event()
    r._headers = [(b"x-kvrun-replica", b"r1"), (b"x-kvrun-node", b"n1")]
    return r


def test_stats_are_the_schedulers_with_the_node():
    assert _replica().stats() == {"node": "n1", "running": 2, "waiting": 1,
                                  "kv_used_bytes": 4096, "prefix": {}}
    assert _replica(prefix={"hits": 3}).stats()["prefix"] == {"hits": 3}


def test_handle_relays_the_apps_reply_marked_with_the_replica():
    async def app(scope, receive, send):
        body = (await receive())["body"]
        await send({"type": "http.response.start", "status": 201, "headers": [(b"a", b"1")]})
        await send({"type": "http.response.body", "body": scope["path"].encode() + body})

    async def collect():
        req = Forward("POST", "/echo", b"", [], b"+body")
        return [m async for m in _replica(app).handle(req)]
    start, body = asyncio.run(collect())
    assert start["status"] == 201
    assert start["headers"] == [(b"a", b"1"), (b"x-kvrun-replica", b"r1"), (b"x-kvrun-node", b"n1")]
    assert body["body"] == b"/echo+body"
