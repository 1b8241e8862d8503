"""The one-call decode step (kernels/native/decode_step.py, decode_layer.c kvrun_decode_step)
against the per-layer route it replaces (pre, each row's `attend`, post per layer): the
same logits and the same cache bytes, bit for bit, step after step through several
flushes, for one row and for three rows of different depths, on every arena kernel (fp16,
int8, KIVI, TaDA and a mixed per-layer profile on decode_attention.c, cb on
codebook_attention.c), rotated and not; on Gemma 3's layered cache (sliding rings of 16,
8 and 4 bits on ring_attention.c beside the global layers' arena, V rotated and not, rings
filling and wrapping); on evicting arenas (the attention mass each layer adds for the
policy, compactions of a full tail, rotated or not); the caches it does not take (a
layer the kernels decline) keep the per-layer route, decided per cache; and a full window,
which no arena operation leaves, is refused rather than written past."""
import copy
import json

import pytest
import torch

import kvrun
from kvrun.kernels import native
from kvrun.kernels.native.decode_step import DecodeStep
from kvrun.kv.config import parse_kv
from kvrun.kv.ring import LayeredKVCache
from kvrun.model import native_rows
from kvrun.model.native_rows import row
from tiny import NATIVE_GEMMA, NATIVE_LLAMA, load_quantized_tiny, make_tiny_model_dir

pytestmark = pytest.mark.skipif(native.load() is None, reason="the native kernels did not build")

CTX = 256


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_quantized_tiny(tmp_path_factory.mktemp("step"), "int4", CTX, **NATIVE_LLAMA)


def _kv(spec, tmp_path):
    kw = dict(residual=32, group=32)                    # a flush every 32 tokens
    if spec.startswith("profile"):                      # three layers, three kernels' codecs
        p = tmp_path / "p.json"
        p.write_text(json.dumps({"format": "kvrun-kv-profile", "layers": [
            {"k": "kivi-4", "v": "kivi-2"}, {"k": "int8", "v": "tada-4"}, {"k": "fp16", "v": "kivi-4"}]}))
        return parse_kv("fp16" + spec[len("profile"):], profile=str(p), **kw)
    return parse_kv(spec, **kw)


def _state(c):
    """Everything an arena holds: counts, windows and every storage tensor, an eviction
    policy's scores, positions and drops; a layered cache's arena, then its rings'
    position, torn flag and storage."""
    if isinstance(c, LayeredKVCache):
        counts, tensors = _state(c.inner)
        r = c.ring
        return counts + [r.seq_len, r.torn], tensors + r.k.parts + r.v.parts
    counts = [c.seq_len, list(c.n_tail), list(c.n_win)]
    tensors = [c.win_k, c.win_v] + [t for st in c.k_store + c.v_store for _, t in sorted(st.items())]
    if c.ev is not None:                # the policy's scores, positions and drops
        counts += [list(c.ev.n_drop), c.ev.n_compactions]
        tensors += c.ev.acc + c.ev.pos_tail
    return counts, tensors


def _decode(m, caches, tokens, monkeypatch, one_call):
    """Logits (steps, B, V) of feeding tokens (steps, B) to `caches` (changed in place);
    `one_call` False forces the per-layer route. Also returns how many one-call steps ran."""
    ran = []
    with monkeypatch.context() as mp:
        call = DecodeStep.__call__
        mp.setattr(DecodeStep, "__call__", lambda self, *a: (ran.append(1), call(self, *a))[1])
        if not one_call:
            mp.setattr(native_rows, "row", lambda cache, H: None)
        out = []
        for tok in tokens:
            step = m.transformer.native_step(tok[:1, None], caches[0])
            assert step is not None
            out.append(step(tok[:, None], caches[0]) if len(caches) == 1
                       else step.rows(tok[:, None], caches))
    return torch.stack(out), len(ran)


@pytest.mark.parametrize("kv", ["fp16", "fp16+rot", "int8+rot", "kivi-4", "kivi-4+rot", "tada-4",
                                "profile", "profile+rot", "cb-4", "cb-3/cb-2"])
@pytest.mark.parametrize("depths", [[45], [21, 40, 77]])
def test_one_call_equals_the_per_layer_route(model, tmp_path, monkeypatch, kv, depths):
    caches = _both_routes(model, _kv(kv, tmp_path), depths, len(depths), monkeypatch)
    assert min(c.n_tail[0] for c in caches) >= 64                       # flushed on the way


@pytest.mark.parametrize("kv,policy", [("kivi-4", "h2o"), ("fp16", "snapkv"), ("int8", "streaming"),
                                       ("tada-4", "kvcrush"), ("kivi-4+rot", "h2o"),
                                       ("int8+rot", "snapkv")])
@pytest.mark.parametrize("depths", [[45], [21, 77]])
def test_evicting_one_call_equals_the_per_layer_route(model, monkeypatch, kv, policy, depths):
    """An evicting arena on the one-call step: the same logits, cache bytes, scores,
    positions and evictions as the per-layer route, through compactions of a full tail."""
    spec = parse_kv(kv, residual=32, group=32, evict=policy, budget=96)
    caches = _both_routes(model, spec, depths, len(depths), monkeypatch)
    assert all(c.ev.n_drop[0] > 0 for c in caches)                      # it evicted on the way


