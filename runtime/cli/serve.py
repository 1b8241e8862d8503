"""`kvrun serve`: the OpenAI-compatible server (runtime/cli/server.py) as a command.
Registered on the main group by runtime/cli/main.py: `main.add_command(serve_cmd)`."""
from __future__ import annotations

import os

import click

from .cluster_flags import cluster_only, cluster_options, serve_on_ray
from .common import eprint, threads_option
from ..engine.prefix_budget import SERVE_CAP_MB, SERVE_FRACTION, serve_default_mb
from ..errors import KvrunError


@click.command("serve")
@click.option("-m", "--model", "model", default=None,
              help="Model directory or pullable name (default: the embedded SmolLM2-135M-Instruct).")
@click.option("-c", "--ctx-size", "ctx", default=4096, show_default=True, type=int,
              help="Context per sequence in tokens (a request's cache holds its prompt + "
                   "max_tokens, at most this).")
@click.option("--kv", default="fp16", show_default=True,
              help="Default KV method of a request's cache (any --kv spec; a request may pick "
                   "its own with the `kv` field).")
@click.option("--ctx-policy", default=None, type=click.Choice(["error", "shift"]),
              help="When a sequence's context is full: error (finish_reason length) or shift.")
@click.option("-np", "--parallel", default=4, show_default=True, type=int,
              help="Most sequences decoded together.")
@click.option("--kv-budget-mb", default=None, type=float,
              help="Most MiB of KV cache across the running sequences (default: no limit); "
                   "requests wait until theirs fits.")
@click.option("--cache-ram", "cache_ram", default=None, type=float, metavar="MB",
              help="MiB of host RAM for the prefix cache across requests: a request starts from "
                   "the longest cached prefix of its prompt (exactly; docs/serve.md). 0: off. "
                   f"Default: 1/{SERVE_FRACTION} of this machine's memory (RAM, or a cgroup "
                   f"limit), at most {SERVE_CAP_MB} MiB: {serve_default_mb():g} MiB here.")
@click.option("--cache-dir", "cache_dir", default=None, metavar="DIR",
              help="Also keep the prefix cache's entries as files in DIR, so a restarted server "
                   "with the same model and --kv starts from them (docs/serve.md).")
@click.option("--cache-disk-mb", default=1024.0, show_default=True, type=float, metavar="MB",
              help="Most MiB the --cache-dir files hold (least recently used removed first).")
@click.option("--queue", "queue", default=64, show_default=True, type=int,
              help="Most requests waiting beyond the free --parallel slots (more get HTTP 429).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8080, show_default=True, type=int)
@click.option("--alias", default=None, help="Model name clients use (default: the model directory's name).")
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(["auto", "fp32", "fp16", "bf16"]))
@click.option("-b", "--batch-size", "chunk", default=512, show_default=True, type=int,
              help="Prefill chunk size in tokens (one chunk per step while others decode).")
@threads_option
@click.option("--api-key", default=None, envvar="KVRUN_API_KEY",
              help="Require 'Authorization: Bearer KEY' on every route but /health "
                   "(default: $KVRUN_API_KEY, else no key).")
@click.option("--cors-origin", "cors", multiple=True,
              help="An origin browser pages may call the API from (repeatable; '*' for any). "
                   "Default: none, so no cross-origin page can read replies.")
@click.option("--max-body-mb", default=4.0, show_default=True, type=float,
              help="Largest request body in MiB (HTTP 413 past it).")
@click.option("--shutdown-timeout", default=30.0, show_default=True, type=float,
              help="Seconds running requests may take to finish after Ctrl-C / SIGTERM; then "
                   "they end with an error (a second Ctrl-C quits at once).")
