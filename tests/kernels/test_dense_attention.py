"""Attention over an uncompressed cache (kvrun.kernels.dense_attention) against the textbook
form — K/V repeated per query head, an explicit causal (or sliding-window) mask, softmax in
fp32 — over GQA 1/3/8, decode steps and chunks, windows shorter than the context, and long
chunks cut into query blocks."""
import sys

import pytest
import torch
from torch.testing import assert_close

from kvrun.kernels.dense_attention import causal_mask, dense_attention


def _reference(q, k, v, q_start, window=0):
    B, H, T, D = q.shape
    G = H // k.shape[1]
    k, v = k.float().repeat_interleave(G, 1), v.float().repeat_interleave(G, 1)
    s = q.float() @ k.transpose(-1, -2) / D ** 0.5                        # (B, H, T, S)
    qpos = torch.arange(q_start, q_start + T)[:, None]
    kpos = torch.arange(k.shape[2])[None, :]
    seen = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
    return s.masked_fill(~seen, float("-inf")).softmax(-1) @ v


def test_causal_mask():
    assert causal_mask(2, 4, 2).int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert causal_mask(2, 5, 3, window=2).int().tolist() == [[0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]


@pytest.mark.parametrize("H,Hkv", [(2, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("T,q_start", [(1, 0), (1, 13), (5, 0), (4, 9)])
@pytest.mark.parametrize("window", [0, 3])
def test_matches_the_textbook_form(H, Hkv, T, q_start, window):
    g = torch.Generator().manual_seed(H + T + q_start)
    S, D = q_start + T, 32
    q = torch.randn(1, H, T, D, generator=g)
    k, v = torch.randn(2, 1, Hkv, S, D, generator=g)
    assert_close(dense_attention(q, k, v, q_start, window), _reference(q, k, v, q_start, window),
                 atol=1e-5, rtol=1e-5)


def test_half_cache_decode_step_returns_the_query_dtype():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 1, 64, generator=g)
    k, v = torch.randn(2, 1, 2, 10, 64, generator=g).half()
    out = dense_attention(q, k, v, 9)
    assert out.dtype == torch.float32
    assert_close(out, _reference(q, k, v, 9), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("window", [0, 3])
def test_long_chunks_in_query_blocks_give_the_same_rows(monkeypatch, window):
    # 11 queries: blocks of 4, 4, 3 (the module, which kvrun.kernels' function name hides)
    monkeypatch.setattr(sys.modules[dense_attention.__module__], "QBLOCK", 4)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 6, 11, 16, generator=g)
    k, v = torch.randn(2, 1, 2, 13, 16, generator=g)
    assert_close(dense_attention(q, k, v, 2, window), _reference(q, k, v, 2, window),
                 atol=1e-5, rtol=1e-5)
