"""torch's rounding in Triton registers (kvrun.kernels.triton.rounding), under Triton's CPU
interpreter: `_rnd` rounds fp32 to fp16 / bf16 as torch's casts do (bf16 to nearest even,
which the interpreter's own cast does not), and `_rhe` rounds half to even like torch.round."""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest                                                             # noqa: E402
import torch                                                              # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl                                              # noqa: E402

from kvrun.kernels.triton.rounding import XDT_CODES, _rhe, _rnd          # noqa: E402

pytestmark = pytest.mark.interpret


@triton.jit
def _round_kernel(X, RND, RHE, n, XDT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < n
    v = tl.load(X + i, mask=m, other=0.0)
    tl.store(RND + i, _rnd(v, XDT), mask=m)
    tl.store(RHE + i, _rhe(v), mask=m)


def _values():
    """Ties of both roundings (bf16: 1 + 2^-8 and 1 + 3 * 2^-8; fp16: 1 + 2^-11), halves
    for torch.round, negatives, and random values."""
    ties = [1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11,
            0.5, 1.5, 2.5, -0.5, -2.5, 3.0, -7.25]
    return torch.cat([torch.tensor(ties), torch.randn(53, generator=torch.Generator().manual_seed(0)) * 100])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rounds_like_torch(dtype):
    x = _values()
    rnd, rhe = torch.empty_like(x), torch.empty_like(x)
    _round_kernel[(1,)](x, rnd, rhe, x.numel(), XDT=XDT_CODES[dtype], BLOCK=64)
    assert torch.equal(rnd, x.to(dtype).float())
    assert torch.equal(rhe, torch.round(x))