@cluster_options
def serve_cmd(model, ctx, kv, ctx_policy, parallel, kv_budget_mb, cache_ram, cache_dir, cache_disk_mb, queue, host, port, alias,
              dtype, chunk, threads, api_key, cors, max_body_mb, shutdown_timeout, **cluster):
    """Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions,
    /v1/completions, /v1/models, /health, /tokenize, /detokenize, /metrics), many requests
    decoded together.

    Needs the server extra: pip install 'kvrun[server]'."""
    try:
        import uvicorn
    except ImportError:
        raise KvrunError("kvrun serve needs starlette, uvicorn and prometheus_client: "
                         "pip install 'kvrun[server]'") from None
    from ..engine.api import load
    from ..kv.config import parse_kv
    from ..engine.scheduler import Scheduler, check_budget_mb
    from .server import create_app
    from .server_http import HeaderDeadline, Server
    if not 0 < port < 65536:
        raise KvrunError(f"--port must be in 1..65535 (got {port})")
    if parallel < 1:
        raise KvrunError(f"--parallel must be >= 1 (got {parallel})")
    check_budget_mb(kv_budget_mb)
    if cache_ram is None:
        cache_ram = serve_default_mb()
    if not 0 <= cache_ram < float("inf"):
        raise KvrunError(f"--cache-ram must be a finite number >= 0 MiB (got {cache_ram:g})")
    if not 0 <= cache_disk_mb < float("inf"):
        raise KvrunError(f"--cache-disk-mb must be a finite number >= 0 MiB (got {cache_disk_mb:g})")
    if queue < 0:
        raise KvrunError(f"--queue must be >= 0 (got {queue})")
    if not 0 < max_body_mb <= 1024:
        raise KvrunError(f"--max-body-mb must be in (0, 1024] (got {max_body_mb:g})")
    if not 0 <= shutdown_timeout <= 3600:
        raise KvrunError(f"--shutdown-timeout must be in [0, 3600] s (got {shutdown_timeout:g})")
    if api_key is not None and (not api_key.strip() or not api_key.isprintable()):
        raise KvrunError("--api-key must be printable and not empty")
    if cluster.pop("ray"):                          # replicas of this server on Ray Serve
        return serve_on_ray(cluster, eprint, cache_dir, model=model, ctx=ctx, kv=kv,
                            ctx_policy=ctx_policy, parallel=parallel, kv_budget_mb=kv_budget_mb,
                            cache_ram=cache_ram, queue=queue, alias=alias, dtype=dtype,
                            chunk=chunk, threads=threads, api_key=api_key, cors=tuple(cors),
                            max_body=int(max_body_mb * (1 << 20)), host=host, port=port)
    cluster_only(cluster)
    # long prompts are tokenized in worker threads (runtime/model/tokenizer.py): one thread each,
    # not a rayon pool per call
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sock = _listen(host, port)                      # a busy port is an error before the load
    spec = parse_kv(kv, **({"ctx_policy": ctx_policy} if ctx_policy else {}))
    # the model's own cache is never used by the server: one token keeps it out of the way
    m = load(model, dtype=dtype, ctx=1, kv="fp16", prefill_chunk=chunk, threads=threads,
             progress=eprint, cache_ram_mb=0)         # the scheduler has its prefix cache
    sched = Scheduler(m, parallel=parallel, kv_budget_mb=kv_budget_mb, max_queue=queue,
                      ctx=ctx, kv=spec, cache_ram_mb=cache_ram,
                      cache_dir=cache_dir, cache_disk_mb=cache_disk_mb)
    name = alias or m.path.name
    app = create_app(m, sched, name, api_key=api_key, cors_origins=tuple(cors),
                     max_body=int(max_body_mb * (1 << 20)))
    budget = f"{kv_budget_mb:g} MiB" if kv_budget_mb else "unlimited"
    where = f"[{host}]" if ":" in host else host
    eprint(f"kvrun serve: model '{name}', {parallel} parallel, {ctx} tokens per sequence, "
            f"kv {spec.label()}, KV budget {budget}"
            + (f", prefix cache {cache_ram:g} MiB" if cache_ram else "")
            + (f", cache dir {sched.prefix.disk.root} ({cache_disk_mb:g} MiB)" if cache_dir else "") + f"; http://{where}:{port}/v1"
            + ("" if api_key else " (no --api-key: anyone who can connect may use it)"
               if host not in ("127.0.0.1", "localhost", "::1") else ""))
    server = Server(uvicorn.Config(app, log_level="warning", http=HeaderDeadline,
                                   timeout_keep_alive=5), sched, shutdown_timeout,
                    app.state.drain)
    server.run(sockets=[sock])


def _listen(host: str, port: int):
    """A listening socket on host:port (IPv6 when host has a colon)."""
    import socket
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError as e:
        s.close()
        raise KvrunError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    s.listen(2048)
    return s
