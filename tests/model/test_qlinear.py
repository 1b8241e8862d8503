"""Weight-only quantized linear layers (runtime/model/qlinear.py) against a dense F.linear
over their dequantized weights (fused op for few rows, dequant + GEMM above), int4 packing
and its round-to-nearest bound, and the group fallback."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvrun.convert.quantize import op_dequantize, quantize_int4, quantize_int8, rel_error
from kvrun.model import qlinear
from kvrun.model.qlinear import (Int4Linear, Int8Linear, dequantize_int4, dequantize_int8,
                                 int4_group, pack_int4, unpack_int4)

SHAPES = [(576, 1536), (192, 576), (1536, 576), (40, 96)]        # (out N, in K)
BF16 = lambda t: t.to(torch.bfloat16).float()                     # noqa: E731


def _weights(N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    w[:, ::7] += 0.02                    # groups with a nonzero mean: the min/zero matters
    return w


def _int8_layer(w, bias=None):
    lin = Int8Linear(w.shape[1], w.shape[0], bias=bias is not None)
    parts = quantize_int8(w)
    lin.qweight.copy_(parts["qweight"])
    lin.scales.copy_(parts["scales"])
    if bias is not None:
        lin.bias.data.copy_(bias)
    lin.prepare()
    return lin


def _int4_layer(w, group, bias=None):
    g = int4_group(w.shape[1], group)
    lin = Int4Linear(w.shape[1], w.shape[0], g, bias=bias is not None)
    parts = quantize_int4(w, g)
    for k in ("qweight", "scales", "mins"):
        getattr(lin, k).copy_(parts[k])
    if bias is not None:
        lin.bias.data.copy_(bias)
    lin.prepare()
    return lin


# -- layers vs a dequantized reference ------------------------------------------------------

@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 200])      # fused op (≤ 32 rows) and dequant + GEMM
def test_int8_linear_equals_dequantized_reference(N, K, rows):
    w, b = _weights(N, K), torch.randn(N) * 0.1
    lin = _int8_layer(w, b)
    x = torch.randn(2, rows, K) if rows == 200 else torch.randn(rows, K)
    y = lin(x)
    ref = F.linear(x, dequantize_int8(lin.qweight, lin.scales), b)
    if not lin.uses_fused_op(x.numel() // K):   # fp32 dequantized path: same numbers
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    else:   # the op sees bf16 activations and scales and rounds its output to bf16
        emu = F.linear(BF16(x), lin.qweight.float() * BF16(lin.scales)[:, None], b)
        torch.testing.assert_close(y, emu, rtol=1e-2, atol=2e-3 * emu.abs().max().item())
        assert rel_error(ref, y) < 1e-2
    assert rel_error(F.linear(x, w, b), ref) < 1e-2           # int8 itself is close to w


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 4, 100])
def test_int4_linear_equals_dequantized_reference(N, K, group, rows):
    w, b = _weights(N, K, seed=1), torch.randn(N) * 0.1
    lin = _int4_layer(w, group, b)
    assert K % lin.group == 0 and lin.group <= group
    x = torch.randn(rows, K)
    y = lin(x)
    ref = F.linear(x, dequantize_int4(lin.qweight, lin.scales, lin.mins), b)
    assert lin.uses_fused_op(rows) == (rows <= qlinear.QUANT_OP_MAX_ROWS and N % 16 == 0)
    if not lin.uses_fused_op(rows):
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    else:
        parts = {"qweight": lin.qweight, "scales": lin.scales, "mins": lin.mins}
        emu = F.linear(BF16(x), op_dequantize(parts), b)
        torch.testing.assert_close(y, emu, rtol=1e-2, atol=2e-3 * emu.abs().max().item())
        assert rel_error(ref, y) < 1e-2
    assert rel_error(F.linear(x, w, b), ref) < 0.15           # 4-bit RTN on Gaussian weights


@pytest.mark.parametrize("group", [32, 64])
def test_int4_pack_round_trip_and_rtn_bound(group):
    codes = torch.randint(0, 16, (24, 192), generator=torch.Generator().manual_seed(3))
    packed = pack_int4(codes, group)
    assert packed.shape == (24, 96) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed, group, torch.int64), codes)
    # stored layout: byte j of a group = column j (low nibble) and j + G/2 (high nibble)
    assert packed[0, 0].item() == codes[0, 0].item() | (codes[0, group // 2].item() << 4)
    w = _weights(24, 192, seed=4)
    parts = quantize_int4(w, group)
    err = (dequantize_int4(**parts) - w).abs().view(24, -1, group)
    assert (err <= parts["scales"].float()[..., None] / 2 + 1e-6).all()


def test_int4_group_fallback():
    assert int4_group(576, 128) == 64 and int4_group(1536, 128) == 128
    assert int4_group(96, 64) == 32 and int4_group(40, 32) == 0
