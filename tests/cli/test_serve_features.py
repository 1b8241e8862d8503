"""`kvrun serve`'s OpenAI features beyond plain text: logprobs (chat and the legacy
completions format, streamed and not) checked against the model's own log-softmax, `n`
choices, `stream_options.include_usage`, /tokenize and /detokenize, and /metrics; through the
official `openai` client on the default model, a real server in a thread."""
from __future__ import annotations


import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.register_assert_rewrite("hostile_serving")   # its asserts report as a test's do

from kvrun.engine.scheduler import Scheduler  # noqa: E402
from hostile_serving import call, openai_error  # noqa: E402
from serving import default_model_server  # noqa: E402

NAME = "smol"
CTX = 256
TIMEOUT = 120

# nats: the served logprobs (prefill's last row, then native decode steps over the
# sequence's fp32 cache) against Model.logits' one full forward differ by up to ~0.2 on the
# default model (other weight routes); a wrong position, or a distribution after
# temperature 0.5 or 2, is nats off
TOL = 0.3


model, server, client = default_model_server(NAME, CTX, TIMEOUT)


def greedy_ids(model, ids: list[int], n: int) -> list[int]:
    """The greedy continuation's token ids (stop tokens excluded), decoded alone."""
    model.reset()
    return [ev.token_id for ev in model.stream(ids, n, temp=0)
            if ev.token_id is not None and ev.token_id not in model.stop_ids]


def reference(model, prompt: list[int], gen: list[int]) -> torch.Tensor:
    """(len(gen), V) log-probabilities the model gives each generated token's position."""
    lg = model.logits(prompt + gen[:-1])[len(prompt) - 1:]
    return torch.log_softmax(lg.float(), dim=-1)


def chat_prompt(model, msgs) -> list[int]:
    return model.tokenizer.encode_parts(model.template.render_parts(msgs))


def check_chat_logprobs(model, content, prompt, gen, k):
    ref = reference(model, prompt, gen)
    assert len(content) == len(gen)
    for j, (e, t) in enumerate(zip(content, gen)):
        b = model.tokenizer.token_bytes(t)
        assert bytes(e.bytes) == b and e.token == b.decode("utf-8", "replace")
        assert abs(e.logprob - float(ref[j, t])) < TOL, (j, e.logprob, float(ref[j, t]))
        assert len(e.top_logprobs) == k
        if k:
            want = torch.topk(ref[j], k)
            got = [a.logprob for a in e.top_logprobs]
            torch.testing.assert_close(torch.tensor(got), want.values, atol=TOL, rtol=0)
            assert e.top_logprobs[0].token == e.token       # greedy: the best is the pick
            assert got == sorted(got, reverse=True)


