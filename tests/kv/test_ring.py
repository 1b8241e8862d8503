"""The cache of a model with sliding-window layers (runtime/kv/ring.py): sliding layers in a
ring of min(window, ctx) slots, full-attention layers in the dense cache or the arena.

- A sliding layer's output, chunk by chunk and token by token (through ring wrap-arounds),
  equals dense attention over the whole history with the sliding-window mask.
- Full layers behave exactly as the same cache built for the full layers alone.
- Bytes: the ring never grows with -c; kv_bytes_at equals what build_cache allocates; the
  fp16 formula 2·Hkv·D·2·(n_full·ctx + n_sliding·window) holds.
- Truncation keeps what the ring can still serve; context shift and TaDA on one KV head
  are refused with one line.
- A tiny random Gemma 3 on the layered cache: fp16 gives the logits of the masked
  full-length dense cache (chunks and decode steps past the window); compressed methods
  run on it and stay close.
"""
import pytest
import torch
from torch.testing import assert_close

from kvrun.kernels import dense_attention
from kvrun.errors import KvrunError
from kvrun.kv import build_cache, kv_bytes_at, parse_kv
from kvrun.kv.build import fp16_bytes
from kvrun.kv.ring import LayeredKVCache, SlidingWindowKV
from tiny import tiny_config

W = 16


def _cfg(**kw):
    # six layers, the last one global; 1 KV head of D 32; window 16
    return tiny_config("gemma3", **kw)


def _history(n, Hkv=1, H=4, D=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, n, D, generator=g)
    k = torch.randn(1, Hkv, n, D, generator=g).half().float()      # exact in the fp16 ring
    v = torch.randn(1, Hkv, n, D, generator=g).half().float()
    return q, k, v


@pytest.mark.parametrize("bits,tol", [(16, 2e-3), (8, 2e-2), (4, 0.25)])
@pytest.mark.parametrize("chunks", [[1] * 40, [5, 1, 1, 30, 1, 1, 7, 2], [40], [17, 1, 22]])
@pytest.mark.parametrize("rotate_v", [False, True])
def test_sliding_layer_equals_masked_dense_attention(chunks, bits, tol, rotate_v):
    """fp16 ring: equal to rounding (fp16 SDPA on one token); quantized rings, rotated or
    not: within their codes' error, and the step's own rows exactly as given (see the next
    test)."""
    n = sum(chunks)
    q, k, v = _history(n)
    ring = SlidingWindowKV(1, 1, 32, W, max_ctx=64, bits=bits, rotate_v=rotate_v)
    ref = dense_attention(q, k, v, 0, window=W)                          # (1, H, n, D)
    s = 0
    for T in chunks:
        o = ring.attend(0, q[:, :, s:s + T], k[:, :, s:s + T], v[:, :, s:s + T])
        ring.commit(T)
        assert_close(o, ref[:, :, s:s + T], atol=tol, rtol=0)
        s += T
    assert ring.k.read(0, slice(0, W)).shape[1] == W                     # never more than W slots


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_ring_attends_new_rows_in_full_precision(bits):
    """The first token's output is exactly its own V (one key): its row was not quantized
    before it attended. Read back, it is within half a quantization step of the input."""
    q, k, v = _history(1)
    ring = SlidingWindowKV(1, 1, 32, W, max_ctx=64, bits=bits)
    o = ring.attend(0, q, k, v)
    assert_close(o, v.half().float().expand(1, 4, 1, 32), atol=1e-3, rtol=0)
    g = v[0, 0, 0].view(-1, 32)
    step = (g.amax(-1) - g.amin(-1)) / ((1 << bits) - 1)
    err = (ring.v.read(0, slice(0, 1))[0, 0].float().view(-1, 32) - g).abs()
    assert (err <= step[:, None] * 0.5 + 2e-3).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_rotated_ring_makes_an_outlier_channel_cost_less(bits):
    """One K channel and one V channel 30x larger than the rest: stored as given, their
    32-channel groups take a range that crushes their neighbours; rotated, the range spreads
    over all channels. The rotated ring's attention error (K always, V with "+rot-v"; decode
    through wrap-arounds) is under 0.7x the unrotated one's (~0.5x at 8 and 4 bits); an
    fp16 ring is never rotated."""
    q, k, v = _history(40, D=64)
    k[..., 3] *= 30
    v[..., 37] *= 30
    ref = dense_attention(q, k, v, 0, window=W)
    err = {}
    for rotated in (True, False):
        ring = SlidingWindowKV(1, 1, 64, W, max_ctx=64, bits=bits, rotate_v=True)
        if not rotated:
            ring.rot_k = ring.rot_v = None
        o = []
        for t in range(40):
            o.append(ring.attend(0, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1]))
            ring.commit(1)
        err[rotated] = (torch.cat(o, 2) - ref).abs().mean().item()
    assert err[True] < 0.7 * err[False], err
    assert SlidingWindowKV(1, 1, 64, W, max_ctx=64, bits=16, rotate_v=True).rot_k is None


