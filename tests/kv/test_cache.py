"""What the caches share (runtime/kv/cache.py): the uncompressed dtypes, `NewKV` (one step's
K/V as attention hands it over) and a part bound to a kernels backend by name."""
import pytest
import torch
from torch.testing import assert_close

from kvrun.kernels.rope import Rope, apply_rope
from kvrun.kv.build import build_cache
from kvrun.kv.cache import KV_DTYPES, NewKV
from kvrun.kv.config import parse_kv
from tiny import tiny_config


def _step(T=3, Hkv=2, D=16):
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, Hkv, T, D, generator=g) for _ in range(2))
    cos, sin = Rope(D, 10000.0, None, 64).tables(torch.arange(5, 5 + T), torch.float32)
    return k, v, cos, sin


def test_the_float_methods_are_their_torch_dtypes():
    assert KV_DTYPES == {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def test_rows_are_k_after_rope_and_the_v_rows():
    k, v, cos, sin = _step()
    rk, rv = NewKV(k, cos, sin, v=v).rows()
    assert_close(rk, apply_rope(k, cos, sin), atol=0, rtol=0)
    assert rv is v
    assert not torch.equal(rk, k)                          # positions 5.. do rotate


def test_rows_of_projection_operands_come_from_rotated():
    k, v, cos, sin = _step()
    x, w = torch.randn(3, 32), torch.randn(2 * 16, 32)
    nk = NewKV(k, cos, sin, v_x=x, v_weight=w, rotated=lambda: ("K", "V"))
    assert nk.rows() == ("K", "V")
    with pytest.raises(AssertionError, match="not both"):
        NewKV(k, cos, sin, v=v, v_x=x, v_weight=w)
    with pytest.raises(AssertionError, match="needs `rotated`"):
        NewKV(k, cos, sin, v_x=x, v_weight=w).rows()


def test_a_cache_rebinds_its_backend_by_name():
    c = build_cache(tiny_config(), 64, parse_kv("fp16", residual=32, group=32))
    for name in ("torch", "triton", "torch"):
        c.backend = name
        assert c.backend == name == c.kernels.name
