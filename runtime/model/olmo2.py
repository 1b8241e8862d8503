"""OLMo 2's decoder layer (Team OLMo, "2 OLMo 2 Furious", 2024), as HF's `modeling_olmo2`
computes it.

No norm before attention or the MLP: the block outputs are normalized before each residual
add instead (`post_attention_layernorm`, `post_feedforward_layernorm`; Gemma 3 has these
too, beside its pre-norms). Its q/k RMSNorm runs over the whole projection (H·D, Hkv·D)
before the heads are split: config.qk_norm "proj", in attention.py. SwiGLU MLP, plain
RMSNorm, RoPE on every layer.

The native decode step runs it with no block-input norms and q/k norms over the projection
(decode_layer.c's norm1 / norm2 NULL and qk_norm_proj).
"""
from __future__ import annotations

from torch import nn

from .attention import Attention
from .config import ModelConfig
from .layers import MLP, RMSNorm
from .qlinear import make_linear


class Olmo2DecoderLayer(nn.Module):
    sliding = False
    local_rope = False

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size,
                       lambda i, o: make_linear(cfg.weights, cfg.weight_group, i, o))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache):
        x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, cache))
        return x + self.post_feedforward_layernorm(self.mlp(x))
