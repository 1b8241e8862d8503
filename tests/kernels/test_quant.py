"""kvrun.kernels.quant: the word packing is lossless, min-max RTN stays within half a step,
and the scale / code ranges are the documented ones."""
import pytest
import torch

from kvrun.kernels.quant import (Workspace, asym_params, dequantize_asym, pack_codes, qmax,
                                 quantize_asym, quantize_sym_int8, sym_int8_params, unpack_codes,
                                 word_planes)

D, G = 64, 32


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_roundtrip(bits):
    c = torch.randint(0, 2 ** bits, (2, 96, D), dtype=torch.uint8)
    words = pack_codes(c, bits, G)
    assert words.dtype == torch.int32 and words.numel() * 4 == c.numel() * bits // 8
    assert torch.equal(unpack_codes(words, bits, G), c.float())


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_rtn_error_bound(bits):
    x = torch.randn(5, 37, 64) * torch.logspace(-2, 1, 64)
    scale, zero = asym_params(x, -1, bits)
    xh = dequantize_asym(quantize_asym(x, scale, zero, bits), scale, zero)
    assert ((x - xh).abs() <= scale.float() / 2 * 1.001 + 1e-5).all()



def test_code_ranges_and_planes():
    assert [qmax(b) for b in (2, 3, 4, 8)] == [3, 7, 15, 255]
    assert [word_planes(b) for b in (2, 4, 8)] == [16, 8, 4]


def test_asym_covers_the_row_and_hits_both_ends():
    """The zero is the row's minimum in fp16 and the top code reaches the maximum: the
    extreme values quantize to codes 0 and qmax."""
    x = torch.tensor([[-1.0, 0.25, 3.0, 2.0]])
    scale, zero = asym_params(x, -1, 2)
    assert zero.item() == -1.0 and scale.dtype == torch.float16
    assert zero.float() + 3 * scale.float() >= 3.0
    assert quantize_asym(x, scale, zero, 2).tolist() == [[0, 1, 3, 2]]


def test_sym_int8_codes_are_offset_by_128():
    x = torch.tensor([[127.0, -127.0, 0.0, 63.4]])
    scale = sym_int8_params(x, -1)
    assert scale.item() == 1.0
    assert quantize_sym_int8(x, scale).tolist() == [[255, 1, 128, 191]]
    assert sym_int8_params(torch.zeros(1, 4), -1).item() == 2.0 ** -24    # never 0 in fp16


def test_workspace_reuses_and_grows_its_buffer():
    ws = Workspace()
    a = ws.get("x", (2, 3))
    b = ws.get("x", (3, 2))
    assert a.data_ptr() == b.data_ptr() and b.shape == (3, 2)
    c = ws.get("x", (4, 4))                                      # larger: a new buffer
    assert c.shape == (4, 4) and c.data_ptr() != a.data_ptr()
    u = ws.get_u8("u", (5,))
    assert u.dtype == torch.uint8 and u.shape == (5,)
