"""Eviction's compaction, what it re-packs (runtime/kv/arena_evict.py): packing one head
through views writes only that head (TaDA's storage is shared across heads), the fill order,
KIVI keys compact at most one dirty block per KV head with every other block bit-exact in
place, streaming keeps KIVI's whole sink block and re-quantizes nothing, dirty_blocks picks
the blocks to re-pack, and a prefill chunk's compaction keeps what the policy chooses.
"""
from __future__ import annotations

import pytest
import torch

import kvrun
from kvrun.kv import parse_kv
from evict_cases import one_thread, tiny32_dir  # noqa: F401  (fixtures)


# -- compaction: what is re-packed -----------------------------------------------------------------

@pytest.mark.parametrize("method", ["fp16", "int8", "kivi-2", "kivi-4", "gear-l", "gear", "cb-2", "cb-3"])
@pytest.mark.parametrize("role", ["k", "v"])
def test_packing_one_head_through_views_writes_only_that_head(method, role):
    """Per-head compaction packs each KV head through views of its storage; that must give
    the all-heads pack's bytes for that head and leave the other heads alone."""
    from kvrun.kernels.codecs import make_codec
    from kvrun.kv.arena_evict import per_head_storage
    Hkv, D, S, G = 3, 64, 128, 32
    c = make_codec(method, role, G)
    assert per_head_storage(c, Hkv, D, S)
    x = torch.randn(Hkv, 64, D, generator=torch.Generator().manual_seed(0))
    full, split = c.alloc(Hkv, D, S), c.alloc(Hkv, D, S)
    c.store(full, x, 32)
    for h in (2, 0):                                     # head 1 never written
        c.store({k: t[h:h + 1] for k, t in split.items()}, x[h:h + 1], 32)
    for name in full:
        assert torch.equal(split[name][[0, 2]], full[name][[0, 2]]), name
        assert not split[name][1].any(), name


def test_tada_storage_is_shared_across_heads():
    from kvrun.kernels.codecs import make_codec
    from kvrun.kv.arena_evict import per_head_storage
    assert not per_head_storage(make_codec("tada-4", "k", 32), 3, 64, 128)


def test_fill_order_by_priority_and_aligned_common_tokens():
    from kvrun.kv.arena_evict import fill_order
    fill = torch.tensor([[1, 1, 0, 1, 1], [1, 0, 1, 1, 1]], dtype=torch.bool)
    prio = torch.tensor([[5., 9, 0, 1, 1], [2, 0, 8, 7, 1]], dtype=torch.float64)
    got = fill_order(fill, prio, aligned=False)
    assert [g.tolist() for g in got] == [[1, 0, 3, 4], [2, 3, 0, 4]]        # ties: lower index
    # aligned: tokens 0, 3, 4 are filled by both heads: first, by summed priority (7, 8, 2)
    got = fill_order(fill, prio, aligned=True)
    assert [g.tolist() for g in got] == [[3, 0, 4, 1], [3, 0, 4, 2]]


def _tail_snapshot(cache):
    return [(cache.ev.pos_tail[l][:, :cache.n_tail[l]].clone(),
             cache.k_codecs[l].dequant(cache.k_store[l], 0, cache.n_tail[l]),
             cache.v_codecs[l].dequant(cache.v_store[l], 0, cache.n_tail[l]))
            for l in range(cache.L)]