def test_sliding_layer_check_can_fail():
    """Without the window (all history visible) the outputs differ: the check above bites."""
    q, k, v = _history(40)
    assert (dense_attention(q, k, v, 0, window=W) - dense_attention(q, k, v, 0)).abs().max() > 0.1


@pytest.mark.parametrize("kv", ["fp16", "kivi-4"])
def test_full_layers_behave_as_their_own_cache(kv):
    cfg = _cfg()
    c = build_cache(cfg, 128, parse_kv(kv, residual=32, group=32))
    assert isinstance(c, LayeredKVCache)
    alone = build_cache(tiny_config("llama", num_layers=1, num_heads=4, num_kv_heads=1,
                                         head_dim=32, hidden_size=64), 128,
                        parse_kv(kv, residual=32, group=32))
    q, k, v = _history(100)
    s = 0
    for T in [33, 1, 1, 31, 1, 33]:                      # crosses flushes of the arena
        pos = c.positions(T)
        assert torch.equal(pos, alone.positions(T))
        for layer in range(cfg.num_layers):
            o = c.attend(layer, q[:, :, s:s + T], k[:, :, s:s + T], v[:, :, s:s + T])
            if layer == 5:                                               # the global layer
                assert torch.equal(o, alone.attend(0, q[:, :, s:s + T], k[:, :, s:s + T],
                                                   v[:, :, s:s + T]))
        c.commit(T)
        alone.commit(T)
        s += T
    assert c.seq_len == s == 100


# bytes per token and head of a ring (D = 32): fp16 rows, or codes + fp16 scale and min
RING_BYTES = {"fp16": 32 * 2, "int8": 32 + 4, "kivi-4": 16 + 4, "kivi-2": 16 + 4}


@pytest.mark.parametrize("kv", ["fp16", "int8", "kivi-4", "kivi-2"])
@pytest.mark.parametrize("ctx", [8, 100, 4096])
def test_bytes_the_ring_never_grows_and_accounting_is_exact(kv, ctx):
    cfg = _cfg()
    c = build_cache(cfg, ctx, kv)
    assert kv_bytes_at(cfg, kv, ctx) == c.nbytes()
    assert c.nbytes()["ring"] == 2 * 5 * 1 * min(W, ctx) * RING_BYTES[kv]   # 5 sliding layers
    if kv == "fp16":                    # the formula docs/measurements.md states
        ideal = 2 * 1 * 32 * 2 * (1 * ctx + 5 * min(W, ctx))
        assert fp16_bytes(cfg, ctx) == ideal
        # what the global layer's arena adds: its window's spare slots, at most one block
        assert 0 <= sum(c.nbytes().values()) - ideal <= 2 * 1 * 32 * 2 * 32


@pytest.mark.parametrize("v_group,per", [(16, 16 + 8), (32, 16 + 4)])
def test_quantized_ring_groups_channels_as_the_v_group(v_group, per):
    """A quantized ring's scale/min pairs follow the config's V group ("kivi-4@64" on a real
    model), in what it allocates and in kv_bytes_at."""
    cfg, kv = _cfg(), parse_kv("kivi-4", v_group=v_group)
    c = build_cache(cfg, 100, kv)
    assert c.ring.k.group == v_group
    assert c.ring.rot_k is not None and c.ring.rot_v is None        # K always; V on request
    assert build_cache(cfg, 100, "kivi-4+rot-v").ring.rot_v is not None
    assert build_cache(cfg, 100, "fp16").ring.rot_k is None
    assert kv_bytes_at(cfg, kv, 100)["ring"] == c.nbytes()["ring"] == 2 * 5 * 1 * W * per


