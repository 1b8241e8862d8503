"""GEAR / GEAR-L (kvrun.kernels.codecs.gear): the low-rank and outlier corrections shrink
KIVI's error, the power iteration recovers a low-rank matrix, and the outlier count per side
follows the sparsity with a floor of one."""
import pytest
import torch
from torch.testing import assert_close

from kvrun.kernels.codecs import make_codec
from kvrun.kernels.codecs.gear import outliers_per_side, power_lowrank
from test_codecs import D, G, Hkv, _packed


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("role", ["k", "v"])
def test_gear_reduces_kivi_error(bits, role):
    _, _, x, kivi = _packed(f"kivi-{bits}", role)
    _, _, _, gl = _packed(f"gear-l-{bits}", role)
    _, _, _, g = _packed(f"gear-{bits}", role)
    e_kivi, e_gl, e_g = ((x - r).norm() for r in (kivi, gl, g))
    assert e_gl < e_kivi and e_g < e_gl, (e_kivi, e_gl, e_g)


def test_gear_outliers_absorb_spikes():
    """Isolated spikes widen KIVI's per-token range; GEAR keeps them aside (exactly, in fp16)
    and quantizes the rest with a narrow range."""
    torch.manual_seed(0)
    x = torch.randn(Hkv, 64, D)
    x[:, :, 7] += 40.0 * torch.sign(torch.randn(Hkv, 64))
    errs = {}
    for m in ("kivi-4", "gear-4"):
        c = make_codec(m, "v", G)
        st = c.alloc(Hkv, D, 64)
        errs[m] = (x - c.pack(st, x, 0)).abs().max()
    assert errs["gear-4"] * 4 < errs["kivi-4"], errs



def test_outliers_per_side():
    # s / 2 % per side: at s = 2, 0.32 of 32 (the floor: 1), 1.28 of 128 → 1, 2.56 of 256 → 3
    assert [outliers_per_side(2.0, n) for n in (32, 128, 256)] == [1, 1, 3]
    assert outliers_per_side(10.0, 128) == 6                     # 6.4
    assert make_codec("gear", "v", G).outliers_per_row(D) == outliers_per_side(2.0, D)


def test_power_lowrank_recovers_a_rank_two_matrix():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(3, 32, 2, generator=g) @ torch.randn(3, 2, 64, generator=g)   # (N, m, d) rank 2
    A, B = power_lowrank(X, torch.randn(64, 2, generator=g))
    assert A.shape == (3, 32, 2) and B.shape == (3, 64, 2)
    assert_close(A.transpose(1, 2) @ A, torch.eye(2).expand(3, 2, 2), atol=1e-5, rtol=0)
    assert_close(A @ B.transpose(1, 2), X, atol=1e-4, rtol=1e-4)
