"""Token eviction in the arena (runtime/kv/arena_evict.py), on tiny models.

The arena is checked in lockstep against a reference cache that keeps every K/V and attends
over exactly the tokens the arena reports kept, at their original positions (so a wrong RoPE
position, a wrong slot gather or a lost token changes the logits). Then: bounded memory with
the compressed codecs, generation and truncate past the budget, the configuration and CLI
errors, the CLI with eviction, an interrupted forward and TaDA's sinks. The policies alone
are in test_evict_policies.py, what a compaction re-packs in test_arena_evict_compaction.py,
the kv report in test_report.py."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch.testing import assert_close

sys.path.insert(0, str(Path(__file__).parents[1]))
import kvrun  # noqa: E402
from kvrun.cli.main import main  # noqa: E402
from kvrun.errors import KvrunError  # noqa: E402
from kvrun.kv import parse_kv  # noqa: E402
from kvrun.kv.build import kv_bytes_at  # noqa: E402
from tiny import interrupted_forward, make_tiny_model_dir  # noqa: E402
from evict_cases import one_thread, tiny32_dir  # noqa: E402,F401  (fixtures)


# -- the arena ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("ev") / "tiny")


class KeptReference:
    """Cache interface that stores every token's K/V (rounded like the arena's window) and
    attends over the positions in `self.kept[layer]` (Hkv, n) plus the new tokens."""

    def __init__(self, L, Hkv, D, n_max):
        self.K = torch.zeros(L, Hkv, n_max, D)
        self.V = torch.zeros(L, Hkv, n_max, D)
        self.seq_len, self.kept = 0, None

    def positions(self, T):
        return torch.arange(self.seq_len, self.seq_len + T)

    def attend_new(self, layer, q, new):        # the model's entry (KVCache): rows to attend
        return self.attend(layer, q, *new.rows())

    def attend(self, layer, q, k, v):
        T, H, Hkv, D = q.shape[2], q.shape[1], k.shape[1], q.shape[3]
        s = self.seq_len
        self.K[layer, :, s:s + T] = k[0].half().float()
        self.V[layer, :, s:s + T] = v[0].half().float()
        out = torch.empty(1, H, T, D)
        new = torch.arange(s, s + T)
        for h in range(Hkv):
            idx = torch.cat([self.kept[layer][h], new])                # (n,)
            Kh, Vh = self.K[layer, h, idx], self.V[layer, h, idx]
            hidden = idx[None] > new[:, None]                          # (T, n) causal
            for g in range(H // Hkv):
                qh = q[0, h * (H // Hkv) + g].float()                  # (T, D)
                sc = (qh @ Kh.T * D ** -0.5).masked_fill(hidden, float("-inf"))
                out[0, h * (H // Hkv) + g] = sc.softmax(-1) @ Vh
        return out

    def commit(self, T):
        self.seq_len += T


def _lockstep(m, budget, n_total, prompt_len, chunk, seed=0):
    """Drive the arena model with the reference attending beside it; returns the arena.

    The reference runs inside the same forward, on the q/k/v each layer hands the arena
    (the arena's `attend` is wrapped), and its output is compared layer by layer. Two
    separate forwards (arena, then reference) would each store their own K/V rounded to
    fp16; their fp32 inputs differ by the summation order of the GEMMs, which depends on
    the CPU's kernels (AVX-512 vs AVX2), and a value near an fp16 rounding boundary then
    differs by a whole fp16 ulp (2^-11 relative) in one store and not the other. Those
    flips, not the arena, made the logits of separate forwards differ by up to ~4e-4 on
    some CPUs. With shared inputs the only difference left is the order of fp32 sums over
    at most ~100 kept tokens: |Δo| <= n·2^-24·max|v|·(a few) ≈ 1e-5 for |v| <= 4, which
    is the tolerance below (measured: 3e-7)."""
    tr, cache = m.transformer, m.engine.cache
    cfg = m.cfg
    ref = KeptReference(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, n_total + 8)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg.vocab_size, (prompt_len,), generator=g).tolist()
    nbytes = sum(cache.nbytes().values())
    feed = [ids[s:s + chunk] for s in range(0, len(ids), chunk)]
    arena_attend = cache.attend
    n_checked = []

    def attend(layer, q, k, v):
        o = arena_attend(layer, q, k, v)
        assert_close(o, ref.attend(layer, q, k, v), atol=1e-5, rtol=1e-5)
        n_checked.append(layer)
        return o

    cache.attend = attend
    try:
        while cache.seq_len < n_total:
            batch = feed.pop(0) if feed else [nxt]
            ref.kept = [cache.ev.kept_positions(l) for l in range(cfg.num_layers)]
            a = cache
            for l in range(cfg.num_layers):                             # within the budget
                assert ref.kept[l].shape[1] <= a.S_l[l] + a.R + a.G - 1
                assert len(set(ref.kept[l][0].tolist())) == ref.kept[l].shape[1]
            assert sum(k.shape[1] for k in ref.kept) <= budget * cfg.num_layers
            n_checked.clear()
            la = tr(torch.tensor([batch]), cache)[0]                    # (T, V)
            assert n_checked == list(range(cfg.num_layers))             # every layer compared
            ref.commit(len(batch))
            nxt = int(la[-1].argmax())
            assert 0 <= nxt < cfg.vocab_size
    finally:
        del cache.attend                                                # the class's method again
    assert sum(cache.nbytes().values()) == nbytes
    return cache


@pytest.mark.parametrize("policy,slack", [("streaming", 0), ("h2o", 0), ("snapkv", 0),
                                          ("pyramidkv", 0), ("kvcrush", 0), ("kvcrush-h2o", 0),
                                          ("h2o", 32), ("snapkv", 16)])
def test_arena_matches_reference_over_kept_tokens(tiny_dir, policy, slack):
    budget = 16 + 16 + 48                                             # R + G + 3 blocks
    kv = parse_kv("fp16", residual=16, group=16, evict=policy, budget=budget, sinks=3,
                  snap_window=8, evict_slack=slack)
    m = kvrun.load(tiny_dir, dtype="fp32", ctx=4096, kv=kv, prefill_chunk=64)
    _check_against_reference(m, policy, slack, budget)


@pytest.mark.parametrize("policy", ["streaming", "h2o", "snapkv", "kvcrush"])
def test_one_dirty_block_mode_matches_reference_over_kept_tokens(tiny_dir, policy):
    """The one-dirty-block compaction of KIVI/GEAR keys, run on the lossless fp16 codec so
    the reference comparison is exact: positions, slots and scores of the kept tokens."""
    budget = 16 + 16 + 48
    kv = parse_kv("fp16", residual=16, group=16, evict=policy, budget=budget, sinks=3,
                  snap_window=8)
    m = kvrun.load(tiny_dir, dtype="fp32", ctx=4096, kv=kv, prefill_chunk=64)
    ev = m.engine.cache.ev
    ev.token_groups = [True] * m.cfg.num_layers
    ev.sinks = [16] * m.cfg.num_layers                 # a whole sink block
    _check_against_reference(m, policy, 0, budget)


def _check_against_reference(m, policy, slack, budget):
    cache = _lockstep(m, budget, 4 * budget, prompt_len=100, chunk=40)
    assert cache.seq_len >= 4 * budget and sum(cache.ev.n_drop) > 0
    assert cache.ev.n_compactions > 0
    if slack:                           # each compaction frees `slack` more: fewer of them
        assert cache.ev.n_compactions * 16 < sum(cache.ev.n_drop)
    for l in range(m.cfg.num_layers):
        kept = cache.ev.kept_positions(l)
        assert int(kept.max()) == cache.seq_len - 1                     # the newest is kept
        if policy == "streaming":
            s = cache.ev.sinks[l]
            assert kept[:, :s].tolist() == [list(range(s))] * kept.shape[0]  # sinks survive
    if policy != "streaming" and not slack:     # per-head selection: the heads' sets differ
        assert any(not torch.equal(cache.ev.kept_positions(l)[0], cache.ev.kept_positions(l)[1])
                   for l in range(m.cfg.num_layers))


@pytest.mark.parametrize("method", ["tada-4", "kivi-2", "int8", "cb-3"])
def test_compressed_codecs_with_eviction_stay_bounded(tiny32_dir, method):
    d = tiny32_dir
    budget = 32 + 32 + 64
    kv = parse_kv(method, residual=32, group=32, evict="h2o", budget=budget)
    m = kvrun.load(d, dtype="fp32", ctx=4096, kv=kv)
    cache = m.engine.cache
    b0 = sum(cache.nbytes().values())
    ids = torch.randint(3, m.cfg.vocab_size, (4 * budget,), generator=torch.Generator().manual_seed(0))
    logits = m.transformer(ids[None], cache)
    for t in range(40):                                                 # decode on top
        logits = m.transformer(torch.tensor([[int(logits[0, -1].argmax())]]), cache)
    assert torch.isfinite(logits).all()
    assert cache.seq_len == 4 * budget + 40
    assert all(nt + w <= budget for nt, w in zip(cache.n_tail, cache.n_win))
    assert sum(cache.nbytes().values()) == b0
    # the allocation does not depend on the context size, only on the budget
    assert kv_bytes_at(m.cfg, kv, 4096) == kv_bytes_at(m.cfg, kv, 65536) == cache.nbytes()


def test_generation_of_4x_budget_outputs_valid_text(tiny_dir):
    from kvrun.engine.sampling import SamplingParams
    budget = 64
    kv = parse_kv("fp16", residual=16, group=16, evict="snapkv", budget=budget)
    m = kvrun.load(tiny_dir, dtype="fp32", ctx=1024, kv=kv)
    b0 = m.kv_bytes()
    ids = m.tokenize("abc " * 30)
    events = list(m.engine.stream(ids, 4 * budget, SamplingParams(temp=0.0), set()))
    toks = [e.token_id for e in events if e.token_id is not None]
    assert len(toks) == 4 * budget and all(0 <= t < m.cfg.vocab_size for t in toks)
    assert events[-1].finish_reason == "length"
    assert m.tokenizer.decode(toks, skip_special=True) == "".join(e.text for e in events)
    assert m.engine.cache.seq_len == len(ids) + 4 * budget - 1 and m.kv_bytes() == b0


def test_truncate_within_window_and_reset(tiny_dir):
    kv = parse_kv("fp16", residual=16, group=16, evict="h2o", budget=64)
    m = kvrun.load(tiny_dir, dtype="fp32", ctx=1024, kv=kv)
    c = m.engine.cache
    m.transformer(torch.randint(3, 200, (1, 150)), c)
    assert c.truncate(148) == 148 and c.seq_len == 148                 # window tokens only
    m.transformer(torch.tensor([[5, 6]]), c)                            # consistent again
    assert c.truncate(10) == 0 and c.seq_len == 0                       # evicted history: reset
    m.transformer(torch.randint(3, 200, (1, 20)), c)
    assert c.seq_len == 20


# -- configuration and CLI errors ---------------------------------------------------------------

@pytest.mark.parametrize("fields,msg", [
    (dict(evict="lru", budget=512), "unknown eviction policy"),
    (dict(evict="h2o"), "needs --kv-budget"),
    (dict(budget=512), "needs an eviction policy"),
    (dict(evict="h2o", budget=100), "too small"),
    (dict(evict="streaming", budget=223, sinks=40), r"too small.*use >= 224"),
    (dict(evict="h2o", budget=191), r"too small.*use >= 192"),
    (dict(evict="kvcrush", budget=512, crush_fraction=1.5), "crush-fraction"),
    (dict(evict="h2o", budget=512, ctx_policy="shift"), "alternatives"),
    (dict(evict="h2o", budget=512, evict_slack=-1), "evict-slack"),
])
def test_bad_eviction_config(fields, msg):
    with pytest.raises(KvrunError, match=msg):
        parse_kv("tada-4", **fields)


@pytest.mark.parametrize("args,msg", [
    (["--evict", "lru", "--kv-budget", "512"], "unknown eviction policy 'lru'"),
    (["--evict", "h2o", "--kv-budget", "100"], "too small"),
    (["--evict", "snapkv"], "needs --kv-budget"),
    (["--kv-budget", "512"], "needs an eviction policy"),
])
def test_cli_eviction_errors_are_one_line(tiny_dir, args, msg):
    r = CliRunner().invoke(main, ["generate", "-m", str(tiny_dir), "-p", "hi", "-n", "2",
                                  "--kv", "tada-4"] + args)
    assert r.exit_code != 0
    out = r.output.strip()
    assert out.startswith("error: ") and msg in out and len(out.splitlines()) == 1


def test_cli_generate_with_eviction(tiny_dir):
    r = CliRunner().invoke(main, ["generate", "-m", str(tiny_dir), "-p", "hello " * 40,
                                  "-n", "200", "--temp", "0", "--kv", "fp16", "--kv-residual", "16",
                                  "--kv-group", "16", "--evict", "streaming", "--kv-budget", "64",
                                  "--sinks", "2", "-c", "1024"])
    assert r.exit_code == 0, r.output


def test_no_eviction_below_the_budget_is_the_plain_arena(tiny32_dir):
    """While the context fits the budget nothing is evicted and the logits are bit-identical
    to the arena without eviction (the mass output does not disturb the read path)."""
    ids = torch.randint(3, 200, (1, 90), generator=torch.Generator().manual_seed(3))
    out = []
    for fields in ({}, dict(evict="h2o", budget=512), dict(evict="snapkv", budget=512)):
        m = kvrun.load(tiny32_dir, dtype="fp32", ctx=512,
                       kv=parse_kv("int8", residual=32, group=32, **fields))
        logits = [m.transformer(ids[:, :70], m.engine.cache)]
        for t in range(70, 90):
            logits.append(m.transformer(ids[:, t:t + 1], m.engine.cache))
        out.append(torch.cat(logits, 1))
        if fields:
            assert sum(m.engine.cache.ev.n_drop) == 0
    assert torch.equal(out[0], out[1]) and torch.equal(out[0], out[2])


def test_cli_ppl_with_eviction(tiny32_dir, tmp_path):
    import json
    f = tmp_path / "t.txt"
    f.write_text("the quick brown fox jumps over the lazy dog. " * 30)
    r = CliRunner().invoke(main, ["ppl", str(f), "-m", str(tiny32_dir), "-c", "384", "--windows", "1",
                                  "--kv", "fp16,int8", "--evict", "streaming", "--kv-budget", "224",
                                  "--json"])
    assert r.exit_code == 0, r.output
    recs = json.loads(r.stdout[r.stdout.index("["):])
    assert [x["method"] for x in recs] == ["fp16", "fp16+streaming@224", "int8+streaming@224"]
    assert all(x["ppl"] > 1 and x["n_scored"] == 191 for x in recs)
    assert recs[1]["kld"] > 0                      # 384-token windows do not fit 224 tokens
    r = CliRunner().invoke(main, ["ppl", str(f), "-m", str(tiny32_dir), "--evict", "h2o"])
    assert r.exit_code != 0 and "needs --kv-budget" in r.output


def test_interrupted_forward_with_eviction_is_repaired(tiny_dir):
    """Ctrl-C between layers: the engine truncates back to what every layer holds; with
    eviction that is exact when only window tokens differ, and the cache keeps working."""
    kv = parse_kv("fp16", residual=16, group=16, evict="h2o", budget=64)
    m = kvrun.load(tiny_dir, dtype="fp32", ctx=1024, kv=kv)
    prompt = m.tokenize("abcdefgh" * 25)
    m.engine.prefill(prompt)
    with interrupted_forward(m), pytest.raises(KeyboardInterrupt):   # in the second layer
        m.engine.decode_step(5)
    assert len(m.engine.cached) == m.cache.seq_len == len(prompt)      # layer 0's token dropped
    assert all(nt + w + d == len(prompt)
               for nt, w, d in zip(m.cache.n_tail, m.cache.n_win, m.cache.ev.n_drop))
    got = m.engine.decode_step(5)
    ref = kvrun.load(tiny_dir, dtype="fp32", ctx=1024, kv=kv)
    ref.engine.prefill(prompt)
    assert_close(got, ref.engine.decode_step(5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mu", ["fp16", "int8"])
def test_tada_sinks_survive_many_compactions_bit_exact(tiny32_dir, mu):
    """TaDA re-packs kept tokens with their stored means, so tokens every head keeps (the
    streaming sinks) come back bit-identical however often their block is re-packed
    (recomputing the mean from the reconstruction drifted ~0.07 per re-pack: tada-4 +
    streaming@512 at -c 2048 went from ppl 116 to 26 when this was fixed)."""
    kv = parse_kv("tada-4", residual=32, group=32, evict="streaming", budget=32 + 32 + 64,
                  sinks=4, tada_mu=mu)
    m = kvrun.load(tiny32_dir, dtype="fp32", ctx=4096, kv=kv)
    cache = m.engine.cache
    ids = torch.randint(3, m.cfg.vocab_size, (160,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        m.transformer(ids[None], cache)
        first = [cache.k_codecs[l].dequant(cache.k_store[l], 0, 32)[:, :4].clone() for l in range(cache.L)]
        c0 = cache.ev.n_compactions
        for t in range(200):
            m.transformer(torch.tensor([[5 + t % 50]]), cache)
        assert cache.ev.n_compactions > c0 + 3
        for l in range(cache.L):
            assert torch.equal(cache.ev.pos_tail[l][:, :4], torch.arange(4).expand(cache.Hkv, 4))
            assert torch.equal(cache.k_codecs[l].dequant(cache.k_store[l], 0, 32)[:, :4], first[l])
