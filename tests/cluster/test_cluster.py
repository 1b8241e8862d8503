"""`kvrun serve --ray` (runtime/cluster/) on a local two-node Ray cluster
(ray.cluster_utils.Cluster, one CPU each, so one replica per node): the official `openai`
client against the ingress, greedy replies equal to the single-machine server's, a prefix
computed on one replica restored on the other from the shared tier, corrupt and foreign
entries refused, the shared tier down (the replicas go on, /metrics says so), and a replica
killed mid-stream (its stream ends with an error event, the other request finishes), a node
removed (the service answers on the rest).

One cluster for the module, round-robin routing (so "the other replica" is the next request)
until one test redeploys it with prefix routing and checks affinity and the load bound
(the policy's cases are tests/cluster/test_affinity.py's); few and short requests."""
from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

import kvrun  # noqa: E402
from kvrun import threads as kthreads  # noqa: E402
from kvrun.cluster.deploy import ClusterSpec, deploy, undeploy  # noqa: E402
from kvrun.cluster.replica import REPORT_EVERY, ReplicaSpec  # noqa: E402
from kvrun.cluster.registry import REGISTRY_NAME  # noqa: E402
from kvrun.cluster.store import STORE_NAME, PrefixStore  # noqa: E402
from kvrun.engine.prefix_cache import kv_key  # noqa: E402
from kvrun.engine.prefix_disk import DiskTier  # noqa: E402
from kvrun.engine.session import model_record  # noqa: E402
from kvrun.kv.config import parse_kv  # noqa: E402
from serving import free_port, openai_client, served  # noqa: E402

# one process runs them all under -n N (pyproject's --dist loadgroup): one cluster, in order
pytestmark = pytest.mark.xdist_group("ray-cluster")

NAME, CTX, CHUNK, NS = "smol", 384, 32, "kvrun-test"
TIMEOUT = 120
SYSTEM = ("You are a careful assistant for a small bakery. Answer in one short sentence, "
          "name the bread when you can, and never invent prices or opening hours. ") * 3


@pytest.fixture(scope="module")
def cluster():
    """(base url, Cluster) of the app deployed on two 1-CPU nodes; torn down at the end."""
    from ray.cluster_utils import Cluster

    from kvrun.engine.pull import ensure_default_model
    path = str(ensure_default_model(progress=None))    # pulled once, before two replicas ask
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    worker = c.add_node(num_cpus=1)
    ray.init(address=c.address, namespace=NS, log_to_driver=False)
    try:
        url = deploy(ClusterSpec(address=c.address, replicas=2, port=free_port(),
                                 routing="round-robin"),
                     ReplicaSpec(model=path, ctx=CTX, parallel=2, chunk=CHUNK, threads=1,
                                 cache_ram=8, shared_mb=64, alias=NAME, namespace=NS))
        yield url, c, worker
    finally:
        from ray import serve
        try:
            undeploy(NS)
            serve.shutdown()
        finally:
            ray.shutdown()
            c.shutdown()


@pytest.fixture(scope="module")
def single():
    """(port, model) of the single-machine server with the replicas' settings (one thread:
    greedy output is bit-equal only on one thread count)."""
    from kvrun.engine.pull import ensure_default_model
    before = kthreads.torch.get_num_threads()
    m = kvrun.load(ensure_default_model(progress=None), ctx=1, kv="fp16", prefill_chunk=CHUNK,
                   threads=1)
    try:
        with served(m, NAME, parallel=2, ctx=CTX, kv="fp16") as (port, _):
            yield port, m
    finally:
        kthreads.configure(before)


def client(url: str):
    return openai.OpenAI(base_url=url, api_key="none", timeout=TIMEOUT, max_retries=0)


