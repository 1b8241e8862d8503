"""Rotary position embedding (kvrun.kernels.rope): the frequencies of each `rope_scaling`
kind, partial rotary's passed-through channels, longrope's factor sets and attention factor,
and apply_rope's rotation (identity at position 0, norm-preserving, logits depending on the
relative position only)."""
import math

import pytest
import torch
from torch.testing import assert_close

from kvrun.kernels.rope import (Rope, apply_rope, inv_frequencies, long_factors,
                                longrope_attention)

LONG = {"rope_type": "longrope", "original_max_position_embeddings": 64,
        "short_factor": [1.0, 1.0], "long_factor": [2.0, 4.0], "attention_factor": 1.5}


def test_frequencies_by_kind():
    base = [1.0, 0.1, 0.01, 0.001]                                     # 10000^(-2i/8)
    assert_close(inv_frequencies(8, 1e4, None), torch.tensor(base, dtype=torch.float64))
    assert_close(inv_frequencies(8, 1e4, {"type": "linear", "factor": 4.0}),
                 torch.tensor(base, dtype=torch.float64) / 4)
    # partial rotary: 4 of 8 channels rotate (pairs i < 2), the other two pairs see 0
    assert_close(inv_frequencies(8, 1e4, None, rotary_dim=4),
                 torch.tensor([1.0, 0.01, 0.0, 0.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        inv_frequencies(8, 1e4, {"rope_type": "yarn", "factor": 2.0})


def test_llama3_keeps_short_and_scales_long_wavelengths():
    sc = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    plain, scaled = inv_frequencies(128, 5e5, None), inv_frequencies(128, 5e5, sc)
    assert scaled[0] == plain[0]                                     # wavelength 2π: kept
    assert_close(scaled[-1], plain[-1] / 8)                          # beyond 8192: / factor
    assert torch.all(scaled <= plain)


def test_longrope_factor_sets_and_attention_factor():
    assert not long_factors(LONG, 64) and long_factors(LONG, 65)
    assert_close(inv_frequencies(4, 100.0, LONG, ctx=65),
                 torch.tensor([1.0 / 2, 0.1 / 4], dtype=torch.float64))
    assert longrope_attention(1.0, 4096) == 1.0
    assert longrope_attention(8.0, 4096) == pytest.approx(math.sqrt(1.25))   # ln 8 / ln 4096 = 1/4
    rope = Rope(4, 100.0, LONG, 16)
    cos_short, _ = rope.tables(torch.tensor([0]), torch.float32, ctx=32)
    cos_long, _ = rope.tables(torch.tensor([0]), torch.float32, ctx=128)
    assert torch.equal(cos_short, torch.full((1, 4), 1.5)) and torch.equal(cos_long, cos_short)
    _, sin_short = rope.tables(torch.tensor([1]), torch.float32, ctx=32)
    _, sin_long = rope.tables(torch.tensor([1]), torch.float32, ctx=128)
    assert_close(sin_long[0, 0], torch.tensor(1.5 * math.sin(0.5)))
    assert_close(sin_short[0, 0], torch.tensor(1.5 * math.sin(1.0)))


def test_apply_rope_rotates_by_position():
    g = torch.Generator().manual_seed(0)
    D = 16
    rope = Rope(D, 1e4, None, 8, rotary_dim=12)
    q, k = torch.randn(2, 1, 1, 1, D, generator=g).double()
    cos, sin = rope.tables(torch.arange(20), torch.float64)        # grown past max_pos
    assert cos.shape == (20, D)
    assert torch.equal(apply_rope(q, cos[:1], sin[:1]), q)          # position 0
    assert torch.equal(cos[:, 6:8], torch.ones(20, 2, dtype=torch.float64))   # passed through
    r = lambda x, p: apply_rope(x, cos[p:p + 1], sin[p:p + 1])       # noqa: E731
    assert_close(r(q, 7).norm(), q.norm())
    assert_close((r(q, 9) * r(k, 4)).sum(), (r(q, 15) * r(k, 10)).sum())   # m - n = 5