def test_truncate_keeps_only_what_the_ring_can_serve():
    cfg = _cfg()
    c = build_cache(cfg, 128, "fp16")
    q, k, v = _history(40)

    def feed(s, T):
        c.positions(T)
        for layer in range(cfg.num_layers):
            c.attend(layer, q[:, :, s:s + T], k[:, :, s:s + T], v[:, :, s:s + T])
        c.commit(T)
    feed(0, 10)
    assert c.truncate(4) == 4 and c.seq_len == 4                         # nothing wrapped yet
    feed(4, 36)                                                          # 40 > W: wrapped
    assert c.resume_point(40, 8) == 40 and c.resume_point(39, 8) == 39   # n >= seq_len - 1
    assert c.resume_point(30, 8) == 0
    assert c.truncate(30) == 0 and c.seq_len == 0 and c.ring.seq_len == 0


def test_interrupted_chunk_is_not_kept():
    """A chunk that wrote some ring layers and was interrupted before commit: the ring lost
    keys of the committed state, so truncate(seq_len) keeps nothing."""
    cfg = _cfg()
    c = build_cache(cfg, 128, "fp16")
    q, k, v = _history(60)
    c.positions(30)
    for layer in range(cfg.num_layers):
        c.attend(layer, q[:, :, :30], k[:, :, :30], v[:, :, :30])
    c.commit(30)
    c.positions(20)
    c.attend(0, q[:, :, 30:50], k[:, :, 30:50], v[:, :, 30:50])          # then Ctrl-C
    assert c.truncate(30) == 0


def test_refusals_are_one_line():
    cfg = _cfg()
    with pytest.raises(KvrunError, match="sliding-window"):
        build_cache(cfg, 128, parse_kv("kivi-4", ctx_policy="shift"))
    with pytest.raises(KvrunError, match="more than one KV head"):
        build_cache(cfg, 128, "tada-4")
    build_cache(tiny_config("llama"), 128, "tada-4")                # 2 KV heads: fine


def _tiny_gemma():
    from kvrun.model.llama import Transformer
    torch.manual_seed(0)
    cfg = _cfg()
    m = Transformer(cfg).float().eval()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return cfg, m


# fp16 is the strict check (logits std ~1.9); the random model amplifies quantization
# error, so the compressed methods only check that they run and stay in range (their
# real-model quality is `kvrun ppl`'s, docs/measurements.md)
@pytest.mark.parametrize("kv,tol", [("fp16", 5e-3), ("int8", 0.2), ("kivi-4", 2.0)])
def test_tiny_gemma_on_the_layered_cache(kv, tol):
    from kvrun.kv.build import make_cache
    from ref_cache import RefCache
    cfg, m = _tiny_gemma()
    ids = torch.randint(0, cfg.vocab_size, (1, 120))
    ref_cache = RefCache(cfg.num_layers, 1, cfg.head_dim, 128, torch.float16,
                         windows=cfg.layer_windows)
    c = make_cache(cfg, 128, parse_kv(kv, residual=32, group=32))
    assert isinstance(c, LayeredKVCache) and c.ring.W == W
    with torch.inference_mode():
        for s, e in [(0, 7), (7, 70)] + [(i, i + 1) for i in range(70, 120)]:
            ref = m(ids[:, s:e], ref_cache)[0]
            got = m(ids[:, s:e], c)[0]
            assert_close(got, ref, atol=tol, rtol=0, msg=f"{kv} tokens {s}:{e}")
    assert c.seq_len == 120 and c.ring.seq_len == 120


# -- the ring's width as a setting (--kv …+ring8, --kv-ring, a profile's "kv" block) -------------

# bytes per token and head of a ring (D = 32) at each width
WIDTH_BYTES = {16: 32 * 2, 8: 32 + 4, 4: 16 + 4}


