"""The KV arena (runtime/kv/arena.py): flush rule, prefill straight into the tail, chunked ==
one-shot, truncate and layer repair, per-layer profiles, larger groups, fp32 and the
uncompressed arenas, errors. Context shift: test_arena_shift.py; the configuration:
test_kv_config.py; byte accounting: test_build.py."""
import json

import pytest
import torch
from torch.testing import assert_close

from kvrun.kernels import dense_attention
from kvrun.errors import KvrunError
from kvrun.kv import build_cache, kv_bytes_at, load_profile, parse_kv, save_profile
from kvrun.kv.arena import KVArena
from kvrun.model.llama import Transformer
from ref_cache import RefCache
from tiny import tiny_config

CFG = tiny_config(num_layers=2, num_heads=6, num_kv_heads=2, hidden_size=384,
                       max_position=1024)                            # D = 64, GQA 3
L, Hkv, H, D = CFG.num_layers, CFG.num_kv_heads, CFG.num_heads, CFG.head_dim


def _feed(cache, T, gen):
    """One forward's worth of cache traffic with random q/k/v; returns the outputs per layer."""
    cache.positions(T)
    outs = []
    for l in range(L):
        q, k, v = torch.randn(1, H, T, D, generator=gen), *(torch.randn(1, Hkv, T, D, generator=gen) for _ in range(2))
        outs.append(cache.attend(l, q, k, v))
    cache.commit(T)
    return outs


def _state(a):
    return ([{k: t.clone() for k, t in st.items()} for st in a.k_store + a.v_store],
            a.win_k.clone(), a.win_v.clone(), list(a.n_tail), list(a.n_win))


def _same_state(a, b):
    sa, sb = _state(a), _state(b)
    assert sa[3:] == sb[3:]
    for da, db in zip(sa[0], sb[0]):
        for k in da:
            assert torch.equal(da[k], db[k]), k
    w = a.n_win[0]
    assert torch.equal(sa[1][:, :, :w], sb[1][:, :, :w]) and torch.equal(sa[2][:, :, :w], sb[2][:, :, :w])


def test_flush_rule_decode_one_by_one():
    a = build_cache(CFG, 300, parse_kv("kivi-2", residual=64, group=32))
    g = torch.Generator().manual_seed(0)
    for n in range(1, 140):                                    # flushes at 96 and 128
        _feed(a, 1, g)
        R, G = 64, 32
        exp_tail = 0 if n < R + G else (n - R) // G * G
        assert a.n_tail == [exp_tail] * L and a.n_win == [n - exp_tail] * L
        assert n < R + G or R <= a.n_win[0] <= R + G - 1


def test_prefill_longer_than_window_goes_to_the_tail():
    a = build_cache(CFG, 600, parse_kv("tada-4", residual=64, group=32))
    _feed(a, 517, torch.Generator().manual_seed(0))
    assert a.n_tail == [448] * L and a.n_win == [69] * L         # 69 in [R, R+G-1]


@pytest.mark.parametrize("method", ["kivi-2", "tada-4", "gear", "int8"])
def test_chunked_prefill_equals_one_shot(method):
    kv = parse_kv(method, residual=32, group=32, tada_mu="int8")
    a, b = build_cache(CFG, 400, kv), build_cache(CFG, 400, kv)
    torch.manual_seed(0)
    k = torch.randn(L, 1, Hkv, 333, D)
    v = torch.randn(L, 1, Hkv, 333, D)
    q = torch.randn(1, H, 1, D)
    a.positions(333)
    for l in range(L):
        a.attend(l, q.expand(1, H, 333, D), k[l], v[l])
    a.commit(333)
    for s0, s1 in [(0, 7), (7, 100), (100, 101), (101, 300), (300, 333)]:   # multi-turn appends
        b.positions(s1 - s0)
        for l in range(L):
            b.attend(l, q.expand(1, H, s1 - s0, D), k[l, :, :, s0:s1], v[l, :, :, s0:s1])
        b.commit(s1 - s0)
    _same_state(a, b)