def test_kivi_keys_compact_one_dirty_block_per_head(tiny32_dir):
    """KIVI keys are quantized per channel over a block of G tokens, so re-packing a block
    re-quantizes every token in it. With them a compaction re-packs at most one tail block
    per KV head; every other block a head holds stays bit-exact in place, and the heads'
    choices may differ (snapkv)."""
    G = 32
    kv = parse_kv("kivi-2", residual=32, group=G, evict="snapkv", budget=32 + 32 + 128)
    m = kvrun.load(tiny32_dir, dtype="fp32", ctx=4096, kv=kv)
    cache = m.engine.cache
    ids = torch.randint(3, m.cfg.vocab_size, (200,), generator=torch.Generator().manual_seed(2))
    kept_blocks = one_head_only = 0
    with torch.inference_mode():
        m.transformer(ids[None], cache)
        for t in range(160):
            before = _tail_snapshot(cache)
            m.transformer(torch.tensor([[7 + t % 40]]), cache)
            for l, (pos, k, v) in enumerate(_tail_snapshot(cache)):
                p0, k0, v0 = before[l]
                nb = min(p0.shape[1], pos.shape[1]) // G
                same = (p0[:, :nb * G] == pos[:, :nb * G]).view(cache.Hkv, nb, G).all(-1)
                assert bool(((~same).sum(-1) <= 1).all()), (l, same)      # one dirty block
                for h, b in torch.nonzero(same).tolist():
                    sl = slice(b * G, b * G + G)
                    assert torch.equal(k[h, sl], k0[h, sl]) and torch.equal(v[h, sl], v0[h, sl])
                    kept_blocks += 1
                one_head_only += int((same.any(0) & ~same.all(0)).sum())
    assert cache.ev.n_compactions > 10
    assert kept_blocks and one_head_only          # some blocks re-packed for one head only


def test_streaming_keeps_the_whole_sink_block_of_kivi_keys(tiny32_dir):
    """With KIVI keys streaming's sinks round up to a whole block (G tokens), which then is
    never re-packed; the rest is a ring of whole blocks (nothing is re-quantized)."""
    G = 32
    kv = parse_kv("kivi-2", residual=32, group=G, evict="streaming", budget=32 + 32 + 128, sinks=4)
    m = kvrun.load(tiny32_dir, dtype="fp32", ctx=4096, kv=kv)
    cache = m.engine.cache
    ids = torch.randint(3, m.cfg.vocab_size, (200,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        m.transformer(ids[None], cache)
        first = [cache.k_codecs[l].dequant(cache.k_store[l], 0, G) for l in range(cache.L)]
        c0 = cache.ev.n_compactions
        for t in range(320):
            m.transformer(torch.tensor([[7 + t % 40]]), cache)
        assert cache.ev.n_compactions >= c0 + 20
        for l in range(cache.L):
            pos = cache.ev.pos_tail[l]
            assert torch.equal(pos[:, :G], torch.arange(G).expand(cache.Hkv, G))
            assert torch.equal(cache.k_codecs[l].dequant(cache.k_store[l], 0, G), first[l])
            # the rest: the most recent whole blocks before the window
            rest = pos[:, G:].sort(-1).values
            start = cache.seq_len - cache.n_win[l] - rest.shape[1]
            assert torch.equal(rest, torch.arange(start, start + rest.shape[1]).expand_as(rest))
    assert cache.ev.n_repacked == 0


def test_one_dirty_block_keeps_the_pool_best_and_spares_the_rest():
    from kvrun.kv.arena_evict import dirty_blocks
    # 2 heads, G 4, tail of 2 blocks + 4 flushing tokens; the policy keeps 8 per head
    kept = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 0, 0],
                         [1, 0, 1, 1, 1, 1, 1, 0, 0, 1, 0, 1]], dtype=torch.bool)
    value = torch.arange(12.).expand(2, 12).double()
    got = dirty_blocks(kept, value, 8, 4, per_head=True)
    # head 0: block 1 holds its 2 victims; head 1: a tie (1 victim each), block 0 is worth less
    assert got.int().tolist() == [[1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 0, 0],
                                  [0, 0, 1, 1, 1, 1, 1, 1, 0, 1, 0, 1]]
    # shared slots: one block for both heads (block 1: 3 victims over the heads); head 1
    # keeps its policy-kept 4, 5, 6, 9, 11 minus the least valuable, 4
    got = dirty_blocks(kept, value, 8, 4, per_head=False)
    assert got.int().tolist() == [[1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 0, 0],
                                  [1, 1, 1, 1, 0, 1, 1, 0, 0, 1, 0, 1]]
    assert (got.sum(1) == 8).all()
    # two blocks allowed: every policy victim's block is re-packed, the policy's choice stands
    assert torch.equal(dirty_blocks(kept, value, 8, 4, per_head=True, n_blocks=2), kept)
    assert torch.equal(dirty_blocks(kept, value, 8, 4, per_head=False, n_blocks=2), kept)