@pytest.mark.parametrize("spec,bits", [
    ("kivi-4", 4), ("kivi-4+ring8", 8), ("kivi-4+rot+ring16", 16), ("int8", 8),
    ("int8+ring4", 4), ("fp16", 16), ("fp16+ring4", 4), ("kivi-4/kivi-2+ring8", 8)])
@pytest.mark.parametrize("ctx", [9, 100])
def test_ring_width_setting_is_honoured(spec, bits, ctx):
    """The width a config sets is the one the ring stores at, and the one every byte count
    (kv_bytes_at, the /kv report) states; without it the methods pick it (ring_bits)."""
    cfg, kv = _cfg(), parse_kv(spec)
    c = build_cache(cfg, ctx, kv)
    assert c.ring.bits == bits
    assert kv_bytes_at(cfg, kv, ctx) == c.nbytes()
    assert c.nbytes()["ring"] == 2 * 5 * 1 * min(W, ctx) * WIDTH_BYTES[bits]
    assert ("fp16" if bits == 16 else f"{bits}-bit per token") in c.report()[0]
    assert ("+ring" in spec) == ("+ring" in kv.label())          # ppl tables tell them apart


def test_ring_width_changes_what_the_ring_returns():
    """8-bit rings keep K and V closer to the rows written than 4-bit ones (and fp16 exact)."""
    q, k, v = _history(24)
    err = {}
    for bits in (16, 8, 4):
        r = SlidingWindowKV(1, 1, 32, W, 64, bits=bits)
        r.store(0, torch.arange(W), k[0, :, -W:], v[0, :, -W:])
        r.commit(W)
        kr, vr = r.rows(0)
        err[bits] = float((kr - k[0, :, -W:]).abs().max() + (vr - v[0, :, -W:]).abs().max())
    assert err[16] < 1e-6 < err[8] < err[4] / 4


def test_ring_width_from_the_kv_flag_and_a_profile(tmp_path):
    import json
    from kvrun.cli.kv_flags import kv_config
    assert kv_config({"kv": "kivi-4", "kv_ring": 8}).ring == 8
    cfg = _cfg()
    body = {"format": "kvrun-kv-profile", "layers": [{"k": "kivi-4", "v": "kivi-2"}]}
    old = tmp_path / "old.json"                                  # no "ring": picked from methods
    old.write_text(json.dumps(body))
    assert build_cache(cfg, 64, parse_kv(f"profile:{old}")).ring.bits == 4
    new = tmp_path / "new.json"
    new.write_text(json.dumps({**body, "kv": {"ring": 8}}))
    kv = parse_kv(f"profile:{new}")
    assert build_cache(cfg, 64, kv).ring.bits == 8 and kv.label() == "profile:new"
    over = parse_kv(f"profile:{new}+ring16")                     # the spec wins over the file
    assert build_cache(cfg, 64, over).ring.bits == 16 and over.label() == "profile:new+ring16"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**body, "kv": {"ring": "8"}}))
    with pytest.raises(KvrunError, match="ring width must be one of 4, 8, 16 bits, got '8'"):
        parse_kv(f"profile:{bad}")


@pytest.mark.parametrize("spec,fields,msg", [
    ("kivi-4+ring5", {}, "unknown suffix '\\+ring5'"),
    ("kivi-4+ring", {}, "unknown suffix '\\+ring'"),
    ("kivi-4+ring8+ring4", {}, "more than one suffix sets the ring"),
    ("kivi-4", {"ring": 2}, "ring width must be one of 4, 8, 16 bits, got 2"),
    ("kivi-4", {"ring": 8.0}, "got 8.0"),
    ("kivi-4", {"ring": True}, "got True"),
])
def test_bad_ring_widths_are_refused_in_one_line(spec, fields, msg):
    with pytest.raises(KvrunError, match=msg) as e:
        parse_kv(spec, **fields)
    assert "\n" not in str(e.value)


def test_ring_width_on_a_model_without_rings_is_refused():
    with pytest.raises(KvrunError, match="no sliding-window layers"):
        build_cache(tiny_config("llama"), 64, "int8+ring8")
    build_cache(tiny_config("llama"), 64, "int8")
