"""The integer GEMV's torch oracle (kvrun.kernels.native.gemv_reference): the input quantizer's
rounding and zero blocks, and the GEMV over its codes equals the quantized input times the
dequantized weight (the C paths are held to it in test_native_decode_layer_gemv.py)."""
import pytest
import torch
from torch.testing import assert_close

from kvrun.kernels.native.gemv_reference import QB, gemv_int_reference, quantize_input


def test_quantize_input_rounds_half_to_even_and_keeps_zero_blocks():
    x = torch.zeros(1, 72)
    x[0, :4] = torch.tensor([32767.0, 0.5, 1.5, -2.5])     # d = 1: halves go to even codes
    x[0, 40] = 1e-31                                        # below TINY: a zero block
    x[0, 69] = -3.0                                         # the last, partial block
    q, d = quantize_input(x)
    assert q[0, :4].tolist() == [32767, 0, 2, -2] and q[0, 69] == -32767
    assert q[0].abs().sum() == 32767 + 2 + 2 + 32767
    assert torch.equal(d[0], torch.tensor([1.0, 0.0, 3.0 / 32767], dtype=torch.float32))



def _dequantized_input(x):
    q, d = quantize_input(x)
    return q.double() * d.double().repeat_interleave(QB, 1)[:, :x.shape[1]]     # (B, K)


@pytest.mark.parametrize("K", [40, 96])                        # 40: a partial input block
def test_int8_reference_is_the_quantized_product(K):
    g = torch.Generator().manual_seed(K)
    N, B = 5, 3
    qw = torch.randint(-128, 128, (N, K), generator=g).to(torch.int8)
    scales, bias = torch.rand(N, generator=g) * 0.01 + 1e-4, torch.randn(N, generator=g)
    x = torch.randn(B, K, generator=g)
    y, mag = gemv_int_reference({"kind": "int8", "qweight": qw, "scales": scales, "bias": bias}, x)
    want = _dequantized_input(x) @ (qw.double() * scales.double()[:, None]).T + bias.double()
    assert_close(y, want, atol=1e-12, rtol=1e-12)
    assert ((y - bias.double()).abs() <= mag + 1e-12).all()


def test_int4_reference_is_the_quantized_product():
    """int4: each group of G columns stored as two halves in the low and high nibbles, the
    weight s_g * c + m_g."""
    g = torch.Generator().manual_seed(0)
    N, K, G, B = 3, 128, 64, 2
    codes = torch.randint(0, 16, (N, K), generator=g)
    c = codes.view(N, K // G, 2, G // 2)
    qw = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(N, K // 2).to(torch.uint8)
    s = (torch.rand(N, K // G, generator=g) * 0.1).half()
    m = (torch.randn(N, K // G, generator=g) * 0.1).half()
    W = codes.double() * s.double().repeat_interleave(G, 1) + m.double().repeat_interleave(G, 1)
    x = torch.randn(B, K, generator=g)
    y, _ = gemv_int_reference({"kind": "int4", "qweight": qw, "scales": s, "mins": m,
                               "group": G}, x)
    assert_close(y, _dequantized_input(x) @ W.T, atol=1e-12, rtol=1e-12)
