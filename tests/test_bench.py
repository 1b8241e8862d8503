"""`kvrun bench`: a tiny run completes with every column; accounting equals the arena's."""
import json

import pytest
from click.testing import CliRunner

import kvrun
from kvrun.runtime import bench as B
from kvrun.runtime.api import make_cache
from kvrun.runtime.cli import main
from tiny import make_tiny_model_dir

JSON_KEYS = {"method", "test", "n", "depth", "tok_s", "tok_s_sd", "ms_per_token",
             "ms_per_token_median", "kv_bytes", "kv_bytes_by_component", "kv_ratio",
             "peak_rss_bytes", "reps", "fill", "checkpoints_ms", "cuda_max_allocated"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # head dim 32 so that KIVI's default 32-channel V groups fit
    return make_tiny_model_dir(tmp_path_factory.mktemp("m") / "tiny", hidden_size=128, num_heads=4,
                               num_kv_heads=2)


def run(args):
    return CliRunner().invoke(main, args)


def test_tiny_bench_json_has_every_column(tiny_dir):
    r = run(["bench", "-m", str(tiny_dir), "--kv", "fp16,kivi-4", "-p", "32", "-n", "4",
             "-d", "400", "-r", "2", "--json", "--dtype", "fp32"])
    assert r.exit_code == 0, r.stderr
    recs = json.loads(r.stdout)
    assert [(x["method"], x["test"], x["depth"]) for x in recs] == [
        ("fp16", "pp", 0), ("kivi-4", "pp", 0), ("fp16", "tg", 400), ("kivi-4", "tg", 400)]
    for x in recs:
        assert set(x) == JSON_KEYS
        assert x["tok_s"] > 0 and x["ms_per_token"] > 0 and x["reps"] == 2
        assert x["kv_bytes"] == sum(x["kv_bytes_by_component"].values()) > 0
    fp16, kivi = recs[2], recs[3]
    assert fp16["kv_ratio"] == pytest.approx(1.0) and kivi["kv_ratio"] < 1.0


def test_bench_bytes_equal_arena_accounting(tiny_dir):
    m = kvrun.load(tiny_dir, dtype="fp32", ctx=8)
    recs = B.bench_model(m, ["tada-4"], [], 3, [40], 1)
    cache = make_cache(m.cfg, 43, "tada-4")
    assert recs[0].kv_bytes_by_component == cache.nbytes()
    assert recs[0].kv_bytes == sum(cache.nbytes().values())


def test_synthetic_fill_is_labelled_and_same_depth(tiny_dir):
    r = run(["bench", "-m", str(tiny_dir), "--kv", "fp16", "-p", "0", "-n", "2", "--ctx", "48",
             "-r", "1", "--fill", "synthetic", "--dtype", "fp32"])
    assert r.exit_code == 0, r.stderr
    assert "SYNTHETIC" in r.stdout and "tg2 @ d48" in r.stdout


def test_csv_output(tiny_dir):
    r = run(["bench", "-m", str(tiny_dir), "--kv", "int8", "-p", "16", "-n", "2", "-r", "1",
             "--csv", "--dtype", "fp32"])
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].split(",") == B.CSV_FIELDS and len(lines) == 3


def test_layer_mode_checkpoints():
    recs = B.bench_layer("4,2,32", ["fp16", "kivi-2"], 400, checkpoints=(64, 256))
    assert [r.method for r in recs] == ["fp16", "kivi-2"]
    assert all(set(r.checkpoints_ms) == {"64", "256"} and r.test == "layer" for r in recs)
    assert recs[1].kv_bytes < recs[0].kv_bytes


@pytest.mark.parametrize("args,fragment", [
    (["--kv", "fp16,nope"], "unknown KV method"),
    (["-d", "1,,x"], "bad token count"),
    (["-d", ""], "empty list"),
    (["-r", "0"], "-r must be >= 1"),
    (["--layer", "7,2,64"], "multiple of HKV"),
    (["--layer", "gpt-9"], "a name"),
    (["-d", "2000k"], "beyond what this benchmark allocates"),
])
def test_bench_bad_arguments(tiny_dir, args, fragment):
    r = run(["bench", "-m", str(tiny_dir), "-p", "0", "-n", "1"] + args)
    assert r.exit_code != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: ") and fragment in r.stderr


def test_layer_mode_takes_the_models_write_attend_step(monkeypatch):
    """On the torch backend the arena offers write-then-attend; the layer bench measures
    that step (what the model runs), not attend."""
    from kvrun.runtime.kv.arena import KVArena
    monkeypatch.setenv("KVRUN_BACKEND", "torch")
    calls = {"write_attend": 0, "attend": 0}
    for name in calls:
        real = getattr(KVArena, name)

        def counted(self, *a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(self, *a, **k)
        monkeypatch.setattr(KVArena, name, counted)
    B.bench_layer("4,2,32", ["kivi-2"], 80, checkpoints=(64,))
    assert calls == {"write_attend": 80, "attend": 0}
