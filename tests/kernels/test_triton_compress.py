"""The fused write kernels (kvrun.kernels.triton.fused_compress: rope_compress_k,
vproj_compress) under Triton's CPU interpreter against the torch implementation
(kvrun.kernels.fused_compress): the packed storage (codes, scales, zeros, μ) must be
bit-identical, the window equal, and the flush count the same, over codecs and bit widths,
K and V, GQA 1/3/8, D 64/128, G 32/64, a window-only append, a one-block flush and
multi-block flushes (a prefill chunk whose blocks straddle window and new tokens, and
blocks made of new tokens only).

vproj_compress's projection sums in a different order than torch's GEMM, so the V tests use
dyadic inputs (multiples of 1/4 and 1/8, small hidden size) on which every fp32 partial sum
is exact: then the rows, and so the packed bytes, must agree exactly. One test with general
inputs bounds the disagreement instead (codes at rounding boundaries).
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

pytest.importorskip("triton")

from kvrun.kernels import fused_compress as ref                          # noqa: E402
from kvrun.kernels import make_codec                                     # noqa: E402
from kvrun.kernels.triton import fused_compress as tfc                   # noqa: E402

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
S = 384                 # tail slots


def _state(method, role, Hkv, D, G, R, w, n_tail, wdt=F16, tada_mu="fp16", seed=0):
    """(codec, two identical storages, two identical windows) with n_tail packed tokens."""
    torch.manual_seed(seed)
    c = make_codec(method, role, G, tada_mu=tada_mu)
    st = [c.alloc(Hkv, D, S), c.alloc(Hkv, D, S)]
    if n_tail:
        pre = (torch.randn(Hkv, n_tail, D) * 2).half().float()
        for s in st:
            c.pack(s, pre, 0)
    win = torch.zeros(Hkv, R + G, D, dtype=wdt)
    win[:, :w] = torch.randn(Hkv, w, D) * 2
    return c, st, [win, win.clone()]


def _check(c, st, win, f, f_ref, w, T):
    assert f == f_ref
    assert f == ref.flush_count(w, T, win[0].shape[1] - c.G, c.G)
    n = w + T - f
    assert torch.equal(win[0][:, :n], win[1][:, :n])
    for name in st[0]:
        assert torch.equal(st[0][name], st[1][name]), name
    if f:                       # (TaDA with one KV head: μ is the row, deviations are 0)
        assert st[0]["mu" if "mu" in st[0] and win[0].shape[0] == 1 else "codes"].any()


def _rope_tables(T, D, dtype):
    ang = torch.rand(T, D // 2) * 6
    emb = torch.cat([ang, ang], -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


# (method, Hkv, D, G, R, w, T, n_tail): decode step without flush; a one-block flush
# (w = R+G−1, T = 1); a prefill chunk over a partial window (blocks straddling window and
# new rows, and blocks of new rows only); an empty window; tails that half-fill a storage
# block (n_tail 32 / 96 in 64- and 128-token blocks)
K_CASES = [
    ("kivi-4", 1, 128, 64, 64, 10, 5, 0),
    ("kivi-4", 3, 64, 32, 32, 63, 1, 32),
    ("kivi-2", 8, 64, 32, 32, 40, 100, 96),
    ("kivi-2", 3, 128, 64, 64, 127, 1, 64),
    ("int8", 1, 128, 32, 64, 95, 1, 32),
    ("int8", 3, 64, 64, 64, 0, 150, 0),
    ("tada-2", 3, 64, 32, 32, 20, 150, 32),
    ("tada-4", 8, 128, 64, 64, 127, 1, 128),
    ("tada-8", 1, 64, 32, 32, 33, 70, 96),
]


@pytest.mark.parametrize("case", K_CASES, ids=lambda c: "-".join(map(str, c)))
def test_rope_compress_k_is_bit_identical(case):
    method, Hkv, D, G, R, w, T, n_tail = case
    c, st, win = _state(method, "k", Hkv, D, G, R, w, n_tail)
    x = (torch.randn(Hkv, T, D) * 2)
    cos, sin = _rope_tables(T, D, F32)
    f_ref = ref.rope_compress_k(x, cos, sin, win[0], w, c, st[0], n_tail, R)
    f = tfc.rope_compress_k(x, cos, sin, win[1], w, c, st[1], n_tail, R)
    _check(c, st, win, f, f_ref, w, T)


@pytest.mark.parametrize("xdt,wdt,method,tada_mu", [(F16, F16, "tada-4", "int8"),
                                                    (BF16, F16, "kivi-4", "fp16"),
                                                    (BF16, BF16, "int8", "fp16")])
def test_rope_compress_k_half_inputs_and_int8_means(xdt, wdt, method, tada_mu):
    """RoPE in fp16 / bf16 rounds after every operation like torch's CPU half arithmetic;
    a bf16 window; TaDA's int8 μ words."""
    Hkv, D, G, R, w, T, n_tail = 3, 64, 32, 32, 30, 70, 32
    c, st, win = _state(method, "k", Hkv, D, G, R, w, n_tail, wdt=wdt, tada_mu=tada_mu)
    x = (torch.randn(1, T, Hkv, D) * 2).to(xdt).transpose(1, 2)[0]    # (Hkv, T, D), strided
    cos, sin = _rope_tables(T, D, xdt)
    f_ref = ref.rope_compress_k(x, cos, sin, win[0], w, c, st[0], n_tail, R)
    f = tfc.rope_compress_k(x, cos, sin, win[1], w, c, st[1], n_tail, R)
    _check(c, st, win, f, f_ref, w, T)


