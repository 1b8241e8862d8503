"""A key transform fitted once per model: per layer, a mean mu (per KV head and channel) and
a spread sigma (per channel) of the keys after RoPE, stored in a profile's layer entry as
"k_map": {"mu": [[...D] x Hkv], "sigma": [...D]}.

The arena stores that layer's keys as ((k - mu) / sigma) @ R and multiplies queries by
sigma before R (kernels/hadamard.py KeyMap): q' . k' = q . k - q . mu, one constant per
query, which softmax removes, so attention is unchanged in full precision. What changes
is what a codec quantizes: a codebook code (cb-N, a per-token norm and fixed levels) spends
no levels on the direction every key shares, and sees channels of equal spread, as KIVI's
per-channel zero and scale already do for KIVI (docs/codebook.md, "A key transform fitted
once per model"). `fit_key_maps` computes it from keys of a full-precision prefill.
"""
from __future__ import annotations

import math

import torch

from ..errors import KvrunError


def _numbers(where: str, xs, n: int | None = None) -> list[float]:
    if (not isinstance(xs, list) or not xs or (n is not None and len(xs) != n)
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                       for x in xs)):
        want = f"{n} finite numbers" if n is not None else "a non-empty list of finite numbers"
        raise KvrunError(f"{where} must be {want}")
    return [float(x) for x in xs]


def check_key_map(where: str, m) -> dict:
    """A profile's "k_map" entry, validated: {"mu": (Hkv lists of D numbers), "sigma": (D
    numbers > 0)}. Its fit to a model's geometry is checked when an arena is built."""
    if not isinstance(m, dict) or set(m) != {"mu", "sigma"}:
        raise KvrunError(f"{where} must be an object with 'mu' and 'sigma'")
    sigma = _numbers(f"{where} sigma", m["sigma"])
    if min(sigma) <= 0:
        raise KvrunError(f"{where} sigma must be positive")
    if not isinstance(m["mu"], list) or not m["mu"]:
        raise KvrunError(f"{where} mu must be a list of one list of {len(sigma)} numbers per KV head")
    mu = [_numbers(f"{where} mu", row, len(sigma)) for row in m["mu"]]
    return {"mu": mu, "sigma": sigma}


def key_map_tensors(m: dict, n_kv_heads: int, head_dim: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mu (Hkv, D), sigma (D,)) float32 of a checked entry, refused when the layer's geometry
    differs."""
    mu, sigma = torch.tensor(m["mu"], dtype=torch.float32), torch.tensor(m["sigma"], dtype=torch.float32)
    if mu.shape != (n_kv_heads, head_dim):
        raise KvrunError(f"KV profile: layer {layer}'s k_map is for {mu.shape[0]} KV heads of "
                         f"{mu.shape[1]} channels, the model has {n_kv_heads} of {head_dim}")
    return mu, sigma


def fit_key_map(k: torch.Tensor, skip: int = 4) -> dict:
    """The k_map of one layer from its keys k (Hkv, n, D) after RoPE, positions from `skip`
    on (the first tokens, an attention sink, lie far from the rest): mu the mean per head and
    channel, sigma each channel's standard deviation (over heads and tokens), scaled to unit
    RMS over the channels."""
    x = k[:, skip:].double()
    if x.shape[1] < 2:
        raise KvrunError(f"a key map needs more than {skip + 1} calibration tokens")
    mu = x.mean(1)                                                       # (Hkv, D)
    var = (x - mu[:, None]).pow(2).mean((0, 1))                          # (D,)
    sd = var.clamp_min(0).sqrt()
    sd = (sd / sd.pow(2).mean().sqrt().clamp_min(1e-30)).clamp_min(1e-3)
    g = lambda t: [float(f"{v:.6g}") for v in t.tolist()]                # noqa: E731 (JSON size)
    return {"mu": [g(row) for row in mu], "sigma": g(sd)}
