"""`kvrun serve --ray` on a shared-prefix workload (docs/cluster.md): many users, a few long
system prompts; prefix-hit rate, time to first token p50/p99 and throughput, prefix-aware
routing against round robin; and the bytes the shared tier holds for a 2048-token prefix
per KV method (what a replica ships to / fetches from the store).

    python tools/cluster_bench.py --nodes 2 --node-cpus 2 --replicas 2 -t 2 \
        --systems 3 --system-tokens 1024 --users 32 --requests 96 --concurrency 8
    python tools/cluster_bench.py --bytes-only --kv fp16,auto
    python tools/cluster_bench.py --address HOST:6379 --replicas 4 ...   # a real cluster

Each routing policy gets a fresh deployment (empty caches, an empty shared tier) on the
same Ray cluster: a local ray.cluster_utils.Cluster of --nodes nodes unless --address names
one. Requests are streamed chat completions, greedy, --max-tokens each; a request's time
to first token is from sending it to its first content chunk. Hit rate is the replicas'
prompt tokens restored (RAM or shared tier) over prompt tokens looked up, from the
ingress's /metrics before and after (vLLM's convention). One line per result to stdout,
and --json FILE for a program. Under round robin it also times one --long-tokens prompt
cold on one replica and then restored from the shared tier on the other (restore + first
token against re-prefill). `--shared-mb 0` is the no-shared-tier baseline.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

WORDS = ("bread flour yeast oven crust crumb rye spelt wheat starter proof knead bake loaf "
         "butter salt water sugar honey seed oat barley malt dough shape score steam cool").split()


def system_prompts(n: int, tokens: int, seed: int = 0) -> list[str]:
    """n distinct system prompts of about `tokens` tokens each (~1.3 tokens per word)."""
    rng = random.Random(seed)
    return [f"You are bakery assistant number {i}. " +
            " ".join(rng.choice(WORDS) for _ in range(int(tokens / 1.3))) for i in range(n)]


def workload(systems: list[str], users: int, requests: int, seed: int = 1) -> list[list[dict]]:
    """`requests` chats: a user (of `users`) asks a short question under that user's system
    prompt (users spread evenly over the system prompts)."""
    rng = random.Random(seed)
    out = []
    for i in range(requests):
        u = rng.randrange(users)
        out.append([{"role": "system", "content": systems[u % len(systems)]},
                    {"role": "user", "content": f"User {u}, question {i}: which bread today?"}])
    return out


def scrape(base: str) -> dict:
    """Summed replica counters from the ingress's /metrics."""
    text = urllib.request.urlopen(base + "/metrics", timeout=60).read().decode()
    out = {}
    for name in ("kvrun_replica_prefix_cache_queries_total", "kvrun_replica_prefix_cache_hits_total",
                 "kvrun_replica_shared_tier_restores_total", "kvrun_replica_shared_tier_bytes_in_total",
                 "kvrun_replica_shared_tier_bytes_out_total"):
        out[name] = sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
    return out


