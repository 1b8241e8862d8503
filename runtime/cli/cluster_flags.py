"""`kvrun serve --ray`'s flags and the hand-over to runtime/cluster/ (docs/cluster.md). Ray is
imported only past `--ray`: `kvrun serve` alone, and `import kvrun`, never import it."""
from __future__ import annotations

import os

import click

from ..errors import KvrunError

_FLAGS = [
    click.option("--ray", "ray", is_flag=True,
                 help="Serve on Ray Serve: --replicas replicas of this server behind one "
                      "OpenAI ingress on --host:--port, with prefix-aware routing and a shared "
                      "tier of compressed prefixes (docs/cluster.md; pip install 'kvrun[cluster]')."),
    click.option("--address", default=None, metavar="ADDR",
                 help="With --ray: the Ray cluster to join ('auto', host:port or ray://...); "
                      "default: start a local Ray."),
    click.option("--replicas", default=2, show_default=True, type=int,
                 help="With --ray: how many replicas (each its own model, scheduler and caches)."),
    click.option("--replica-cpus", default=1.0, show_default=True, type=float,
                 help="With --ray: Ray CPUs each replica reserves (placement: one per node "
                      "when nodes have this many)."),
    click.option("--routing", default="prefix", show_default=True,
                 type=click.Choice(["prefix", "round-robin"]),
                 help="With --ray: send a prompt to the replica that computed its prefix (with "
                      "--load-bound), or round robin."),
    click.option("--load-bound", default=4, show_default=True, type=int,
                 help="With --ray --routing prefix: most in-flight requests a prefix's replica "
                      "may have beyond the least loaded before a request goes elsewhere."),
    click.option("--shared-mb", default=1024.0, show_default=True, type=float, metavar="MB",
                 help="With --ray: MiB of the shared prefix tier (Ray's object store) all "
                      "replicas restore from; 0: none."),
]


def cluster_options(f):
    """The decorators of the flags above, for `kvrun serve`."""
    for opt in reversed(_FLAGS):
        f = opt(f)
    return f


# Ray's switch for its single-machine mode (named for the platforms where it is the
# default): the node's address is then 127.0.0.1, so a local Ray's GCS, raylets and object
# store listen and talk on loopback only, never on the machine's network address
RAY_LOOPBACK = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def local_ray_on_loopback() -> None:
    """Before Ray is imported: a Ray this process starts (no --address) stays on 127.0.0.1.
    The local cluster of tests/cluster/test_cluster.py and tools/cluster_bench.py does the same."""
    os.environ.setdefault(*RAY_LOOPBACK)


def serve_on_ray(cluster: dict, say, cache_dir, **serve) -> None:
    """Run `kvrun serve --ray`: `cluster` holds the flags above (without `ray`), `serve` the
    server's own settings (ReplicaSpec's fields, host, port), checked already but --kv."""
    if cache_dir is not None:
        raise KvrunError("--cache-dir is one machine's second tier; with --ray the shared "
                         "tier is (--shared-mb)")
    from ..kv.config import parse_kv
    parse_kv(serve["kv"], **({"ctx_policy": serve["ctx_policy"]} if serve["ctx_policy"] else {}))
    if not 0 <= cluster["shared_mb"] < float("inf"):
        raise KvrunError(f"--shared-mb must be a finite number >= 0 MiB (got {cluster['shared_mb']:g})")
    if cluster["address"] is None:
        local_ray_on_loopback()
    try:
        import ray  # noqa: F401
        from ray import serve as _  # noqa: F401
    except ImportError:
        raise KvrunError("kvrun serve --ray needs Ray Serve: pip install 'kvrun[cluster]'") from None
    from ..cluster.deploy import ClusterSpec, check, serve_until_interrupted
    from ..cluster.replica import ReplicaSpec
    spec = ClusterSpec(address=cluster["address"], replicas=cluster["replicas"],
                       host=serve.pop("host"), port=serve.pop("port"),
                       replica_cpus=cluster["replica_cpus"], routing=cluster["routing"],
                       load_bound=cluster["load_bound"])
    check(spec)
    serve_until_interrupted(spec, ReplicaSpec(**serve, shared_mb=cluster["shared_mb"]), say)


def cluster_only(cluster: dict) -> None:
    """KvrunError when a --ray-only flag is given without --ray."""
    defaults = {p.name: p.default for p in (o(lambda: 0).__click_params__[0] for o in _FLAGS)}
    given = [k for k, v in cluster.items() if k in defaults and v != defaults[k]]
    if given:
        raise KvrunError(f"--{given[0].replace('_', '-')} needs --ray")
