"""Attention logit soft-capping (Gemma 2's attn_logit_softcapping: each scaled score s becomes
cap·tanh(s / cap) before the mask and the softmax) in every backend's attention kernel.

The oracle is HF's eager_attention_forward written out here in plain torch (scores, scale,
divide, tanh, multiply, mask, softmax, p·V in fp32) over the explicitly dequantized rows; it
shares no code with kvrun. Against it:
- the torch kernels (kernels/decode_attention.py, kernels/dense_attention.py, the ring's
  torch step), the native C kernel (decode_attention.c: its fp32 and its integer q·K paths;
  the fused window append; the one-token FusedStep) and the Triton kernel (interpreter), over
  an fp16, an int8 and a kivi-4 tail beside a window and new tokens, a decode step and a
  prefill chunk;
- the rings' one-token kernels (ring_attention.c at 4, 8 and 16 bits; Triton at 4 and 8)
  against the ring's torch step, both capped, through wrap-arounds;
- an arena and a ring as caches on native (their routes: attend, the fused steps) against
  the torch backend's (write_attend); an evicting arena's prompt over exact rows.
The queries are scaled so the logits reach several times the cap: every check also asserts
that the uncapped result is far from the capped one, so a kernel that ignored the cap fails.
softcap 0 is the uncapped kernel, bit for bit (the bit-identity suites keep their bits).
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")       # before kvrun.kernels.triton is imported

import pytest                                                             # noqa: E402
import torch                                                              # noqa: E402
from torch.testing import assert_close                                    # noqa: E402

from attention_cases import attention_case                                # noqa: E402
from kvrun.kernels import dense_attention, native                         # noqa: E402
from kvrun.kernels.decode_attention import decode_attention as torch_attention   # noqa: E402
from kvrun.kv import build_cache, parse_kv                                # noqa: E402
from kvrun.kv.cache import NewKV                                          # noqa: E402
from kvrun.kv.ring import SlidingWindowKV                                 # noqa: E402
from ring_cases import count_ring_steps, ring_data, steps_agree          # noqa: E402
from tiny import tiny_config                                              # noqa: E402

# the interpreter evaluates the masked rows of the Triton kernels' log-sum-exp stores too
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2")

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_NATIVE = native.load() is not None
CAP = 2.0
Q_GAIN = 4.0            # queries x4: scaled scores of spread ~4-8, beyond the cap of 2
METHODS = ("fp16", "int8", "kivi-4")
# (Hkv, Gq, D, n_tail, W, T): a decode step over a tail + window, a prefill chunk
GEOMS = [(2, 3, 64, 160, 35, 1), (1, 4, 128, 96, 10, 5)]
FAR = 0.05              # the least max |capped - uncapped| output difference of a case


def reference(q, K, V, q_start, softcap, window=0):
    """HF's eager attention (modeling_gemma2.eager_attention_forward) in fp32: q (1, H, T, D);
    K, V (1, Hkv, S, D) every key, S = q_start + T; query t at position q_start + t sees keys
    up to its own (the last `window` of them when window > 0)."""
    _, H, T, D = q.shape
    Hkv, S = K.shape[1], K.shape[2]
    K, V = (x.float().repeat_interleave(H // Hkv, 1) for x in (K, V))   # repeat_kv
    w = torch.matmul(q.float(), K.transpose(2, 3)) * D ** -0.5
    if softcap:
        w = torch.tanh(w / softcap) * softcap
    qpos, kpos = torch.arange(q_start, S)[:, None], torch.arange(S)[None]
    seen = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
    w = w.masked_fill(~seen, -math.inf)
    return torch.matmul(torch.softmax(w, -1), V)


def _case(method, geom, seed=0):
    Hkv, Gq, D, n_tail, W, T = geom
    q, kt, vt, kw, vw, kn, vn = attention_case(method, method, Hkv, Gq, D, n_tail, W, T, seed=seed)
    return (q * Q_GAIN, kt, vt, n_tail, kw, vw, kn, vn)


def _dequantized(args):
    """The reference over the case's rows, tail dequantized (capped, uncapped)."""
    q, (kc, ks), (vc, vs), n_tail, kw, vw, kn, vn = args
    kd = kc.dequant(ks, 0, n_tail)[None] if n_tail else kn[:, :, :0].float()
    vd = vc.dequant(vs, 0, n_tail)[None] if n_tail else vn[:, :, :0].float()
    K = torch.cat([kd, kw.float(), kn.float()], 2)
    V = torch.cat([vd, vw.float(), vn.float()], 2)
    start = K.shape[2] - q.shape[2]
    capped, plain = reference(q, K, V, start, CAP), reference(q, K, V, start, 0)
    assert (capped - plain).abs().max() > FAR, "the case's logits do not reach the cap"
    return capped


