"""The building blocks every architecture shares (runtime/model/layers.py): RMSNorm, the
identity RoPE tables of NoPE layers, the final logits' scaling and soft-cap, the dense
Linear with its GEMV copy, and the SwiGLU MLP. (tests/test_layers.py is the import
layering, not this module.)"""
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from kvrun.kernels.rope import apply_rope
from kvrun.model.layers import GEMV_MAX_ROWS, MLP, Linear, NoRope, RMSNorm, final_logits
from test_attention import randomized


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_in_fp32_returns_the_input_dtype(dtype):
    n = randomized(RMSNorm(48, 1e-6))
    x = torch.randn(3, 5, 48, generator=torch.Generator().manual_seed(0)).to(dtype)
    xf = x.double()
    want = xf / (xf.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * n.weight.double()
    got = n(x)
    assert got.dtype == dtype
    assert_close(got.double(), want, **({} if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)))
    assert torch.equal(n.multiplier(), n.weight.float())


def test_no_rope_tables_leave_the_keys_bit_for_bit():
    cos, sin = NoRope(16).tables(torch.arange(7, 12), torch.float32)
    assert cos.shape == sin.shape == (5, 16)
    k = torch.randn(1, 2, 5, 16)
    assert torch.equal(apply_rope(k, cos, sin), k)


def test_final_logits_scale_then_cap():
    x = torch.tensor([-300.0, -3.0, 0.0, 6.0, 300.0])
    assert torch.equal(final_logits(x, 1.0, None), x)
    assert_close(final_logits(x, 3.0, None), x / 3)
    capped = final_logits(x, 3.0, 30.0)
    assert_close(capped, 30 * torch.tanh(x / 90))
    assert capped.abs().max() < 30 and capped[2] == 0


def test_the_gemv_copy_serves_only_few_rows():
    lin = randomized(Linear(32, 8, bias=True))
    x = torch.randn(GEMV_MAX_ROWS + 1, 32, generator=torch.Generator().manual_seed(1))
    full = F.linear(x, lin.weight, lin.bias)
    lin.set_gemv_dtype(torch.float16)
    assert lin.weight_for(GEMV_MAX_ROWS).dtype == torch.float16 and lin.weight_for(GEMV_MAX_ROWS + 1) is lin.weight
    assert torch.equal(lin(x), full)                                    # many rows: the fp32 weight
    few = lin(x[:2])
    assert_close(few, F.linear(x[:2].half(), lin.weight.half()).float() + lin.bias)
    assert not torch.equal(few, full[:2])                               # rounded through fp16
    lin.set_gemv_dtype(torch.float32)                                   # the weight's own dtype: no copy
    assert lin.gemv_weight is None and torch.equal(lin(x[:2]), full[:2])


def test_mlp_is_swiglu():
    m = randomized(MLP(16, 40))
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(2))
    want = F.linear(F.silu(F.linear(x, m.gate_proj.weight)) * F.linear(x, m.up_proj.weight), m.down_proj.weight)
    assert_close(m(x), want)
