"""The attention block every architecture shares: q/k/v/o projections, RoPE, and the
cache's attention in between (`cache.attend`, or `cache.write_attend` when the cache takes
K before RoPE and V's projection operands: kv/cache.py). Gemma 3 subclasses it (gemma3.py)
for its q/k norms and per-layer RoPE tables."""
from __future__ import annotations

from torch import nn

from kvrun.kernels.rope import apply_rope
from ..kv.cache import NewKV
from .config import ModelConfig
from .layers import Linear
from .qlinear import make_linear


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        lin = lambda i, o, b=False: make_linear(cfg.weights, cfg.weight_group, i, o, b)  # noqa: E731
        self.q_proj = lin(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias)
        self.k_proj = lin(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias)
        self.v_proj = lin(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias)
        self.o_proj = lin(cfg.num_heads * cfg.head_dim, cfg.hidden_size)

    def forward(self, x, cos, sin, cache):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)     # (B, Hkv, T, D)
        return self._attend(x, apply_rope(q, cos, sin), k, cos, sin, cache)

    def _attend(self, x, q, k, cos, sin, cache):
        """q (B, H, T, D) after RoPE, k (B, Hkv, T, D) before it: the cache's attention, then
        o_proj. Every architecture's attention ends here (gemma3.py too)."""
        B, T = x.shape[:2]
        if cache.takes_new_kv(self.layer_idx, T):
            # K's RoPE and the V projection run inside the cache's fused window writes
            # (kernels/fused_compress.py); same step contract as attend
            o = cache.write_attend(self.layer_idx, q, self._new_kv(x, k, cos, sin))
        else:
            o = cache.attend(self.layer_idx, q, apply_rope(k, cos, sin), self._v(x))  # (B, H, T, D)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    def _new_kv(self, x, k, cos, sin) -> NewKV:
        """This step's K/V for the fused writes (batch 1): K before RoPE; V as the operands
        of x @ Wvᵀ when v_proj is dense (the op runs the GEMM: none here), else the rows a
        weight-quantized v_proj computes with its own op."""
        if isinstance(self.v_proj, Linear):
            w = self.v_proj.weight_for(x.shape[1])         # the GEMV copy, like forward()
            return NewKV(k, cos, sin, v_x=x[0].to(w.dtype), v_weight=w, v_bias=self.v_proj.bias)
        return NewKV(k, cos, sin, v=self._v(x))

    def _v(self, x):
        B, T, _ = x.shape
        return self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
