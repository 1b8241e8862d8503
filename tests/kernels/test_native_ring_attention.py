"""The sliding ring's one-token step on the native kernel (kernels/native/ring_attention.c)
against the torch step (runtime/kv/ring.py `rotate_step`, `_attend`, `unrotate`), its oracle.

Two rings start from the same state and take the same tokens, one through each backend
(each ring's `backend`: native / torch): after every step their codes, scales and mins are equal
bit for bit, and their outputs agree to fp32 summation order. Parametrized over 4 and 8
bits, channel groups of 32 and 64 (head dims 64 and 256; and 16, which the vector path
serves on AVX2 but not with AVX-512's wider blocks), GQA (4 query heads over 1 KV head, 6
over 2), V rotated or not, an odd window so the filled-slot count is odd and even, through
two wrap-arounds; 16-bit rings (the window dtype's rows) in fp16, bf16 and fp32; on the
default build and the portable one (-DKVRUN_NO_AVX512). The kernel rotates q and the new
rows itself, by the signed Hadamard's butterfly in the fixed order the torch step's `fwht`
runs, so the stored codes equal the torch step's by construction on every CPU (checked
directly on fp32 rows: test_rotation_is_the_torch_butterfly_bit_for_bit), not by the luck
of a BLAS library's summation order.
"""
import copy
import ctypes

import pytest
import torch

import kvrun.kernels.native.ring_attention as nra
from kvrun.kernels import native
from kvrun.kernels.hadamard import Hadamard, fwht, random_signs
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


@pytest.mark.parametrize("D", [16, 32, 48, 64, 96, 128, 192, 256])
def test_rotation_is_the_torch_butterfly_bit_for_bit(build, D):
    """The kernel's rotation of the new rows (rows_inline.h hadamard_rotate) is torch's
    `fwht` bit for bit — one fixed order of IEEE fp32 operations on both sides, whatever the
    CPU, its BLAS or the build — so stored codes never depend on where they were computed.
    Seen through an fp32 ring given a rotation: its slots hold the rotated rows exactly.
    Rows of magnitudes 1e-3 .. 1e3 and head dims whose Hadamard blocks are 16 .. 256 wide
    (48 = 3 x 16, 96 = 3 x 32, 192 = 3 x 64)."""
    Hkv, H, Wr = 8, 8, 24
    g = torch.Generator().manual_seed(D)
    rot = Hadamard(random_signs(D, D))
    ring = SlidingWindowKV(1, Hkv, D, Wr, max_ctx=64, dtype=torch.float32, bits=16)
    for t in range(Wr):
        q, k, v = (torch.randn(1, h, 1, D, generator=g) * 10 ** (6 * torch.rand(1, h, 1, D, generator=g) - 3)
                   for h in (H, Hkv, Hkv))
        o = nra.ring_step(q, k, v, ring.k.parts, ring.v.parts, 16, 32, torch.float32, 0, t, t + 1, rot, rot)
        assert o is not None, "the native kernel declined the step"
        for role, x in (("k", k), ("v", v)):
            stored = getattr(ring, role).parts[0][0, :, t]                 # (Hkv, D) fp32
            want = fwht(x[0, :, 0], rot.signs)
            assert torch.equal(stored, want), f"{role} slot {t}: {(stored != want).sum()} values differ"


@pytest.mark.parametrize("bits", [4, 8])
def test_fp16_ring_the_models_dtype(build, counted, monkeypatch, bits):
    """The ring dtype compressed models use (fp16): the new rows are rounded to fp16 before
    they are quantized or attended, on both sides (storage equal). The torch step reads
    the dequantized rows back in fp16 (2^-11 relative, on values up to ~4) and attends in
    fp32 (q's dtype, not fp16 SDPA, whose internal rounding is the CPU library's); the
    kernel dequantizes in fp32: 4e-3 absolute."""
    q, k, v = ring_data(W + 20, 4, 1, 256, seed=bits)
    a = SlidingWindowKV(1, 1, 256, W, max_ctx=256, dtype=torch.float16, bits=bits, rotate_v=True)
    b = copy.deepcopy(a)
    steps_agree(a, b, "native", 0, q, k, v, dict(atol=4e-3, rtol=0))
    assert counted and all(counted)


@pytest.mark.parametrize("bits", [4, 8])
def test_degenerate_and_tied_values_quantize_alike(build, monkeypatch, bits):
    """Unrotated rows (a ring with its rotation removed, as tests/kv/test_ring.py does) that hit
    the corners of the quantizer (ring_cases.corner_rows). Storage equal to the torch
    step's after every step."""
    q, k, v = corner_rows(bits)
    a = SlidingWindowKV(1, 1, 64, 8, max_ctx=64, dtype=torch.float32, bits=bits)
    a.rot_k = a.rot_v = None
    b = copy.deepcopy(a)
    steps_agree(a, b, "native", 0, q, k, v)


def test_torch_backend_keeps_the_torch_step(monkeypatch):
    """KVRUN_BACKEND=torch never reaches the native ring kernel, whatever the ring's width."""
    def refuse(*a, **k):
        raise AssertionError("native ring kernel called")
    monkeypatch.setattr(nra, "ring_step", refuse)
    q, k, v = ring_data(3, 4, 1, 64, seed=0)
    monkeypatch.setenv("KVRUN_BACKEND", "torch")
    for bits in (4, 16):
        r = SlidingWindowKV(1, 1, 64, W, max_ctx=64, bits=bits)
        for t in range(3):
            r.attend(0, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1])
            r.commit(1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D", [64, 48])
@pytest.mark.parametrize("Hkv,H", [(1, 4), (2, 6)])
def test_16_bit_ring_equals_the_torch_step(build, counted, dtype, D, Hkv, H):
    """A ring of the window dtype (bits 16, the rings of an uncompressed --kv): the new rows
    rounded to it, stored as torch's .to(dtype) stores them (bit for bit), attended from
    their rounded values. Outputs: both sides attend the rounded rows in fp32 (the torch
    step in q's dtype), so they differ by summation order only (as above). D 64 takes
    the vector path for fp16 rows, D 48 (not whole vector blocks), bf16 and fp32 the plain
    one; through a wrap-around."""
    q, k, v = ring_data(W + 20, H, Hkv, D, seed=D + H)
    a = SlidingWindowKV(2, Hkv, D, W, max_ctx=256, dtype=dtype, bits=16)
    assert a.rot_k is None and a.rot_v is None                      # never rotated
    b = copy.deepcopy(a)
    steps_agree(a, b, "native", 1, q, k, v, dict(atol=1e-4, rtol=1e-4))
    assert counted and all(counted)


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
