"""The prefix cache across requests (runtime/engine/prefix_cache.py): a request that starts
from a cached prefix gives, greedy, exactly the cold request's output, for fp16, int8,
kivi-4 and auto on the default model; it does start from the cache (a chat's next turn, a
shared system prompt); the byte budget holds (LRU); caches it cannot hold are skipped."""
from __future__ import annotations

import pytest

import kvrun
from kvrun.engine.prefix_cache import PrefixCache
from kvrun.engine.sampling import SamplingParams
from kvrun.engine.scheduler import Scheduler
from kvrun.errors import KvrunError
from conftest import PREFIX_CHUNK

CHUNK = PREFIX_CHUNK
GREEDY = SamplingParams(temp=0)
pytestmark = pytest.mark.usefixtures("one_thread_cap")       # conftest.py


@pytest.fixture(scope="module")
def m(chunked_default):                                       # conftest.py
    return chunked_default


@pytest.fixture(scope="module")
def base(m, wikitext):
    return m.tokenize(wikitext[3000:9000])[:197]


def _run(sched, prompt, n=12):
    r = sched.submit(prompt, n, GREEDY)
    sched.run()
    assert r.finish_reason in ("stop", "length"), r.error
    return r.text, r.seq.start


@pytest.mark.parametrize("kv", ["fp16", "int8", "kivi-4", "auto"])
def test_warm_requests_equal_cold_ones(m, base, kv):
    cold = Scheduler(m, parallel=1, ctx=1024, kv=kv)
    warm = Scheduler(m, parallel=1, ctx=1024, kv=kv, cache_ram_mb=64)
    starts = []
    p = base + m.tokenize(" Question 0:", bos=False)
    for _ in range(3):                      # a conversation: each turn extends the last
        want, _ = _run(cold, p)
        got, start = _run(warm, p)
        assert got == want
        starts.append(start)
        p = p + m.tokenize(want, bos=False) + m.tokenize(" And then?", bos=False)
    for i in (1, 2):                        # other questions after the same long prefix
        q = base + m.tokenize(f" Question {i}:", bos=False)
        want, _ = _run(cold, q)
        got, start = _run(warm, q)
        assert got == want
        starts.append(start)
    assert starts[0] == 0
    # every later request resumed at least at the shared prefix's last chunk boundary
    assert all(s >= len(base) // CHUNK * CHUNK for s in starts[1:]), starts
    st = warm.prefix.stats()
    assert st["requests"] == 5 and st["hits"] == 4 and st["hit_tokens"] == sum(starts)
    assert 0 < st["bytes"] <= st["budget_bytes"]


def test_budget_is_kept_least_recently_used_first(m, base):
    s = Scheduler(m, parallel=1, ctx=1024, kv="kivi-4", cache_ram_mb=64)
    _run(s, base, 2)
    one = s.prefix.used
    assert one > 0
    s.prefix.budget = int(2.5 * one)         # room for about two requests' entries
    for i in range(4):
        _run(s, m.tokenize(f"Topic {i}. ", bos=False) + base, 2)
    st = s.prefix.stats()
    assert 0 < st["bytes"] <= s.prefix.budget
    # the newest entry is kept, the oldest (the first prompt's) went first
    assert any(e.tokens[:3] == tuple(m.tokenize("Topic 3. ", bos=False))[:3]
               for e in s.prefix.entries.values())
    assert not any(e.tokens[:len(base) // CHUNK * CHUNK] == tuple(base[:len(base) // CHUNK * CHUNK])
                   for e in s.prefix.entries.values())


def test_evicting_caches_and_prompt_logprobs_bypass_it(m, base):
    from kvrun.kv.config import parse_kv
    s = Scheduler(m, parallel=1, ctx=1024, kv=parse_kv("kivi-4", evict="h2o", budget=256),
                  cache_ram_mb=64)
    _run(s, base, 2)
    assert s.prefix.stats()["entries"] == 0          # refused by the snapshot, not an error
    s = Scheduler(m, parallel=1, ctx=1024, kv="fp16", cache_ram_mb=64)
    _run(s, base, 2)
    r = s.submit(base + [42], 2, GREEDY, prompt_logprobs=1)
    s.run()
    assert r.seq.start == 0 and len(r.prompt_logprobs) == len(base) + 1


def test_bad_budget():
    with pytest.raises(KvrunError, match="cache-ram"):
        PrefixCache(-1)


@pytest.mark.parametrize("kv", ["fp16", "kivi-4"])
def test_gemma_rings_warm_equal_cold(wikitext, kv):
    try:
        g = kvrun.load("gemma-3-270m", ctx=8, prefill_chunk=128)
    except KvrunError as e:
        pytest.skip(f"gemma-3-270m is not available here: {e}")
    base = g.tokenize(wikitext[3000:12000])[:540]          # past the 512-slot rings
    cold = Scheduler(g, parallel=1, ctx=640, kv=kv)
    warm = Scheduler(g, parallel=1, ctx=640, kv=kv, cache_ram_mb=128)
    for i in range(2):
        p = base + g.tokenize(f" Question {i}: why?", bos=False)
        want, _ = _run(cold, p, 10)
        got, start = _run(warm, p, 10)
        assert got == want and start == (0 if i == 0 else 512)
