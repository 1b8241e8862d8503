"""The channel-major byte planes of per-channel K codes (kvrun.kernels.chanpack): codes read
back as written for every plane width, at 32-token offsets inside a block, without touching
their neighbours; the byte of a known token holds it at its documented shift; 3 bits are
split in a 2-bit and a 1-bit buffer."""
import pytest
import torch

from kvrun.kernels import chanpack


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_codes_read_back_as_written(bits):
    g = torch.Generator().manual_seed(bits)
    Hkv, D, S = 2, 5, 512
    buf = torch.zeros(chanpack.shape(bits, Hkv, D, S), dtype=torch.uint8)
    a = torch.randint(0, 1 << bits, (Hkv, 32, D), generator=g, dtype=torch.uint8)
    b = torch.randint(0, 1 << bits, (Hkv, 96, D), generator=g, dtype=torch.uint8)
    chanpack.write(buf, a, 64, bits)                       # plane 2 of a 4-plane block
    chanpack.write(buf, b, 96, bits)                       # the rest of it and beyond
    assert torch.equal(chanpack.codes(buf, 64, 96, bits), a.float())
    assert torch.equal(chanpack.codes(buf, 96, 192, bits), b.float())
    assert torch.equal(chanpack.codes(buf, 64, 192, bits), torch.cat([a, b], 1).float())
    assert not chanpack.codes(buf, 0, 64, bits).any() and not chanpack.codes(buf, 192, 256, bits).any()


def test_a_token_sits_at_its_plane_shift():
    """2 bits: U = 128 tokens per block; token 32·e + j of block i is byte j at bits 2e."""
    buf = torch.zeros(chanpack.shape(2, 1, 1, 256), dtype=torch.uint8)
    assert buf.shape == (1, 1, 64)
    c = torch.zeros(1, 32, 1, dtype=torch.uint8)
    c[0, 5, 0] = 3                                          # token 128 + 64 + 5: block 1, e = 2
    chanpack.write(buf, c, 128 + 64, 2)
    assert buf[0, 0].nonzero().flatten().tolist() == [32 + 5]
    assert buf[0, 0, 37].item() == 3 << 4


def test_three_bits_take_two_buffers():
    assert chanpack.byte_planes(3) == [("codes", 2, 0), ("hi", 1, 2)]
    assert chanpack.byte_planes(4) == [("codes", 4, 0)]
    assert [chanpack.unit(b) for b in (1, 2, 4, 8)] == [256, 128, 64, 32]
