"""`kvrun bench --batch` (runtime/eval/bench_batch.py) on the tiny model: the records, the budget
arithmetic, the table, and the CLI's one-line errors. No timings are asserted."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import kvrun
from kvrun.eval.bench_batch import MiB, bench_batch, format_batch_table, max_batch
from kvrun.cli.main import main
from kvrun.errors import KvrunError
from kvrun.kv.build import kv_bytes_at


@pytest.fixture(scope="module")
def model(tiny_dir):
    return kvrun.load(tiny_dir, dtype="fp32", ctx=8, kv="fp32")


def test_records_and_budget(model):
    per = sum(kv_bytes_at(model.cfg, "fp16", 40).values())
    budget_mb = 3.5 * per / MiB                             # three sequences fit, not four
    assert max_batch(model.cfg, "fp16", 40, int(budget_mb * MiB)) == (3, per)
    recs = bench_batch(model, ["fp16", "int8"], [1, 2], tg=8, depth=32, reps=2, budget_mb=budget_mb)
    plain = [r for r in recs if r.budget_bytes is None]
    assert [(r.method, r.batch) for r in plain] == [("fp16", 1), ("fp16", 2), ("int8", 1), ("int8", 2)]
    for r in plain:
        assert r.tok_s > 0 and r.kv_bytes == r.batch * r.kv_bytes_per_seq and r.reps == 2
        assert r.n == 8 and r.depth == 32
    fit = {r.method: r for r in recs if r.budget_bytes is not None}
    assert fit["fp16"].batch == 3 and fit["fp16"].kv_bytes_per_seq == per
    assert fit["int8"].batch >= fit["fp16"].batch            # the smaller cache fits more
    table = format_batch_table(recs, "title")
    assert "largest batch within the KV budget" in table and table.count("| fp16") == 3


def test_errors(model):
    with pytest.raises(KvrunError, match="-n must be >= 1"):
        bench_batch(model, ["fp16"], [1], tg=0, depth=0, reps=1)
    with pytest.raises(KvrunError, match="not one fp16 sequence"):
        bench_batch(model, ["fp16"], [1], tg=4, depth=8, reps=1, budget_mb=1e-6)


@pytest.mark.parametrize("args, msg", [
    (["--kv-budget-mb", "5"], "--kv-budget-mb goes with --batch"),
    (["--batch", "1,x"], "bad token count"),
    (["--batch", "1", "-d", "1,2"], "at one depth"),
    (["--batch", "1", "--layer", "smollm2-135m"], "model mode"),
])
def test_cli_errors(args, msg):
    r = CliRunner().invoke(main, ["bench", *args])
    assert r.exit_code == 1 and msg in r.output and "Traceback" not in r.output


def test_cli_json(tiny_dir):
    r = CliRunner().invoke(main, ["bench", "-m", str(tiny_dir), "--dtype", "fp32", "--kv", "fp16",
                                  "--batch", "1,2", "-n", "3", "-d", "16", "-r", "1", "--json"])
    assert r.exit_code == 0, r.output
    recs = json.loads(r.stdout)
    assert [x["batch"] for x in recs] == [1, 2] and all(x["tok_s"] > 0 for x in recs)
