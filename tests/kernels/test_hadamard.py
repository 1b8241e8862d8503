"""The Hadamard rotation (kvrun.kernels.hadamard): the butterfly equals the explicit matrix and
is orthogonal, a non-power-of-two head dim is block-diagonal, the `Hadamard` form rotates like
its matrix, and a fitted KeyMap moves each logit by a per-query constant only."""
import pytest
import torch
from torch.testing import assert_close

from kvrun.errors import KvrunError
from kvrun.kernels.hadamard import (Hadamard, KeyMap, block_size, fwht, random_signs, rotate,
                                    rotate_k, rotation_matrix, q_matrix, unrotate, unrotate_k)
from tiny import tiny_config


@pytest.mark.parametrize("D", [64, 128, 80, 96, 6])
@pytest.mark.parametrize("seed", [None, 3])
def test_fast_transform_equals_matrix_and_is_orthogonal(D, seed):
    s = random_signs(D, seed) if seed is not None else None
    r = rotation_matrix(D, s)
    x = torch.randn(7, 3, D)
    assert_close(fwht(x, s), x @ r, atol=1e-5, rtol=1e-5)
    assert_close(r @ r.T, torch.eye(D), atol=1e-6, rtol=0)


def test_non_power_of_two_is_block_diagonal_and_odd_is_refused():
    assert block_size(80) == 16 and block_size(96) == 32 and block_size(128) == 128
    r = rotation_matrix(80)
    assert torch.count_nonzero(r[:16, 16:]) == 0                 # blocks do not mix
    with pytest.raises(ValueError):
        block_size(63)
    # an odd head dim cannot be rotated by RoPE either: the config refuses it before any cache
    with pytest.raises(KvrunError, match="must be even"):
        tiny_config(num_heads=2, num_kv_heads=1, hidden_size=126)       # D = 63



@pytest.mark.parametrize("D", [64, 96])
def test_the_butterfly_form_rotates_like_its_matrix(D):
    h = Hadamard.for_head_dim(D, seed=5)
    assert torch.equal(h.matrix, rotation_matrix(D, random_signs(D, 5)))
    x = torch.randn(2, 3, D)
    assert_close(rotate(x, h), rotate(x, h.matrix), atol=1e-5, rtol=1e-5)
    assert_close(unrotate(rotate(x, h), h), x, atol=1e-5, rtol=1e-5)
    assert torch.equal(Hadamard.for_head_dim(D, None).signs, torch.ones(D))


def test_key_map_shifts_each_logit_by_a_per_query_constant():
    """q' . k' = q . k - q . mu for every key of a head: softmax is unchanged."""
    g = torch.Generator().manual_seed(0)
    Hkv, D = 2, 64
    r = rotation_matrix(D, random_signs(D, 1))
    mu, sigma = torch.randn(Hkv, D, generator=g), torch.rand(D, generator=g) + 0.5
    km = KeyMap(r, mu, sigma)
    k, q = torch.randn(Hkv, 5, D, generator=g), torch.randn(Hkv, 3, D, generator=g)
    got = (q @ q_matrix(km)) @ rotate_k(k, km).transpose(1, 2)              # (Hkv, 3, 5)
    want = q @ k.transpose(1, 2) - (q * mu[:, None]).sum(-1, keepdim=True)
    assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert_close(unrotate_k(rotate_k(k, km), km), k, atol=1e-5, rtol=1e-5)
