"""Rotary position embedding (RoPE), HF "rotate_half" convention: the model applies it to q
and k, the arena to re-rotate keys when the context shifts.

Frequencies follow HF's `rope_scaling` variants: default, `linear` (positions divided by
the factor) and `llama3` (long wavelengths scaled by the factor, short ones kept, a
smooth blend between; Llama 3.1 §"RoPE scaling").
"""
from __future__ import annotations

import math

import torch


ROPE_TYPES = ("default", "linear", "llama3")


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """(D/2,) float64 inverse frequencies after scaling."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(mid, blended, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r} ({', '.join(ROPE_TYPES)})")


class Rope:
    """Precomputed cos/sin tables for positions [0, max_pos); grown on demand."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_pos: int):
        self.inv = inv_frequencies(head_dim, theta, scaling)
        self._build(max_pos)

    def _build(self, n: int):
        t = torch.arange(n, dtype=torch.float64)
        freqs = torch.outer(t, self.inv)                      # (n, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)               # (n, D)
        self.cos, self.sin = emb.cos().float(), emb.sin().float()

    def tables(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin: (T, D) for integer positions (T,)."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self.cos.shape[0]:
            self._build(max(need, 2 * self.cos.shape[0]))
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, D); cos/sin: (T, D)."""
    return x * cos + rotate_half(x) * sin