def ask(c, prompt: str, n: int = 10, stream: bool = False):
    """(text, replica id) of a greedy chat reply (replica None from the single server)."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    if stream:
        with c.chat.completions.with_streaming_response.create(
                model=NAME, messages=msgs, max_tokens=n, temperature=0, stream=True) as r:
            text = "".join(ch.choices[0].delta.content or "" for ch in r.parse() if ch.choices)
            return text, r.headers.get("x-kvrun-replica")
    r = c.chat.completions.with_raw_response.create(model=NAME, messages=msgs, max_tokens=n,
                                                    temperature=0)
    return r.parse().choices[0].message.content, r.headers.get("x-kvrun-replica")


def metrics(url: str) -> str:
    with urllib.request.urlopen(url[:-3] + "/metrics", timeout=TIMEOUT) as r:
        return r.read().decode()


def value(text: str, name: str, **labels) -> float:
    """The sum of metric `name`'s samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(?:{{(.*)}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def wait_metric(url, name, pred, timeout=20.0, **labels) -> float:
    """Poll /metrics until pred(value) (replicas report every 2 s)."""
    deadline = time.monotonic() + timeout
    while True:
        v = value(metrics(url), name, **labels)
        if pred(v) or time.monotonic() > deadline:
            return v
        time.sleep(0.5)


def test_replies_equal_the_single_server(cluster, single):
    url = cluster[0]
    ref = openai_client(single[0], TIMEOUT)
    seen = set()
    for i, stream in enumerate((False, True, False)):
        q = f"Which bread is best with soup? ({i})"
        got, replica = ask(client(url), q, stream=stream)
        want, _ = ask(ref, q, stream=stream)
        assert got == want and got
        seen.add(replica)
    assert len(seen) == 2 and None not in seen        # both replicas served, and said so
    r = client(url).completions.create(model=NAME, prompt="The oven", max_tokens=8, temperature=0)
    assert r.choices[0].text == openai_client(single[0], TIMEOUT).completions.create(
        model=NAME, prompt="The oven", max_tokens=8, temperature=0).choices[0].text


def test_the_local_cluster_is_on_loopback(cluster):
    """Every node of the local cluster (and so its GCS, raylets and object store) is on
    127.0.0.1: the suite never talks on the machine's network address (conftest.py)."""
    assert [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]] == ["127.0.0.1"] * 2
    assert cluster[1].address.startswith("127.0.0.1:")


def test_errors_are_the_servers(cluster):
    c = client(cluster[0])
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                  max_tokens=-1)
    req = urllib.request.Request(cluster[0] + "/chat/completions", data=b"{",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=TIMEOUT)
    assert e.value.code == 400 and "error" in json.loads(e.value.read())


def test_prefix_from_one_replica_restored_on_the_other(cluster, single):
    url = cluster[0]
    # past the system prompt (whose boundaries both replicas hold by now) by > 2 chunks
    q = "Which loaf keeps longest? " + "We bake rye, spelt, wheat and oat loaves daily. " * 6
    want, _ = ask(openai_client(single[0], TIMEOUT), q)
    first, a = ask(client(url), q)                  # computed on a
    time.sleep(REPORT_EVERY * 1.5)                  # every replica's counts reported since
    before = metrics(url)                           # (b may have restored in an earlier test)
    second, b = ask(client(url), q)                 # round robin: the other replica
    assert a != b
    assert first == second == want
    name = "kvrun_replica_shared_tier_restores_total"
    was = value(before, name, replica=b)
    restored = wait_metric(url, name, lambda v: v > was, replica=b)     # reported every 2 s
    assert restored > was, [l for l in metrics(url).splitlines() if "replica_" in l and not l.startswith("#")]
    assert wait_metric(url, "kvrun_replica_prefix_cache_hits_total", lambda v: v >= CHUNK,
                       replica=b) >= CHUNK


def _names(m, ids: list[int], tmp_path) -> dict:
    """{boundary: entry name} of a prompt's ids, as the replicas name them."""
    tier = DiskTier(tmp_path / "names", 1 << 20, model_record(m))
    ns = range(CHUNK, len(ids), CHUNK)
    return {n: p.name for n, p in tier.paths(kv_key(parse_kv("fp16")), ids, ns).items()}