def test_chat_logprobs(client, model):
    msgs = [{"role": "user", "content": "Name three colours."}]
    prompt = chat_prompt(model, msgs)
    gen = greedy_ids(model, prompt, 12)
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0,
                                       logprobs=True, top_logprobs=5)
    check_chat_logprobs(model, r.choices[0].logprobs.content, prompt, gen, 5)
    assert r.choices[0].message.content == model.detokenize(gen)
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12,
                                                 temperature=0, logprobs=True, stream=True))
    content = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    check_chat_logprobs(model, content, prompt, gen, 0)
    plain = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs(client, model):
    p = "The capital of France is"
    prompt = model.tokenize(p)
    gen = greedy_ids(model, prompt, 10)
    ref = reference(model, prompt, gen)
    r = client.completions.create(model=NAME, prompt=p, max_tokens=10, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    toks = [model.tokenizer.token_bytes(t).decode("utf-8", "replace") for t in gen]
    assert lp.tokens == toks and r.choices[0].text == "".join(toks)
    for j, t in enumerate(gen):
        assert abs(lp.token_logprobs[j] - float(ref[j, t])) < TOL, j
    assert lp.text_offset == [sum(map(len, toks[:j])) for j in range(len(toks))]
    for j, top in enumerate(lp.top_logprobs):
        want = torch.topk(ref[j], 3)
        assert len(top) == 3 and toks[j] in top
        torch.testing.assert_close(torch.tensor(sorted(top.values(), reverse=True)), want.values,
                                   atol=TOL, rtol=0)
    chunks = list(client.completions.create(model=NAME, prompt=p, max_tokens=10, temperature=0,
                                            logprobs=3, stream=True))
    streamed = {k: [x for c in chunks if c.choices[0].logprobs
                    for x in getattr(c.choices[0].logprobs, k)]
                for k in ("tokens", "token_logprobs", "text_offset")}
    # the same tokens and offsets; the values to fp32 summation order (the thread governor
    # may run the two requests on different thread counts)
    assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
    assert streamed["token_logprobs"] == pytest.approx(lp.token_logprobs, abs=1e-3)


def test_logprobs_are_the_models_not_the_samplers(client, model):
    """At temperature 1.5 with top-k 20 the reported logprobs stay the raw model's."""
    from kvrun.engine.sampling import SamplingParams
    p = "Once upon a time"
    prompt = model.tokenize(p)
    sched = Scheduler(model, parallel=1, ctx=CTX, kv="fp32")
    req = sched.submit(prompt, 8, SamplingParams(temp=1.5, top_k=20, top_p=1, min_p=0, seed=3))
    sched.run()
    gen = [ev.token_id for ev in req.events() if ev.token_id not in (None, *model.stop_ids)]
    r = client.completions.create(model=NAME, prompt=p, max_tokens=8, temperature=1.5, seed=3,
                                  logprobs=0, extra_body={"top_k": 20})
    lp = r.choices[0].logprobs
    assert lp.tokens == [model.tokenizer.token_bytes(t).decode("utf-8", "replace") for t in gen]
    ref = reference(model, prompt, gen)
    for j, t in enumerate(gen):
        assert abs(lp.token_logprobs[j] - float(ref[j, t])) < TOL, j
    assert lp.top_logprobs == [{}] * len(gen)


def test_echo_scores_the_prompt(client, model):
    """lm-eval-harness' loglikelihood request: echo + logprobs + max_tokens 0."""
    p = "The capital of France is Paris."
    ids = model.tokenize(p)
    ref = torch.log_softmax(model.logits(ids).float(), dim=-1)         # (T, V)
    r = client.completions.create(model=NAME, prompt=p, max_tokens=0, echo=True, logprobs=2)
    c, lp = r.choices[0], r.choices[0].logprobs
    toks = [model.tokenizer.token_bytes(t).decode("utf-8", "replace") for t in ids]
    assert c.text == p and lp.tokens == toks and r.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]     # the same prefill: exact
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), want, atol=1e-3, rtol=0)
    for j in range(1, len(ids)):
        torch.testing.assert_close(torch.tensor(sorted(lp.top_logprobs[j].values(), reverse=True)),
                                   torch.topk(ref[j - 1], 2).values, atol=1e-3, rtol=0)
    assert lp.text_offset == [sum(map(len, toks[:j])) for j in range(len(toks))]

    kw = dict(model=NAME, prompt=ids, max_tokens=4, echo=True, logprobs=1, temperature=0)
    whole = client.completions.create(**kw)
    wl = whole.choices[0].logprobs
    assert whole.choices[0].text.startswith(p) and len(whole.choices[0].text) > len(p)
    assert wl.tokens[:len(ids)] == toks and len(ids) < len(wl.tokens) <= len(ids) + 4
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text
    streamed = [x for ch in chunks if ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(wl.token_logprobs[1:], abs=1e-3)
    assert wl.token_logprobs[0] is None
    plain = client.completions.create(model=NAME, prompt=p, max_tokens=0, echo=True)
    assert plain.choices[0].text == p and plain.choices[0].logprobs is None


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2.5}, "top_logprobs"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": 1, "echo": "yes"}, "echo"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"top_logprobs": 2}, "top_logprobs"),
])
def test_bad_logprobs_are_400(server, path, body, param):
    base = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    status, _, got = call(server[0], "POST", path, {**base, "max_tokens": 2, **body})
    openai_error(status, got, 400, param)


def test_n_choices_equal_separate_requests(client):
    p = "Once upon a time"
    kw = dict(model=NAME, prompt=p, max_tokens=12, temperature=1.0, top_p=0.9)
    r = client.completions.create(n=3, seed=7, **kw)
    alone = [client.completions.create(n=1, seed=7 + i, **kw) for i in range(3)]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert len({c.text for c in r.choices}) > 1                 # three different samples
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens
    chunks = list(client.completions.create(n=3, seed=7, stream=True, **kw))
    texts, reasons = ["", "", ""], [None] * 3
    for c in chunks:
        (ch,) = c.choices
        texts[ch.index] += ch.text
        reasons[ch.index] = ch.finish_reason or reasons[ch.index]
    assert texts == [c.text for c in r.choices] and None not in reasons


