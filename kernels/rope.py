"""Rotary position embedding (RoPE), HF "rotate_half" convention: the model applies it to q
and k, the arena to re-rotate keys when the context shifts.

Frequencies follow HF's `rope_scaling` variants: default, `linear` (positions divided by
the factor), `llama3` (long wavelengths scaled by the factor, short ones kept, a smooth
blend between; Llama 3.1 §"RoPE scaling") and `longrope` (Phi-3's, LongRoPE: each
frequency divided by its own factor, from `short_factor` or, for a cache larger than
`original_max_position_embeddings`, `long_factor`; cos and sin times an attention factor).

Partial rotary (Phi-4-mini): RoPE on `rotary_dim` < D channels of each head. kvrun keeps
the full-D "rotate_half" pairing (i, i + D/2) everywhere: convert/ permutes q and k's rows
so the rotated pairs are i < rotary_dim/2, and the channels beyond see frequency 0 (cos 1,
sin 0: passed through bit for bit, and a context shift's re-rotation leaves them too).
"""
from __future__ import annotations

import math

import torch


ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None, rotary_dim: int = 0,
                    ctx: int = 0) -> torch.Tensor:
    """(D/2,) float64 inverse frequencies after scaling: those of the first rotary_dim
    channels (0: all D), then zeros for the channels RoPE passes through. `ctx`: the
    context the tables serve (longrope takes its long factors above the original one)."""
    rd = rotary_dim or head_dim
    inv = _scaled(1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)), scaling, ctx)
    return torch.cat([inv, torch.zeros((head_dim - rd) // 2, dtype=torch.float64)])


def rope_kind(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def long_factors(scaling: dict | None, ctx: int) -> bool:
    """Whether longrope runs a cache of `ctx` tokens on its long factors: when its size
    exceeds the original context, as llama.cpp picks them from its context size. Every
    position of a cache takes one set. (HF switches per forward on the longest position:
    the same for a sequence that stays within the original context in a cache within it,
    and for one that starts past it; a sequence that crosses it there keeps its cached keys
    on the short factors while new tokens take the long ones.)"""
    return rope_kind(scaling) == "longrope" and ctx > int(scaling["original_max_position_embeddings"])


def longrope_attention(scale: float, original: int) -> float:
    """longrope's default attention factor for a context `scale` times the original one
    (LongRoPE; transformers' `_compute_longrope_parameters`, llama.cpp's converter)."""
    return 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))


def attention_factor(scaling: dict | None) -> float:
    """What longrope multiplies cos and sin by (1 for the other kinds)."""
    return float(scaling["attention_factor"]) if rope_kind(scaling) == "longrope" else 1.0


def _scaled(inv: torch.Tensor, scaling: dict | None, ctx: int) -> torch.Tensor:
    kind = rope_kind(scaling)
    if kind == "default":
        return inv
    if kind == "longrope":
        ext = scaling["long_factor" if long_factors(scaling, ctx) else "short_factor"]
        return inv / torch.tensor(ext, dtype=torch.float64)
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


class _Tables:
    """cos/sin tables of one frequency set for positions [0, n); grown on demand."""

    def __init__(self, inv: torch.Tensor, gain: torch.Tensor, n: int):
        self.inv, self.gain = inv, gain                       # (D/2,), (D,)
        self._build(n)

    def _build(self, n: int):
        t = torch.arange(n, dtype=torch.float64)
        freqs = torch.outer(t, self.inv)                      # (n, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)               # (n, D)
        self.cos, self.sin = (emb.cos() * self.gain).float(), (emb.sin() * self.gain).float()

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self.cos.shape[0]:
            self._build(max(need, 2 * self.cos.shape[0]))
        return self.cos[positions], self.sin[positions]


class Rope:
    """cos/sin tables for positions [0, max_pos), grown on demand; for longrope one set per
    factor set, each row's picked by the size of the cache it is for (`long_factors`).
    rotary_dim: as inv_frequencies."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_pos: int,
                 rotary_dim: int = 0):
        self.args = (head_dim, theta, scaling, rotary_dim)
        self.scaling, self.max_pos = scaling, max_pos
        # longrope's attention factor on the rotated channels; the passed-through ones stay as they are
        rd = rotary_dim or head_dim
        half = torch.cat([torch.full((rd // 2,), attention_factor(scaling), dtype=torch.float64),
                          torch.ones((head_dim - rd) // 2, dtype=torch.float64)])
        self.gain = torch.cat([half, half])                   # (D,)
        self._sets: dict[bool, _Tables] = {}
        self._set(False)

    def _set(self, long: bool) -> _Tables:
        if long not in self._sets:
            ctx = int(self.scaling["original_max_position_embeddings"]) + 1 if long else 0
            self._sets[long] = _Tables(inv_frequencies(*self.args, ctx=ctx), self.gain, self.max_pos)
        return self._sets[long]

    def tables(self, positions: torch.Tensor, dtype: torch.dtype, ctx: "int | list[int]" = 0):
        """cos, sin: (T, D) for integer positions (T,) in a cache of `ctx` tokens, or a list
        of T cache sizes (row t in a cache of ctx[t]: a batch's rows, each its own cache)."""
        sizes = ctx if isinstance(ctx, (list, tuple)) else [ctx]
        long = [long_factors(self.scaling, c) for c in sizes]
        if len(set(long)) == 1:
            cos, sin = self._set(long[0]).rows(positions)
        else:
            rows = [self._set(x).rows(positions[t:t + 1]) for t, x in enumerate(long)]
            cos, sin = torch.cat([c for c, _ in rows]), torch.cat([s for _, s in rows])
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, D); cos/sin: (T, D)."""
    return x * cos + rotate_half(x) * sin