def test_rope_matches_the_models_rotation():
    """The kernels' RoPE is kernels/rope.py apply_rope (rotate-half) on the same tables."""
    from kvrun.kernels.rope import Rope, apply_rope
    rope = Rope(64, 10000.0, None, 128)
    pos = torch.tensor([3, 50, 51, 99])
    cos, sin = rope.tables(pos, F32)
    x = torch.randn(1, 2, 4, 64)
    assert torch.equal(ref.rope(x[0], cos, sin), apply_rope(x, cos, sin)[0])


def _dyadic(T, hidden, Hkv, D, dtype=F32, bias=False):
    x = (torch.randint(-4, 5, (T, hidden)).float() / 4).to(dtype)
    wv = (torch.randint(-8, 9, (Hkv * D, hidden)).float() / 8).to(dtype)
    b = (torch.randint(-8, 9, (Hkv * D,)).float() / 8).to(dtype) if bias else None
    return x, wv, b


V_CASES = [
    ("kivi-4", 3, 64, 32, 32, 63, 1, 64),
    ("kivi-2", 3, 128, 64, 64, 100, 60, 64),
    ("kivi-4", 8, 64, 32, 32, 0, 97, 32),
    ("int8", 1, 128, 64, 64, 0, 200, 0),
    ("tada-2", 8, 64, 32, 32, 50, 80, 96),
    ("tada-8", 1, 64, 32, 32, 63, 1, 32),
    ("tada-4", 3, 128, 32, 32, 12, 7, 0),
]


@pytest.mark.parametrize("case", V_CASES, ids=lambda c: "-".join(map(str, c)))
def test_vproj_compress_is_bit_identical(case):
    method, Hkv, D, G, R, w, T, n_tail = case
    c, st, win = _state(method, "v", Hkv, D, G, R, w, n_tail)
    x, wv, b = _dyadic(T, 40, Hkv, D, bias=method == "kivi-2")
    f_ref = ref.vproj_compress(x, wv, b, win[0], w, c, st[0], n_tail, R)
    f = tfc.vproj_compress(x, wv, b, win[1], w, c, st[1], n_tail, R)
    _check(c, st, win, f, f_ref, w, T)


def test_vproj_compress_half_inputs_and_int8_means():
    Hkv, D, G, R, w, T, n_tail = 3, 64, 64, 64, 30, 170, 64
    c, st, win = _state("tada-2", "v", Hkv, D, G, R, w, n_tail, tada_mu="int8")
    x, wv, _ = _dyadic(T, 24, Hkv, D, dtype=F16)
    f_ref = ref.vproj_compress(x, wv, None, win[0], w, c, st[0], n_tail, R)
    f = tfc.vproj_compress(x, wv, None, win[1], w, c, st[1], n_tail, R)
    _check(c, st, win, f, f_ref, w, T)


@pytest.mark.parametrize("method,Hkv,w,T,n_tail,xdt", [("kivi-4", 3, 63, 1, 32, F32),
                                                     ("tada-4", 8, 50, 30, 0, F16),
                                                     ("int8", 1, 10, 3, 64, BF16),
                                                     ("kivi-2", 3, 20, 100, 64, F32)])
def test_vproj_compress_rows_as_given_is_bit_identical(method, Hkv, w, T, n_tail, xdt):
    """weight None: V rows a weight-quantized v_proj computed (strided like the model's
    (B, T, Hkv, D) → (Hkv, T, D) view) are appended and packed exactly like torch."""
    D, G, R = 64, 32, 32
    c, st, win = _state(method, "v", Hkv, D, G, R, w, n_tail)
    v = (torch.randn(1, T, Hkv, D) * 2).to(xdt).transpose(1, 2)[0]    # (Hkv, T, D), strided
    f_ref = ref.vproj_compress(v, None, None, win[0], w, c, st[0], n_tail, R)
    f = tfc.vproj_compress(v, None, None, win[1], w, c, st[1], n_tail, R)
    _check(c, st, win, f, f_ref, w, T)
    n = w + T - f
    kept = min(n, T)                                                  # new rows still windowed
    assert torch.equal(win[1][:, n - kept:n], v[:, T - kept:].to(F16))    # as given


