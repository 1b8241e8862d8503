"""The fused window write kernels (kvrun.kernels.triton.window_write: write_k, write_v)
under Triton's CPU interpreter against the torch implementation (kvrun.kernels.window_write):
the window after the write must be bit-identical — the new rows at [w, w + T), every other
slot untouched — over GQA 1/3/8, D 64/128, fp32 / fp16 / bf16 inputs and windows, an empty
window, a decode step into a nearly full one and prefill chunks over several runs of 32.

write_v's projection sums in a different order than torch's GEMM, so the V tests use dyadic
inputs (multiples of 1/4 and 1/8, small hidden size) on which every fp32 partial sum is
exact: then the rows must agree exactly. One test with general inputs bounds the
disagreement instead. No write packs: the arena's flush does (tests/kv/test_write_attend.py).
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

pytest.importorskip("triton")

from kvrun.kernels import window_write as ref                            # noqa: E402
from kvrun.kernels.triton import window_write as tww                     # noqa: E402

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _windows(Hkv, slots, D, w, wdt=F16, seed=0):
    """Two identical windows holding w tokens; the free slots hold a marker a write must
    leave where it does not write."""
    torch.manual_seed(seed)
    win = torch.full((Hkv, slots, D), 7.0, dtype=wdt)
    win[:, :w] = torch.randn(Hkv, w, D) * 2
    return [win, win.clone()]


def _check(win, before, w, T):
    assert torch.equal(win[0], win[1])
    assert torch.equal(win[1][:, :w], before[:, :w])               # older rows untouched
    assert torch.equal(win[1][:, w + T:], before[:, w + T:])       # past the write too
    assert not torch.equal(win[1][:, w:w + T], before[:, w:w + T])


def _rope_tables(T, D, dtype):
    ang = torch.rand(T, D // 2) * 6
    emb = torch.cat([ang, ang], -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


# (Hkv, D, slots, w, T): a decode step into a partly full and a nearly full window, chunks
# of several 32-token runs (one ending mid-run), an empty window
K_CASES = [(1, 128, 128, 10, 5), (3, 64, 64, 63, 1), (8, 64, 160, 40, 100),
           (3, 128, 128, 0, 128), (1, 64, 96, 33, 33)]


@pytest.mark.parametrize("case", K_CASES, ids=lambda c: "-".join(map(str, c)))
def test_write_k_is_bit_identical(case):
    Hkv, D, slots, w, T = case
    win = _windows(Hkv, slots, D, w)
    before = win[0].clone()
    x = torch.randn(Hkv, T, D) * 2
    cos, sin = _rope_tables(T, D, F32)
    ref.write_k(x, cos, sin, win[0], w)
    tww.write_k(x, cos, sin, win[1], w)
    _check(win, before, w, T)


@pytest.mark.parametrize("xdt,wdt", [(F16, F16), (BF16, F16), (BF16, BF16), (F32, BF16)])
def test_write_k_half_inputs(xdt, wdt):
    """RoPE in fp16 / bf16 rounds after every operation like torch's CPU half arithmetic;
    a bf16 window rounds to nearest even; strided rows as the model's view gives them."""
    Hkv, D, w, T = 3, 64, 30, 70
    win = _windows(Hkv, 128, D, w, wdt=wdt)
    before = win[0].clone()
    x = (torch.randn(1, T, Hkv, D) * 2).to(xdt).transpose(1, 2)[0]    # (Hkv, T, D), strided
    cos, sin = _rope_tables(T, D, xdt)
    ref.write_k(x, cos, sin, win[0], w)
    tww.write_k(x, cos, sin, win[1], w)
    _check(win, before, w, T)


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


# (Hkv, D, slots, w, T, bias)
V_CASES = [(3, 64, 64, 63, 1, False), (3, 128, 128, 60, 60, True), (8, 64, 128, 0, 97, False),
           (1, 128, 256, 0, 200, True)]


@pytest.mark.parametrize("case", V_CASES, ids=lambda c: "-".join(map(str, c)))
def test_write_v_projection_is_bit_identical(case):
    Hkv, D, slots, w, T, bias = case
    win = _windows(Hkv, slots, D, w)
    before = win[0].clone()
    x, wv, b = _dyadic(T, 40, Hkv, D, bias=bias)
    ref.write_v(x, wv, b, win[0], w)
    tww.write_v(x, wv, b, win[1], w)
    _check(win, before, w, T)