# -- the torch kernels, the oracles of the others -------------------------------------------

@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("T,q_start", [(1, 20), (7, 0), (6, 13)])
def test_dense_attention_caps_as_transformers(window, T, q_start):
    g = torch.Generator().manual_seed(T + q_start)
    q = torch.randn(1, 6, T, 64, generator=g) * Q_GAIN
    K, V = (torch.randn(1, 2, q_start + T, 64, generator=g) for _ in range(2))
    ref = reference(q, K, V, q_start, CAP, window)
    assert (ref - reference(q, K, V, q_start, 0, window)).abs().max() > FAR
    assert_close(dense_attention(q, K, V, q_start, window, softcap=CAP), ref, atol=2e-6, rtol=1e-5)
    assert torch.equal(dense_attention(q, K, V, q_start, window, softcap=0.0),
                       dense_attention(q, K, V, q_start, window))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: "-".join(map(str, g)))
def test_torch_decode_attention_caps(method, geom):
    """The torch kernel multiplies packed codes in bf16 (test_decode_attention.py's
    tolerance); an fp16 tail is read as it is."""
    args = _case(method, geom)
    ref = _dequantized(args)
    tol = dict(atol=2e-5, rtol=1e-4) if method == "fp16" else dict(atol=5e-2, rtol=0)
    assert_close(torch_attention(*args, softcap=CAP), ref, **tol)
    assert torch.equal(torch_attention(*args, softcap=0.0), torch_attention(*args))


# -- native: decode_attention.c's softmax phase caps every read's logits --------------------

@pytest.mark.skipif(not HAS_NATIVE, reason="native kernels unavailable")
@pytest.mark.parametrize("attn", ["fp32", "int"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: "-".join(map(str, g)))
def test_native_decode_attention_caps(attn, method, geom):
    """fp32: exact against the dequantized rows (test_native_decode_attention.py's tolerance); int
    (int8 and KIVI keys' q·K in int32 over int16 queries, then the fp32 logits capped): to
    the integer scheme's error, ~1e-4 of a logit's spread (test_int_attention.py) — here
    logits of spread ~8 — through a cap whose slope is at most 1."""
    from kvrun.kernels.native.decode_attention import decode_attention as native_attention
    args = _case(method, geom)
    ref = _dequantized(args)
    out = native_attention(*args, attn=attn, softcap=CAP)
    assert out is not None
    tol = dict(atol=2e-5, rtol=1e-4) if attn == "fp32" or method == "fp16" else dict(atol=5e-3, rtol=0)
    assert_close(out, ref, **tol)
    assert torch.equal(native_attention(*args, attn=attn, softcap=0.0), native_attention(*args, attn=attn))


@pytest.mark.skipif(not HAS_NATIVE, reason="native kernels unavailable")
@pytest.mark.parametrize("rot", ["none", "kv"])
def test_native_fused_routes_cap(rot):
    """The arena's fused native routes (attend_append: rotate + round + window write +
    attention, one call; FusedStep: the same for one token, its arguments built once) carry
    the cap as decode_attention does: their outputs equal the capped kernel over the steps
    done apart (test_native_decode_attention.py's test_fused_append_equals_the_steps)."""
    from kvrun.kernels.hadamard import random_signs, rotate, rotation_matrix, unrotate
    from kvrun.kernels.native.decode_attention import attend_append, decode_attention, fused_step
    Hkv, Gq, D, n_tail, W = 2, 3, 64, 96, 7
    q, kt, vt, _, _, _, kn, vn = _case("kivi-4", (Hkv, Gq, D, n_tail, W, 1))
    win = [torch.randn(1, Hkv, W + 5, D).half() for _ in range(2)]
    r = rotation_matrix(D, random_signs(D, 1)) if rot == "kv" else None
    qr = rotate(q, r) if r is not None else q
    k2, v2 = ((rotate(x.float(), r) if r is not None else x).half() for x in (kn, vn))
    want = decode_attention(qr, kt, vt, n_tail, win[0][:, :, :W], win[1][:, :, :W], k2, v2,
                            attn="fp32", softcap=CAP)
    want = unrotate(want, r) if r is not None else want
    plain = [x.clone() for x in win]
    out = attend_append(q, kt, vt, n_tail, plain[0][:, :, :W], plain[1][:, :, :W], kn, vn,
                        plain[0][0, :, W:W + 1], plain[1][0, :, W:W + 1], r, r, attn="fp32",
                        softcap=CAP)
    assert_close(out, want, atol=2e-5, rtol=1e-4)
    step = fused_step(win[0], win[1], 0, Hkv * Gq, r, r, attn="fp32", softcap=CAP)
    assert step.a.softcap == CAP
    assert_close(step(q, kt, vt, n_tail, W, kn, vn), want, atol=2e-5, rtol=1e-4)
    assert fused_step(win[0], win[1], 0, Hkv * Gq, r, r, attn="fp32").a.softcap == 0.0   # rebuilt


# -- Triton: the split-K kernel caps each tile's base-2 logits -------------------------------

@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: "-".join(map(str, g)))
def test_triton_decode_attention_caps(method, geom):
    """The interpreter's exact fp32 against the dequantized rows; the cap by exp2 (Triton has
    no tanh: softcap_logits) is within a few fp32 ulps of the cap's value."""
    from kvrun.kernels import triton as tri
    args = _case(method, geom)
    ref = _dequantized(args)
    assert_close(tri.decode_attention(*args, split=64, softcap=CAP), ref, atol=2e-5, rtol=1e-4)
    mass = torch.zeros(args[0].shape[1], args[3] + args[4].shape[2] + args[0].shape[2])
    mass_t = mass.clone()
    tri.decode_attention(*args, split=64, softcap=CAP, mass=mass)
    torch_attention(*args, softcap=CAP, mass=mass_t)                     # the probabilities too
    assert_close(mass, mass_t, atol=2e-2 if method != "fp16" else 1e-5, rtol=0)