def test_corrupt_and_foreign_entries_are_refused(cluster, single, tmp_path):
    url, m = cluster[0], single[1]
    store = ray.get_actor(STORE_NAME, namespace=NS)
    other = list(range(1000, 1000 + 3 * CHUNK + 5))   # a prompt of ids: names known exactly
    c = client(url)
    c.completions.create(model=NAME, prompt=other, max_tokens=1, temperature=0)
    good = ray.get(ray.get(store.get.remote(_names(m, other, tmp_path)[CHUNK]))[0])
    ids = list(range(2000, 2000 + 2 * CHUNK + 5))
    names = _names(m, ids, tmp_path)
    ray.get(store.put.remote(names[CHUNK], good))     # another prompt's entry under this name
    ray.get(store.put.remote(names[2 * CHUNK], b"KVRUNSES" + b"\0" * 4096))     # corrupt
    before = value(metrics(url), "kvrun_replica_shared_tier_refused_total")
    want = openai_client(single[0], TIMEOUT).completions.create(
        model=NAME, prompt=ids, max_tokens=8, temperature=0).choices[0].text
    assert c.completions.create(model=NAME, prompt=ids, max_tokens=8,
                                temperature=0).choices[0].text == want
    assert wait_metric(url, "kvrun_replica_shared_tier_refused_total",
                       lambda v: v >= before + 2) >= before + 2
    # refused entries are dropped from the store; the replica stored its own
    got = ray.get(store.get.remote(names[CHUNK]))
    assert got is None or ray.get(got[0]) != good


def test_client_gone_frees_the_replicas_slot(cluster):
    """A client that leaves mid-stream cancels its sequence on the replica (as on one
    machine): the replica's running count goes back to 0."""
    url = cluster[0]
    with client(url).chat.completions.with_streaming_response.create(
            model=NAME, messages=[{"role": "user", "content": "Tell me about bread."}],
            max_tokens=CTX - 40, temperature=0, stream=True) as r:
        replica = r.headers["x-kvrun-replica"]
        next(iter(r.parse()))
        assert wait_metric(url, "kvrun_replica_running", lambda v: v == 1, replica=replica) == 1
    # well before its ~340 tokens could be done
    assert wait_metric(url, "kvrun_replica_running", lambda v: v == 0, timeout=5,
                       replica=replica) == 0


def _logged(cluster, text: str) -> bool:
    """Whether a replica's log (the nodes' Ray session directories) has `text`."""
    dirs = {n.get_session_dir_path() for n in (cluster[1].head_node, cluster[2])}
    for d in dirs:
        for f in Path(d, "logs").rglob("*"):
            if f.is_file() and f.suffix in (".err", ".out", ".log") and \
                    text in f.read_text(errors="replace"):
                return True
    return False


def test_shared_tier_down_falls_back_to_local_caches(cluster, single):
    url = cluster[0]
    ray.kill(ray.get_actor(STORE_NAME, namespace=NS), no_restart=True)
    ref = openai_client(single[0], TIMEOUT)
    for i in range(2):                               # each replica finds the store gone
        q = f"Is rye bread sour? ({i})"
        assert ask(client(url), q)[0] == ask(ref, q)[0]
    text = metrics(url)
    assert value(text, "kvrun_cluster_store_up") == 0
    assert wait_metric(url, "kvrun_replica_shared_tier_up", lambda v: v == 0) == 0
    assert _logged(cluster, "shared prefix tier unreachable"), "no log line says the tier is down"
    # a store back under the name: the replicas use it again after their retry delay
    store = ray.remote(PrefixStore).options(name=STORE_NAME, namespace=NS, lifetime="detached",
                                            num_cpus=0).remote(64 << 20)
    ray.get(store.ping.remote(), timeout=TIMEOUT)
    time.sleep(5.5)
    for i in range(2):
        ask(client(url), f"And spelt? ({i})", n=2)
    assert wait_metric(url, "kvrun_replica_shared_tier_up", lambda v: v == 2) == 2


