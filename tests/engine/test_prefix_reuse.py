"""Prefix reuse is exact: greedy output with the cache reused equals the
output after reset(), for every codec, in repeated generations and in chat turns; and it
still reuses the prefix where that is exact (the dense cache, a window not yet flushed)."""
import json

import pytest
import torch

import kvrun
from kvrun.engine.chat_session import ChatSession
from kvrun.engine.generate import Timings
from kvrun.kv.config import parse_kv
from kvrun.engine.sampling import SamplingParams
from tiny import make_tiny_model_dir

METHODS = ["fp16", "int8", "kivi-4", "kivi-2", "kivi-3/cb-3", "tada-4", "gear-l", "gear", "kivi-4+rot", "cb-3",
           "profile"]
GREEDY = SamplingParams(temp=0)


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory):
    """Head dim 32 (the packed codecs need D a multiple of 32)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("reuse") / "tiny", hidden_size=128)


def _kv(method, tmp_path, **kw):
    if method == "profile":                      # different codecs per layer
        p = tmp_path / "p.json"
        p.write_text(json.dumps({"format": "kvrun-kv-profile",
                                 "layers": [{"k": "kivi-4", "v": "kivi-2"}, {"k": "int8", "v": "tada-4"}]}))
        return parse_kv("fp16", profile=str(p), residual=32, group=32, **kw)
    return parse_kv(method, residual=32, group=32, **kw)


def _ids(n, seed=0):
    return torch.randint(3, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(m, ids, n=40):
    """Greedy token ids (no stop token: the random model's EOS would end runs early)."""
    return [t for t, _ in m.engine.tokens(ids, n, GREEDY, set(), Timings())]


@pytest.mark.parametrize("method", METHODS)
def test_repeated_generation_equals_generation_after_reset(tiny32, tmp_path, method):
    m = kvrun.load(tiny32, dtype="fp32", ctx=1024, kv=_kv(method, tmp_path), prefill_chunk=48)
    prompt = _ids(150)                           # 3 chunks + a short one; flushes in prefill
    first = _run(m, prompt)
    again = [_run(m, prompt), _run(m, prompt)]   # the cache holds prompt + 39 generated ids
    longer = _run(m, prompt + first[:20])        # a prompt that extends the previous one
    m.reset()
    assert again == [first, first]
    assert longer == _run(m, prompt + first[:20])
    m.reset()
    assert _run(m, prompt) == first


@pytest.mark.parametrize("method", METHODS)
def test_chat_turns_with_reuse_equal_turns_after_reset(tiny32, tmp_path, method):
    m = kvrun.load(tiny32, dtype="fp32", ctx=1024, kv=_kv(method, tmp_path), prefill_chunk=48)
    user1 = "hello there, " * 12
    msgs = [{"role": "user", "content": user1}]
    r1 = m.chat(msgs, max_tokens=30, temp=0)
    msgs2 = msgs + [{"role": "assistant", "content": r1}, {"role": "user", "content": "and then?"}]
    r2 = m.chat(msgs2, max_tokens=30, temp=0)    # reuses what is exact of turn 1
    r1_again = m.chat(msgs, max_tokens=30, temp=0)
    m.reset()
    assert m.chat(msgs2, max_tokens=30, temp=0) == r2
    m.reset()
    assert r1_again == r1 == m.chat(msgs, max_tokens=30, temp=0)


@pytest.mark.parametrize("method", ["fp16", "kivi-2", "tada-4"])
def test_chat_session_replays_the_same_after_reset(tiny32, tmp_path, method):
    """A session's turns continue the cache as it stands (no re-prefill of the past); the
    same turns after /reset give the same replies."""
    m = kvrun.load(tiny32, dtype="fp32", ctx=2048, kv=_kv(method, tmp_path), prefill_chunk=48)
    s = ChatSession(m, system="be brief")
    turns = ["first question " * 8, "second", "third one, longer " * 5]

    def replay():
        out = []
        for t in turns:
            out.append("".join(ev.text for ev in s.reply(t, 24, temp=0)))
            assert s.m.engine.cached == s.ids[:len(s.m.engine.cached)]
        return out
    a = replay()
    n_prompt = s.m.engine.cached
    s.reset()
    assert s.m.engine.cached == [] and replay() == a
    assert len(n_prompt) > 150                 # the conversation flushed to the tail


def test_reuse_still_happens_where_it_is_exact(tiny32, tmp_path):
    prompt = _ids(100)
    # dense cache: everything is held in full precision, the whole common prefix is reused
    m = kvrun.load(tiny32, dtype="fp32", ctx=1024, kv="fp16", prefill_chunk=48)
    _run(m, prompt, 8)
    assert m.engine.reuse_prefix(prompt + [5, 6]) == len(prompt)
    # compressed, nothing flushed yet (window R + G = 64 > 40 tokens): reused too
    m = kvrun.load(tiny32, dtype="fp32", ctx=1024, kv=_kv("kivi-2", tmp_path), prefill_chunk=48)
    _run(m, prompt[:30], 8)
    assert m.engine.reuse_prefix(prompt[:30] + [5]) == 30
    # flushed past what a fresh prefill of the new prompt would hold compressed: re-prefill
    _run(m, prompt, 40)
    assert m.cache.n_tail[0] > 0
    assert m.engine.reuse_prefix(prompt) == 0
    assert m.cache.seq_len == 0 and m.engine.cached == []


def test_resume_point_is_where_a_fresh_prefill_holds_the_same_tail(tiny32, tmp_path):
    """A long prompt resumed inside its last chunk: the compressed tail then equals the one
    a fresh prefill had at that chunk's start, so the reuse is kept (no full re-prefill)."""
    m = kvrun.load(tiny32, dtype="fp32", ctx=1024, kv=_kv("kivi-4", tmp_path), prefill_chunk=96)
    a = m.cache
    prompt = _ids(200)
    m.engine.prefill(prompt[:192])               # chunks [0, 96), [96, 192): tail t(192)
    assert a.n_tail[0] == a.canonical_tail(192) == 160
    n = m.engine.reuse_prefix(prompt)            # fresh: chunk [192, 200) sees t(192)
    assert n == 192 and a.n_tail[0] == a.canonical_tail(192)