# -- the rings' one-token kernels against the ring's torch step, both capped ----------------

PRE = 5                 # a ring's first chunk (the torch step), before the one-token steps


def _rings(bits, D, Hkv, H, W, seed):
    """Two equal capped rings holding a PRE-token chunk, and the inputs (q, k, v) of
    2 W + 9 tokens, the chunk's first."""
    q, k, v = ring_data(2 * W + 9, H, Hkv, D, seed=seed)
    q = q * Q_GAIN
    a = SlidingWindowKV(2, Hkv, D, W, max_ctx=256, dtype=torch.float32, bits=bits, group=32,
                        rotate_v=bits != 16, softcap=CAP)
    a.backend = "torch"
    a.attend(1, q[:, :, :PRE], k[:, :, :PRE], v[:, :, :PRE])
    a.commit(PRE)
    return a, copy.deepcopy(a), (q, k, v)


@pytest.mark.parametrize("backend,bits", [("native", 4), ("native", 8), ("native", 16),
                                          ("triton", 4), ("triton", 8)])
def test_ring_step_caps(monkeypatch, backend, bits):
    """Each step's stored bytes are equal bit for bit (the cap touches no stored byte) and the
    outputs agree to fp32 summation order (test_native_ring_attention.py's tolerance), through two
    wrap-arounds of a 9-slot ring; the same steps without the cap are far from them."""
    if backend == "native" and not HAS_NATIVE or backend == "triton" and not HAS_TRITON:
        pytest.skip(f"no {backend} kernels here")
    counted = count_ring_steps(monkeypatch, backend)
    D, Hkv, H, W = 64, 2, 6, 9
    a, b, (q, k, v) = _rings(bits, D, Hkv, H, W, bits)
    # the first step against the reference (a 16-bit fp32 ring holds the rows exactly) and
    # the same step uncapped
    plain = copy.deepcopy(a)
    plain.softcap, plain.backend = 0.0, backend
    x = [z[:, :, PRE:PRE + 1] for z in (q, k, v)]
    off = plain.attend(1, *x)
    c = copy.deepcopy(a)
    c.backend = backend
    got = c.attend(1, *x)
    assert (got - off).abs().max() > FAR
    if bits == 16:
        assert_close(got, reference(x[0], k[:, :, :PRE + 1], v[:, :, :PRE + 1], PRE, CAP),
                     atol=1e-5, rtol=1e-4)
    counted.clear()
    steps_agree(a, b, backend, 1, *(z[:, :, PRE:] for z in (q, k, v)), dict(atol=1e-4, rtol=1e-4))
    assert counted and all(counted), f"the {backend} kernel did not serve every step"
    assert a.seq_len > 2 * W


# -- the caches: an arena and Gemma 2's rings beside one, on every backend ------------------

GEMMA2 = tiny_config("gemma2", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                     hidden_size=256, sliding_window=16, attn_logit_softcapping=CAP,
                     max_position=512)               # layer 0 slides, layer 1 is global


