"""Structured output: `response_format` json_object / json_schema in `kvrun serve` and
`json_schema=` in the library. One grammar state per sequence however the batch mixes them
(runtime/engine/grammar.py, batch.py; the grammar alone: test_grammar.py, the mask in
sampling: test_sampling.py), greedy replies that parse and validate on the default model, through the official `openai`
client, and a 400 naming `response_format` for anything that cannot be served."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.register_assert_rewrite("hostile_serving")

from kvrun.engine import grammar as grammar_mod  # noqa: E402
from kvrun.engine.sampling import SamplingParams  # noqa: E402
from kvrun.engine.scheduler import Scheduler  # noqa: E402
from hostile_serving import call, openai_error  # noqa: E402
from serving import default_model_server  # noqa: E402
from test_grammar import PERSON  # noqa: E402

NAME = "smol"
CTX = 256
TIMEOUT = 180

COLORS = {"type": "object", "properties": {"colors": {
    "type": "array", "items": {"enum": ["red", "green", "blue", "yellow", "black", "white"]},
    "minItems": 1, "maxItems": 3}}, "required": ["colors"], "additionalProperties": False}
ASK_PERSON = [{"role": "user", "content": "Give the name and age of a person as JSON."}]
ASK_COLORS = [{"role": "user", "content": "Name some colors."}]


def rf(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


# -- the states in a batch (the tiny model: a byte-level vocabulary of 259) ------------------
def test_each_batch_row_keeps_its_own_constraint(tiny):
    """Rows with different schemas, none, and two sharing one compiled schema (as `n` > 1
    and generate_batch share it), decoded in one batch: each row's tokens equal its run
    alone, and every constrained row stays inside its grammar."""
    person, colors = tiny.grammars.json_schema(PERSON), tiny.grammars.json_schema(COLORS)
    specs = [(person, 0.0), (colors, 0.0), (None, 0.0), (person, 0.9), (colors, 1.2), (None, 0.8)]
    prompts = [tiny.tokenize(s) for s in ("a", "bc", "def", "gh", "ijk", "lmnop")]

    def submit(sched, i):
        g, temp = specs[i]
        return sched.submit(prompts[i], 24, SamplingParams(temp=temp, seed=i), grammar=g)

    def ids(r):
        return r.seq.tokens
    together = Scheduler(tiny, parallel=len(specs), ctx=128, kv="fp32")
    reqs = [submit(together, i) for i in range(len(specs))]
    together.step()                                     # all admitted at the first step
    assert len(together.running) == len(specs)
    together.run()
    for i, r in enumerate(reqs):
        alone = Scheduler(tiny, parallel=1, ctx=128, kv="fp32")
        ref = submit(alone, i)
        alone.run()
        assert ids(r) == ids(ref) and r.finish_reason == ref.finish_reason, i
        if specs[i][0] is not None:
            state = specs[i][0].start()
            for t in ids(r):
                assert state.allowed()[t], (i, t)
                state.accept(t)


# -- the default model ---------------------------------------------------------------------------
model, server, client = default_model_server(NAME, CTX, TIMEOUT)


def valid(text: str, schema: dict):
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def test_library_greedy_json_validates(model):
    model.reset()
    out = model.chat(ASK_PERSON, 96, temp=0, json_schema=PERSON)
    assert set(valid(out, PERSON)) == {"name", "age"}
    model.reset()
    free = model.chat(ASK_PERSON, 24, temp=0)
    assert not free.lstrip().startswith("{")            # the schema is what made it JSON
    prompts = ["A person as JSON:", "Colors as JSON:"]
    batch = model.generate_batch(prompts, 64, temp=0, json_schema=COLORS)
    for p, b in zip(prompts, batch):
        model.reset()
        assert b == model.generate(p, 64, temp=0, json_schema=COLORS)
        valid(b, COLORS)


def test_chat_json_schema_through_openai(client, model):
    r = client.chat.completions.create(model=NAME, messages=ASK_PERSON, max_tokens=96,
                                       temperature=0, response_format=rf(PERSON))
    c = r.choices[0]
    assert c.finish_reason == "stop"
    valid(c.message.content, PERSON)
    model.reset()
    assert c.message.content == model.chat(ASK_PERSON, 96, temp=0, json_schema=PERSON)
    chunks = list(client.chat.completions.create(model=NAME, messages=ASK_PERSON, max_tokens=96,
                                                 temperature=0, response_format=rf(PERSON),
                                                 stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == c.message.content


def test_json_object_chat_and_completions(client):
    # json_object bounds no key: the default model may list keys until max_tokens, so the
    # reply is checked as an object while open, and parsed whole when it ended
    r = client.chat.completions.create(model=NAME, messages=ASK_PERSON, max_tokens=96,
                                       temperature=0, response_format={"type": "json_object"})
    c = r.choices[0]
    assert c.message.content.lstrip().startswith("{")
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    r = client.completions.create(model=NAME, prompt="Colors as JSON:", max_tokens=64,
                                  temperature=0, extra_body={"response_format": rf(COLORS)})
    assert r.choices[0].finish_reason == "stop"
    valid(r.choices[0].text, COLORS)
    r = client.completions.create(model=NAME, prompt="Colors as JSON:", max_tokens=64,
                                  temperature=0, extra_body={"response_format": {"type": "text"}})
    assert not r.choices[0].text.lstrip().startswith("{")
    any_value = {"type": "json_schema", "json_schema": {"name": "any"}}     # no schema: any JSON
    r = client.completions.create(model=NAME, prompt="The answer in JSON:", max_tokens=64,
                                  temperature=0, extra_body={"response_format": any_value})
    assert r.choices[0].finish_reason == "stop"
    json.loads(r.choices[0].text)


def test_sampled_choices_stay_valid(client):
    r = client.chat.completions.create(model=NAME, messages=ASK_COLORS, max_tokens=64, n=3,
                                       temperature=1.0, seed=5, response_format=rf(COLORS))
    assert all(c.finish_reason == "stop" for c in r.choices)
    values = [valid(c.message.content, COLORS) for c in r.choices]
    assert len({c.message.content for c in r.choices}) > 1, values     # three samples


def test_concurrent_requests_equal_their_single_outputs(client):
    """Schemas that differ, json_object, no format and n > 1 at once: every reply equals the
    one it gets alone."""
    chat = client.chat.completions.create
    jobs = [
        lambda: chat(model=NAME, messages=ASK_PERSON, max_tokens=64, temperature=0,
                     response_format=rf(PERSON)).choices[0].message.content,
        lambda: chat(model=NAME, messages=ASK_COLORS, max_tokens=64, temperature=0,
                     response_format=rf(COLORS)).choices[0].message.content,
        lambda: chat(model=NAME, messages=ASK_COLORS, max_tokens=40,
                     temperature=0).choices[0].message.content,
        lambda: client.completions.create(
            model=NAME, prompt="A cat as JSON:", max_tokens=64, temperature=0,
            extra_body={"response_format": {"type": "json_object"}}).choices[0].text,
        lambda: [c.message.content for c in chat(
            model=NAME, messages=ASK_COLORS, max_tokens=64, n=2, temperature=0.9, seed=3,
            response_format=rf(COLORS)).choices],
    ]
    alone = [job() for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: job(), jobs * 2))
    assert together == alone * 2
    valid(alone[0], PERSON)
    valid(alone[1], COLORS)
    assert not alone[2].lstrip().startswith("{")
    assert isinstance(json.loads(alone[3]), dict)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("fmt", [
    {"type": "xml"}, {"type": "json_object", "schema": {}}, {"type": "json_schema"},
    {"type": "json_schema", "json_schema": {"schema": [1]}},
    {"type": "json_schema", "json_schema": {"name": 3, "schema": {}}},
    {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}},
    {"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}},
    {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}},
    {"type": "json_schema", "json_schema": {"schema": {"not": {"type": "string"}}}},
    {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(("}}},
    {"type": "json_schema", "json_schema": {"schema": {"$ref": "https://example.org/s.json"}}},
    {"type": "json_schema", "json_schema": {"schema": {"$ref": "#"}}},
    "json", ["json_object"]])
def test_bad_response_format_is_400(server, path, fmt):
    base = {"messages": ASK_PERSON} if "chat" in path else {"prompt": "hi"}
    status, _, got = call(server[0], "POST", path, {**base, "max_tokens": 2,
                                                    "response_format": fmt})
    assert "response_format" in openai_error(status, got, 400, "response_format")


def test_without_the_library_the_server_says_so(server, monkeypatch):
    monkeypatch.setattr(grammar_mod, "llguidance", None)
    status, _, got = call(server[0], "POST", "/v1/chat/completions",
                          {"messages": ASK_PERSON, "max_tokens": 2,
                           "response_format": {"type": "json_object"}})
    assert "llguidance" in openai_error(status, got, 400, "response_format")
    status, _, got = call(server[0], "POST", "/v1/chat/completions",
                          {"messages": ASK_PERSON, "max_tokens": 2,
                           "response_format": {"type": "text"}})
    assert status == 200, got