def test_replica_killed_mid_stream(cluster):
    """Its stream ends with an error event (no hang); the other replica's request finishes;
    Ray Serve starts a new replica in its place, which reports in."""
    url = cluster[0]
    c = client(url)
    first = set(ray.get(ray.get_actor(REGISTRY_NAME, namespace=NS).replica_reports.remote()))
    msgs = [{"role": "user", "content": "Tell me a long story about bread."}]
    with c.chat.completions.with_streaming_response.create(
            model=NAME, messages=msgs, max_tokens=300, temperature=0, stream=True) as r:
        victim = r.headers["x-kvrun-replica"]
        chunks = iter(r.parse())
        next(chunks)
        other = {}
        t = threading.Thread(target=lambda: other.update(
            zip(("text", "replica"), ask(client(url), "Name one bread.", n=6))))
        t.start()
        time.sleep(0.5)
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=False)
        with pytest.raises(openai.APIError, match="failed"):
            for _ in chunks:
                pass
        t.join(TIMEOUT)
    assert other.get("text") and other["replica"] != victim
    assert value(metrics(url), "kvrun_cluster_replica_failures_total", stage="mid_stream") >= 1
    ask(client(url), "Still there?", n=2)           # the service goes on
    registry = ray.get_actor(REGISTRY_NAME, namespace=NS)
    deadline = time.monotonic() + 90
    while not set(ray.get(registry.replica_reports.remote(max_age=3))) - first:
        assert time.monotonic() < deadline, "no replica took the killed one's place"
        time.sleep(1)


def test_prefix_routing_and_its_load_bound(cluster, single):
    """Redeployed with --routing prefix --load-bound 0: a prompt goes back to the replica
    that computed its prefix; while that one is busy, the next goes to the other (spill)."""
    from ray import serve
    url = cluster[0]
    serve.delete("kvrun")
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    deploy(ClusterSpec(address=cluster[1].address, replicas=2, port=port, routing="prefix",
                       load_bound=0),
           ReplicaSpec(model=str(single[1].path), ctx=CTX, parallel=2, chunk=CHUNK, threads=1,
                       cache_ram=8, shared_mb=64, alias=NAME, namespace=NS))
    q = "Which crust is crispest? " + "Our ovens run hot and our loaves rest overnight. " * 6
    served_by = {ask(client(url), q, n=2)[1] for _ in range(3)}
    assert len(served_by) == 1                      # affinity: the same replica each time
    owner = served_by.pop()
    text = metrics(url)
    assert value(text, "kvrun_cluster_route_decisions_total", kind="affinity") >= 2
    with client(url).chat.completions.with_streaming_response.create(
            model=NAME, messages=[{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": q}],
            max_tokens=CTX // 2, temperature=0, stream=True) as r:
        assert r.headers["x-kvrun-replica"] == owner
        next(iter(r.parse()))                       # in flight on the owner: over bound 0
        assert ask(client(url), q, n=2)[1] != owner
    assert value(metrics(url), "kvrun_cluster_route_decisions_total", kind="spill") >= 1


def test_node_removed_leaves_the_service_up(cluster):
    """The worker node (one replica, maybe the ingress or the store) leaves: requests are
    answered by what is left within a bounded time, none hangs."""
    url, c, worker = cluster
    c.remove_node(worker)
    deadline, answered = time.monotonic() + 90, 0
    while answered < 2:
        try:
            answered += bool(ask(client(url), "Any bread left?", n=2)[0])
        except openai.APIError:
            assert time.monotonic() < deadline, "the service did not come back without the node"
            time.sleep(1)
