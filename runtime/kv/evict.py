"""Token-eviction policies (arena_evict.py applies them) as pure functions over score tensors.

Each policy answers one question: of the n candidate tokens of a layer, which k does every
KV head keep? Inputs are the per-query-head attention mass the decode op reports
(`decode_attention(..., mass=)`) and the tokens' absolute positions; outputs are sorted
candidate indices (Hkv, k), one set per KV head (the arena stores heads independently, so
every head keeps its own tokens, as SnapKV does). The arena (arena.py) calls `select`.

- streaming (StreamingLLM, Xiao et al. 2023): the `sinks` first tokens + the most recent.
- h2o (Zhang et al. 2023): accumulated attention of every query so far, summed over the
  query heads of a KV group; heavy hitters + the `n_recent` most recent tokens.
- snapkv (Li et al. 2024): attention of an observation window of the last W queries,
  max-pooled over neighbouring positions (kernel 7), top-k per KV head.
- pyramidkv (Cai et al. 2024): snapkv with per-layer budgets decreasing linearly from the
  lower to the upper layers, same total (`pyramid_budgets`).
- kvcrush (Jha et al. 2025, sections III-IV): a fraction of the budget goes to
  representatives of the tokens the base policy (snapkv or h2o scoring) evicts: each token
  is the binary vector of its per-query-head keep/evict decisions, sorted by Hamming
  distance to an anchor (random / mean / alternate) — a counting sort over the H+1
  possible distances, O(n H) — cut into as many equal buckets as representatives, and the
  middle token of each bucket is kept (no k-means).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

POLICIES = ("none", "streaming", "h2o", "snapkv", "pyramidkv", "kvcrush", "kvcrush-h2o")
ANCHORS = ("random", "mean", "alternate")
SNAP_KERNEL = 7                 # SnapKV's pooling kernel
PYRAMID_BETA = 20               # PyramidKV: the top layer gets total / (beta * L)


def _sorted(idx: torch.Tensor) -> torch.Tensor:
    return idx.sort(-1).values


def group_scores(score_q: torch.Tensor, Hkv: int) -> torch.Tensor:
    """(H, n) per query head → (Hkv, n) summed over the query heads of each KV group."""
    H, n = score_q.shape
    return score_q.view(Hkv, H // Hkv, n).sum(1)


def streaming_keep(pos: torch.Tensor, k: int, sinks: int) -> torch.Tensor:
    """pos: (Hkv, n) absolute positions → (Hkv, k): tokens at positions < sinks, then the
    most recent."""
    s = pos.double().masked_fill(pos < sinks, float("inf"))
    return _sorted(s.topk(k, -1).indices)


def h2o_keep(score: torch.Tensor, pos: torch.Tensor, k: int, n_recent: int = 0) -> torch.Tensor:
    """score, pos: (Hkv, n) → (Hkv, k): the n_recent most recent tokens, then the highest
    accumulated attention among the rest."""
    n_recent = min(n_recent, k)
    s = score.double().clone()
    if n_recent:
        recent = pos.topk(n_recent, -1).indices                          # (Hkv, n_recent)
        s.scatter_(-1, recent, float("inf"))
    return _sorted(s.topk(k, -1).indices)


def snapkv_pool(score: torch.Tensor, pos: torch.Tensor, kernel: int = SNAP_KERNEL) -> torch.Tensor:
    """Max-pool (Hkv, n) scores over neighbouring *positions* (the arena's slot order is
    not position order once slots are reused); stride 1, same length."""
    order = pos.argsort(-1)                                              # (Hkv, n)
    s = score.float().gather(-1, order)
    pooled = F.max_pool1d(s[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
    return torch.empty_like(pooled).scatter_(-1, order, pooled)


def snapkv_keep(score: torch.Tensor, pos: torch.Tensor, k: int,
                kernel: int = SNAP_KERNEL) -> torch.Tensor:
    """(Hkv, n) observation-window scores → (Hkv, k): top-k of the pooled scores."""
    return _sorted(snapkv_pool(score, pos, kernel).topk(k, -1).indices)


def pyramid_budgets(total: int, n_layers: int, unit: int, beta: float = PYRAMID_BETA) -> list[int]:
    """Per-layer budgets (multiples of `unit`, each >= unit) that decrease linearly from
    layer 0 to the last layer and sum to `total` (a multiple of unit, >= n_layers * unit).
    PyramidKV: b_last = total / (beta L), b_0 = 2 total / L - b_last, arithmetic between."""
    assert total % unit == 0 and total >= n_layers * unit, (total, n_layers, unit)
    tu, L = total // unit, n_layers
    if L == 1:
        return [total]
    last = tu / (beta * L)
    first = 2 * tu / L - last
    b = [max(1, int(first + (last - first) * i / (L - 1))) for i in range(L)]
    while sum(b) < tu:                   # floor rounding: give the units back, lowest first
        i = next(i for i in range(L) if i == 0 or b[i] < b[i - 1])
        b[i] += 1
    while sum(b) > tu:                   # clamping at one unit: take from the largest layer
        top = max(b)
        i = max(i for i in range(L) if b[i] == top)
        b[i] -= 1
    return [x * unit for x in b]


# -- KVCrush ---------------------------------------------------------------------------------

def crush_bits(score_q: torch.Tensor, k: int) -> torch.Tensor:
    """(H, n) scores → (n, H) bool: bit h = query head h's own top-k keeps the token."""
    H, n = score_q.shape
    bits = torch.zeros(H, n, dtype=torch.bool)
    bits.scatter_(-1, score_q.topk(min(k, n), -1).indices, True)
    return bits.T.contiguous()


