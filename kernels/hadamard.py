"""Normalized Hadamard rotation along the head dim (llama.cpp's rotated KV, QuaRot, RotateKV).

An orthogonal rotation R spreads a channel outlier over all D channels, so a quantizer's
range fits the bulk of the values, while attention is unchanged:
    q·k = (qR)·(kR)        and        P·V = (P·(VR))·Rᵀ.
R = diag(s)·H/√n per block, with H the Sylvester Hadamard matrix of size n and s an
optional fixed ±1 sign vector. For D a power of two there is one block (n = D); otherwise
R is block-diagonal with n = the largest power of two dividing D (e.g. D = 80 → five
16-blocks, D = 96 → three 32-blocks); an odd D has no rotation and is refused.

Two implementations, equal up to fp32 rounding: `rotate` by the explicit D×D matrix (one
GEMM, faster on CPU than log2(D) eager passes for a decode step's few rows, but its sum
order is the BLAS library's: MKL's differs between CPU kinds and thread counts), and the
O(D log D) butterfly `fwht` / `fwht_t`, a fixed sequence of IEEE fp32 operations (signs,
then pairwise a ± b stages, then one multiply by fp32(1/√n)) that the native kernels
repeat (kernels/native/rows_inline.h `hadamard_rotate`): rows rotated by either are equal
bit for bit on every CPU. A `Hadamard` is a rotation held as its signs and applied by the
butterfly; the rings, whose stored codes the kernels promise bit for bit
(runtime/kv/ring.py), rotate with one.
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


def _butterfly(y: torch.Tensor) -> torch.Tensor:
    """y (..., D) fp32 times blockdiag(H_n) / √n: stages h = 1, 2, ..., n/2, each pair
    (i, i + h) of a 2h-run becoming (a + b, a - b), then one multiply by fp32(1/√n) — the
    order rows_inline.h's `hadamard_stages` runs."""
    D = y.shape[-1]
    n = block_size(D)
    lead = y.shape[:-1]
    y = y.reshape(-1, D // n, n)                                  # (rows, blocks, n)
    h = 1
    while h < n:
        y = y.view(-1, D // n, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2).view(-1, D // n, n)
        h *= 2
    inv = torch.tensor(1.0 / math.sqrt(n), dtype=torch.float32, device=y.device)
    return (y * inv).reshape(*lead, D)


def fwht(x: torch.Tensor, signs: torch.Tensor | None = None) -> torch.Tensor:
    """x @ rotation_matrix(D, signs) by the fast Walsh–Hadamard butterfly, in x's dtype
    (math in fp32); x: (..., D). Bit-identical on every CPU (module docstring)."""
    y = x.float() * signs.float() if signs is not None else x.float()
    return _butterfly(y).to(x.dtype)


def fwht_t(x: torch.Tensor, signs: torch.Tensor | None = None) -> torch.Tensor:
    """x @ rotation_matrix(D, signs)ᵀ (`fwht`'s inverse): the butterfly, then the signs
    (Rᵀ = blockdiag(H_n)/√n · diag(s), H symmetric)."""
    y = _butterfly(x.float())
    return (y * signs.float() if signs is not None else y).to(x.dtype)


class Hadamard:
    """R = diag(s) · blockdiag(H_n)/√n (`rotation_matrix`) held as its signs (D,) and applied
    by the butterfly (`fwht`, `fwht_t`): the rotation a kernel repeats bit for bit.
    `rotate`, `unrotate`, `rotate_k`, `unrotate_k` and `rotate_step` take one where they
    take a matrix; `matrix` is the (D, D) form for a kernel that multiplies by it (Triton's
    un-rotation of an output, where rounding is within tolerance)."""

    def __init__(self, signs: torch.Tensor):
        self.signs = signs.float().contiguous()                     # (D,) of ±1
        self.D = self.signs.numel()
        block_size(self.D)                                          # an odd D is refused here
        self._matrix = None

    @classmethod
    def for_head_dim(cls, D: int, seed: int | None, device="cpu") -> "Hadamard":
        """The one construction every cache's rotation comes from: signs from `seed`
        (`random_signs`; part of the cache's format), or none (all +1) for seed None."""
        signs = random_signs(D, seed) if seed is not None else torch.ones(D)
        return cls(signs).to(device)

    def to(self, device) -> "Hadamard":
        return Hadamard(self.signs.to(device))

    @property
    def matrix(self) -> torch.Tensor:
        """(D, D) fp32 R, built on first use."""
        if self._matrix is None:
            self._matrix = rotation_matrix(self.D, self.signs.cpu()).to(self.signs.device).contiguous()
        return self._matrix


def rotate(x: torch.Tensor, r) -> torch.Tensor:
    """x @ R in x's dtype (math in fp32 for half inputs); r from `rotation_matrix`, or a
    `Hadamard` (the butterfly)."""
    if isinstance(r, Hadamard):
        return fwht(x, r.signs)
    return (x.float() @ r).to(x.dtype) if x.dtype != torch.float32 else x @ r


def unrotate(x: torch.Tensor, r) -> torch.Tensor:
    """x @ Rᵀ, the inverse of `rotate`."""
    if isinstance(r, Hadamard):
        return fwht_t(x, r.signs)
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
    """Keys (..., Hkv, T, D) into the storage space of rk (a rotation, a Hadamard or a
    KeyMap), float32."""
    if isinstance(rk, Hadamard):
        return fwht(k.float(), rk.signs)
    y = k.float() @ k_matrix(rk)
    b = k_bias(rk)
    return y if b is None else y + b[:, None]


def unrotate_k(y: torch.Tensor, rk) -> torch.Tensor:
    """`rotate_k`'s inverse: stored keys (..., Hkv, T, D) back in the model's space."""
    if isinstance(rk, Hadamard):
        return fwht_t(y.float(), rk.signs)
    b = k_bias(rk)
    return (y.float() - (0 if b is None else b[:, None])) @ q_matrix(rk).T


def rotate_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rk,
                rv: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step's inputs into a cache's rotated storage space: q and k by rk (a rotation,
    a Hadamard or a KeyMap), v by rv (None: left as is). A rotated q keeps its dtype;
    rotated k and v come back float32, to be rounded to the storage dtype once. The torch route of every
    rotated cache (the arena's layers, the quantized ring) calls this; the native attention
    kernel applies the same x @ R inside its call. The step's output is then
    `unrotate(o, rv)`."""
    if rk is not None:
        q, k = rotate(q, q_matrix(rk)), rotate_k(k, rk)
    if rv is not None:
        v = rotate(v.float(), rv)
    return q, k, v