def _both_routes(m, kv, depths, seed, monkeypatch, steps=80):
    """Rows prefilled to `depths`, then `steps` decode steps on the one-call route and on
    twins of the caches on the per-layer route: each route ran every step, and the logits
    and every cache's counts and tensors are equal bit for bit. Returns the caches."""
    g = torch.Generator().manual_seed(seed)
    caches = [kvrun.kv.make_cache(m.cfg, CTX, kv) for _ in depths]
    for c, d in zip(caches, depths):
        m.transformer(torch.randint(3, 250, (1, d), generator=g), c)    # prefill
    tokens = torch.randint(3, 250, (steps, len(depths)), generator=g)
    twins = copy.deepcopy(caches)
    got, n_one = _decode(m, caches, tokens, monkeypatch, True)
    want, n_layers = _decode(m, twins, tokens, monkeypatch, False)
    assert (n_one, n_layers) == (steps, 0)                              # each route ran
    assert torch.isfinite(got).all()
    assert torch.equal(got, want), (got - want).abs().max()
    for c, t in zip(caches, twins):
        (counts, tensors), (counts_t, tensors_t) = _state(c), _state(t)
        assert counts == counts_t
        assert all(torch.equal(a, b) for a, b in zip(tensors, tensors_t))
    return caches


def test_caches_the_one_call_does_not_take(tmp_path):
    """A layer the kernels decline keeps the per-layer route; an evicting arena, rotated or
    not, and Gemma's rings are rows; a full window (a state no arena operation leaves) is
    refused: the step would write its token past the window."""
    cfg = kvrun.load(make_tiny_model_dir(tmp_path / "m", hidden_size=128), ctx=CTX).cfg
    plain = kvrun.kv.make_cache(cfg, CTX, parse_kv("kivi-4", residual=32, group=32))
    assert row(plain, cfg.num_heads) is not None
    evicting = kvrun.kv.make_cache(cfg, CTX, parse_kv("kivi-4", residual=32, group=32,
                                                      evict="h2o", budget=128))
    assert row(evicting, cfg.num_heads) is not None
    rotated = kvrun.kv.make_cache(cfg, CTX, parse_kv("kivi-4+rot", residual=32, group=32,
                                                     evict="h2o", budget=128))
    assert row(rotated, cfg.num_heads) is not None
    odd_group = kvrun.kv.make_cache(cfg, CTX, parse_kv("fp16", residual=32, group=16))
    assert row(odd_group, cfg.num_heads) is None
    assert not odd_group.routes[0].fused                  # resolved at build: tiles of 32
    plain.n_win[1] = plain.win_k.shape[2]                              # (forged: kv/snapshot.py refuses it)
    with pytest.raises(RuntimeError, match="a full KV window"):
        row(plain, cfg.num_heads)
    gemma = make_tiny_model_dir(tmp_path / "g", architecture="gemma3", hidden_size=128, num_heads=4)
    gcfg = kvrun.load(gemma, ctx=CTX).cfg
    layered = kvrun.kv.make_cache(gcfg, CTX, parse_kv("kivi-4", residual=32, group=32))
    assert row(layered, gcfg.num_heads) is not None
    layered.inner.n_win[0] = layered.inner.win_k.shape[2]              # its arena's window full
    with pytest.raises(RuntimeError, match="a full KV window"):
        row(layered, gcfg.num_heads)
    evicting = kvrun.kv.make_cache(gcfg, CTX, parse_kv("kivi-4", residual=32, group=32,
                                                       evict="h2o", budget=128))
    assert row(evicting, gcfg.num_heads) is not None


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """Gemma 3 layers, odd sizes (tiny.py NATIVE_GEMMA)."""
    return load_quantized_tiny(tmp_path_factory.mktemp("gemma_step"), "int4", CTX, **NATIVE_GEMMA)


@pytest.mark.parametrize("kv,bits", [("fp16", 16), ("kivi-4", 4), ("kivi-4+rot-v", 4),
                                     ("int8", 8), ("int8+rot", 8), ("kivi-4+ring8", 8)])
@pytest.mark.parametrize("depths", [[9], [5, 21, 77]])
def test_gemma_rings_one_call_equals_the_per_layer_route(gemma, tmp_path, monkeypatch, kv, bits,
                                                         depths):
    """Rings of every width, V rotated and not, one row and three: a row at depth 5, 9 or
    21 starts with its ring not yet full (and fills, then wraps, within the 80 steps), the
    one at 77 has wrapped already; the global layers' arena flushes on the way. Logits, ring
    storage, ring position and the arena bit for bit; and the one-call route ran every
    step (a ring layer it declined would have sent the step to the per-layer route)."""
    caches = _both_routes(gemma, _kv(kv, tmp_path), depths, len(depths) + bits, monkeypatch)
    assert all(isinstance(c, LayeredKVCache) and c.ring.bits == bits for c in caches)
    assert (caches[0].ring.rot_v is not None) == kv.endswith(("rot-v", "rot"))
    assert min(c.inner.n_tail[0] for c in caches) >= 32                 # the arena flushed
    for c in caches:
        assert c.ring.seq_len > c.ring.W                                  # every ring wrapped


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_gemma_evicting_one_call_equals_the_per_layer_route(gemma, monkeypatch, policy):
    """Gemma's rings beside an evicting arena: the global layers add their attention mass
    and compact on the one-call step as on the per-layer route, bit for bit."""
    spec = parse_kv("kivi-4", residual=32, group=32, evict=policy, budget=96)
    caches = _both_routes(gemma, spec, [21, 77], 3, monkeypatch)
    assert all(isinstance(c, LayeredKVCache) and c.inner.ev.n_drop[0] > 0 for c in caches)
