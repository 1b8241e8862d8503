"""The quantized sliding ring's one-token step on the native kernel (kernels/native/
ring_attention.c) against the torch step (runtime/kv/ring.py `_attend`), its oracle.

Two rings start from the same state and take the same tokens, one through each backend
(each ring's `backend`: native / torch): after every step their codes, scales and mins are equal
bit for bit, and their outputs agree to fp32 summation order. Parametrized over 4 and 8
bits, channel groups of 32 and 64 (head dims 64 and 256; and 16, which the vector path
serves on AVX2 but not with AVX-512's wider blocks), GQA (4 query heads over 1 KV head, 6
over 2), V rotated or not, an odd window so the filled-slot count is odd and even, through
two wrap-arounds; on the default build and the portable one (-DKVRUN_NO_AVX512).
"""
import copy
import ctypes

import pytest
import torch

import kvrun.kernels.native.ring_attention as nra
from kvrun.kernels import native
from kvrun.kv.ring import SlidingWindowKV
from ring_cases import corner_rows, count_ring_steps, ring_data, steps_agree

W = 37                      # odd: the filled-slot count min(s + 1, W) takes odd and even values

pytestmark = pytest.mark.skipif(native.load() is None, reason="native kernels unavailable")


@pytest.fixture(params=["default", "portable"])
def build(request, monkeypatch):
    """The library the ring step calls: the default build (its vector path, 16 lanes on
    AVX-512, 8 on AVX2), or the portable one (-DKVRUN_NO_AVX512: plain loops)."""
    if request.param == "portable":
        lib = ctypes.CDLL(str(native._build(("-DKVRUN_NO_AVX512",))))
        monkeypatch.setattr(nra, "load", lambda: lib)
    return request.param


@pytest.fixture
def counted(monkeypatch):
    """Per one-token step on the native backend: whether the native kernel served it."""
    return count_ring_steps(monkeypatch, "native")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("D,group", [(64, 32), (256, 64), (256, 32), (48, 16)])
@pytest.mark.parametrize("Hkv,H", [(1, 4), (2, 6)])
@pytest.mark.parametrize("rotate_v", [False, True])
def test_native_step_equals_the_torch_step(build, counted, monkeypatch, bits, D, group, Hkv, H,
                                           rotate_v):
    """fp32 ring rows, so the torch step is fp32 SDPA over the same dequantized values and
    the two differ by summation order only: the logits are sums of D products of O(1)
    values (q/sqrt(D) . k, |error| ~ D * 2^-24 * |q||k|/sqrt(D) < 2e-5 at D 256) and the
    output a convex mix of O(1) V rows over <= 37 slots (|error| ~ 37 * 2^-24 * 4 < 1e-5),
    the exp polynomial adds 2e-7 relative: 1e-4 absolute and relative (values of scale ~1-4)
    leaves 5x margin; a wrong slot, scale or row moves outputs by O(0.1)."""
    q, k, v = ring_data(2 * W + 11, H, Hkv, D, seed=bits + D + group + H)
    a = SlidingWindowKV(3, Hkv, D, W, max_ctx=256, dtype=torch.float32, bits=bits, group=group,
                        rotate_v=rotate_v)
    a.backend = "torch"
    a.attend(2, q[:, :, :5], k[:, :, :5], v[:, :, :5])                 # a chunk: torch on both
    a.commit(5)
    b = copy.deepcopy(a)
    steps_agree(a, b, "native", 2, q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], dict(atol=1e-4, rtol=1e-4))
    assert counted and all(counted), "the native kernel did not serve every step"
    assert a.seq_len > 2 * W                                             # wrapped twice


@pytest.mark.parametrize("bits", [4, 8])
def test_fp16_ring_the_models_dtype(build, counted, monkeypatch, bits):
    """The ring dtype compressed models use (fp16): the new rows are rounded to fp16 before
    they are quantized or attended, on both sides (storage equal). The torch step then runs
    SDPA in fp16 (q, the dequantized rows and the output rounded to fp16, 2^-11 relative,
    on values up to ~4): 4e-3 absolute; the kernel stays in fp32."""
    q, k, v = ring_data(W + 20, 4, 1, 256, seed=bits)
    a = SlidingWindowKV(1, 1, 256, W, max_ctx=256, dtype=torch.float16, bits=bits, rotate_v=True)
    b = copy.deepcopy(a)
    steps_agree(a, b, "native", 0, q, k, v, dict(atol=4e-3, rtol=0))
    assert counted and all(counted)


@pytest.mark.parametrize("bits", [4, 8])
def test_degenerate_and_tied_values_quantize_alike(build, monkeypatch, bits):
    """Unrotated rows (a ring with its rotation removed, as tests/test_ring.py does) that hit
    the corners of the quantizer (ring_cases.corner_rows). Storage equal to the torch
    step's after every step."""
    q, k, v = corner_rows(bits)
    a = SlidingWindowKV(1, 1, 64, 8, max_ctx=64, dtype=torch.float32, bits=bits)
    a.rot_k = a.rot_v = None
    b = copy.deepcopy(a)
    steps_agree(a, b, "native", 0, q, k, v)


def test_torch_backend_and_fp16_rings_keep_the_torch_step(monkeypatch):
    """KVRUN_BACKEND=torch and the 16-bit ring never reach the native ring kernel."""
    def refuse(*a, **k):
        raise AssertionError("native ring kernel called")
    monkeypatch.setattr(nra, "ring_step", refuse)
    q, k, v = ring_data(3, 4, 1, 64, seed=0)
    monkeypatch.setenv("KVRUN_BACKEND", "torch")
    r = SlidingWindowKV(1, 1, 64, W, max_ctx=64, bits=4)
    for t in range(3):
        r.attend(0, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1])
        r.commit(1)
    monkeypatch.setenv("KVRUN_BACKEND", "native")
    r = SlidingWindowKV(1, 1, 64, W, max_ctx=64, bits=16)
    r.attend(0, q[:, :, :1], k[:, :, :1], v[:, :, :1])


@pytest.mark.parametrize("bits", [4, 8])
def test_slots_split_over_threads(build, counted, monkeypatch, bits):
    """A ring long enough for the kernel to split its slots over two threads (one split per
    256 head-slots): the new slot falls in either split, before and after the wrap."""
    nth = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q, k, v = ring_data(620, 4, 1, 64, seed=bits)
        a = SlidingWindowKV(1, 1, 64, 301, max_ctx=1024, dtype=torch.float32, bits=bits,
                            rotate_v=True)
        a.backend = "torch"
        a.attend(0, q[:, :, :280], k[:, :, :280], v[:, :, :280])
        a.commit(280)
        b = copy.deepcopy(a)
        for t0, t1 in ((280, 300), (300, 620)):
            if t0 == 300:                   # the middle stretch on torch for both rings
                a.backend = b.backend = "torch"
                for r in (a, b):
                    r.attend(0, q[:, :, 300:590], k[:, :, 300:590], v[:, :, 300:590])
                    r.commit(290)
                t0 = 590
            steps_agree(a, b, "native", 0, q[:, :, t0:t1], k[:, :, t0:t1], v[:, :, t0:t1],
                        dict(atol=1e-4, rtol=1e-4))
        assert sum(counted) == 20 + 30
    finally:
        torch.set_num_threads(nth)