def test_decode_output_matches_reference_over_dequantized_tail():
    a = build_cache(CFG, 400, parse_kv("kivi-4/tada-2", residual=32, group=32))
    g = torch.Generator().manual_seed(0)
    _feed(a, 250, g)
    q, k, v = torch.randn(1, H, 1, D), torch.randn(1, Hkv, 1, D), torch.randn(1, Hkv, 1, D)
    nt, w = a.n_tail[1], a.n_win[1]
    K = torch.cat([a.k_codecs[1].dequant(a.k_store[1], 0, nt)[None], a.win_k[1, None, :, :w].float(),
                   k.half().float()], 2)
    V = torch.cat([a.v_codecs[1].dequant(a.v_store[1], 0, nt)[None], a.win_v[1, None, :, :w].float(),
                   v.half().float()], 2)
    a.positions(1)
    a.attend(0, q, k, v)
    out = a.attend(1, q, k, v)
    # tada-2 V is mixed from packed codes in bf16 (kernels/nibble.py); K here is kivi (fp32)
    assert_close(out, dense_attention(q, K, V, 250), atol=5e-3, rtol=0)


def test_fp16_arena_equals_dense_cache_on_a_model():
    torch.manual_seed(0)
    m = Transformer(CFG).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)
    ids = torch.randint(0, CFG.vocab_size, (1, 230))
    dense = RefCache(L, Hkv, D, 300, torch.float16)
    arena = build_cache(CFG, 300, parse_kv("fp16", residual=64, ctx_policy="shift"))
    assert isinstance(arena, KVArena)
    ref = torch.cat([m(ids[:, :150], dense)] + [m(ids[:, t:t + 1], dense) for t in range(150, 230)], 1)
    out = torch.cat([m(ids[:, :150], arena)] + [m(ids[:, t:t + 1], arena) for t in range(150, 230)], 1)
    assert arena.n_tail[0] > 0
    # both attend the fp16 rows in fp32 (RefCache in q's dtype): summation order, amplified
    # by the random model
    assert_close(out, ref, atol=5e-4, rtol=1e-3)


def test_truncate_keeps_window_tokens_or_falls_back_to_a_block():
    a = build_cache(CFG, 400, parse_kv("kivi-2", residual=64, group=32))
    _feed(a, 250, torch.Generator().manual_seed(0))               # tail 160, window 90
    assert a.truncate(200) == 200 and a.n_tail == [160] * L and a.n_win == [40] * L
    assert a.truncate(150) == 128 and a.n_tail == [128] * L and a.n_win == [0] * L
    _feed(a, 10, torch.Generator().manual_seed(1))
    assert a.seq_len == 138 and a.n_win == [10] * L


def test_truncate_repairs_an_interrupted_forward():
    a = build_cache(CFG, 600, parse_kv("tada-4", residual=64, group=32))
    g = torch.Generator().manual_seed(0)
    _feed(a, 100, g)                                              # tail 32, window 68
    a.positions(200)
    a.attend(0, torch.randn(1, H, 200, D), torch.randn(1, Hkv, 200, D), torch.randn(1, Hkv, 200, D))
    # Ctrl-C here: layer 0 holds 300 tokens (tail 224), layer 1 holds 100
    assert a.truncate(a.seq_len) == 96                            # layer 0 flushed past 100
    assert a.n_tail == [96, 32] and a.n_win == [0, 64]
    _feed(a, 5, g)
    assert a.seq_len == 101


def test_context_full_error():
    a = build_cache(CFG, 100, parse_kv("kivi-4", residual=32, group=32))
    _feed(a, 90, torch.Generator().manual_seed(0))
    with pytest.raises(KvrunError, match="context full"):
        a.positions(11)


def test_per_layer_profile(tmp_path):
    p = tmp_path / "prof.json"
    save_profile(p, [("tada-4", "tada-2"), ("kivi-2", "fp16")], model="tiny")
    assert load_profile(p) == [("tada-4", "tada-2"), ("kivi-2", "fp16")]
    a = build_cache(CFG, 300, parse_kv("fp16", profile=p, residual=32))
    assert [c.method for c in a.k_codecs] == ["tada-4", "kivi-2"]
    _feed(a, 150, torch.Generator().manual_seed(0))
    assert a.n_tail == [96, 96]
    p.write_text(json.dumps({"format": "kvrun-kv-profile", "layers": [{"k": "kivi-5", "v": "fp16"}]}))
    with pytest.raises(KvrunError, match="kivi-5"):
        load_profile(p)
    p.write_text(json.dumps({"format": "kvrun-kv-profile", "layers": [{"k": "kivi-2", "v": "fp16"}]}))
    with pytest.raises(KvrunError, match="1 layers"):
        build_cache(CFG, 300, parse_kv("fp16", profile=p))


