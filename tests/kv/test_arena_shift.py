"""Context shift (runtime/kv/arena_shift.py, planned by KVArena.shift): one layer's shift
against RoPE at the new positions, the arena against dense attention over the kept tokens,
and in generation and chat: with `--ctx-policy shift` the token loop and chat go on past -c
for every cache, positions stay exact, memory stays the arena's, and a prompt longer than
what a shift keeps is one clear error."""
import json

import pytest
import torch
from torch.testing import assert_close

import kvrun
from kvrun.engine.chat_session import ChatSession
from kvrun.errors import KvrunError
from kvrun.kernels import dense_attention
from kvrun.kernels.rope import Rope, apply_rope
from kvrun.kv.arena_shift import shift_layer
from kvrun.kv.build import build_cache
from kvrun.kv.config import parse_kv
from kvrun.engine.sampling import SamplingParams
from test_arena import CFG, D, H, Hkv, L, _feed
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


# -- one layer, then the arena -----------------------------------------------------------------

@pytest.mark.parametrize("n,a,nd", [(100, 32, 30), (70, 40, 10)])     # sinks in the tail / window
def test_shift_layer_keeps_the_sinks_and_rerotates_the_rest(n, a, nd):
    """fp32 (lossless): after shift_layer(a, nd) a layer holds tokens [0, a) as they were and
    tokens [a + nd, n) with their keys at positions a .. n - nd - 1 (RoPE of the raw keys at
    those positions), their values untouched; the other layer is not touched."""
    c = build_cache(CFG, 160, parse_kv("fp32", residual=32, group=32))
    rope = Rope(D, CFG.rope_theta, None, 512)
    g = torch.Generator().manual_seed(0)
    kraw, v = (torch.randn(L, Hkv, n, D, generator=g) for _ in range(2))       # keys before RoPE
    cos, sin = rope.tables(torch.arange(n), torch.float32)
    c.ingest(apply_rope(kraw, cos, sin), v)
    before = c.rows(1)
    ang = -nd * c.inv_freq                                                     # (D/2,)
    emb = torch.cat([ang, ang])[None].float()                                  # (1, D)
    shift_layer(c, 0, a, nd, emb.cos(), emb.sin())
    kept = list(range(a)) + list(range(a + nd, n))
    k0, v0 = c.rows(0)
    assert k0.shape == (Hkv, n - nd, D) and c.n_tail[0] + c.n_win[0] == n - nd
    cn, sn = rope.tables(torch.arange(n - nd), torch.float32)
    assert_close(k0, apply_rope(kraw[0][:, kept], cn, sn), atol=1e-5, rtol=1e-5)
    assert torch.equal(v0, v[0][:, kept])
    assert all(torch.equal(x, y) for x, y in zip(c.rows(1), before))


def test_context_shift_positions_and_outputs_match_reference():
    """fp16 tail (lossless): after a shift the arena equals dense attention over the kept
    tokens with their keys re-roped at positions 0..n-1."""
    ctx, n_keep, G = 160, 4, 32
    a = build_cache(CFG, ctx, parse_kv("fp16/fp16", residual=32, group=G, ctx_policy="shift",
                                       n_keep=n_keep))
    rope = Rope(D, CFG.rope_theta, None, 512)
    torch.manual_seed(0)
    kraw = torch.randn(L, 1, Hkv, ctx, D)                         # keys before RoPE
    vals = torch.randn(L, 1, Hkv, ctx, D)
    pos = a.positions(ctx)
    cos, sin = rope.tables(pos, torch.float32)
    for l in range(L):
        a.attend(l, torch.randn(1, H, ctx, D), apply_rope(kraw[l], cos, sin), vals[l])
    a.commit(ctx)
    newpos = a.positions(1)                                       # triggers the shift
    keep_a = G                                                    # n_keep rounded up to a block
    nd = (ctx - keep_a) // 2
    kept = list(range(keep_a)) + list(range(keep_a + nd, ctx))
    assert a.seq_len == len(kept) and newpos.tolist() == [len(kept)]
    q = torch.randn(1, H, 1, D)
    kn, vn = torch.randn(1, Hkv, 1, D), torch.randn(1, Hkv, 1, D)
    c1, s1 = rope.tables(newpos, torch.float32)
    for l in range(L):
        out = a.attend(l, apply_rope(q, c1, s1), apply_rope(kn, c1, s1), vn)
        ck, sk = rope.tables(torch.arange(len(kept)), torch.float32)
        K = torch.cat([apply_rope(kraw[l][:, :, kept], ck, sk), apply_rope(kn, c1, s1)], 2)
        V = torch.cat([vals[l][:, :, kept], vn], 2)
        ref = dense_attention(apply_rope(q, c1, s1), K.half().float(), V.half().float(), len(kept))
        assert_close(out, ref, atol=5e-3, rtol=5e-3)
    a.commit(1)


def test_context_shift_with_compressed_codec_keeps_working():
    a = build_cache(CFG, 200, parse_kv("kivi-2", residual=32, group=32, ctx_policy="shift"))
    g = torch.Generator().manual_seed(0)
    _feed(a, 190, g)
    _feed(a, 20, g)                                               # shifts once
    assert a.n_shifts == 1 and a.seq_len == 32 + (190 - 32) - (190 - 32) // 2 + 20
    assert all(nt + w == a.seq_len for nt, w in zip(a.n_tail, a.n_win))



# -- generation and chat ------------------------------------------------------------------------

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
