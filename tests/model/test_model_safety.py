"""A Model under misuse: two threads, interleaved streams, token ids outside the
vocabulary. Each either works as if the calls were made one after the other or raises
KvrunError; none returns garbage silently."""
from __future__ import annotations

import threading

import pytest

import kvrun


def test_two_threads_get_what_sequential_calls_get(tiny):
    prompts = ["hello there", "once upon a time in a land"]
    want = [tiny.generate(p, 24, temp=0) for p in prompts]
    got = [None, None]

    def run(i):
        for _ in range(3):
            got[i] = tiny.generate(prompts[i], 24, temp=0)
            assert got[i] == want[i]

    ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert got == want


def test_interleaved_streams_in_one_thread_raise(tiny):
    want = tiny.generate("hello there", 8, temp=0)
    a = tiny.stream("hello there", 8, temp=0)
    first = next(a).text
    b = tiny.stream("once upon a time", 8, temp=0)
    with pytest.raises(kvrun.KvrunError, match="already streaming"):
        next(b)
    with pytest.raises(kvrun.KvrunError, match="already streaming"):
        tiny.logits([1, 2, 3])
    assert first + "".join(ev.text for ev in a) == want     # the first stream is intact


def test_a_closed_stream_frees_the_model(tiny):
    want = tiny.generate("once upon a time", 8, temp=0)
    a = tiny.stream("hello there", 8, temp=0)
    next(a)
    a.close()
    assert tiny.generate("once upon a time", 8, temp=0) == want
    for ev in tiny.stream("hello there", 8, temp=0):
        break                                   # an abandoned loop closes its iterator
    assert tiny.generate("once upon a time", 8, temp=0) == want


@pytest.mark.parametrize("ids", [[10 ** 9], [-1], [1, 2, 10 ** 6], [1.5], [True], ["a"]])
def test_token_ids_outside_the_vocabulary_are_refused(tiny, ids):
    for call in (lambda: tiny.generate(ids, 2, temp=0), lambda: tiny.logits(ids),
                 lambda: tiny.generate_batch([ids], 2, temp=0)):
        with pytest.raises(kvrun.KvrunError, match="vocabulary"):
            call()


@pytest.mark.parametrize("n", [-1, 2.5, None, True])
def test_bad_max_tokens(tiny, n):
    with pytest.raises(kvrun.KvrunError, match="-n"):
        tiny.generate("hi", n, temp=0)


@pytest.mark.parametrize("kv", ["fp16", "int8", "tada-4"])
def test_a_context_larger_than_memory_is_one_error(tiny_dir, kv):
    """The cache's bytes are computed before it is allocated: -c 1099511627776 was a
    RuntimeError from torch's allocator (and a large kivi-4 cache was killed by the OS)."""
    with pytest.raises(kvrun.KvrunError, match="more than this machine"):
        kvrun.load(tiny_dir, dtype="fp32", ctx=1 << 40, kv=kv)


@pytest.mark.parametrize("kw", [dict(ctx=10.5), dict(ctx="10"), dict(ctx=float("nan")),
                                dict(prefill_chunk="a"), dict(prefill_chunk=0), dict(kv=4),
                                dict(kv=None), dict(threads="2"), dict(path=5)])
def test_bad_load_arguments_are_one_error(tiny_dir, kw):
    """Each was a TypeError or AttributeError from deep inside torch or the parser."""
    kw = {"path": tiny_dir, "dtype": "fp32", "ctx": 16, "kv": "fp32"} | kw
    with pytest.raises(kvrun.KvrunError):
        kvrun.load(**kw)


@pytest.mark.parametrize("call", [
    lambda m: m.generate(None, 2),
    lambda m: m.generate(b"hello", 2),
    lambda m: m.generate("hi", 2, stop=5),
    lambda m: m.generate("hi", 2, temperature=0.5),       # OpenAI's name, not kvrun's
    lambda m: m.generate_batch("hi", 2),
    lambda m: m.tokenize(None),
    lambda m: m.detokenize([-1]),
])
def test_bad_library_calls_are_one_error(tiny, call):
    with pytest.raises(kvrun.KvrunError):
        call(tiny)


@pytest.mark.parametrize("temp", [1e-300, 1e-45, 1e300])
def test_extreme_temperatures_sample(tiny, temp):
    """A temperature below float32's range divided the logits by zero (NaN probabilities,
    RuntimeError); tiny ones are greedy, huge ones draw from the kept tokens."""
    out = tiny.generate("hello", 4, temp=temp, seed=3, top_k=0, top_p=1.0, min_p=0.0)
    if temp < 1:
        assert out == tiny.generate("hello", 4, temp=0)


@pytest.mark.parametrize("penalty", [1e-300, 1e-320, 1e300])
def test_extreme_repeat_penalties_sample(tiny, penalty):
    """A penalty that overflows float32 made the penalized logits ±inf and the sampler's
    probabilities NaN (a RuntimeError; a 500 for that server request)."""
    out = tiny.generate("hello hello hello", 6, temp=0.8, seed=1, repeat_penalty=penalty)
    assert isinstance(out, str)


def test_lone_surrogates_read_as_replacement_characters(tiny):
    """'caf\\udce9' (a surrogateescape decode of Latin-1 bytes) was a TypeError from the
    Rust tokenizer; it is read as U+FFFD, and a valid pair as its character."""
    assert tiny.tokenize("caf\udce9") == tiny.tokenize("caf\ufffd")
    assert tiny.tokenize("\ud83d\ude00") == tiny.tokenize("\U0001F600")
    assert tiny.generate("caf\udce9", 3, temp=0) == tiny.generate("caf\ufffd", 3, temp=0)


@pytest.mark.parametrize("budget", [float("nan"), float("inf"), "256"])
def test_batch_budget_must_be_a_finite_number(tiny, budget):
    with pytest.raises(kvrun.KvrunError, match="kv-budget-mb"):
        tiny.generate_batch(["hi"], 2, kv_budget_mb=budget)


def test_too_many_threads_is_one_error(tiny_dir):
    with pytest.raises(kvrun.KvrunError, match="at most"):
        kvrun.load(tiny_dir, dtype="fp32", ctx=16, kv="fp32", threads=10 ** 21)


# -- lengths are checked before the work they bound (issue 56) ----------------------------------

def test_an_over_long_text_is_refused_untokenized(tiny, monkeypatch):
    """A 50 MB prompt was tokenized (80 s, 6.5 GB) before the length check refused it."""
    from kvrun.engine.chat_session import ChatSession
    big = "word " * (tiny.tokenizer.max_text_chars(tiny.ctx) // 5 + 1)
    for name in ("encode", "encode_parts"):
        def no(x, *a, real=getattr(tiny.tokenizer, name), **k):
            assert len(str(x)) < len(big), "the long prompt was tokenized"
            return real(x, *a, **k)
        monkeypatch.setattr(tiny.tokenizer, name, no)
    for call in (lambda: tiny.generate(big, 2), lambda: tiny.stream(big, 2),
                 lambda: tiny.chat([{"role": "user", "content": big}], 2),
                 lambda: tiny.generate_batch(["ok", big], 2),
                 lambda: list(ChatSession(tiny).reply(big, 2))):
        with pytest.raises(kvrun.KvrunError, match="prompt too long"):
            call()


def test_logits_honours_the_context(tiny):
    """30k ids went through a fresh 30k-token fp32 cache (> 5 GB, > 600 s) at ctx 256."""
    with pytest.raises(kvrun.KvrunError, match="at most the context.s 256"):
        tiny.logits([1] * 257)
    assert tiny.logits([1] * 256).shape[0] == 256
