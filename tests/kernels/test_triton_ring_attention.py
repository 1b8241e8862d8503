"""The quantized sliding ring's one-token step on the Triton kernel (kernels/triton/
ring_attention.py, under Triton's CPU interpreter) against the torch step (runtime/kv/ring.py
`_attend`, then `unrotate`), its oracle.

Two rings start from the same state (a chunk written by the torch step) and take the same
tokens, one on each backend (`backend` "triton" / "torch"): after every step their codes,
scales and mins are equal bit for bit (torch.equal on every part), and their outputs agree
within the tolerance each case states. Cases: 4 and 8 bits; head dims 64, 256 and 48 (not
a power of two: padded tiles); channel groups 16, 32, 64 and 3 (odd: a 4-bit byte's two
channels in different groups); 1 and 2 KV heads under 4 query heads; rings of 16 and 37
slots, stepped past the wrap; V rotated or not; fp32, fp16 and bf16 ring rows.

Tolerances. fp32 rings: the torch step is fp32 SDPA over the same dequantized values, so
the two differ by summation order (and the kernel's base-2 online softmax): logits are sums
of D products of O(1) values, |error| ~ D·2^-24·|q||k|/√D < 2e-5 at D 256, the output a
convex mix of O(1) V rows over <= 37 slots (< 1e-5), the un-rotation D more products
(< 1e-5): 1e-4 absolute and relative (measured: <= 1.7e-6), while a wrong slot, scale or
row moves outputs by O(0.1). fp16 rings (fp16 q, k, v, as a compressed model feeds them):
the torch step rounds q, every dequantized row and SDPA's output to fp16 before
un-rotating and rounding again; the kernel stays in fp32 and rounds the output once. On
outputs up to ~2.5 an fp16 ulp is 2^-9 ≈ 2e-3: 4e-3 absolute, two ulps (measured: <= 1e-3).
bf16 rows: the same roundings at bf16's 2^-8 relative (and the interpreter truncates the
kernel's fp32 → bf16 output, one more bf16 step): 3e-2 absolute (measured: 7.8e-3).

TRITON_INTERPRET must be set before kvrun.kernels.triton is imported; the interpreter runs
each program in numpy (~0.1 s a step here), so rings and step counts stay small.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import contextlib  # noqa: E402
import copy  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kvrun.kernels import backend, dispatch  # noqa: E402
from kvrun.kernels.triton import ring_attention as tra  # noqa: E402
from kvrun.kv.ring import SlidingWindowKV  # noqa: E402
from ring_cases import corner_rows, count_ring_steps, ring_data, steps_agree  # noqa: E402

pytestmark = pytest.mark.interpret

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
TOL = {F32: dict(atol=1e-4, rtol=1e-4), F16: dict(atol=4e-3, rtol=0), BF16: dict(atol=3e-2, rtol=0)}

# (bits, D, group, Hkv, H, W, rotate_v, ring dtype)
CASES = [
    (4, 64, 32, 1, 4, 16, False, F32),
    (8, 64, 32, 2, 4, 37, True, F32),
    (4, 256, 64, 2, 4, 37, True, F32),
    (8, 256, 32, 1, 4, 16, True, F32),
    (4, 48, 16, 1, 4, 16, True, F32),
    (4, 48, 3, 2, 4, 16, False, F32),
    (4, 256, 32, 1, 4, 37, False, F16),
    (8, 256, 64, 1, 4, 37, True, F16),
    (4, 64, 32, 2, 4, 16, True, F16),
    (8, 64, 16, 2, 4, 16, False, F16),
    (8, 64, 32, 1, 4, 16, True, BF16),
]


@pytest.fixture
def counted(monkeypatch):
    """Per one-token step on the Triton backend: whether the Triton kernel served it."""
    return count_ring_steps(monkeypatch, "triton")


def _rings(bits, D, group, Hkv, W, rotate_v, dtype, q, k, v, pre):
    """Two equal rings holding a chunk of `pre` tokens written by the torch step."""
    a = SlidingWindowKV(2, Hkv, D, W, max_ctx=256, dtype=dtype, bits=bits, group=group,
                        rotate_v=rotate_v)
    a.backend = "torch"
    a.attend(1, q[:, :, :pre], k[:, :, :pre], v[:, :, :pre])
    a.commit(pre)
    return a, copy.deepcopy(a)


@pytest.mark.parametrize("bits,D,group,Hkv,H,W,rotate_v,dtype", CASES)
def test_triton_step_equals_the_torch_step(counted, bits, D, group, Hkv, H, W, rotate_v, dtype):
    pre = W - 8                     # the steps fill the ring, wrap, and overwrite 12 slots
    q, k, v = ring_data(W + 12, H, Hkv, D, seed=bits + D + group + W, dtype=dtype)
    a, b = _rings(bits, D, group, Hkv, W, rotate_v, dtype, q, k, v, pre)
    steps_agree(a, b, "triton", 1, q[:, :, pre:], k[:, :, pre:], v[:, :, pre:], TOL[dtype])
    assert len(counted) == 20 and all(counted), "the Triton kernel did not serve every step"
    assert a.seq_len > W and a.k.codes[1].any() and not a.k.codes[0].any()   # wrapped; layer 1


@pytest.mark.parametrize("bits", [4, 8])
def test_slots_split_over_parts(counted, monkeypatch, bits):
    """16-slot parts over a 37-slot ring (3 parts, the last partial): the new slot falls in
    each part in turn, and stage 2 merges the parts by log-sum-exp."""
    monkeypatch.setattr(tra, "BLOCK_N", 16)
    monkeypatch.setattr(tra, "SPLIT_MIN", 16)
    assert tra.n_splits(37, 2) == (3, 16)
    q, k, v = ring_data(50, 4, 2, 64, seed=bits)
    a, b = _rings(bits, 64, 32, 2, 37, True, F32, q, k, v, 10)
    steps_agree(a, b, "triton", 1, q[:, :, 10:], k[:, :, 10:], v[:, :, 10:], TOL[F32])
    assert len(counted) == 40 and all(counted)


@pytest.mark.parametrize("bits", [4, 8])
def test_degenerate_and_tied_values_quantize_alike(bits):
    """Unrotated rows (the ring's rotation removed) at the quantizer's corners
    (ring_cases.corner_rows). Storage equal to the torch step's every step."""
    q, k, v = corner_rows(bits)
    a = SlidingWindowKV(1, 1, 64, 8, max_ctx=64, dtype=F32, bits=bits)
    a.rot_k = a.rot_v = None
    b = copy.deepcopy(a)
    steps_agree(a, b, "triton", 0, q, k, v, around=_quiet)


@contextlib.contextmanager
def _quiet():
    """numpy's warnings for the interpreter's 0/0 and x/0 (the cases under test)."""
    import numpy as np
    with torch.no_grad(), np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        yield


def test_dispatch_routes_and_declines():
    """dispatch.ring_step: the Triton kernel on backend "triton" (None on torch); the kernel
    declines what it does not cover (a chunk, D > 256, Gq > 16, 2-bit codes) with None, which
    the op called with a route's backend raises; the routes the ring resolves say which
    shapes the kernel takes."""
    r = SlidingWindowKV(1, 1, 64, 16, max_ctx=64, dtype=F32, bits=4)
    q, k, v = ring_data(2, 4, 1, 64, seed=0)
    args = (r.k.parts, r.v.parts, 4, 32, F32, 0, 0, 1)
    one = [z[:, :, :1] for z in (q, k, v)]
    assert dispatch.ring_step(*one, *args, backend="torch") is None
    out = dispatch.ring_step(*one, *args, backend="triton")
    assert out is not None and out.shape == (1, 4, 1, 64) and r.k.codes[0, 0, 0].any()
    assert dispatch.ring_step(q, k, v, *args) is None                                # T = 2
    with pytest.raises(dispatch.KernelRouteError, match="declined"):
        dispatch.ring_step(q, k, v, *args, backend="triton")
    assert tra.ring_step(*one, r.k.parts, r.v.parts, 2, 32, F32, 0, 0, 1) is None     # 2 bits
    q17 = torch.zeros(1, 17, 1, 64)
    assert tra.ring_step(q17, *one[1:], *args) is None                                 # Gq 17
    big = SlidingWindowKV(1, 1, 512, 16, max_ctx=64, dtype=F32, bits=4)
    z = torch.zeros(1, 1, 1, 512)
    assert tra.ring_step(z, z, z, big.k.parts, big.v.parts, 4, 32, F32, 0, 0, 1) is None
    tri = backend.named("triton")
    assert [tri.ring_route(b, H, 1, D, 32, F32).step for b, H, D in
            ((4, 4, 64), (8, 16, 64), (16, 4, 64), (4, 17, 64), (4, 4, 512))] == \
        ["triton", "triton", "torch", "torch", "torch"]


def test_bytes_per_step_gemma3_270m():
    """The docstring's count for Gemma 3 270M's ring (H 4, Hkv 1, D 256, group 32, 4 bits)
    at 512 filled slots: 159.7 KiB of codes, 4 parts of 32.1 KiB, R_v 256 KiB."""
    b = tra.bytes_per_step(4, 1, 256, 512, 4, 32, rotate_v=True)
    assert b["ring"] == 2 * 511 * (128 + 32) and abs(b["parts"] / 1024 - 32.125) < 1e-9
    assert b["rot_v"] == 256 * 1024 and tra.n_splits(512, 1) == (4, 128)