def crush_anchor(bits: torch.Tensor, anchor: str, seed: int = 0) -> torch.Tensor:
    """(n, H) bits → (H,) bool anchor point."""
    H = bits.shape[1]
    if anchor == "random":
        return torch.rand(H, generator=torch.Generator().manual_seed(seed)) < 0.5
    if anchor == "mean":
        return bits.float().mean(0) >= 0.5
    if anchor == "alternate":
        return torch.arange(H) % 2 == 0
    raise ValueError(f"unknown KVCrush anchor {anchor!r}")


def crush_buckets(bits: torch.Tensor, anchor: torch.Tensor, n_rep: int):
    """Bucket the n tokens of `bits` (n, H) into n_rep buckets by Hamming distance to the
    anchor. Returns (order, bucket, reps): order (n,) the tokens sorted by distance (ties in
    index order) by a counting sort over the H+1 distances; bucket (n,) each token's bucket
    (equal-size contiguous runs of `order`); reps (n_rep,) the middle token of each bucket."""
    n, H = bits.shape
    assert 0 < n_rep <= n, (n_rep, n)
    dist = (bits != anchor[None]).sum(-1)                                # (n,) in 0..H
    order = torch.cat([torch.nonzero(dist == d)[:, 0] for d in range(H + 1)])
    rank_bucket = torch.arange(n) * n_rep // n                           # (n,) non-decreasing
    bucket = torch.empty(n, dtype=torch.long).scatter_(0, order, rank_bucket)
    starts = (torch.arange(n_rep) * n + n_rep - 1) // n_rep              # first rank of bucket b
    ends = ((torch.arange(n_rep) + 1) * n + n_rep - 1) // n_rep
    return order, bucket, order[(starts + ends - 1) // 2]


def kvcrush_keep(score_q: torch.Tensor, pos: torch.Tensor, Hkv: int, k: int, fraction: float,
                 anchor: str = "random", base: str = "snapkv") -> torch.Tensor:
    """score_q: (H, n) per query head, pos: (Hkv, n) → (Hkv, k). Per KV head: the base
    policy's top (k - n_rep) tokens plus n_rep = round(fraction k) representatives of the
    tokens it evicts, bucketed on the layer's H-bit keep/evict vectors."""
    H, n = score_q.shape
    n_rep = min(int(round(fraction * k)), n - k) if k < n else 0
    kb = k - n_rep
    if base == "snapkv":               # pooled per query head (pos is the same within a group)
        per_q = torch.stack([snapkv_pool(score_q[h:h + 1], pos[h * Hkv // H][None])[0]
                             for h in range(H)])
    else:
        per_q = score_q.float()
    bits = crush_bits(per_q, kb)                                         # (n, H)
    anc = crush_anchor(bits, anchor)
    kv_score = group_scores(per_q, Hkv)                                  # (Hkv, n)
    out = []
    for h in range(Hkv):
        keep = kv_score[h].topk(kb).indices
        if n_rep:
            rest = torch.ones(n, dtype=torch.bool)
            rest[keep] = False
            cand = torch.nonzero(rest)[:, 0]                             # evicted by the base
            _, _, reps = crush_buckets(bits[cand], anc, n_rep)
            keep = torch.cat([keep, cand[reps]])
        out.append(keep.sort().values)
    return torch.stack(out)


# -- dispatch ----------------------------------------------------------------------------------

def select(policy: str, score_q: torch.Tensor, pos: torch.Tensor, k: int, *, sinks: int = 4,
           n_recent: int = 0, crush_fraction: float = 0.25, crush_anchor: str = "random") -> torch.Tensor:
    """Which k of n candidates each KV head keeps. score_q: (H, n) attention mass per query
    head (accumulated for h2o, observation window for snapkv); pos: (Hkv, n) absolute
    positions. Returns sorted indices (Hkv, k)."""
    Hkv, n = pos.shape
    assert 0 < k <= n and score_q.shape[1] == n, (k, n, tuple(score_q.shape))
    if policy == "streaming":
        return streaming_keep(pos, k, sinks)
    if policy == "h2o":
        return h2o_keep(group_scores(score_q, Hkv), pos, k, n_recent)
    if policy in ("snapkv", "pyramidkv"):
        return snapkv_keep(group_scores(score_q, Hkv), pos, k)
    if policy in ("kvcrush", "kvcrush-h2o"):
        return kvcrush_keep(score_q, pos, Hkv, k, crush_fraction, crush_anchor,
                            "h2o" if policy == "kvcrush-h2o" else "snapkv")
    raise ValueError(f"unknown eviction policy {policy!r}")


def resets_scores(policy: str) -> bool:
    """SnapKV-style policies score by an observation window (recent queries only); H2O-style
    ones accumulate every query since the token arrived."""
    return policy in ("snapkv", "pyramidkv", "kvcrush")