def test_write_v_half_inputs():
    Hkv, D, w, T = 3, 64, 30, 70
    win = _windows(Hkv, 128, D, w)
    before = win[0].clone()
    x, wv, _ = _dyadic(T, 24, Hkv, D, dtype=F16)
    ref.write_v(x, wv, None, win[0], w)
    tww.write_v(x, wv, None, win[1], w)
    _check(win, before, w, T)


@pytest.mark.parametrize("Hkv,w,T,xdt", [(3, 63, 1, F32), (8, 50, 30, F16), (1, 10, 3, BF16),
                                         (3, 20, 100, F32)])
def test_write_v_rows_as_given_is_bit_identical(Hkv, w, T, xdt):
    """weight None: V rows a weight-quantized v_proj computed (strided like the model's
    (B, T, Hkv, D) → (Hkv, T, D) view) are written exactly as given, rounded to the window."""
    D = 64
    win = _windows(Hkv, 128, D, w)
    before = win[0].clone()
    v = (torch.randn(1, T, Hkv, D) * 2).to(xdt).transpose(1, 2)[0]    # (Hkv, T, D), strided
    ref.write_v(v, None, None, win[0], w)
    tww.write_v(v, None, None, win[1], w)
    _check(win, before, w, T)
    assert torch.equal(win[1][:, w:w + T], v.to(F16))


def test_write_v_general_inputs_agree_up_to_rounding():
    """Random fp32 inputs: the rows agree to fp16 rounding of slightly different sums."""
    Hkv, D, w, T = 3, 64, 40, 60
    win = _windows(Hkv, 128, D, w)
    x, wv = torch.randn(T, 96), torch.randn(Hkv * D, 96) / 10
    ref.write_v(x, wv, None, win[0], w)
    tww.write_v(x, wv, None, win[1], w)
    torch.testing.assert_close(win[0].float(), win[1].float(), atol=2e-3, rtol=1e-3)
    assert (win[0] == win[1]).float().mean() > 0.9


def test_bad_arguments_are_refused():
    win = _windows(2, 64, 64, 0)
    x = torch.randn(2, 1, 64)
    cos, sin = _rope_tables(1, 64, F32)
    for mod in (ref, tww):
        with pytest.raises(ValueError, match="window write"):
            mod.write_k(torch.randn(2, 3, 64), *_rope_tables(3, 64, F32), win[1], 62)
    with pytest.raises(ValueError, match="cos/sin"):
        tww.write_k(x, cos[:, :32], sin, win[1], 0)
    with pytest.raises(ValueError, match="do not match"):
        tww.write_k(torch.randn(3, 1, 64), cos, sin, win[1], 0)
    with pytest.raises(ValueError, match="V rows"):
        tww.write_v(torch.randn(3, 1, 64), None, None, win[1], 0)


def test_dispatch_runs_the_triton_kernel_on_triton(monkeypatch):
    """kernels.dispatch: the Triton kernel on the triton backend, torch's on torch — the
    same window either way."""
    from kvrun.kernels import dispatch
    used = []
    real = tww.write_k
    monkeypatch.setattr(tww, "write_k", lambda *a: used.append(a[-1]) or real(*a))
    win = _windows(2, 64, 64, 63)
    before = win[0].clone()
    x = torch.randn(2, 1, 64)
    cos, sin = _rope_tables(1, 64, F32)
    dispatch.write_k(x, cos, sin, win[0], 63, backend="torch")
    dispatch.write_k(x, cos, sin, win[1], 63, backend="triton")
    _check(win, before, 63, 1)
    assert used == [63]


def test_bytes_per_step():
    assert tww.bytes_per_step(8, 128) == {"src": 2 * (8 * 128 + 2 * 128), "window": 2 * 8 * 128}
    v = tww.bytes_per_step(8, 128, hidden=8192)
    assert v["src"] == 2 * (8192 + 8 * 128 * 8192) and v["window"] == 2 * 8 * 128