def run_load(url: str, model: str, chats: list, concurrency: int, max_tokens: int) -> dict:
    import openai
    c = openai.OpenAI(base_url=url, api_key="none", timeout=600, max_retries=0)

    def one(msgs):
        t0 = time.perf_counter()
        ttft, n = None, 0
        for ch in c.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens,
                                            temperature=0, stream=True):
            if ch.choices and ch.choices[0].delta.content:
                ttft = ttft or time.perf_counter() - t0
                n += 1
        return ttft or time.perf_counter() - t0, n
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        res = list(ex.map(one, chats))
    wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in res)
    return {"requests": len(res), "wall_s": wall, "tokens": sum(r[1] for r in res),
            "ttft_p50_s": statistics.median(ttfts),
            "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "req_per_s": len(res) / wall, "tok_per_s": sum(r[1] for r in res) / wall}


def restore_vs_prefill(url: str, model: str, tokens: int) -> dict:
    """Time to first token of one long prompt (~`tokens` tokens) cold on one replica, then
    the same prompt on the next one (round robin), which restores it from the shared tier."""
    import openai
    c = openai.OpenAI(base_url=url, api_key="none", timeout=600, max_retries=0)
    msgs = [{"role": "user", "content": system_prompts(1, tokens, seed=7)[0]}]
    out = {}
    for k in ("cold", "restored"):
        t0 = time.perf_counter()
        with c.chat.completions.with_streaming_response.create(
                model=model, messages=msgs, max_tokens=1, temperature=0, stream=True) as r:
            for ch in r.parse():
                if ch.choices and (ch.choices[0].delta.content or ch.choices[0].finish_reason):
                    break           # the first token (not the role chunk that opens a chat)
            out[k + "_ttft_s"] = time.perf_counter() - t0
            out[k + "_replica"] = r.headers.get("x-kvrun-replica")
    return out


def bench_routing(args, routing: str, address: str, chats: list) -> dict:
    from kvrun.cluster.deploy import ClusterSpec, deploy, undeploy
    from kvrun.cluster.replica import ReplicaSpec
    ns = f"kvrun-bench-{routing}"
    url = deploy(ClusterSpec(address=address, replicas=args.replicas, port=args.port,
                             replica_cpus=args.node_cpus, routing=routing,
                             load_bound=args.load_bound),
                 ReplicaSpec(ctx=args.ctx, kv=args.kv.split(",")[0], parallel=args.parallel,
                             chunk=args.chunk, threads=args.threads, cache_ram=args.cache_ram,
                             shared_mb=args.shared_mb, alias="bench", namespace=ns))
    base = url[:-3]
    try:
        run_load(url, "bench", chats[:args.replicas], args.replicas, 1)      # warm up the path
        long = restore_vs_prefill(url, "bench", args.long_tokens) \
            if routing == "round-robin" and args.long_tokens else {}
        time.sleep(2.5)                                 # the replicas' reports
        before = scrape(base)
        res = run_load(url, "bench", chats, args.concurrency, args.max_tokens)
        time.sleep(2.5)
        after = scrape(base)
    finally:
        undeploy(ns)                                    # the cluster stays for the next policy
    d = {k: after[k] - before[k] for k in after}
    q = d["kvrun_replica_prefix_cache_queries_total"]
    res.update(long)
    res.update(routing=routing, hit_rate=d["kvrun_replica_prefix_cache_hits_total"] / q if q else 0.0,
               shared_restores=d["kvrun_replica_shared_tier_restores_total"],
               shared_bytes_in=d["kvrun_replica_shared_tier_bytes_in_total"],
               shared_bytes_out=d["kvrun_replica_shared_tier_bytes_out_total"])
    return res


def prefix_bytes(kv: str, n: int = 2048, chunk: int = 512, threads: int | None = None) -> dict:
    """Bytes of the shared tier's entry for an n-token prefix under `kv`: the session file
    a replica ships (header + the compressed bytes), and the snapshot's own bytes."""
    import kvrun
    from kvrun.engine.prefix_cache import kv_key
    from kvrun.engine.pull import ensure_default_model
    from kvrun.engine.scheduler import Scheduler
    from kvrun.engine.sampling import SamplingParams
    from kvrun.engine.session import kv_record, model_record, write_session
    m = kvrun.load(ensure_default_model(progress=None), ctx=1, kv="fp16", prefill_chunk=chunk,
                   threads=threads)
    sched = Scheduler(m, parallel=1, ctx=n + 64, kv=kv, cache_ram_mb=4096).start()
    try:
        ids = (m.tokenize(" ".join(system_prompts(1, n * 2)[0].split())) * 2)[:n + 1]
        sched.submit(ids, 1, SamplingParams(temp=0)).result(600)
        spec = sched.kv
        e = sched.prefix.entries[(kv_key(spec), tuple(ids[:n]))]
        with tempfile.TemporaryDirectory() as d:
            size = write_session(Path(d) / "e.kvpc", model_record(m), kv_record(spec), e.state, e.snap)
    finally:
        sched.shutdown()
    return {"kv": spec.label(), "tokens": n, "file_bytes": size, "snapshot_bytes": e.nbytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", default=None, help="a running Ray cluster (default: a local one)")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--node-cpus", type=float, default=1.0, help="CPUs per local node = per replica")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--routing", default="round-robin,prefix")
    ap.add_argument("--load-bound", type=int, default=4)
    ap.add_argument("--systems", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--long-tokens", type=int, default=2048,
                    help="round robin: one prompt this long cold, then restored (0: skip)")
    ap.add_argument("-c", "--ctx", type=int, default=4096)
    ap.add_argument("-b", "--chunk", type=int, default=256)
    ap.add_argument("-np", "--parallel", type=int, default=4)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--kv", default="fp16,auto", help="the first serves; all are measured for bytes")
    ap.add_argument("--cache-ram", type=float, default=256.0)
    ap.add_argument("--shared-mb", type=float, default=1024.0)
    ap.add_argument("--port", type=int, default=18300)
    ap.add_argument("--bytes-only", action="store_true", help="only the bytes per 2048-token prefix")
    ap.add_argument("--no-bytes", action="store_true", help="skip the bytes per 2048-token prefix")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    results = {"bytes": [], "routing": []}
    for kv in [] if args.no_bytes else args.kv.split(","):
        b = prefix_bytes(kv, threads=args.threads)
        results["bytes"].append(b)
        print(f"bytes per 2048-token prefix, kv {b['kv']}: {b['file_bytes']} (file), "
              f"{b['snapshot_bytes']} (KV), {b['file_bytes'] / results['bytes'][0]['file_bytes']:.2f}x "
              f"{results['bytes'][0]['kv']}", flush=True)
    if not args.bytes_only:
        if args.address is None:                # a local cluster: on 127.0.0.1 only
            from kvrun.cli.cluster_flags import local_ray_on_loopback
            local_ray_on_loopback()
        import ray
        cluster = None
        address = args.address
        if address is None:
            from ray.cluster_utils import Cluster
            cluster = Cluster(initialize_head=True, head_node_args={
                "num_cpus": args.node_cpus, "include_dashboard": False})
            for _ in range(args.nodes - 1):
                cluster.add_node(num_cpus=args.node_cpus)
            address = cluster.address
        ray.init(address=address, log_to_driver=False)
        chats = workload(system_prompts(args.systems, args.system_tokens), args.users, args.requests)
        try:
            for routing in args.routing.split(","):
                r = bench_routing(args, routing, address, chats)
                results["routing"].append(r)
                print(f"{routing:12s} hit rate {r['hit_rate']:.1%}  TTFT p50 {r['ttft_p50_s'] * 1e3:.0f} ms "
                      f"p99 {r['ttft_p99_s'] * 1e3:.0f} ms  {r['req_per_s']:.2f} req/s "
                      f"{r['tok_per_s']:.1f} tok/s  shared restores {r['shared_restores']:.0f} "
                      f"({r['shared_bytes_in'] / 2**20:.1f} MiB in, {r['shared_bytes_out'] / 2**20:.1f} MiB out)",
                      flush=True)
                if "restored_ttft_s" in r:
                    print(f"{args.long_tokens}-token prompt: cold TTFT {r['cold_ttft_s'] * 1e3:.0f} ms, "
                          f"restored from the shared tier on the other replica "
                          f"{r['restored_ttft_s'] * 1e3:.0f} ms", flush=True)
        finally:
            from ray import serve
            serve.shutdown()
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
