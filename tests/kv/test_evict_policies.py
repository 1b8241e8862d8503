"""Token eviction policies (runtime/kv/evict.py) on hand-built attention patterns, checked
against their definitions: streaming's sinks and recent tokens, H2O's heavy hitters, SnapKV's
pooled top-k (pooled in position order, not slot order), PyramidKV's per-layer budgets and
KVCrush's buckets and representatives.
"""
from __future__ import annotations

import pytest
import torch

from kvrun.kv.evict import (crush_anchor, crush_bits, crush_buckets, kvcrush_keep,
                            pyramid_budgets, select, snapkv_pool)
from evict_cases import one_thread  # noqa: F401  (autouse fixture)


def _pos(n, Hkv=2):
    return torch.arange(n).expand(Hkv, n)


# -- policies on hand-built patterns ------------------------------------------------------------

def test_streaming_keeps_sinks_and_recent():
    pos = torch.tensor([[9, 0, 5, 1, 7, 2, 8, 3, 6, 4]] * 2)            # slot order != position
    keep = select("streaming", torch.zeros(4, 10), pos, 5, sinks=2)
    assert sorted(pos[0, keep[0]].tolist()) == [0, 1, 7, 8, 9]
    assert torch.equal(keep[0], keep[1])


def test_h2o_keeps_the_heavy_hitter_and_recent():
    H, Hkv, n = 4, 2, 12
    score = torch.rand(H, n, generator=torch.Generator().manual_seed(0)) * 0.1
    score[0:2, 3] = 5.0                 # KV head 0's group attends token 3 heavily
    score[2:4, 6] = 5.0                 # KV head 1's group: token 6
    score[:, 8] = 1.0                   # both: token 8
    keep = select("h2o", score, _pos(n), 4, n_recent=2)
    assert keep.tolist() == [[3, 8, 10, 11], [6, 8, 10, 11]]
    # without a recent share it is exactly the top-k of the group sums
    keep = select("h2o", score, _pos(n), 3, n_recent=0)
    ref = score.view(2, 2, n).sum(1).topk(3, -1).indices.sort(-1).values
    assert torch.equal(keep, ref)


def test_snapkv_picks_the_pooled_top_k():
    n = 20
    score = torch.zeros(2, n)
    score[0, 10] = 1.0                  # one peak: pooling (kernel 7) spreads it to 7..13
    score[1, 2] = 0.5
    score[1, 17] = 0.9
    pooled = snapkv_pool(score, _pos(n))
    assert pooled[0].nonzero()[:, 0].tolist() == list(range(7, 14))
    keep = select("snapkv", score.repeat_interleave(2, 0) / 2, _pos(n), 7)
    assert keep[0].tolist() == list(range(7, 14))
    ref = pooled.topk(7, -1).indices.sort(-1).values
    assert torch.equal(keep[0], ref[0])
    # head 1: 17's neighbourhood 14..19 (6 tokens, clipped at the end) then 2's (0..5)
    assert set(keep[1].tolist()) >= set(range(14, 20))
    assert set(keep[1].tolist()) - set(range(14, 20)) <= set(range(0, 6))


def test_snapkv_pools_in_position_order():
    """Slots reused by eviction are not in position order: pooling must follow positions."""
    perm = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])
    pos = perm[None]
    score = torch.zeros(1, 8)
    score[0, (perm == 3).nonzero()[0, 0]] = 1.0                        # peak at position 3
    pooled = snapkv_pool(score, pos, kernel=3)
    hot = sorted(pos[0, pooled[0] > 0].tolist())
    assert hot == [2, 3, 4]


def test_pyramid_budgets_sum_and_decrease():
    for total, L, unit in [(27 * 32 * 30, 30, 32), (3 * 16 * 4, 4, 16), (5 * 32 * 7, 7, 32)]:
        b = pyramid_budgets(total, L, unit)
        assert sum(b) == total and len(b) == L
        assert all(x % unit == 0 and x >= unit for x in b)
        assert all(x >= y for x, y in zip(b, b[1:])) and b[0] > b[-1]
    assert pyramid_budgets(64, 1, 32) == [64]


def test_kvcrush_buckets_are_distinct_and_ordered_by_distance():
    g = torch.Generator().manual_seed(1)
    n, H, n_rep = 101, 9, 10
    bits = torch.rand(n, H, generator=g) < 0.5
    anc = crush_anchor(bits, "alternate")
    order, bucket, reps = crush_buckets(bits, anc, n_rep)
    dist = (bits != anc).sum(-1)
    assert sorted(order.tolist()) == list(range(n))
    assert (dist[order][1:] >= dist[order][:-1]).all()                 # counting sort
    assert sorted(bucket[reps].tolist()) == list(range(n_rep))          # one rep per bucket
    sizes = torch.bincount(bucket, minlength=n_rep)
    assert sizes.max() - sizes.min() <= 1                               # equal buckets
    # a bucket never mixes a farther token before a nearer one
    for b in range(n_rep - 1):
        assert dist[bucket == b].max() <= dist[bucket == b + 1].min()


@pytest.mark.parametrize("anchor", ["random", "mean", "alternate"])
def test_kvcrush_keeps_base_plus_representatives(anchor):
    g = torch.Generator().manual_seed(2)
    H, Hkv, n, k = 6, 2, 64, 16
    score = torch.rand(H, n, generator=g)
    keep = kvcrush_keep(score, _pos(n, Hkv), Hkv, k, 0.25, anchor, base="h2o")
    n_rep = 4
    grp = score.view(Hkv, H // Hkv, n).sum(1)
    bits = crush_bits(score, k - n_rep)
    anc = crush_anchor(bits, anchor)
    for h in range(Hkv):
        base = set(grp[h].topk(k - n_rep).indices.tolist())
        kept = keep[h].tolist()
        assert len(set(kept)) == k and base <= set(kept)
        reps = sorted(set(kept) - base)
        cand = torch.tensor(sorted(set(range(n)) - base))
        _, bucket, ref = crush_buckets(bits[cand], anc, n_rep)
        assert reps == sorted(cand[ref].tolist())
        assert len({int(bucket[(cand == r).nonzero()[0, 0]]) for r in reps}) == n_rep
