"""The KV accounting people read (runtime/kv/report.py): byte units, the one summary behind
`/kv` and the stats line, and `/kv` on an arena that shifts and one that evicts."""
import pytest
import torch

import kvrun
from kvrun.kv.config import parse_kv
from kvrun.kv.report import KVSummary, fmt_bytes, fp16_bytes_per_token
from test_arena_shift import CTX, GREEDY, _kv, tiny32  # noqa: F401  (tiny32: a fixture)
from tiny import tiny_config


@pytest.mark.parametrize("n,want", [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"),
                                    (3 * 2**20 // 2, "1.50 MiB"), (5 * 2**30, "5.00 GiB")])
def test_fmt_bytes_picks_the_largest_unit_that_fits(n, want):
    assert fmt_bytes(n) == want


def test_fp16_bytes_per_token_counts_k_and_v_of_every_layer():
    cfg = tiny_config(num_layers=3, num_kv_heads=2, hidden_size=64)     # D = 16
    assert fp16_bytes_per_token(cfg) == 2 * 3 * 2 * 16 * 2


def test_summary_totals_its_parts_and_says_the_ratio():
    s = KVSummary("kivi-4", tokens=10, max_ctx=100, parts={"codes": 3 * 2**10, "window": 2**10},
                  fp16_bytes=16 * 2**10)
    assert s.total == 4 * 2**10 and s.ratio == 0.25
    assert s.short() == "KV kivi-4 4.00 KiB (0.250x fp16)"


def test_kv_report_says_what_shifts_did(tiny32, tmp_path):
    """/kv names the policy and counts the shifts and dropped tokens (a shift happened
    silently before)."""
    from kvrun.kv.report import format_kv
    m = kvrun.load(tiny32, dtype="fp32", ctx=CTX, kv=_kv("fp16", tmp_path))
    assert "0 shifts so far" in format_kv(m)
    list(m.engine.stream(list(range(1, 20)), 200, GREEDY, set()))     # no stop token
    e = m.engine
    assert e.n_shifts >= 1
    assert (f"{e.n_shifts} shift{'s' if e.n_shifts != 1 else ''} so far, "
            f"{e.n_dropped} tokens dropped") in format_kv(m)


def test_kv_report_shows_eviction(tiny_dir):
    from kvrun.kv.report import format_kv
    m = kvrun.load(tiny_dir, dtype="fp32", ctx=1024,
                   kv=parse_kv("fp16", residual=16, group=16, evict="h2o", budget=64))
    m.transformer(torch.randint(3, 200, (1, 200)), m.engine.cache)
    rep = format_kv(m)
    c = m.engine.cache
    assert "eviction: h2o, budget 64 tokens/layer" in rep
    # tail 64 - 16 - 16 = 32 tokens + a window of 24 (200 - 176 flushed in blocks of 16)
    assert "holding 56-56 per layer" in rep and sum(c.ev.n_drop) == 2 * (200 - 56)
    assert f"{sum(c.ev.n_drop)} evicted in all" in rep
    assert parse_kv("fp16", evict="h2o", budget=512).label() == "fp16+h2o@512"
