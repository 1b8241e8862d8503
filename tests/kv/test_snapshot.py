"""A cache's state as bytes and back (runtime/kv/snapshot.py): what a snapshot holds grows
with the tokens, a restore gives back the same rows bit for bit, and a snapshot that does
not fit the cache is refused with the cache unchanged."""
import pytest
import torch

from kvrun.errors import KvrunError
from kvrun.kv.build import build_cache
from kvrun.kv.config import parse_kv
from kvrun.kv.snapshot import OtherSize, Snapshot, nest, part
from tiny import tiny_config

CFG = tiny_config()                                     # 2 layers, Hkv 2, D 16


def _filled(spec, n, ctx=256, arch="llama"):
    cfg = tiny_config(arch)
    c = build_cache(cfg, ctx, parse_kv(spec, residual=32, group=32, v_group=16))
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(cfg.num_layers, cfg.num_kv_heads, n, cfg.head_dim, generator=g).half()
            for _ in range(2))
    c.ingest(k, v)
    return c, cfg


@pytest.mark.parametrize("spec", ["fp16", "kivi-4", "int8"])
def test_restore_gives_back_the_rows_bit_for_bit(spec):
    c, cfg = _filled(spec, 150)
    snap = c.snapshot()
    assert snap.meta["kind"] == "arena" and snap.meta["seq_len"] == 150
    other, _ = _filled(spec, 0, ctx=200)                 # another -c that holds the tokens
    other.restore(snap)
    assert other.seq_len == 150 and other.n_tail == c.n_tail and other.n_win == c.n_win
    for layer in range(cfg.num_layers):
        for x, y in zip(other.rows(layer), c.rows(layer)):
            assert torch.equal(x, y)


def test_a_snapshot_grows_with_the_tokens_not_the_context():
    small, _ = _filled("kivi-4", 40, ctx=1024)
    big, _ = _filled("kivi-4", 400, ctx=1024)
    assert 0 < small.snapshot().nbytes() < big.snapshot().nbytes()
    assert small.snapshot().tensors["0.win_k"].shape == (2, 40, 16)       # (Hkv, w, D)


def test_a_snapshot_that_does_not_fit_leaves_the_cache_unchanged():
    c, cfg = _filled("fp16", 150)
    short, _ = _filled("fp16", 10, ctx=100)
    before = [t.clone() for t in short.rows(0)]
    with pytest.raises(KvrunError, match="holds 150 tokens; this context holds 100"):
        short.restore(c.snapshot())
    assert short.seq_len == 10 and all(torch.equal(x, y) for x, y in zip(short.rows(0), before))
    snap = c.snapshot()
    snap.tensors["1.win_v"] = snap.tensors["1.win_v"][:, :-1]
    fits, _ = _filled("fp16", 0, ctx=200)
    with pytest.raises(KvrunError, match="the saved cache's 1.win_v is"):
        fits.restore(snap)
    del snap.tensors["1.win_v"]
    with pytest.raises(KvrunError, match="lacks 1.win_v"):
        fits.restore(snap)
    assert fits.seq_len == 0
    with pytest.raises(KvrunError, match="a 'ring' cache, this one an arena"):
        short.restore(Snapshot({"kind": "ring"}))


def test_a_window_a_flush_would_have_emptied_is_refused():
    """A window holds fewer than R + G tokens after every arena operation, which the one-call
    step relies on (it writes the step's token into slot n_win): a snapshot claiming a full
    window (a forged or damaged session file) is refused, the cache unchanged."""
    c, _ = _filled("fp16", 64)                              # R 32 + G 32
    assert c.n_tail == c.n_win == [32, 32]                   # the flush at 64 tokens
    snap = c.snapshot()
    full = Snapshot({**snap.meta, "n_tail": [0, 0], "n_win": [64, 64]},
                    {**snap.tensors, **{f"{l}.{w}": torch.zeros(2, 64, 16, dtype=torch.float16)
                                        for l in range(2) for w in ("win_k", "win_v")}})
    fresh, _ = _filled("fp16", 5)
    with pytest.raises(KvrunError, match=r"layer 0 \(0 compressed \+ 64 window tokens of 64\)"):
        fresh.restore(full)
    assert fresh.seq_len == 5 and fresh.n_win == [5, 5]
    fresh.restore(snap)                                     # the arena's own: R..R+G-1 tokens
    assert fresh.n_win == c.n_win and fresh.n_tail == c.n_tail


def test_an_evicting_arena_cannot_be_saved():
    c = build_cache(CFG, 256, parse_kv("kivi-4", residual=32, group=32, v_group=16, evict="h2o", budget=128))
    with pytest.raises(KvrunError, match="token eviction"):
        c.snapshot()


def test_gemma_rings_nest_beside_the_arena():
    c, cfg = _filled("fp16", 40, ctx=128, arch="gemma3")
    snap = c.snapshot()
    assert snap.meta["kind"] == "layered" and part(snap, "ring").meta["W"] == 16
    again, _ = _filled("fp16", 0, ctx=128, arch="gemma3")
    again.restore(snap)
    for layer in range(cfg.num_layers):
        for x, y in zip(again.rows(layer), c.rows(layer)):
            assert torch.equal(x, y)
    narrow, _ = _filled("fp16", 0, ctx=8, arch="gemma3")     # -c 8 < the window: 8-slot rings
    with pytest.raises(OtherSize, match="hold 16 slots of 16 bits; this cache's hold 8"):
        narrow.restore(snap)


def test_nest_and_part_round_trip():
    a = Snapshot({"kind": "x", "seq_len": 1}, {"t": torch.ones(2)})
    both = nest({"kind": "pair"}, {"a": a, "b": Snapshot({"kind": "y"})})
    assert set(both.tensors) == {"a/t"} and both.meta["a"] == a.meta
    back = part(both, "a")
    assert back.meta == a.meta and torch.equal(back.tensors["t"], a.tensors["t"])
    with pytest.raises(KvrunError, match="no c part"):
        part(both, "c")
