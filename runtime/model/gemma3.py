"""Gemma 3's decoder layer (text model; Gemma Team, "Gemma 3 Technical Report", 2025).

What differs from the Llama layer in llama.py, each as HF's `modeling_gemma3` computes it:

- RMSNorm scales by (1 + w), in fp32, then casts back (`OffsetRMSNorm`). Weights are stored
  as HF stores them (w, not 1 + w); the GGUF converter subtracts the 1 llama.cpp adds.
- "Sandwich" norms: the attention and MLP outputs are normalized again before the residual
  add (post_attention_layernorm / post_feedforward_layernorm), and the MLP input has its own
  pre_feedforward_layernorm. Note the names: Llama's `post_attention_layernorm` is the MLP's
  input norm, Gemma's is the attention output's.
- QK-norm: q and k are RMS-normalized per head over D (q_norm / k_norm) before RoPE.
- Scores are scaled by query_pre_attn_scalar**-0.5; the caches' attention scales by
  D**-0.5, so q is multiplied by the ratio (exactly 1 for every released size but 27B).
- GeGLU MLP with the tanh GELU approximation.
- Layers of two kinds (config.layer_types): sliding-window layers get the local RoPE tables
  (the model picks them, llama.py) and the cache restricts them to their last
  `sliding_window` tokens (runtime/kv/ring.py); the layer itself does not know its window.

The token embedding is scaled by sqrt(hidden) and logits may be soft-capped: both in
model.py's `Transformer`, which serves every architecture.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import MLP, RMSNorm
from .attention import Attention
from .qlinear import make_linear


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x / rms(x) · (1 + w), statistics and scale in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)          # the identity, as ones are for RMSNorm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def multiplier(self) -> torch.Tensor:
        return 1.0 + self.weight.detach().float()


class GeGLUMLP(MLP):
    """down(gelu_tanh(gate(x)) * up(x)): HF's `gelu_pytorch_tanh` activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma3Attention(Attention):
    """The shared attention with (1 + w) q/k norms (config.qk_norm "head", q_scale from
    query_pre_attn_scalar: attention.py)."""
    norm_cls = OffsetRMSNorm


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.sliding = cfg.layer_types[layer_idx] == "sliding_attention"
        self.local_rope = self.sliding          # the model's rope_local tables (llama.py)
        self.self_attn = Gemma3Attention(cfg, layer_idx)
        self.mlp = GeGLUMLP(cfg.hidden_size, cfg.intermediate_size,
                            lambda i, o: make_linear(cfg.weights, cfg.weight_group, i, o))
        norm = lambda: OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # noqa: E731
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()

    def forward(self, x, cos, sin, cache):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
