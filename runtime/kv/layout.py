"""Shape facts every cache module shares: which layers attend to everything (and so get the
KV method) and how many tokens a compressed tail can hold. Imports nothing from kv/, so the
arena, eviction and profiles can all ask it."""
from __future__ import annotations


def tail_capacity(max_ctx: int, R: int, G: int) -> int:
    return max(0, max_ctx - R) // G * G


def layer_windows(cfg) -> list[int]:
    """Per model layer its attention window (0: full attention; ModelConfig.layer_windows)."""
    return list(getattr(cfg, "layer_windows", None) or [0] * cfg.num_layers)


def arena_layers(cfg) -> int:
    """The layers a KV method applies to: the full-attention ones (a per-layer profile lists
    these, in model order); sliding-window layers keep a ring of their window (ring.py)."""
    return layer_windows(cfg).count(0)
