"""Hand-built GGUF k-quant blocks for tests: `gguf.quants` dequantizes Q4_K but cannot
quantize it, so tiny tensors are written here from ggml-common.h's block_q4_K layout."""
from __future__ import annotations

import numpy as np


def q4_k_blocks(w: np.ndarray) -> np.ndarray:
    """w (N, K) float, K a multiple of 256 → (N, K/256·144) uint8 Q4_K blocks: per
    sub-block of 32 a min-max grid (w ≈ q·d·sc − dmin·m), its 6-bit sc and m scaled by the
    super-block's fp16 d and dmin. Round to nearest; not llama.cpp's search, only valid."""
    N, K = w.shape
    g = w.astype(np.float32).reshape(-1, 8, 32)                           # (nb, 8, 32)
    lo, hi = np.minimum(g.min(-1), 0), g.max(-1)
    d = ((hi - lo) / 15).max(-1, keepdims=True) / 63                      # (nb, 1)
    dmin = (-lo).max(-1, keepdims=True) / 63
    d, dmin = d.astype(np.float16), dmin.astype(np.float16)
    df, mf = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.clip(np.rint((hi - lo) / 15 / np.where(df > 0, df, 1)), 1, 63).astype(np.uint8)
    m = np.clip(np.rint(-lo / np.where(mf > 0, mf, 1)), 0, 63).astype(np.uint8)
    step = df * sc
    q = np.clip(np.rint((g + (mf * m)[..., None]) / step[..., None]), 0, 15).astype(np.uint8)
    scales = np.empty((g.shape[0], 12), np.uint8)
    for j in range(4):         # 6-bit sc/m of sub-blocks 0-3; 4-7 split into low and high bits
        scales[:, j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        scales[:, j + 4] = (m[:, j] & 63) | ((m[:, j + 4] >> 4) << 6)
        scales[:, j + 8] = (sc[:, j + 4] & 15) | ((m[:, j + 4] & 15) << 4)
    q = q.reshape(-1, 4, 2, 32)                 # 64 columns per 32 bytes: low | high nibble
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), scales, qs], axis=1)
    return blocks.reshape(N, K // 256 * 144)
