"""kvrun's transformer for the Llama family (Llama 2/3, SmolLM2, TinyLlama, Mistral) and Qwen2.

Module names follow HF (`model.layers.N.self_attn.q_proj`, `mlp.gate_proj`,
`input_layernorm` …) so converted weights load with `strict=True`. Attention reads and
writes K/V only through the cache object (`cache.attend`), which is either the dense
cache or the compressed arena; the model does not know which.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import MLP, Linear, RMSNorm
from .rope import Rope, apply_rope


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size)

    def forward(self, x, cos, sin, cache):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)     # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)     # (B, Hkv, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = cache.attend(self.layer_idx, q, k, v)                                   # (B, H, T, D)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        with torch.device("cpu"):       # tables stay real even when built on the meta device
            self.rope = Rope(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def set_gemv_dtype(self, dtype: torch.dtype | None) -> None:
        """Keep a second copy of every linear weight for few-row (decode) inputs."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.set_gemv_dtype(dtype)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache, last_only: bool = False) -> torch.Tensor:
        """ids: (B, T) new tokens appended after the cache's contents.

        Returns float32 logits (B, T, V), or (B, 1, V) for the last position only.
        """
        B, T = ids.shape
        positions = cache.positions(T)                                  # (T,)
        cos, sin = self.rope.tables(positions, self.dtype)              # (T, D)
        h = self.model.embed_tokens(ids)                                # (B, T, hidden)
        for layer in self.model.layers:
            h = layer(h, cos, sin, cache)
        cache.commit(T)
        if last_only:
            h = h[:, -1:]
        return self.lm_head(self.model.norm(h)).float()

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Strict load; a tied lm_head is the only key allowed to be absent."""
        state = {k: v.to(self.dtype) for k, v in state.items()}
        missing, unexpected = self.load_state_dict(state, strict=False)
        if self.cfg.tie_word_embeddings:
            missing = [k for k in missing if k != "lm_head.weight"]
        if missing or unexpected:
            from .errors import KvrunError
            parts = []
            if missing:
                parts.append(f"missing {len(missing)} tensors (e.g. {missing[0]})")
            if unexpected:
                parts.append(f"unexpected {len(unexpected)} tensors (e.g. {unexpected[0]})")
            raise KvrunError("weights do not match the config: " + "; ".join(parts))
