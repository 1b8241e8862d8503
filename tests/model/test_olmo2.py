"""OLMo 2's decoder layer (runtime/model/olmo2.py): no norm before attention or the MLP,
each block's output normalized before its residual add, q/k norms over the whole
projection. (Its logits against transformers: test_families.py.)"""
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from kvrun.kernels.rope import Rope
from kvrun.model.olmo2 import Olmo2DecoderLayer
from ref_cache import RefCache
from test_attention import randomized
from tiny import tiny_config


def test_blocks_are_normalized_after_not_before():
    cfg = tiny_config("olmo2")                                     # hidden 64, 4 heads of 16, 2 KV
    layer = randomized(Olmo2DecoderLayer(cfg, 0)).eval()
    assert not hasattr(layer, "input_layernorm") and not hasattr(layer, "pre_feedforward_layernorm")
    assert layer.self_attn.q_norm.weight.shape == (64,) and layer.self_attn.k_norm.weight.shape == (32,)
    x = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(0))
    cos, sin = Rope(16, cfg.rope_theta, None, 16).tables(torch.arange(6), torch.float32)

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w
    with torch.no_grad():
        got = layer(x, cos, sin, RefCache(1, 2, 16, 8))
        a = layer.self_attn(x, cos, sin, RefCache(1, 2, 16, 8))    # the raw x: no pre-norm
        h = x + rms(a, layer.post_attention_layernorm.weight)
        mlp = layer.mlp
        f = F.linear(F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight),
                     mlp.down_proj.weight)
        assert_close(got, h + rms(f, layer.post_feedforward_layernorm.weight), atol=1e-5, rtol=1e-5)