def test_n_chat_stream_with_logprobs_and_usage(client):
    msgs = [{"role": "user", "content": "Say something short."}]
    kw = dict(model=NAME, messages=msgs, max_tokens=8, temperature=0.8, seed=11, logprobs=True,
              top_logprobs=2)
    whole = client.chat.completions.create(n=2, **kw)
    chunks = list(client.chat.completions.create(n=2, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    texts, lps = ["", ""], [[], []]
    for c in chunks[:-1]:
        (ch,) = c.choices
        texts[ch.index] += ch.delta.content or ""
        lps[ch.index] += ch.logprobs.content if ch.logprobs else []
    assert texts == [c.message.content for c in whole.choices]
    for i, c in enumerate(whole.choices):
        assert [e.token for e in lps[i]] == [e.token for e in c.logprobs.content]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("body,param", [({"n": 5}, "n"), ({"n": 0}, "n"), ({"n": "2"}, "n"),
                                        ({"n": 2.0}, "n"), ({"n": 2, "seed": (1 << 64) - 1}, "seed")])
def test_bad_n_is_400(server, body, param):
    status, _, got = call(server[0], "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, **body})
    openai_error(status, got, 400, param)


def test_include_usage(client, server):
    kw = dict(model=NAME, prompt="One, two,", max_tokens=6, temperature=0.5, seed=1, n=2)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    whole = client.completions.create(**kw)
    last = chunks[-1]
    assert last.choices == [] and last.usage.model_dump() == whole.usage.model_dump()
    assert whole.usage.completion_tokens > 6                   # both choices counted
    assert all(c.choices and c.usage is None for c in chunks[:-1])
    plain = list(client.completions.create(stream=True, stream_options={"include_usage": False}, **kw))
    assert all(c.choices and c.usage is None for c in plain)
    status, _, got = call(server[0], "POST", "/v1/completions",
                          {"prompt": "hi", "max_tokens": 2, "stream_options": {"include_usage": True}})
    openai_error(status, got, 400, "stream_options")


def test_tokenize_round_trip(server, model):
    port = server[0]
    text = "Héllo wörld, <|im_end|> 1234 €"
    status, _, got = call(port, "POST", "/tokenize", {"content": text})
    assert status == 200 and got["tokens"] == model.tokenize(text)
    assert model.tokenizer.token_id("<|im_end|>") in got["tokens"]      # read as a raw prompt
    status, _, back = call(port, "POST", "/detokenize", {"tokens": got["tokens"]})
    assert status == 200 and back == {"content": text}
    assert call(port, "POST", "/tokenize", {"content": ""})[2] == {"tokens": []}
    V = model.cfg.vocab_size
    for path, body, param in (("/detokenize", {"tokens": [1, V]}, "tokens"),
                              ("/detokenize", {"tokens": [-1]}, "tokens"),
                              ("/detokenize", {"tokens": [1.5]}, "tokens"),
                              ("/detokenize", {"tokens": "1 2"}, "tokens"),
                              ("/detokenize", {}, "tokens"),
                              ("/tokenize", {"content": 5}, "content"),
                              ("/tokenize", {}, "content"),
                              ("/tokenize", {"content": "x", "with_pieces": True}, "with_pieces"),
                              ("/tokenize", {"content": "x", "add_special": "yes"}, "add_special")):
        status, _, got = call(port, "POST", path, body)
        openai_error(status, got, 400, param)


def test_tokenize_and_metrics_have_the_other_routes_limits(model):
    from hostile_serving import start
    port, _, stop = start(model, api_key="k3y", max_body=1000)
    try:
        auth = {"Authorization": "Bearer k3y"}
        for path, body in (("/tokenize", {"content": "hi"}), ("/detokenize", {"tokens": [1]})):
            openai_error(*call(port, "POST", path, body)[::2], 401)
            assert call(port, "POST", path, body, headers=auth)[0] == 200
            openai_error(*call(port, "POST", path, b"{}", headers={**auth, "Content-Type":
                                                                      "text/plain"})[::2], 415)
        openai_error(*call(port, "GET", "/metrics")[::2], 401)            # as llama-server
        assert call(port, "GET", "/metrics", headers=auth)[0] == 200
        big = {"content": "x" * 2000}
        openai_error(*call(port, "POST", "/tokenize", big, headers=auth)[::2], 413)
    finally:
        stop()


def scrape(port: int, headers=None) -> dict:
    """{(name, labels as a sorted tuple): value} of every sample /metrics exposes."""
    from prometheus_client.parser import text_string_to_metric_families
    status, hdrs, raw = call(port, "GET", "/metrics", headers=headers)
    assert status == 200 and hdrs["content-type"].startswith("text/plain"), raw
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(raw.decode()) for s in fam.samples}


def test_metrics_move(client, server):
    import time
    port, sched = server
    before = scrape(port)
    ok = (("endpoint", "/v1/chat/completions"), ("status", "200"))
    bad = (("endpoint", "/v1/chat/completions"), ("status", "400"))
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=5, temperature=0, n=2)
    call(port, "POST", "/v1/chat/completions", {"messages": [], "max_tokens": 1})
    call(port, "GET", "/nowhere")
    deadline = time.monotonic() + 10                # the loop counts a sequence after its step
    while (after := scrape(port)).get(("kvrun_time_to_first_token_seconds_count", ()), 0) < \
            before.get(("kvrun_time_to_first_token_seconds_count", ()), 0) + 2:
        assert time.monotonic() < deadline, after
        time.sleep(0.05)

    def moved(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)
    assert moved("kvrun_requests_total", ok) == 1 and moved("kvrun_requests_total", bad) == 1
    assert moved("kvrun_requests_total", (("endpoint", "other"), ("status", "404"))) == 1
    assert moved("kvrun_generation_tokens_total") == r.usage.completion_tokens
    assert moved("kvrun_prompt_tokens_total") == 2 * r.usage.prompt_tokens     # one per choice
    assert after[("kvrun_requests_running", ())] == 0 == after[("kvrun_kv_cache_used_bytes", ())]
    assert ("kvrun_requests_waiting", ()) in after

    stream = client.completions.create(model=NAME, prompt="Count: 1, 2,", max_tokens=200,
                                       temperature=0, stream=True)
    next(iter(stream))                              # it runs now
    during = scrape(port)
    stream.close()
    assert during[("kvrun_requests_running", ())] == 1
    assert during[("kvrun_kv_cache_used_bytes", ())] > 0
