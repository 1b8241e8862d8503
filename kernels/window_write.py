"""write_k and write_v (kernels/dispatch.py), torch implementation: the window half of the
arena's fused-write step. New K rows get RoPE, new V rows come out of the V projection (or
arrive as rows when the model's v_proj is weight-quantized and ran its own op); both are
rounded to the window dtype and written into the layer's residual window at slots
[w, w + T). Nothing else: the arena counts the rows and flushes whole blocks afterwards
(runtime/kv/arena.py `wrote` → `flush`, the one flush), so a write never packs.

Who calls them: the arena's fused-write route on Triton (`attend_new`, runtime/kv/arena.py;
when it is taken: kernels/table.py), through kernels/dispatch.py. This module is the Triton
kernels' oracle (kernels/triton/window_write.py: bit-identical rows). Kernels must not import
the runtime, so RoPE's cos/sin tables come in as arguments; the rotation is HF's
rotate-half, computed in x's dtype like kernels/rope.py apply_rope (x·cos + rotate_half(x)·sin,
cos/sin cast to x's dtype).
"""
from __future__ import annotations

import torch


def write_rows(rows: torch.Tensor, win: torch.Tensor, w: int) -> None:
    """rows (Hkv, T, D) into win (Hkv, slots, D) at [w, w + T), rounded to the window's dtype;
    the rows must fit."""
    T = rows.shape[1]
    if w < 0 or w + T > win.shape[1]:
        raise ValueError(f"window write: {w} + {T} tokens > {win.shape[1]} window slots")
    win[:, w:w + T] = rows


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (Hkv, T, D), cos/sin (T, D): x·cos + rotate_half(x)·sin in x's dtype."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos.to(x.dtype) + rot * sin.to(x.dtype)


def write_k(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, win: torch.Tensor, w: int) -> None:
    """RoPE on new K rows x (Hkv, T, D) (before RoPE; any strides) with cos/sin (T, D) of
    their positions, written into the window at [w, w + T)."""
    write_rows(rope(x, cos, sin), win, w)


def vproj(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, Hkv: int) -> torch.Tensor:
    """x (T, hidden) @ weightᵀ (+ bias), weight (Hkv·D, hidden): (Hkv, T, D) in x's dtype."""
    v = torch.nn.functional.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    return v.view(x.shape[0], Hkv, -1).transpose(0, 1)


def write_v(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
            win: torch.Tensor, w: int) -> None:
    """The V projection of hidden states x (T, hidden), written into the window at [w, w + T).
    weight None: x already holds the V rows (Hkv, T, D) (a weight-quantized v_proj computed
    them) and they are written as given."""
    rows = x if weight is None else vproj(x, weight, bias, win.shape[0])
    write_rows(rows, win, w)
