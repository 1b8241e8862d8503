"""`kvrun serve --cache-ram` through the official `openai` client: a bounded load test (32
chat requests, 8 at a time, four shared system prompts) where no request fails and every
reply equals the same request's output run alone on a cold cache; a conversation's next
turn starts from the cache; /metrics shows the hits."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.register_assert_rewrite("hostile_serving")

import kvrun  # noqa: E402
from serving import openai_client, served  # noqa: E402
from test_serve_features import scrape  # noqa: E402

NAME = "smol"
CTX = 512
CHUNK = 64
KV = "kivi-4"
N_GEN = 8
pytestmark = pytest.mark.usefixtures("one_thread_cap")       # conftest.py


@pytest.fixture(scope="module")
def model():
    return kvrun.load(ctx=CTX, kv=KV, prefill_chunk=CHUNK)


@pytest.fixture(scope="module")
def server(model):
    with served(model, NAME, parallel=8, max_queue=64, ctx=CTX, kv=KV, cache_ram_mb=64) as s:
        yield s


@pytest.fixture()
def client(server):
    return openai_client(server[0], 300)


def alone(model, msgs) -> str:
    """The request's greedy reply decoded alone, on a fresh cache without any prefix cache."""
    ids = model.tokenizer.encode_parts(model.template.render_parts(msgs))
    return model.generate_batch([ids], N_GEN, temp=0)[0]


def ask(client, msgs) -> str:
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=N_GEN, temperature=0)
    return r.choices[0].message.content


def test_load_with_shared_prefixes(client, server, model, wikitext):
    systems = [wikitext[4000 + 1500 * i: 4000 + 1500 * i + 450] for i in range(4)]
    reqs = [[{"role": "system", "content": systems[i % 4]},
             {"role": "user", "content": f"Question {i}: what is {i} plus {i % 7}?"}]
            for i in range(32)]
    before = scrape(server[0])
    with ThreadPoolExecutor(8) as pool:
        served = list(pool.map(lambda msgs: ask(client, msgs), reqs))   # raises on any 5xx
    want = [alone(model, msgs) for msgs in reqs]
    assert served == want
    after = scrape(server[0])

    def moved(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)
    hits = moved("kvrun_prefix_cache_requests_total", (("hit", "true"),))
    # each system prompt's first requests (8 at once) run before anything is cached; the
    # others start at least at a chunk boundary inside their system prompt
    assert hits >= 16 and moved("kvrun_prefix_cache_hits_total") >= hits * CHUNK
    assert moved("kvrun_prefix_cache_queries_total") >= moved("kvrun_prefix_cache_hits_total")
    assert 0 < after[("kvrun_prefix_cache_bytes", ())] <= 64 << 20


def test_next_turn_starts_from_the_cache(client, server, model, wikitext):
    sched = server[1]
    msgs = [{"role": "system", "content": wikitext[20000:20800]},
            {"role": "user", "content": "Summarise this in one line."}]
    first = ask(client, msgs)
    assert first == alone(model, msgs)
    before = sched.prefix.stats()
    msgs += [{"role": "assistant", "content": first}, {"role": "user", "content": "Shorter."}]
    second = ask(client, msgs)
    after = sched.prefix.stats()
    assert second == alone(model, msgs)
    assert after["hits"] == before["hits"] + 1
    # at least the first turn's prompt up to its last chunk boundary was not prefilled again
    ids = model.tokenizer.encode_parts(model.template.render_parts(msgs[:2]))
    assert after["hit_tokens"] - before["hit_tokens"] >= (len(ids) - 1) // CHUNK * CHUNK
