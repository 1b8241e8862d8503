"""The attention block every architecture shares: q/k/v/o projections, RoPE, and the
cache's attention in between (`cache.attend_new`: the step's K before RoPE and V's
projection operands, which a cache with a fused window write runs inside it, else RoPE'd K
and V rows: kv/cache.py NewKV).

The families' quirks, from the config: q/k RMSNorm before RoPE (`qk_norm` "head": per head
over D, Qwen3 / Gemma 3; "proj": over the whole projection, OLMo 2), and q multiplied by
`q_scale` after RoPE where the family's score scale is not D**-0.5 (Gemma's
query_pre_attn_scalar, Granite's attention_multiplier). Gemma 3 subclasses it (gemma3.py)
for its (1 + w) norms."""
from __future__ import annotations

from torch import nn

from kvrun.kernels.rope import apply_rope
from ..kv.cache import NewKV
from .config import ModelConfig
from .layers import Linear, RMSNorm
from .qlinear import make_linear


class Attention(nn.Module):
    norm_cls = RMSNorm                      # the q/k norms' kind (Gemma: OffsetRMSNorm)

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
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            per_head = cfg.qk_norm == "head"
            self.q_norm = self.norm_cls(cfg.head_dim * (1 if per_head else cfg.num_heads), cfg.rms_norm_eps)
            self.k_norm = self.norm_cls(cfg.head_dim * (1 if per_head else cfg.num_kv_heads), cfg.rms_norm_eps)
        self.q_scale = None if cfg.q_scale == 1.0 else cfg.q_scale

    def forward(self, x, cos, sin, cache):
        B, T, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)                           # (B, T, H D), (B, T, Hkv D)
        if self.qk_norm == "proj":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)   # (B, H, T, D)
        k = k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)      # (B, Hkv, T, D)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin)
        if self.q_scale is not None:
            q = q * self.q_scale
        # the normalized K is what RoPE rotates, so the fused writes take it as is
        return self._attend(x, q, k, cos, sin, cache)

    def _attend(self, x, q, k, cos, sin, cache):
        """q (B, H, T, D) after RoPE, k (B, Hkv, T, D) before it: the cache's attention, then
        o_proj. Every architecture's attention ends here."""
        B, T = x.shape[:2]
        o = cache.attend_new(self.layer_idx, q, self._new_kv(x, k, cos, sin))     # (B, H, T, D)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    def _new_kv(self, x, k, cos, sin) -> NewKV:
        """This step's K/V for the cache: K before RoPE; V as the operands of x @ Wvᵀ when
        v_proj is dense (a fused window write runs the GEMM; `rows()` runs v_proj), else the
        rows a weight-quantized v_proj computes with its own op."""
        if isinstance(self.v_proj, Linear) and x.shape[0] == 1:     # the fused writes' batch
            w = self.v_proj.weight_for(x.shape[1])         # the GEMV copy, like forward()
            return NewKV(k, cos, sin, v_x=x[0].to(w.dtype), v_weight=w, v_bias=self.v_proj.bias,
                         rotated=lambda: (apply_rope(k, cos, sin), self._v(x)))
        v = self._v(x)
        return NewKV(k, cos, sin, v=v, rotated=lambda: (apply_rope(k, cos, sin), v))

    def _v(self, x):
        B, T, _ = x.shape
        return self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
