"""Attention over an uncompressed K/V cache (the fp16/bf16/fp32 baseline read path).

The GQA group is folded into the query rows, (B, Hkv, G*T, D), so each KV head is read
once for all of its query heads instead of being repeated G times in memory. A decode step
(T = 1) over an fp16/bf16 cache runs SDPA in the cache dtype (its CPU kernel accumulates in
fp32): ~4x faster than converting the whole K/V to fp32 every step.

A long chunk (a 16k-token prefill in one piece, as SnapKV's one-shot selection wants) is
cut into blocks of QBLOCK queries, each over only the keys it can see: a sliding-window
layer then costs O(T · window) instead of O(T²), and no (G·T, S) mask or score matrix is
ever built for the whole chunk (at T = S = 16k with G = 4 that was a 1 GiB mask and ~4 GiB
of scores per layer). Each query's arithmetic is the same either way.

Soft-capped logits (`softcap` > 0, Gemma 2) have no SDPA kernel: those calls form the
scores explicitly in q's dtype, s = (q/sqrt(D))·k, cap them to softcap·tanh(s / softcap),
mask, and run softmax and p·V (the torch decode_attention's order); softcap 0 keeps SDPA.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_mask(T: int, S: int, q_start: int, device=None, window: int = 0) -> torch.Tensor:
    """(T, S) bool, True where query t (absolute position q_start + t) may see key s; with
    `window` > 0 only the last `window` keys up to and including its own position."""
    qpos = torch.arange(q_start, q_start + T, device=device)[:, None]
    kpos = torch.arange(S, device=device)[None, :]
    mask = kpos <= qpos
    return mask & (kpos > qpos - window) if window else mask


QBLOCK = 1024          # queries per block of a long chunk (module docstring)


def _block(q, k, v, q_start: int, window: int, t0: int, t1: int, softcap: float) -> torch.Tensor:
    """Queries t0 .. t1-1 of a chunk over the keys they can see (dense_attention's args)."""
    lo = max(0, q_start + t0 - window + 1) if window else 0
    return dense_attention(q[:, :, t0:t1], k[:, :, lo:q_start + t1], v[:, :, lo:q_start + t1],
                           q_start + t0 - lo, window, softcap)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int,
                    window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of T new queries over S cached keys.

    q: (B, H, T, D); k, v: (B, Hkv, S, D) with S = q_start + T; query t sits at absolute
    position q_start + t. `window` > 0: sliding-window attention, each query sees only the
    last `window` keys (its own included; HF's and llama.cpp's convention). `softcap` > 0:
    logits soft-capped (the module docstring). Returns (B, H, T, D) in q's dtype; K/V are
    cast to q's dtype.
    """
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    assert H % Hkv == 0 and S == q_start + T, (q.shape, k.shape, q_start)
    if T > QBLOCK:                     # K/V cast once here, not again for every block
        k, v = k.to(q.dtype), v.to(q.dtype)
        return torch.cat([_block(q, k, v, q_start, window, t0, min(T, t0 + QBLOCK), softcap)
                          for t0 in range(0, T, QBLOCK)], 2)
    G = H // Hkv
    qg = q.reshape(B, Hkv, G * T, D)                                   # rows ordered (g, t)
    if softcap:                        # no SDPA kernel caps: the scores, capped, then masked
        k, v = k.to(q.dtype), v.to(q.dtype)
        s = torch.matmul(qg * D ** -0.5, k.transpose(-1, -2))          # (B, Hkv, G*T, S)
        s = s.div_(softcap).tanh_().mul_(softcap)
        s.masked_fill_(~causal_mask(T, S, q_start, q.device, window).repeat(G, 1), float("-inf"))
        return torch.matmul(torch.softmax(s, -1), v).reshape(B, H, T, D)
    if window and S > window:
        k, v = k.to(q.dtype), v.to(q.dtype)
        mask = causal_mask(T, S, q_start, q.device, window).repeat(G, 1)   # (G*T, S)
        return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask).reshape(B, H, T, D)
    if T == 1 and k.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype:
        return F.scaled_dot_product_attention(qg.to(k.dtype), k, v).to(q.dtype).reshape(B, H, T, D)
    k, v = k.to(q.dtype), v.to(q.dtype)
    if T == 1:
        o = F.scaled_dot_product_attention(qg, k, v)
    elif q_start == 0 and G == 1:
        o = F.scaled_dot_product_attention(qg, k, v, is_causal=True)
    else:
        mask = causal_mask(T, S, q_start, q.device).repeat(G, 1)       # (G*T, S)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
    return o.reshape(B, H, T, D)
