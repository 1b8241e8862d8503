"""Normalized Hadamard rotation along the head dim (llama.cpp's rotated KV, QuaRot, RotateKV).

An orthogonal rotation R spreads a channel outlier over all D channels, so a quantizer's
range fits the bulk of the values, while attention is unchanged:
    q·k = (qR)·(kR)        and        P·V = (P·(VR))·Rᵀ.
R = diag(s)·H/√n per block, with H the Sylvester Hadamard matrix of size n and s an
optional fixed ±1 sign vector. For D a power of two there is one block (n = D); otherwise
R is block-diagonal with n = the largest power of two dividing D (e.g. D = 80 → five
16-blocks, D = 96 → three 32-blocks); an odd D has no rotation and is refused.

Two equal implementations: `fwht` is the O(D log D) butterfly (what a GPU kernel does in
registers); `rotate` multiplies by the explicit D×D matrix, which on CPU is one GEMM and
faster than log2(D) eager passes for the (few rows × 64/128) shapes of a decode step.
"""
from __future__ import annotations

import math

import torch


def block_size(D: int) -> int:
    """Size of the Hadamard blocks for head dim D (largest power of two dividing D)."""
    if D < 2 or D % 2:
        raise ValueError(f"head dim {D} has no Hadamard rotation (need an even head dim)")
    return D & -D


def hadamard_matrix(n: int) -> torch.Tensor:
    """(n, n) Sylvester Hadamard matrix of ±1 (n a power of two)."""
    assert n > 0 and n & (n - 1) == 0, n
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def random_signs(D: int, seed: int) -> torch.Tensor:
    """(D,) fixed ±1 vector from a seed (stored in profiles so a cache can be re-read)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (D,), generator=g).float() * 2 - 1


def rotation_matrix(D: int, signs: torch.Tensor | None = None) -> torch.Tensor:
    """(D, D) orthogonal R = diag(s) · blockdiag(H_n / √n): x_rot = x @ R, x = x_rot @ Rᵀ."""
    n = block_size(D)
    h = hadamard_matrix(n) / math.sqrt(n)
    r = torch.block_diag(*([h] * (D // n)))
    if signs is not None:
        r = signs.float()[:, None] * r
    return r


def fwht(x: torch.Tensor, signs: torch.Tensor | None = None) -> torch.Tensor:
    """x @ rotation_matrix(D, signs) by the fast Walsh–Hadamard butterfly; x: (..., D)."""
    D = x.shape[-1]
    n = block_size(D)
    y = x.float() * signs.float() if signs is not None else x.float()
    lead = y.shape[:-1]
    y = y.reshape(-1, D // n, n)                                  # (rows, blocks, n)
    h = 1
    while h < n:
        y = y.view(-1, D // n, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2).view(-1, D // n, n)
        h *= 2
    return (y / math.sqrt(n)).reshape(*lead, D).to(x.dtype)


def rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x @ R in x's dtype (math in fp32 for half inputs); r from `rotation_matrix`."""
    return (x.float() @ r).to(x.dtype) if x.dtype != torch.float32 else x @ r


def unrotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x @ Rᵀ, the inverse of `rotate`."""
    return (x.float() @ r.T).to(x.dtype) if x.dtype != torch.float32 else x @ r.T


class KeyMap:
    """A key transform fitted once per model, folded into a layer's K rotation: keys are
    stored as ((k - mu) / sigma) @ R and queries enter as (q * sigma) @ R, so
        q' . k' = q . k - q . mu,
    one constant per query, which softmax removes: attention is unchanged in full
    precision, and a codec quantizes keys without the direction every token shares (mu)
    and with channels of equal spread (sigma). As matrices: k' = k @ K + bias with
    K = diag(1/sigma) R, bias = -(mu / sigma) @ R per KV head, q' = q @ Q with
    Q = diag(sigma) R; K is undone by Q's transpose (K Q^T = I). Where a plain rotation
    tensor is taken as `rk`, a KeyMap may be given instead (`k_matrix`, `q_matrix`,
    `k_bias` read either)."""

    def __init__(self, r: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor):
        """r (D, D) the rotation (the identity for none), mu (Hkv, D), sigma (D,) > 0."""
        s = sigma.float().to(r.device)
        self.k = (r / s[:, None]).contiguous()                       # diag(1/sigma) R
        self.q = (r * s[:, None]).contiguous()                       # diag(sigma) R
        self.bias = (-(mu.float().to(r.device) / s) @ r).contiguous()   # (Hkv, D)


def k_matrix(rk):
    """The (D, D) matrix keys are multiplied by (a rotation, or a KeyMap's K)."""
    return rk.k if isinstance(rk, KeyMap) else rk


def q_matrix(rk):
    """The (D, D) matrix queries are multiplied by (the rotation itself, or a KeyMap's Q)."""
    return rk.q if isinstance(rk, KeyMap) else rk


def k_bias(rk):
    """(Hkv, D) added to every rotated key (a KeyMap's), or None."""
    return rk.bias if isinstance(rk, KeyMap) else None


def rotate_k(k: torch.Tensor, rk) -> torch.Tensor:
    """Keys (..., Hkv, T, D) into the storage space of rk (a rotation or a KeyMap), float32."""
    y = k.float() @ k_matrix(rk)
    b = k_bias(rk)
    return y if b is None else y + b[:, None]


def unrotate_k(y: torch.Tensor, rk) -> torch.Tensor:
    """`rotate_k`'s inverse: stored keys (..., Hkv, T, D) back in the model's space."""
    b = k_bias(rk)
    return (y.float() - (0 if b is None else b[:, None])) @ q_matrix(rk).T


def rotate_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rk,
                rv: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step's inputs into a cache's rotated storage space: q and k by rk (a rotation
    or a KeyMap), v by rv (None: left as is). A rotated q keeps its dtype; rotated k and v
    come back float32, to be rounded to the storage dtype once. The torch route of every
    rotated cache (the arena's layers, the quantized ring) calls this; the native attention
    kernel applies the same x @ R inside its call. The step's output is then
    `unrotate(o, rv)`."""
    if rk is not None:
        q, k = rotate(q, q_matrix(rk)), rotate_k(k, rk)
    if rv is not None:
        v = rotate(v.float(), rv)
    return q, k, v
