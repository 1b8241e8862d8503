"""The attention block every architecture shares (runtime/model/attention.py) against torch's
SDPA over the same projections: RoPE on q and k, GQA, a causal prefill then a decode step
through the cache, and the q/k norms per head (Qwen3) or over the whole projection (OLMo 2)."""
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from kvrun.kernels.rope import Rope, apply_rope
from kvrun.model.attention import Attention
from ref_cache import RefCache
from tiny import tiny_config


def randomized(module, seed=0):
    """`module` with every parameter random (norm weights near 1): the layers allocate their
    weights uninitialized, as loading fills them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * r if "norm" in name else 0.15 * r)
    return module


def _reference(att, x, cos, sin, past=None):
    """o_proj(SDPA(q, k, v)) with the norms applied where the config puts them; `past`: the
    (k, v) of earlier tokens, attended first."""
    B, T, _ = x.shape
    H, Hkv, D = att.n_heads, att.n_kv, att.head_dim
    q, k, v = att.q_proj(x), att.k_proj(x), att.v_proj(x)
    if att.qk_norm == "proj":
        q, k = att.q_norm(q), att.k_norm(k)
    q, k, v = (t.view(B, T, n, D).transpose(1, 2) for t, n in ((q, H), (k, Hkv), (v, Hkv)))
    if att.qk_norm == "head":
        q, k = att.q_norm(q), att.k_norm(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if past is not None:
        k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
    mask = torch.ones(T, k.shape[2], dtype=torch.bool).tril(k.shape[2] - T)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)   # (B, H, T, D)
    return att.o_proj(o.transpose(1, 2).reshape(B, T, H * D)), (k, v)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "olmo2"])
@pytest.mark.parametrize("T", [1, 7])
def test_prefill_then_a_step_equal_sdpa(arch, T):
    cfg = tiny_config(arch, num_heads=6, num_kv_heads=2, hidden_size=96)          # D 16, GQA 3
    att = randomized(Attention(cfg, 0)).eval()
    norm_dims = {"llama": None, "qwen3": 16, "olmo2": 6 * 16}[arch]
    assert (att.q_norm.weight.shape[0] if cfg.qk_norm else None) == norm_dims
    rope = Rope(cfg.head_dim, cfg.rope_theta, None, 64)
    cache = RefCache(1, cfg.num_kv_heads, cfg.head_dim, 64)
    g = torch.Generator().manual_seed(1)
    x, x1 = torch.randn(1, T, 96, generator=g), torch.randn(1, 1, 96, generator=g)
    with torch.no_grad():
        cos, sin = rope.tables(cache.positions(T), torch.float32)
        got = att(x, cos, sin, cache)
        cache.commit(T)
        want, past = _reference(att, x, cos, sin)
        assert_close(got, want, atol=1e-5, rtol=1e-5)
        cos, sin = rope.tables(cache.positions(1), torch.float32)
        assert_close(att(x1, cos, sin, cache), _reference(att, x1, cos, sin, past)[0], atol=1e-5, rtol=1e-5)


def test_q_scale_multiplies_the_queries():
    """Granite's attention_multiplier: scores scaled by it instead of D**-0.5, so q carries
    multiplier·sqrt(D) into the caches' D**-0.5."""
    cfg = tiny_config("granite", attention_multiplier=0.5)
    att = randomized(Attention(cfg, 0)).eval()
    assert att.q_scale == pytest.approx(0.5 * cfg.head_dim ** 0.5)
    plain = randomized(Attention(tiny_config("granite"), 0)).eval()
    assert plain.q_scale is None
    rope = Rope(cfg.head_dim, cfg.rope_theta, None, 64)
    x = torch.randn(1, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    cos, sin = rope.tables(torch.arange(5), torch.float32)
    with torch.no_grad():
        a = att(x, cos, sin, RefCache(1, 2, cfg.head_dim, 8))
        b = plain(x, cos, sin, RefCache(1, 2, cfg.head_dim, 8))
    assert (a - b).abs().max() > 1e-3                   # same weights, other score scale
