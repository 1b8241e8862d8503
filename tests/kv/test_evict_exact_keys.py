"""Observation-window policies over a compressed tail read a prompt's chunks over the exact
rows (runtime/kv/arena_evict.py, "The prompt over exact rows"): the scores and the prompt's
logits are the ones the same policy gives over a lossless tail, every re-pack quantizes the
rows as they were, and the copies are freed when the prompt is in."""
from __future__ import annotations

import pytest
import torch

import kvrun
from kvrun.kv import parse_kv
from evict_cases import one_thread, tiny32_dir  # noqa: F401  (fixtures)
from tiny import make_tiny_model_dir

G, R = 32, 32


def _prefill(m, ids, chunk: int) -> None:
    with torch.inference_mode():
        for s in range(0, len(ids), chunk):
            m.transformer(ids[None, s:s + chunk], m.engine.cache)


def _first_scores(tiny32_dir, method: str, policy: str, exact: bool = True) -> torch.Tensor:
    """Layer 0's scores (H, n) at its first compaction, in position order."""
    kv = parse_kv(method, residual=R, group=G, evict=policy, budget=R + G + 4 * G, snap_window=8,
                  evict_scores="exact" if exact else "codes")
    m = kvrun.load(tiny32_dir, dtype="fp32", ctx=4096, kv=kv)
    ev, seen = m.engine.cache.ev, []
    own = ev.choose

    def choose(l, score, pos, K):
        if l == 0:
            seen.append((score.clone(), pos.clone()))
        return own(l, score, pos, K)
    ev.choose = choose
    ids = torch.randint(3, m.cfg.vocab_size, (R + 8 * G,), generator=torch.Generator().manual_seed(8))
    _prefill(m, ids, 3 * G)
    score, pos = seen[0]
    assert torch.equal(pos, pos.sort(-1).values), pos          # filled in order: no re-pack yet
    return score


@pytest.mark.parametrize("policy", ["snapkv", "pyramidkv", "kvcrush"])
@pytest.mark.parametrize("method, atol", [("kivi-2", 1e-5), ("kivi-4", 1e-5), ("tada-4", 1e-5),
                                          ("int8", 1e-5), ("cb-3", 2e-3), ("kivi-4+rot", 2e-3)])
def test_a_prompt_is_scored_as_over_a_lossless_tail(tiny32_dir, method, atol, policy):
    """Layer 0's queries and keys do not depend on the cache, so over the exact keys its
    first compaction sees the scores fp16 + the same policy sees: to the summation order,
    and for rotated rows (cb-3's, +rot) to their rounding to the window's fp16 after the
    rotation. (The selection can still flip a near-tie, and a flip then carries on.) Over
    the stored codes, the attention kernel's mass, they differ at least 5x as much."""
    ref = _first_scores(tiny32_dir, "fp16", policy)
    assert (_first_scores(tiny32_dir, method, policy) - ref).abs().max() <= atol
    assert (_first_scores(tiny32_dir, method, policy, exact=False) - ref).abs().max() > 5 * atol


@pytest.mark.parametrize("method", ["kivi-2", "kivi-4", "kivi-3/kivi-4"])
def test_tail_keys_are_one_quantization_of_the_exact_keys(tiny32_dir, method):
    """After a chunked prefill with compactions, every tail block of per-channel keys is the
    codec's packing of the exact keys its slots hold: the re-packs quantized the keys as
    they were, not their decoded codes (which would compound the error)."""
    kv = parse_kv(method, residual=R, group=G, evict="snapkv", budget=R + G + 4 * G)
    m = kvrun.load(tiny32_dir, dtype="fp32", ctx=4096, kv=kv)
    cache = m.engine.cache
    ids = torch.randint(3, m.cfg.vocab_size, (R + 12 * G,), generator=torch.Generator().manual_seed(9))
    _prefill(m, ids, 3 * G)
    assert cache.ev.n_repacked > 0
    for l in range(cache.L):
        nt, codec = cache.n_tail[l], cache.k_codecs[l]
        fresh = codec.alloc(cache.Hkv, cache.D, nt)
        codec.pack(fresh, cache.ev.keys[l][:, :nt].float(), 0)
        assert torch.equal(codec.dequant(fresh, 0, nt), codec.dequant(cache.k_store[l], 0, nt)), l


def test_no_exact_keys_where_they_would_change_nothing(tiny32_dir):
    """A lossless tail is exact already, and H2O-style policies score every query (decode
    steps included) over the tail as stored: neither holds a copy."""
    for method, policy in (("fp16", "snapkv"), ("kivi-4", "h2o"), ("kivi-4", "streaming")):
        kv = parse_kv(method, residual=R, group=G, evict=policy, budget=R + G + 4 * G)
        m = kvrun.load(tiny32_dir, dtype="fp32", ctx=4096, kv=kv)
        _prefill(m, 3 + torch.arange(R + 8 * G) % 250, 3 * G)
        assert m.engine.cache.ev.transient_nbytes() == 0, (method, policy)


