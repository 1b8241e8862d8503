"""Context shift in generation and chat: with `--ctx-policy shift` the
token loop and chat go on past -c for every cache, positions stay exact, memory stays the
arena's, and a prompt longer than what a shift keeps is one clear error."""
import json

import pytest
import torch
from torch.testing import assert_close

import kvrun
from kvrun.engine.chat_session import ChatSession
from kvrun.errors import KvrunError
from kvrun.kv.config import parse_kv
from kvrun.engine.sampling import SamplingParams
from tiny import make_tiny_model_dir

CTX = 128
GREEDY = SamplingParams(temp=0)
METHODS = ["fp16", "bf16", "int8", "kivi-4", "kivi-2", "kivi-3/kivi-2", "tada-4", "gear-l", "gear", "kivi-4+rot",
           "cb-3", "tada-4+rot", "profile"]


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("shift") / "tiny", hidden_size=128)


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    """One layer: its K/V depend only on the token and its position, so after a shift the
    cache must equal a fresh prefill of the kept tokens at their new positions."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("shift1") / "tiny", hidden_size=128,
                               num_layers=1)


def _kv(method, tmp_path, **kw):
    kw = dict(residual=32, group=32, ctx_policy="shift", n_keep=4) | kw
    if method == "profile":
        p = tmp_path / "p.json"
        p.write_text(json.dumps({"format": "kvrun-kv-profile",
                                 "layers": [{"k": "kivi-4", "v": "kivi-2"}, {"k": "int8", "v": "tada-4"}]}))
        return parse_kv("fp16", profile=str(p), **kw)
    return parse_kv(method, **kw)


def _ids(n, seed=0):
    return torch.randint(3, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("method", METHODS)
def test_generation_runs_past_the_context_with_shift(tiny32, tmp_path, method):
    m = kvrun.load(tiny32, dtype="fp32", ctx=CTX, kv=_kv(method, tmp_path))
    eng, cache = m.engine, m.cache
    nbytes = cache.nbytes()
    events = list(eng.stream(_ids(20), 4 * CTX, GREEDY, set()))
    assert events[-1].finish_reason == "length"
    assert sum(ev.token_id is not None for ev in events) == 4 * CTX
    assert eng.n_shifts >= 4 and cache.n_shifts == eng.n_shifts
    assert len(eng.cached) == cache.seq_len <= CTX            # ids and cache agree
    assert cache.nbytes() == nbytes                            # the arena, never regrown
    assert all(nt + w == cache.seq_len for nt, w in zip(cache.n_tail, cache.n_win))


def test_without_shift_generation_stops_at_the_context(tiny32, tmp_path):
    m = kvrun.load(tiny32, dtype="fp32", ctx=CTX, kv="kivi-4")
    events = list(m.engine.stream(_ids(20), 4 * CTX, GREEDY, set()))
    assert events[-1].finish_reason == "context" and len(m.engine.cached) == CTX


@pytest.mark.parametrize("keep", [4, 40])
def test_logits_after_a_shift_equal_a_fresh_prefill_of_the_kept_tokens(one_layer, tmp_path, keep):
    """fp16 cache: at the step right after a shift, the logits equal those of a fresh
    prefill of the ids the engine kept (at positions 0..n-1). The kept keys were stored in
    fp16 at their old positions and rotated back by the shift, the fresh ones rounded at
    their new positions: one fp16 rounding each, |ΔK| <= 2^-11·|K|, and the logits of this
    model move by well under 1e-2 for such a change (measured: at most 2.3e-3 after
    several shifts; keys off by one position move them by 0.9-2.3)."""
    m = kvrun.load(one_layer, dtype="fp32", ctx=CTX, kv=_kv("fp16", tmp_path, n_keep=keep))
    eng = m.engine
    logits = eng.prefill(_ids(30))
    checked = 0
    for _ in range(3 * CTX):
        before = eng.n_shifts
        logits = eng.decode_step(int(logits.argmax()))
        if eng.n_shifts > before:
            fresh = kvrun.load(one_layer, dtype="fp32", ctx=CTX, kv="fp16")
            ref = fresh.engine.prefill(list(eng.cached))
            assert_close(logits, ref, atol=1e-2, rtol=0)
            assert int(logits.argmax()) == int(ref.argmax())
            checked += 1
    assert checked >= 3


def test_chat_goes_on_past_the_context(tiny32, tmp_path):
    m = kvrun.load(tiny32, dtype="fp32", ctx=256, kv=_kv("kivi-4", tmp_path))
    s = ChatSession(m)
    for i in range(12):                                  # ~12 × 60 tokens through a 256 context
        evs = list(s.reply(f"turn {i}: " + "tell me more " * 3, 40, temp=0))
        assert evs[-1].finish_reason in ("stop", "length")
        eng = m.engine
        assert len(eng.cached) == m.cache.seq_len <= 256
        assert s.ids[:len(eng.cached)] == eng.cached   # the session follows the shifts
    assert m.engine.n_shifts > 0


def test_a_prompt_longer_than_a_shift_keeps_is_one_clear_error(tiny32, tmp_path):
    m = kvrun.load(tiny32, dtype="fp32", ctx=256, kv=_kv("kivi-4", tmp_path))
    s = ChatSession(m)
    with pytest.raises(KvrunError, match=r"prompt too long: \d+ new tokens > context size 256 "
                                         r"\(a context shift keeps 32 tokens\)") as e:
        list(s.reply("x" * 300, 8, temp=0))
    assert "\n" not in str(e.value)
    list(s.reply("short", 8, temp=0))                    # the session still works


def test_a_context_shorter_than_the_window_allocates_only_the_context(tiny32, tmp_path):
    """-c 64 with R + G = 64 + 32: the window never flushes and holds at most 64 tokens, so the
    arena allocates 64 slots (an fp16 arena then costs what the dense cache does)."""
    from kvrun.kv.build import kv_bytes_at
    kv = _kv("fp16", tmp_path, residual=64)
    m = kvrun.load(tiny32, dtype="fp32", ctx=64, kv=kv)
    cfg = m.cfg
    dense = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 64 * 2
    assert m.cache.nbytes() == kv_bytes_at(cfg, kv, 64) and sum(m.cache.nbytes().values()) == dense
    events = list(m.engine.stream(_ids(10), 200, GREEDY, set()))
    assert events[-1].finish_reason == "length" and m.engine.n_shifts > 0


def test_keep_must_leave_something_to_shift(tiny32, tmp_path):
    with pytest.raises(KvrunError, match=r"--keep 128 leaves nothing to shift in a context of "
                                         r"128 tokens: it must be smaller than -c/--ctx-size"):
        kvrun.load(tiny32, dtype="fp32", ctx=CTX, kv=_kv("kivi-4", tmp_path, n_keep=CTX))


def test_sinks_that_would_fill_a_block_of_the_context_still_shift(tiny32, tmp_path):
    """-c 64 with --keep 60: rounded up to a 32-token block the sinks would be the whole
    context, but they never reach the tail (R = 64), so a shift keeps 60 and drops 2."""
    m = kvrun.load(tiny32, dtype="fp32", ctx=64, kv=_kv("fp16", tmp_path, residual=64, n_keep=60))
    assert m.cache.shift_keep() == 60
    events = list(m.engine.stream(_ids(4), 80, GREEDY, set()))
    assert events[-1].finish_reason == "length" and m.engine.n_shifts > 0
    assert m.engine.cached[:4] == _ids(4)                 # the sinks survive every shift


def test_kv_report_says_what_shifts_did(tiny32, tmp_path):
    """/kv names the policy and counts the shifts and dropped tokens (a shift happened
    silently before)."""
    from kvrun.kv.report import format_kv
    m = kvrun.load(tiny32, dtype="fp32", ctx=CTX, kv=_kv("fp16", tmp_path))
    assert "0 shifts so far" in format_kv(m)
    list(m.engine.stream(list(range(1, 20)), 200, GREEDY, set()))     # no stop token
    e = m.engine
    assert e.n_shifts >= 1
    assert (f"{e.n_shifts} shift{'s' if e.n_shifts != 1 else ''} so far, "
            f"{e.n_dropped} tokens dropped") in format_kv(m)