def test_vproj_compress_general_inputs_agree_up_to_rounding():
    """Random fp32 inputs: the window rows agree to fp16 rounding of slightly different
    sums, and the reconstruction of the packed block to within one quantization step."""
    Hkv, D, G, R, w, T, n_tail = 3, 64, 32, 32, 40, 60, 32
    c, st, win = _state("kivi-4", "v", Hkv, D, G, R, w, n_tail)
    x, wv = torch.randn(T, 96), torch.randn(Hkv * D, 96) / 10
    f = ref.vproj_compress(x, wv, None, win[0], w, c, st[0], n_tail, R)
    assert f == tfc.vproj_compress(x, wv, None, win[1], w, c, st[1], n_tail, R) == 64
    n = w + T - f
    torch.testing.assert_close(win[0][:, :n].float(), win[1][:, :n].float(), atol=2e-3, rtol=1e-3)
    a, b = c.dequant(st[0], n_tail, n_tail + f), c.dequant(st[1], n_tail, n_tail + f)
    step = st[0]["scale"][:, n_tail:n_tail + f].float().repeat_interleave(c.g, -1)
    assert ((a - b).abs() <= step * 1.01 + 1e-3).all()
    assert (a == b).float().mean() > 0.95


def test_unsupported_and_bad_arguments_are_refused():
    c, st, win = _state("gear", "k", 2, 64, 32, 32, 0, 0)
    assert not tfc.supports(c)
    x = torch.randn(2, 1, 64)
    cos, sin = _rope_tables(1, 64, F32)
    with pytest.raises(ValueError, match="KIVI / TaDA / int8"):
        tfc.rope_compress_k(x, cos, sin, win[1], 0, c, st[1], 0, 32)
    k = make_codec("kivi-4", "k", 32)
    with pytest.raises(ValueError, match="cos/sin"):
        tfc.rope_compress_k(x, cos[:, :32], sin, win[1], 0, k, k.alloc(2, 64, 64), 0, 32)
    with pytest.raises(ValueError, match="R\\+G"):
        tfc.rope_compress_k(x, cos, sin, win[1], 0, k, k.alloc(2, 64, 64), 0, 48)
    v = make_codec("kivi-4", "v", 32)
    with pytest.raises(ValueError, match="V rows"):
        tfc.vproj_compress(torch.randn(3, 1, 64), None, None, win[1], 0, v, v.alloc(2, 64, 64), 0, 32)


def test_dispatch_routes_fused_ops(monkeypatch):
    """kernels.dispatch: the Triton kernel under KVRUN_BACKEND=triton for TaDA, torch for
    GEAR (unsupported) — the same storage either way."""
    from kvrun.kernels import dispatch
    used = []
    real = tfc.rope_compress_k
    monkeypatch.setattr(tfc, "rope_compress_k", lambda *a: used.append(a[5].method) or real(*a))
    monkeypatch.setenv("KVRUN_BACKEND", "triton")
    for method in ("tada-4", "gear"):
        c, st, win = _state(method, "k", 2, 64, 32, 32, 63, 0)
        x = torch.randn(2, 1, 64)
        cos, sin = _rope_tables(1, 64, F32)
        f_ref = ref.rope_compress_k(x, cos, sin, win[0], 63, c, st[0], 0, 32)
        f = dispatch.rope_compress_k(x, cos, sin, win[1], 63, c, st[1], 0, 32)
        _check(c, st, win, f, f_ref, 63, 1)
    assert used == ["tada-4"]


def test_bytes_per_step():
    k = make_codec("kivi-4", "k", 32)
    b = tfc.bytes_per_step(k, 8, 128, 128)
    assert b == {"src": 2 * (8 * 128 + 2 * 128), "window": 2 * 8 * 128, "tail": 0.0}
    fl = tfc.bytes_per_step(k, 8, 128, 128, flush=True)
    assert fl["tail"] == 32 * 8 * 128 * (0.5 + 4 / 32)
    v = tfc.bytes_per_step(make_codec("tada-2", "v", 32), 8, 128, 128, hidden=8192)
    assert v["src"] == 2 * (8192 + 8 * 128 * 8192)
