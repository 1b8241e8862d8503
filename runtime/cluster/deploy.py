"""`kvrun serve --ray`: start or join a Ray cluster, put the shared tier's store actor up,
and deploy the ingress + N replicas on Ray Serve (docs/cluster.md).

Without an address a local Ray is started (one machine, several replicas); with one
(`ray://…` or `host:port` of a running cluster, or "auto") it joins that cluster, and the
replicas go wherever Ray places them (`replica_cpus` each). The store actor is named and
detached: a second deploy in the same namespace finds the one already there."""
from __future__ import annotations

import time
from dataclasses import dataclass

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from ..errors import KvrunError
from .ingress import Ingress
from .replica import MiB, Replica, ReplicaSpec
from .router import KvrunRouter
from .registry import REGISTRY_NAME, Registry
from .store import STORE_NAME, PrefixStore

APP = "kvrun"


@dataclass
class ClusterSpec:
    """Where and how many: the cluster flags of `kvrun serve --ray`."""
    address: str | None = None
    replicas: int = 2
    host: str = "127.0.0.1"
    port: int = 8080
    replica_cpus: float = 1.0           # Ray CPUs each replica reserves
    routing: str = "prefix"             # or "round-robin" (router.py)
    load_bound: int = 4                 # affinity.py: most extra in-flight requests
    proxy: str = "HeadOnly"             # Ray Serve proxy_location: HeadOnly | EveryNode


def check(spec: ClusterSpec) -> None:
    """KvrunError for settings no cluster could run."""
    if spec.replicas < 1:
        raise KvrunError(f"--replicas must be >= 1 (got {spec.replicas})")
    if spec.replica_cpus < 0:
        raise KvrunError(f"--replica-cpus must be >= 0 (got {spec.replica_cpus:g})")
    if spec.routing not in ("prefix", "round-robin"):
        raise KvrunError(f"--routing must be prefix or round-robin (got {spec.routing!r})")
    if spec.load_bound < 0:
        raise KvrunError(f"--load-bound must be >= 0 (got {spec.load_bound})")


def connect(address: str | None, namespace: str) -> None:
    """Join the cluster at `address` (None: start a local one)."""
    if ray.is_initialized():
        return
    _reachable(address)
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise KvrunError(f"cannot reach the Ray cluster at {address}: "
                         f"{str(e).strip().splitlines()[0] if str(e).strip() else e}") from None


def _reachable(address: str | None, timeout: float = 5.0) -> None:
    """KvrunError unless a TCP connection to a host:port (or ray://host:port) address opens
    within `timeout` s: Ray itself retries an unreachable address for minutes."""
    if not address or address == "auto":
        return
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not port.isdigit() or not host:
        raise KvrunError(f"--address must be 'auto', HOST:PORT or ray://HOST:PORT (got {address!r})")
    import socket
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout).close()
    except OSError as e:
        raise KvrunError(f"cannot reach the Ray cluster at {address}: {e.strerror or e}") from None


def application(cluster: ClusterSpec, rs: ReplicaSpec):
    """The bound Serve application (ingress over the replicas), after putting the store and
    registry actors up (found, not duplicated, when they are there). Needs a connected Ray."""
    check(cluster)
    store = ray.remote(PrefixStore).options(
        name=STORE_NAME, namespace=rs.namespace, lifetime="detached", get_if_exists=True,
        max_restarts=-1, num_cpus=0).remote(int(rs.shared_mb * MiB))
    ray.remote(Registry).options(
        name=REGISTRY_NAME, namespace=rs.namespace, lifetime="detached", get_if_exists=True,
        max_restarts=-1, num_cpus=0).remote()
    # up before the replicas look for it (a worker process can take seconds to start)
    ray.get(store.ping.remote(), timeout=120)
    router = RequestRouterConfig(request_router_class=KvrunRouter, request_router_kwargs={
        "policy": cluster.routing, "bound": cluster.load_bound})
    replica = serve.deployment(Replica, name="kvrun-replica", num_replicas=cluster.replicas,
                               ray_actor_options={"num_cpus": cluster.replica_cpus},
                               max_ongoing_requests=rs.parallel + rs.queue,
                               request_router_config=router,
                               graceful_shutdown_timeout_s=5)
    ingress = serve.deployment(Ingress, name="kvrun-ingress", num_replicas=1,
                               ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
    return ingress.bind(replica.bind(rs), rs.max_body, rs.api_key, rs.namespace)


def build(args: dict):
    """Ray Serve's application builder (`import_path: kvrun.cluster.deploy:build` in a Serve
    config file or a KubeRay RayService; docs/cluster.md): `args` holds ClusterSpec's
    `replicas`, `replica_cpus`, `routing`, `load_bound` and ReplicaSpec's fields by name;
    unknown names are an error. Host and port are the Serve config's http_options."""
    names = {f: "c" for f in ("replicas", "replica_cpus", "routing", "load_bound")}
    names.update({f: "r" for f in ReplicaSpec.__dataclass_fields__})
    bad = sorted(set(args) - set(names))
    if bad:
        raise KvrunError(f"unknown kvrun app argument {bad[0]!r} (known: {', '.join(sorted(names))})")
    c = {k: _typed(ClusterSpec, k, v) for k, v in args.items() if names[k] == "c"}
    r = {k: _typed(ReplicaSpec, k, v) for k, v in args.items() if names[k] == "r"}
    return application(ClusterSpec(**c), ReplicaSpec(**r))


def _typed(cls, name: str, value):
    """`value` as field `name` of dataclass `cls` wants it: `serve run … key=value` passes
    strings (a config file's YAML passes typed values, kept as they are)."""
    if not isinstance(value, str):
        return value
    kind = str(cls.__dataclass_fields__[name].type).split(" ")[0]
    try:
        if kind in ("int", "float"):
            return {"int": int, "float": float}[kind](value)
    except ValueError:
        raise KvrunError(f"kvrun app argument {name}={value!r}: not a number") from None
    return tuple(v for v in value.split(",") if v) if kind == "tuple" else value


def deploy(cluster: ClusterSpec, rs: ReplicaSpec) -> str:
    """Deploy the app (module docstring) and serve it on cluster.host:port; returns the
    ingress's base URL (…/v1)."""
    check(cluster)
    connect(cluster.address, rs.namespace)
    serve.start(http_options={"host": cluster.host, "port": cluster.port},
                proxy_location=cluster.proxy)
    serve.run(application(cluster, rs), name=APP, route_prefix="/", blocking=False)
    where = f"[{cluster.host}]" if ":" in cluster.host else cluster.host
    return f"http://{where}:{cluster.port}/v1"


def undeploy(namespace: str) -> None:
    """Remove the app, the store and the registry actors (the cluster itself stays)."""
    serve.delete(APP)
    for name in (STORE_NAME, REGISTRY_NAME):
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        except ValueError:
            pass


def serve_until_interrupted(cluster: ClusterSpec, rs: ReplicaSpec, say) -> None:
    """Deploy, print where, and keep the app up until Ctrl-C / SIGTERM; then remove it
    (and stop the local Ray this started). Running requests are not drained: Serve stops
    the replicas (each gets its deployment's graceful_shutdown_timeout_s)."""
    import signal

    def stop(*_):
        raise KeyboardInterrupt
    url = deploy(cluster, rs)
    signal.signal(signal.SIGTERM, stop)             # after ray.init, which installs its own
    say(f"kvrun serve --ray: {cluster.replicas} replicas ({cluster.routing} routing), "
        f"shared tier {rs.shared_mb:g} MiB; {url}")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        undeploy(rs.namespace)
        if cluster.address is None:
            ray.shutdown()
