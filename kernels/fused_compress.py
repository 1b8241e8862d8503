"""rope_compress_k and vproj_compress (kernels/dispatch.py), torch implementation: the write
half of a decode step. New K rows get RoPE, new V rows come out of the V projection (or
arrive as rows when the model's v_proj is weight-quantized and ran its own op); both are
rounded to the window dtype and appended to the layer's residual window, and (flush=True)
the tokens that leave the window in this call are packed into the codec's tail storage.

Who calls them: the arena's fused-write route (`attend_new` (runtime/kv/arena.py; when it is taken:
kernels/table.py), through kernels/dispatch.py, with flush=False: the step attends before
it flushes, so the arena packs the leaving blocks after attention has read tail + window.

The window is the arena's (runtime/kv/arena.py): (Hkv, R + G, D), oldest token first,
compacted after a flush. Appending T tokens to a window holding w: while w + T < R + G
they are just written at [w, w + T); otherwise the oldest f = ⌊(w + T − R)/G⌋·G tokens of
[window, new] are packed into tail tokens [n_tail, n_tail + f) and the rest move to the
front of the window — exactly KVArena.append, so a caller can swap this in for it.

This module is the Triton kernels' oracle (kernels/triton/fused_compress.py: bit-identical
packed storage) and the CPU path. Kernels must not import the runtime, so RoPE's cos/sin
tables come in as arguments; the rotation is HF's rotate-half, computed in x's dtype like
kernels/rope.py apply_rope (x·cos + rotate_half(x)·sin, cos/sin cast to x's dtype).
"""
from __future__ import annotations

import torch

from .table import covers


def supports(codec) -> bool:
    """The codecs the fused write ops cover on every backend (the kernel table's
    `fused_write` row: the Triton kernels' set), with a power-of-two G >= 32."""
    G = codec.G
    return G >= 32 and not G & (G - 1) and covers("fused_write", "torch", codec)


def flush_count(w: int, T: int, R: int, G: int) -> int:
    """Tokens that leave a window of w tokens when T are appended (a multiple of G)."""
    total = w + T
    return 0 if total < R + G else (total - R) // G * G


def append_window(rows: torch.Tensor, win: torch.Tensor, w: int, codec, st: dict,
                  n_tail: int, R: int, flush: bool = True) -> int:
    """Append rows (Hkv, T, D) (window dtype) to win (Hkv, R+G, D) holding w tokens; pack
    the leaving tokens into st at n_tail. Returns f, the number packed (the caller's window
    then holds w + T − f tokens and its tail n_tail + f). flush False: append only (the
    rows must fit, w + T <= R + G; the arena's decode step flushes after attending)."""
    Hkv, T, D = rows.shape
    f = flush_count(w, T, R, codec.G) if flush else 0
    if not flush and w + T > win.shape[1]:
        raise ValueError(f"append without flush: {w} + {T} tokens > {win.shape[1]} window slots")
    if f == 0:
        win[:, w:w + T] = rows
        return 0
    seq = torch.cat([win[:, :w], rows], 1)                              # (Hkv, w+T, D)
    codec.store(st, seq[:, :f].float(), n_tail)          # storage only, as KVArena.append
    win[:, :w + T - f] = seq[:, f:]
    return f


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (Hkv, T, D), cos/sin (T, D): x·cos + rotate_half(x)·sin in x's dtype."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos.to(x.dtype) + rot * sin.to(x.dtype)


def rope_compress_k(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    win: torch.Tensor, w: int, codec, st: dict, n_tail: int, R: int,
                    flush: bool = True) -> int:
    """RoPE on new K rows x (Hkv, T, D) (before RoPE; any strides) with cos/sin (T, D) of
    their positions, then append_window. Returns the number of tokens packed."""
    return append_window(rope(x, cos, sin).to(win.dtype), win, w, codec, st, n_tail, R, flush)


def vproj(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, Hkv: int) -> torch.Tensor:
    """x (T, hidden) @ weightᵀ (+ bias), weight (Hkv·D, hidden): (Hkv, T, D) in x's dtype."""
    v = torch.nn.functional.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    return v.view(x.shape[0], Hkv, -1).transpose(0, 1)


def vproj_compress(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   win: torch.Tensor, w: int, codec, st: dict, n_tail: int, R: int,
                   flush: bool = True) -> int:
    """The V projection of hidden states x (T, hidden), then append_window. Returns the
    number of tokens packed. weight None: x already holds the V rows (Hkv, T, D) (a
    weight-quantized v_proj computed them) and they are appended as given."""
    rows = x if weight is None else vproj(x, weight, bias, win.shape[0])
    return append_window(rows.to(win.dtype), win, w, codec, st, n_tail, R, flush)
