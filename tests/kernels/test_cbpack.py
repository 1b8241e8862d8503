"""The codebook codecs' tables and layout (kvrun.kernels.cbpack): the Lloyd-Max levels of a
randomly rotated head vector's coordinates (fp16-exact, symmetric, tending to the Gaussian's
as D grows) and the packed groups of 32 codes."""
import pytest
import torch
from torch.testing import assert_close

from kvrun.kernels import cbpack

BITS = (2, 3, 4)


@pytest.mark.parametrize("bits,mse", [(2, 0.1175), (3, 0.03454), (4, 0.009497)])
def test_levels_are_the_gaussian_lloyd_max_quantizer_at_large_D(bits, mse):
    """As D grows the coordinate density tends to N(0, 1): the levels' distortion is the
    known Lloyd-Max value (Max 1960) for a standard normal."""
    lv, bd = cbpack.levels(bits, 4096)
    assert lv.shape == (1 << bits,) and bd.shape == ((1 << bits) - 1,)
    assert torch.all(lv[1:] > lv[:-1]) and torch.equal(lv, -lv.flip(0))
    assert_close(bd, (lv[1:] + lv[:-1]) / 2)
    u = torch.randn(2_000_000, generator=torch.Generator().manual_seed(0))
    got = ((u - lv[torch.bucketize(u, bd)]) ** 2).mean().item()
    assert abs(got - mse) < 0.02 * mse


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("D", [64, 256, 4096])
def test_levels_are_fp16_values(bits, D):
    """The AVX2 tile reads look levels up as fp16 halves: every level must be one exactly,
    and within fp16's rounding of the unrounded Lloyd-Max level."""
    lv, bd = cbpack.levels(bits, D)
    assert torch.equal(lv.half().float(), lv)
    exact = torch.tensor(cbpack._lloyd_max(bits, D), dtype=torch.float64)
    assert torch.all((lv.double() - exact).abs() <= exact.abs() * 2.0 ** -11)
    assert torch.equal(bd, (lv[1:] + lv[:-1]) / 2)


def test_levels_follow_the_head_dim():
    """A small D has lighter tails than the Gaussian: its outer level sits further in."""
    assert cbpack.levels(4, 64)[0][-1] < cbpack.levels(4, 256)[0][-1] < cbpack.levels(4, 4096)[0][-1]


@pytest.mark.parametrize("bits", BITS)
def test_group_round_trip_and_layout(bits):
    c = torch.randint(0, 1 << bits, (3, 5, 32))
    b = cbpack.pack_groups(c, bits)
    assert b.shape == (3, 5, 4 * bits) and b.dtype == torch.uint8
    assert torch.equal(cbpack.unpack_groups(b, bits), c)
    one = torch.zeros(32, dtype=torch.long)
    one[17] = (1 << bits) - 1                              # code 17 set to all ones
    got = cbpack.pack_groups(one, bits).tolist()
    want = {4: {1: 0xF0}, 2: {1: 3 << 4}, 3: {1: 3 << 4, 10: 1 << 1}}[bits]
    assert got == [want.get(i, 0) for i in range(4 * bits)]



def test_group_bytes():
    assert [cbpack.group_bytes(b) for b in BITS] == [8, 12, 16]      # 32 codes of b bits
