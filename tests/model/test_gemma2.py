"""Gemma 2 (runtime/model/gemma2.py): Gemma 3's layer without its local RoPE base, so every
layer, sliding or not, takes the model's one RoPE table; and its released head dim 256
against transformers (the checkpoint helpers: test_families.py)."""
from __future__ import annotations

import pytest
import torch

import kvrun
from kvrun.convert import convert_hf
from kvrun.kv.build import build_cache
from kvrun.model.gemma2 import Gemma2DecoderLayer
from kvrun.model.gemma3 import Gemma3DecoderLayer
from kvrun.model.llama import Transformer
from ref_cache import RefCache
from test_attention import randomized
from test_families import CTX, HAS_TRITON, PROMPT, STEPS, _checkpoint, _stepped, _without_softcap
from tiny import tiny_config


def _logits(arch, local_theta):
    cfg = tiny_config(arch, num_layers=2, sliding_window=4, rope_local_theta=local_theta,
                      **({"num_kv_heads": 2, "head_dim": 16} if arch == "gemma3" else {}))
    m = randomized(Transformer(cfg), seed=3).eval()
    ids = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return m, m(ids, RefCache(2, cfg.num_kv_heads, cfg.head_dim, 16, windows=cfg.layer_windows))


def test_every_layer_takes_the_models_one_rope_table():
    m, base = _logits("gemma2", 10.0)
    assert [type(layer) for layer in m.model.layers] == [Gemma2DecoderLayer] * 2
    assert [layer.sliding for layer in m.model.layers] == [True, False]          # even layers slide
    assert not any(layer.local_rope for layer in m.model.layers) and m.rope_local is None
    assert torch.equal(_logits("gemma2", 1e6)[1], base)              # a local base changes nothing
    g3, g3_base = _logits("gemma3", 10.0)
    assert all(type(layer) is Gemma3DecoderLayer for layer in g3.model.layers)
    assert (_logits("gemma3", 1e6)[1] - g3_base).abs().max() > 1e-4    # where Gemma 3's does


@pytest.mark.parametrize("backend", ["torch", "native", "triton"])
def test_gemma2_head_dim_256(tmp_path, backend, monkeypatch):
    """Gemma 2's released head dim (256, the kernels' largest) on a 3-layer checkpoint (sliding,
    global, sliding): logits through an fp32 cache, soft-capped, against transformers to fp32
    rounding; through a kivi-4 cache (its rings 4-bit) against the same on torch."""
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    src, hf = _checkpoint(tmp_path, "gemma2", head_dim=256, num_hidden_layers=3)
    convert_hf(src, tmp_path / "fp32", dtype="fp32")
    ids = torch.randint(3, 259, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits[0].float()
        assert (_without_softcap(hf)(ids).logits[0].float() - ref).abs().max() > 0.5
    monkeypatch.setenv("KVRUN_BACKEND", backend)
    monkeypatch.setenv("KVRUN_ATTN", "fp32")
    m = kvrun.load(tmp_path / "fp32", dtype="fp32", kv="fp32", ctx=CTX, cache_ram_mb=0)
    assert m.cfg.head_dim == 256 and m.cfg.layer_windows == [16, 0, 16]
    got = _stepped(m.transformer, build_cache(m.cfg, CTX, "fp32"), ids)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    if backend == "torch":
        return
    # kivi-4 (4-bit rings): the kernels' compressed routes, capped, against torch's; 0.03
    # apart (torch's KIVI products round to bf16), where a route without the cap is O(1) off
    got = _stepped(m.transformer, build_cache(m.cfg, CTX, "kivi-4"), ids)
    monkeypatch.setenv("KVRUN_BACKEND", "torch")
    want = _stepped(m.transformer, build_cache(m.cfg, CTX, "kivi-4"), ids)
    assert (got - want).abs().max() < 0.1