@pytest.mark.parametrize("policy", ["snapkv", "kvcrush", "h2o"])
@pytest.mark.parametrize("n_blocks", [2, 3])
def test_a_prefill_chunk_keeps_what_the_policy_chooses_with_block_keys(tiny32_dir, policy, n_blocks):
    """A chunk flushing f tokens may re-pack up to f / G tail blocks of per-channel keys, so
    its compaction keeps the tokens the policy picks, as a per-token codec does (with one
    block per compaction, a chunk could bring in at most G of its tokens: a needle the
    question's chunk selected was dropped). Run on the lossless fp16 codec, with and
    without the block-keys rule, so the scores are the same: the tail (n_blocks blocks)
    fills with the first chunk, the second chunk flushes n_blocks blocks into it."""
    G, R = 32, 32
    S = n_blocks * G
    kv = parse_kv("fp16", residual=R, group=G, evict=policy, budget=R + G + S, snap_window=8)
    kept = []
    for block_keys in (False, True):
        m = kvrun.load(tiny32_dir, dtype="fp32", ctx=4096, kv=kv)
        ids = torch.randint(3, m.cfg.vocab_size, (R + 2 * S,),
                            generator=torch.Generator().manual_seed(5))
        ev = m.engine.cache.ev
        if block_keys:                  # the rule KIVI / GEAR keys get, on a lossless codec
            ev.token_groups = [True] * m.cfg.num_layers
        with torch.inference_mode():
            m.transformer(ids[None, :R + S], m.engine.cache)       # fills the tail exactly
            assert ev.n_compactions == 0
            m.transformer(ids[None, R + S:], m.engine.cache)       # flushes S more
        assert ev.n_compactions == m.cfg.num_layers
        kept.append([ev.kept_positions(l) for l in range(m.cfg.num_layers)])
    for l, (a, b) in enumerate(zip(*kept)):
        assert torch.equal(a, b), l


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_a_prefill_chunk_frees_every_dirty_block_of_fine_keys(tiny32_dir, policy):
    """Per-channel keys of 4 bits or more (FINE_KEY_BITS): a chunk flushing f tokens re-packs
    every dirty block, not only f / G, so its compaction keeps exactly the policy's choice
    however the victims spread over the tail; 2- and 3-bit keys keep f / G blocks and then
    differ from it. On the lossless fp16 codec with the block-keys rule, as above: a tail of
    4 blocks, then a chunk of 2."""
    G, R = 32, 32
    S = 4 * G
    kv = parse_kv("fp16", residual=R, group=G, evict=policy, budget=R + G + S, snap_window=8)
    kept = {}
    for rule in ("policy", "fine", "coarse"):
        m = kvrun.load(tiny32_dir, dtype="fp32", ctx=4096, kv=kv)
        ids = torch.randint(3, m.cfg.vocab_size, (R + S + 2 * G,),
                            generator=torch.Generator().manual_seed(6))
        ev, L = m.engine.cache.ev, m.cfg.num_layers
        if rule != "policy":
            ev.token_groups, ev.fine_keys = [True] * L, [rule == "fine"] * L
        with torch.inference_mode():
            m.transformer(ids[None, :R + S], m.engine.cache)
            m.transformer(ids[None, R + S:], m.engine.cache)
        assert ev.n_compactions == L
        kept[rule] = [ev.kept_positions(l) for l in range(L)]
    assert all(torch.equal(a, b) for a, b in zip(kept["policy"], kept["fine"]))
    assert not all(torch.equal(a, b) for a, b in zip(kept["policy"], kept["coarse"]))


@pytest.mark.parametrize("method, fine", [("kivi-4", True), ("kivi-2", False), ("kivi-3/kivi-4", False),
                                          ("gear-l", True), ("int8", False)])
def test_fine_keys_follow_the_key_bits(tiny32_dir, method, fine):
    m = kvrun.load(tiny32_dir, dtype="fp32", ctx=1024,
                   kv=parse_kv(method, residual=32, group=32, evict="snapkv", budget=256))
    ev = m.engine.cache.ev
    assert ev.fine_keys == [fine] * m.cfg.num_layers
    assert ev.token_groups == [method != "int8"] * m.cfg.num_layers
