"""One HTTP request carried from the ingress to a replica's app, and run there: the cluster
has one HTTP layer (runtime/cli/server.py: routes, fields, errors, API key, content type,
limits), and the ingress only moves requests to it.

`Forward` is what crosses the network (method, path, query, headers, body; and the routing
key the router reads, `prompt` and `blocks`). `call_app` runs it through an ASGI app as
uvicorn would and yields the app's ASGI send messages (`http.response.start`, then
`http.response.body` pieces), so a stream is relayed piece by piece. Closing the generator
(the client gone, the ingress cancelled) tells the app `http.disconnect`, which cancels the
request's sequence as a dropped connection does on one machine."""
from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass, field

BLOCK_CHARS = 256           # characters per routing block (a 512-token chunk is ~2000)
MAX_BLOCKS = 256            # a prompt's first 64k characters decide its route


@dataclass
class Forward:
    method: str
    path: str
    query: bytes
    headers: list                   # [(name, value)] as bytes, lower-case names
    body: bytes
    client: tuple | None = None
    # the router's view: text the prompt starts with, and hashes of its whole blocks
    prompt: str = ""
    blocks: list = field(default_factory=list)


def routing_text(path: str, body: bytes) -> str:
    """The text a request's prompt starts with, as far as the body says without the model:
    chat messages' roles and contents in order, or a completion's prompt; "" for anything
    else (malformed bodies included: the replica's app answers those)."""
    if not body or path not in ("/v1/chat/completions", "/v1/completions"):
        return ""
    try:
        b = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(b, dict):
        return ""
    if path == "/v1/chat/completions":
        msgs = b.get("messages")
        if not isinstance(msgs, list):
            return ""
        return "".join(f"\0{m.get('role')}\0{m.get('content')}" for m in msgs if isinstance(m, dict))
    p = b.get("prompt")
    return p if isinstance(p, str) else json.dumps(p)


def blocks_of(text: str, size: int = BLOCK_CHARS) -> list[str]:
    """Chained hashes of the text's whole `size`-character blocks: block i's hash names the
    first (i + 1) * size characters, so two prompts share hash i exactly when they share
    that prefix."""
    out, h = [], hashlib.blake2b(digest_size=12)
    for i in range(0, min(len(text), MAX_BLOCKS * size) // size * size, size):
        h.update(text[i:i + size].encode("utf-8", "surrogatepass"))
        out.append(h.copy().hexdigest())
    return out


def scope_of(req: Forward) -> dict:
    """The ASGI HTTP scope the app sees for `req`."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": req.method, "scheme": "http",
            "path": req.path, "raw_path": req.path.encode(), "root_path": "",
            "query_string": req.query, "headers": [tuple(h) for h in req.headers],
            "client": req.client, "server": ("kvrun-replica", 0), "state": {}}


async def call_app(app, req: Forward, extra_headers: list = ()):
    """The ASGI messages app sends for `req` (module docstring); `extra_headers` are added
    to the response's start."""
    sent: asyncio.Queue = asyncio.Queue()
    body_given, gone = False, asyncio.Event()

    async def receive():
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(msg):
        await sent.put(msg)

    async def run():
        try:
            await app(scope_of(req), receive, send)
        finally:
            await sent.put(None)
    task = asyncio.create_task(run())
    try:
        while True:
            msg = await sent.get()
            if msg is None:
                break
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": [*msg.get("headers", []), *extra_headers]}
            yield msg
            if msg["type"] == "http.response.body" and not msg.get("more_body", False):
                break
    finally:
        gone.set()
        try:        # the app's own errors became its 500 reply (starlette's error middleware)
            await asyncio.wait_for(task, 30)
        except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
            task.cancel()