def _run(backend, kv, monkeypatch, cfg=GEMMA2, n_steps=40):
    """A 56-token chunk, then one token at a time through every layer of cfg's cache on
    `backend` (R = G = 32: the arena flushes at 64 and 96 tokens): per step the layers'
    outputs."""
    monkeypatch.setenv("KVRUN_BACKEND", backend)
    monkeypatch.setenv("KVRUN_ATTN", "fp32")
    c = build_cache(cfg, 128, parse_kv(kv, residual=32, group=32))
    g = torch.Generator().manual_seed(3)
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    out = []
    for T in [56] + [1] * n_steps:
        c.positions(T)
        outs = []
        for layer in range(cfg.num_layers):
            q = torch.randn(1, H, T, D, generator=g) * Q_GAIN
            k, v = (torch.randn(1, Hkv, T, D, generator=g) for _ in range(2))
            # the model's entry: torch's fused write takes K before RoPE (the identity here)
            ones, zeros = torch.ones(T, D), torch.zeros(T, D)
            outs.append(c.attend_new(layer, q, NewKV(k, ones, zeros, v=v)))
        c.commit(T)
        out.append(outs)
    return c, out


@pytest.mark.parametrize("kv", ["fp16", "int8", "kivi-4"])
def test_capped_caches_agree_on_every_backend(monkeypatch, kv):
    """Gemma 2's cache (a ring for layer 0, an arena for layer 1) on native against torch,
    every step (Triton's routes in a whole model: test_families.py test_gemma2_head_dim_256): ring layers to the rounding of its rows (a quantized ring's torch step
    rounds the dequantized rows to fp16, the kernels keep them in fp32:
    test_decode_contract.py's ring tolerance), arena layers to fp32 order (fp16 rows) or to
    torch's bf16 products of packed codes (as test_decode_contract.py). The arena flushes
    twice, the ring wraps. Without the cap the same steps are far away."""
    if not HAS_NATIVE:
        pytest.skip("native kernels unavailable")
    ref = _run("torch", kv, monkeypatch)[1]
    plain = _run("torch", kv, monkeypatch, dataclasses.replace(GEMMA2, attn_logit_softcapping=None))[1]
    assert max((a - b).abs().max() for s, t in zip(ref, plain) for a, b in zip(s, t)) > FAR
    for be in ["native"]:
        c, steps = _run(be, kv, monkeypatch)
        assert c.inner.n_tail[0] == 64 and c.ring.seq_len == 96       # flushed twice; wrapped
        for i, (outs, ref_outs) in enumerate(zip(steps, ref)):
            for layer, (o, r) in enumerate(zip(outs, ref_outs)):
                tol = (dict(atol=2e-3, rtol=0) if layer == 0 else
                       dict(atol=1e-4, rtol=1e-4) if kv == "fp16" else dict(atol=5e-2, rtol=0))
                assert_close(o.float(), r.float(), **tol, msg=lambda m: f"{be} step {i} layer {layer}: {m}")


# -- an evicting arena's prompt over exact rows (arena_evict.py attend_exact) --------------

def _evicting_prompt(method, cap, monkeypatch):
    """Layer 0 of a snapkv arena over a prompt of three 96-token chunks: the second chunk's
    output (the first over a tail: for a lossy tail, attend_exact over the rows it holds)
    and the scores of the first compaction."""
    monkeypatch.setenv("KVRUN_BACKEND", "torch")
    cfg = tiny_config(num_layers=1, num_heads=4, num_kv_heads=2, hidden_size=256,
                      attn_logit_softcapping=cap)                        # D 64
    kv = parse_kv(method, residual=32, group=32, evict="snapkv", budget=32 + 32 + 4 * 32,
                  snap_window=8)
    c = build_cache(cfg, 1024, kv)
    seen, own = [], c.ev.choose
    c.ev.choose = lambda l, score, pos, K: (seen.append(score.clone()), own(l, score, pos, K))[1]
    g = torch.Generator().manual_seed(4)
    outs = []
    for _ in range(3):
        q = torch.randn(1, 4, 96, 64, generator=g) * Q_GAIN
        k, v = (torch.randn(1, 2, 96, 64, generator=g) for _ in range(2))
        c.positions(96)
        outs.append(c.attend(0, q, k, v))
        c.commit(96)
    return outs[1], seen[0]


def test_an_evicting_prompt_over_exact_rows_caps(monkeypatch):
    """A kivi-4 tail's prompt chunks attend over the exact rows and are scored by the
    policy's own softmax over them (dense_attention and arena_evict's scores, both capped):
    the output and the first compaction's scores are fp16's (whose attention kernel caps
    them) to the summation order; uncapped, the fp16 arena's are far from them."""
    o16, s16 = _evicting_prompt("fp16", CAP, monkeypatch)
    o4, s4 = _evicting_prompt("kivi-4", CAP, monkeypatch)
    assert_close(o4, o16, atol=1e-4, rtol=1e-4)
    assert_close(s4, s16, atol=1e-5, rtol=1e-4)
    o_off, s_off = _evicting_prompt("fp16", None, monkeypatch)
    assert (o_off - o16).abs().max() > FAR and (s_off - s16).abs().max() > FAR
