"""Measure the prefix cache and sessions on disk (docs/serve.md):

1. time to first token of a request whose first N tokens are cached, cold against warm,
   per KV method, and whether the warm reply equals the cold one (greedy);
2. bytes a cached prefix holds per token, tokens per GiB, and how many such prompts a
   --cache-ram budget holds;
3. a saved S-token session: its file size against fp16's, and restore + first token
   against re-prefilling it, with the output after restore checked against the
   uninterrupted run;
4. with --disk, a restart from --cache-dir files: a new Scheduler on the directory another
   one filled, time to first token restored from disk against cold, output checked; and
   the time to write the longest entry's file.

    python tools/prefix_cache_bench.py --cached 2048 --session 4096 -t 2
    python tools/prefix_cache_bench.py --kv auto --session 0 --disk -t 2

Text from $KVRUN_WIKITEXT (WikiText-2 test); numbers to stdout, one line each.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import kvrun
from kvrun.engine.generate import Timings
from kvrun.engine.sampling import SamplingParams
from kvrun.engine.scheduler import Scheduler

GREEDY = SamplingParams(temp=0)
GiB = 1 << 30


def text_ids(m, n: int, offset: int = 0) -> list[int]:
    path = os.environ.get("KVRUN_WIKITEXT") or "/work/shared/data/wikitext-2-test.raw"
    ids = m.tokenize(Path(path).read_text(encoding="utf-8")[offset:offset + 12 * n])
    assert len(ids) >= n, "not enough text"
    return ids[:n]


def one(sched, prompt, n_gen):
    r = sched.submit(prompt, n_gen, GREEDY)
    sched.run()
    return r


def ttft(m, kv, cached, tail, n_gen, ram_mb, reps):
    """Cold and warm TTFT (medians over `reps`) of a prompt whose first `cached` tokens
    another request (same prefix, other tail) left in the prefix cache."""
    prefix = text_ids(m, cached)
    ask = lambda i: prefix + text_ids(m, tail, 200000 + 3000 * i)     # noqa: E731
    cold, warm, same, entry = [], [], True, None
    for i in range(reps):
        c = Scheduler(m, parallel=1, ctx=cached + tail + n_gen, kv=kv)
        rc = one(c, ask(2 * i + 1), n_gen)
        w = Scheduler(m, parallel=1, ctx=cached + tail + n_gen, kv=kv, cache_ram_mb=ram_mb)
        one(w, ask(2 * i), 1)                                          # fills the cache
        rw = one(w, ask(2 * i + 1), n_gen)
        assert rw.seq.start == cached, (rw.seq.start, cached)
        cold.append(rc.ttft)
        warm.append(rw.ttft)
        same &= rc.text == rw.text
        entry = max(w.prefix.entries.values(), key=lambda e: len(e.tokens))
    return statistics.median(cold), statistics.median(warm), same, entry


def disk_ttft(m, kv, cached, tail, n_gen):
    """(cold TTFT, TTFT restored from a --cache-dir file in a new Scheduler, output equal,
    seconds to write the longest entry's file, its bytes)."""
    import json
    from kvrun.engine.session import write_session
    prefix = text_ids(m, cached)
    ask = lambda i: prefix + text_ids(m, tail, 200000 + 3000 * i)     # noqa: E731
    ctx = cached + tail + n_gen
    rc = one(Scheduler(m, parallel=1, ctx=ctx, kv=kv), ask(1), n_gen)
    with tempfile.TemporaryDirectory() as d:
        w = Scheduler(m, parallel=1, ctx=ctx, kv=kv, cache_ram_mb=256, cache_dir=d)
        one(w, ask(0), 1)                                              # writes the files
        e = max(w.prefix.entries.values(), key=lambda e: len(e.tokens))
        t0 = time.perf_counter()
        size = write_session(Path(d) / "x.tmpfile", w.prefix.disk.model, json.loads(e.key),
                             e.state, e.snap)
        write_s = time.perf_counter() - t0
        os.unlink(Path(d) / "x.tmpfile")
        r = Scheduler(m, parallel=1, ctx=ctx, kv=kv, cache_ram_mb=256, cache_dir=d)
        rw = one(r, ask(1), n_gen)                                     # a restarted server
        assert rw.seq.start == cached and r.prefix.disk.hits == 1, rw.seq.start
    return rc.ttft, rw.ttft, rc.text == rw.text, write_s, size


def session(m_load, kv, n, tmp):
    """(file bytes, re-prefill s, restore + first token s, output equal) for an n-token
    session."""
    m = m_load(kv)
    ids = text_ids(m, n)
    more = text_ids(m, 16, 300000)
    t0 = time.perf_counter()
    m.generate(ids, 1, temp=0)                                         # prefill + 1 token
    prefill_s = time.perf_counter() - t0
    m.engine.reset()
    m.generate(ids, 0, temp=0)                                         # the state to save
    size = m.save(tmp / f"{kv}.kvs")
    want = m.engine.tokens
    uninterrupted = [t for t, _ in want(ids + more, 16, GREEDY, set(), Timings(), True)]
    m2 = m_load(kv)
    t0 = time.perf_counter()
    m2.load_session(tmp / f"{kv}.kvs")
    first = next(iter(m2.engine.tokens(ids + more[:1], 1, GREEDY, set(),
                                       Timings(), True)))
    restore_s = time.perf_counter() - t0
    del first
    m2.load_session(tmp / f"{kv}.kvs")
    after = [t for t, _ in m2.engine.tokens(ids + more, 16, GREEDY, set(),
                                            Timings(), True)]
    return size, prefill_s, restore_s, after == uninterrupted


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--kv", default="fp16,int8,kivi-4,auto")
    ap.add_argument("--cached", type=int, default=2048, help="cached prefix tokens")
    ap.add_argument("--tail", type=int, default=40, help="uncached prompt tokens after it")
    ap.add_argument("-n", type=int, default=16, help="tokens generated")
    ap.add_argument("--ram-mb", type=float, default=256, help="the --cache-ram budget")
    ap.add_argument("--session", type=int, default=4096, help="session tokens (0: skip)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--disk", action="store_true", help="also measure a restart from --cache-dir")
    ap.add_argument("-b", "--chunk", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=None)
    a = ap.parse_args()
    kvs = a.kv.split(",")
    m = kvrun.load(a.model, ctx=8, prefill_chunk=a.chunk, threads=a.threads)
    print(f"# {m.path.name}, prefill chunk {a.chunk}, threads {a.threads or 'default'}")
    held = {}
    for kv in kvs:
        cold, warm, same, e = ttft(m, kv, a.cached, a.tail, a.n, a.ram_mb, a.reps)
        per_tok = e.nbytes / len(e.tokens)
        held[kv] = int(a.ram_mb * (1 << 20) // e.nbytes)
        print(f"ttft {kv:8s} cached {a.cached}: cold {cold:.3f} s, warm {warm:.3f} s, "
              f"ratio {warm / cold:.3f}, output equal {same}; "
              f"{per_tok:.0f} B/token, {GiB / per_tok:,.0f} tokens/GiB, "
              f"{held[kv]} such prompts in {a.ram_mb:g} MiB")
    for kv in kvs if a.disk else ():
        cold, warm, same, write_s, size = disk_ttft(m, kv, a.cached, a.tail, a.n)
        print(f"disk {kv:8s} cached {a.cached}: cold {cold:.3f} s, restored from disk {warm:.3f} s, "
              f"ratio {warm / cold:.3f}, output equal {same}; file {size / (1 << 20):.2f} MiB "
              f"written in {write_s:.3f} s")
    if "fp16" in held:
        for kv in kvs:
            print(f"held vs fp16 {kv:8s} {held[kv] / max(held['fp16'], 1):.2f}x")
    if a.session:
        def load(kv):
            return kvrun.load(a.model, ctx=a.session + 64, kv=kv, prefill_chunk=a.chunk,
                              threads=a.threads, cache_ram_mb=0)     # a cold re-prefill
        sizes = {}
        with tempfile.TemporaryDirectory() as d:
            for kv in kvs:
                size, pre, rest, same = session(load, kv, a.session, Path(d))
                sizes[kv] = size
                print(f"session {kv:8s} {a.session} tokens: file {size / (1 << 20):.2f} MiB"
                      + (f" ({size / sizes['fp16']:.3f}x fp16)" if "fp16" in sizes else "")
                      + f", re-prefill + first token {pre:.2f} s, restore + first token "
                      f"{rest:.3f} s ({rest / pre:.3f}x), output after restore equal {same}")


if __name__ == "__main__":
    main()