def test_the_exact_keys_are_freed_when_the_prompt_is_in(tmp_path):
    """Engine.prefill ends the prompt (here through Gemma 3's layered cache, whose global
    layer evicts): the exact keys go, and a later chunk (a chat's next turn) is scored over
    the tail as stored. Without end_prompt, the first one-token step frees them."""
    d = make_tiny_model_dir(tmp_path / "g", architecture="gemma3")
    kv = parse_kv("kivi-4", residual=R, group=G, evict="snapkv", budget=R + G + 4 * G)
    m = kvrun.load(d, dtype="fp32", ctx=4096, kv=kv, prefill_chunk=3 * G)
    ev = m.engine.cache.inner.ev
    ids = [3 + i % 250 for i in range(R + 8 * G)]
    with torch.inference_mode():
        chunks = m.engine.prefill_chunks(ids)
        next(chunks)
        next(chunks)
        assert ev.transient_nbytes() > 0 and ev.exact(0, 2)
        for _ in chunks:
            pass
        assert ev.transient_nbytes() == 0 and not ev.exact(0, 2)
        assert ev.mass_buffer(0, 2)[0] is not None           # scored by the attention kernel
        m.engine.cache.reset()
        _prefill(m, torch.tensor(ids), 3 * G)
        assert ev.transient_nbytes() > 0
        m.transformer(torch.tensor([[5]]), m.engine.cache)
        assert ev.transient_nbytes() == 0


def _prompt_logits(tiny32_dir, method: str, log: dict, record: bool, exact: bool = True):
    """The logits of a chunked prefill whose compactions keep what `log` holds per layer
    (recorded from this run when `record`, else forced from it: the same tokens for any
    codec, so a near-tie in the scores cannot make the comparison flaky)."""
    kv = parse_kv(method, residual=R, group=G, evict="snapkv", budget=R + G + 4 * G, snap_window=8,
                  evict_scores="exact" if exact else "codes")
    m = kvrun.load(tiny32_dir, dtype="fp32", ctx=4096, kv=kv)
    ev, done, own = m.engine.cache.ev, {}, m.engine.cache.ev.choose

    def choose(l, score, pos, K):
        if record:
            keep = own(l, score, pos, K)
            log.setdefault(l, []).append(pos.gather(1, keep))
            return keep
        i = done[l] = done.get(l, -1) + 1
        want = torch.stack([torch.isin(p, w) for p, w in zip(pos, log[l][i])])
        assert (want.sum(1) == K).all(), (l, i)
        return torch.stack([torch.nonzero(x)[:, 0] for x in want])
    ev.choose = choose
    ids = torch.randint(3, m.cfg.vocab_size, (R + 12 * G,), generator=torch.Generator().manual_seed(10))
    with torch.inference_mode():
        out = torch.cat([m.transformer(ids[None, s:s + 3 * G], m.engine.cache)
                         for s in range(0, ids.numel(), 3 * G)], 1)
    assert ev.n_compactions > 0
    return out


@pytest.mark.parametrize("method", ["kivi-2", "tada-4", "kivi-4/int8", "fp16/kivi-2", "cb-3"])
def test_a_prompt_attends_as_over_a_lossless_tail(tiny32_dir, method):
    """With the same tokens kept, every chunk of a prompt attends over the tail's exact rows:
    the prompt's logits are fp16 + the policy's to the summation order (the window's fp16
    rounding of rotated rows for cb-3), in every layer, not only the first; attending over
    the codes (`--evict-scores codes`) moves them at least 20x as much."""
    log: dict = {}
    ref = _prompt_logits(tiny32_dir, "fp16", log, record=True)
    err = (_prompt_logits(tiny32_dir, method, log, record=False) - ref).abs().max()
    codes = (_prompt_logits(tiny32_dir, method, {}, record=True, exact=False) - ref).abs().max()
    assert err <= (0.05 if method == "cb-3" else 3e-3), err
    assert codes > 20 * err, (codes, err)


@pytest.mark.parametrize("method, copies", [("kivi-4", 2), ("kivi-4/fp16", 1), ("fp16/kivi-2", 1)])
def test_the_prompt_holds_a_copy_of_each_lossy_side(tiny32_dir, method, copies):
    """A lossless side is read from its storage: only the lossy side's rows are copied, each
    (Hkv, S, D) per layer in the window's fp16."""
    kv = parse_kv(method, residual=R, group=G, evict="snapkv", budget=R + G + 4 * G)
    m = kvrun.load(tiny32_dir, dtype="fp32", ctx=4096, kv=kv)
    _prefill(m, 3 + torch.arange(R + 8 * G) % 250, 3 * G)
    c = m.engine.cache
    assert c.ev.transient_nbytes() == copies * c.L * c.Hkv * c.ev.a.S_l[0] * c.D * 2
    c.end_prompt()
    assert c.ev.transient_nbytes() == 0