@pytest.mark.parametrize("spec", ["kivi-2@64", "kivi-4@64", "gear-l@64"])
def test_larger_groups_read_path_matches_reference(spec):
    """Groups of 64/128 tokens (K) and channels (V): the arena's decode output equals attention
    over its own dequantized tail, with a tail that ends inside a packed block."""
    kv = parse_kv(spec, residual=128)
    a = build_cache(CFG, 1024, kv)
    g = torch.Generator().manual_seed(3)
    _feed(a, 128 * 3 + 64 + 7, g)
    q = torch.randn(1, H, 1, D, generator=g)
    k = torch.randn(1, Hkv, 1, D, generator=g).half()
    v = torch.randn(1, Hkv, 1, D, generator=g).half()
    nt, w = a.n_tail[0], a.n_win[0]
    kt = a.k_codecs[0].dequant(a.k_store[0], 0, nt)
    vt = a.v_codecs[0].dequant(a.v_store[0], 0, nt)
    kk = torch.cat([kt, a.win_k[0, :, :w].float(), k[0].float()], 1)[None]
    vv = torch.cat([vt, a.win_v[0, :, :w].float(), v[0].float()], 1)[None]
    ref = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)
    a.positions(1)
    assert_close(a.attend(0, q, k, v), ref, atol=2e-2, rtol=2e-2)


def test_fp32_is_a_method_like_the_others():
    """fp32 is an arena of fp32 rows when uniform, and a lossless per-layer codec in mixes;
    byte accounting covers both."""
    kv = parse_kv("fp32")
    c = build_cache(CFG, 200, kv)
    assert isinstance(c, KVArena) and c.lossless and c.win_k.dtype == torch.float32
    assert c.k_codecs[0].method == "fp32" and c.bytes_per_token() >= 2 * L * Hkv * D * 4
    assert sum(kv_bytes_at(CFG, kv, 200).values()) == sum(c.nbytes().values())
    a = build_cache(CFG, 400, parse_kv("fp32/kivi-4", residual=64))
    assert isinstance(a, KVArena) and a.k_codecs[0].method == "fp32"
    _feed(a, 150, torch.Generator().manual_seed(0))
    kt = a.k_codecs[0].dequant(a.k_store[0], 0, a.n_tail[0])
    assert kt.dtype == torch.float32 and a.n_tail[0] == 150 - 64 - (150 - 64) % 32
    with pytest.raises(KvrunError, match="valid"):
        parse_kv("fp64")


@pytest.mark.parametrize("spec", ["fp16", "bf16", "fp32"])
def test_an_uncompressed_arena_keeps_any_prefix(spec):
    """fp16 (bf16, fp32) is an arena whose tail holds rows as they are: truncating inside the
    tail keeps exactly n tokens (the cut block's rows go back to the window), so a new prompt
    may reuse its whole common prefix, as it may with nothing compressed."""
    a = build_cache(CFG, 400, parse_kv(spec, residual=64, group=32))
    assert a.lossless and a.canonical_tail(300) == 0
    _feed(a, 230, torch.Generator().manual_seed(0))
    assert a.n_tail[0] == 160 and a.n_compressed() == 0
    before = [a.rows(l) for l in range(L)]
    assert a.resume_point(200, 48) == 200
    assert a.truncate(45) == 45 and a.n_tail == [32] * L and a.n_win == [13] * L
    for l in range(L):
        for x, y in zip(a.rows(l), before[l]):
            assert torch.equal(x, y[:, :45])
    _feed(a, 120, torch.Generator().manual_seed(1))                  # and it goes on from there
    assert a.seq_len == 165 and all(nt + w == 165 for nt, w in zip(a.n_tail, a.n_win))
    assert not build_cache(CFG, 400, parse_kv("fp16/kivi-4", residual=64)).lossless
