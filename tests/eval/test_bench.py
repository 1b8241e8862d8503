"""`kvrun bench`: a tiny run completes with every column; accounting equals the arena's."""
import json

import pytest
import torch
from click.testing import CliRunner

import kvrun
from kvrun.eval import bench as B
from kvrun.kv.build import make_cache
from kvrun.cli.main import main
from tiny import make_tiny_model_dir

JSON_KEYS = {"method", "test", "n", "depth", "tok_s", "tok_s_sd", "ms_per_token",
             "ms_per_token_median", "kv_bytes", "kv_bytes_by_component", "kv_ratio",
             "peak_rss_bytes", "reps", "fill", "checkpoints_ms", "cuda_max_allocated",
             "ms_per_token_sd", "model", "threads", "backend", "cpu"}


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
        # where it ran, as llama-bench records it
        # threads: the cap; the thread governor may have run fewer on a busy machine
        assert x["model"] == tiny_dir.name and x["threads"] >= torch.get_num_threads() >= 1
        assert x["backend"] in ("native", "torch", "triton") and x["cpu"] == B.cpu_name() != ""
        assert x["ms_per_token_sd"] >= 0
    fp16, kivi = recs[2], recs[3]
    # fp16's arena holds at most one block (G = 32 tokens) more than the context
    assert 1.0 <= fp16["kv_ratio"] <= 1.0 + 32 / 400 and kivi["kv_ratio"] < 1.0


def test_bench_bytes_equal_arena_accounting(tiny_dir):
    m = kvrun.load(tiny_dir, dtype="fp32", ctx=8)
    recs = B.bench_model(m, ["tada-4"], [], 3, [40], 1)
    cache = make_cache(m.cfg, 43, "tada-4")
    assert recs[0].kv_bytes_by_component == cache.nbytes()
    assert recs[0].kv_bytes == sum(cache.nbytes().values())


def test_kv_ratio_divides_by_the_models_own_fp16_cache(tmp_path):
    """A model with sliding-window layers: "x fp16" is against its fp16 cache, rings and
    all (the fp16 row reads 1.0, not the share of a cache without windows)."""
    from kvrun.kv import kv_bytes_at
    m = kvrun.load(make_tiny_model_dir(tmp_path / "g", architecture="gemma3"), dtype="fp32", ctx=8)
    fp16, kivi = B.bench_model(m, ["fp16", "kivi-4"], [], 2, [40], 1)
    assert fp16.kv_ratio == pytest.approx(1.0)
    want = sum(kv_bytes_at(m.cfg, "kivi-4", 42).values()) / sum(kv_bytes_at(m.cfg, "fp16", 42).values())
    assert kivi.kv_ratio == pytest.approx(want)


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
    # the checkpoints are columns: every row of the table has as many cells as its header
    lines = B.format_table(recs).splitlines()
    assert "ms @64" in lines[0] and "ms @256" in lines[0]
    assert len({line.count("|") for line in lines}) == 1
    assert f"{recs[1].checkpoints_ms['256']:.3f}" in lines[3]


@pytest.mark.parametrize("args,fragment", [
    (["--kv", "fp16,nope"], "unknown KV method"),
    (["-d", "1,x"], "bad token count"),
    (["-d", "1,,4"], "-d: empty item"),         # not skipped: often an unset variable
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


def test_layer_mode_takes_the_models_step(monkeypatch):
    """The layer bench measures the step the model runs, `attend_new` (the fused window write
    where the layer's route has one: Triton), not `attend` called directly; on the torch
    backend, the oracle, that step is `attend` over the rows."""
    from kvrun.kv.arena import KVArena
    monkeypatch.setenv("KVRUN_BACKEND", "torch")
    calls = {"attend_new": 0, "_write_attend": 0, "attend": 0}
    for name in calls:
        real = getattr(KVArena, name)

        def counted(self, *a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(self, *a, **k)
        monkeypatch.setattr(KVArena, name, counted)
    B.bench_layer("4,2,32", ["kivi-2"], 80, checkpoints=(64,))
    assert calls == {"attend_new": 80, "_write_attend": 0, "attend": 80}


def test_cpu_name_reads_proc_cpuinfo_model_name(monkeypatch, tmp_path):
    import builtins
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\n"
                    "model name\t: AMD EPYC 9R14 96-Core Processor\nflags\t: avx512f\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: real_open(
        info if f == "/proc/cpuinfo" else f, *a, **k))
    assert B.cpu_name() == "AMD EPYC 9R14 96-Core Processor"
    info.write_text("processor\t: 0\n")               # no model name: platform's answer
    monkeypatch.setattr(B.platform, "processor", lambda: "arm")
    assert B.cpu_name() == "arm"


def test_n0_skips_tg_like_llama_bench(tiny_dir):
    r = run(["bench", "-m", str(tiny_dir), "--kv", "fp16,int8", "-p", "16", "-n", "0", "-r", "1",
             "--json", "--dtype", "fp32"])
    assert r.exit_code == 0, r.stderr
    assert [(x["method"], x["test"]) for x in json.loads(r.stdout)] == [("fp16", "pp"), ("int8", "pp")]
    r = run(["bench", "-m", str(tiny_dir), "-p", "0", "-n", "0"])
    assert r.exit_code == 1 and r.stderr.strip().splitlines()[-1] == (
        "error: nothing to measure: -p and -n are both 0")


def test_auto_and_named_profiles_are_labelled_by_name(tiny_dir, tmp_path):
    """`--kv auto` is `auto` in the table and JSON, a profile its name, not `profile`."""
    from kvrun.kv import parse_kv, save_profile
    p = tmp_path / "mine.json"
    save_profile(p, [("kivi-4", "kivi-2"), ("int8", "int8")])
    r = run(["bench", "-m", str(tiny_dir), "--kv", f"fp16,profile:{p}", "-p", "16", "-n", "0",
             "-r", "1", "--json", "--dtype", "fp32"])
    assert r.exit_code == 0, r.stderr
    assert [x["method"] for x in json.loads(r.stdout)] == ["fp16", "profile:mine"]
    assert parse_kv("auto").label() == "auto"
    assert parse_kv("profile:smollm2-135m-0.25").label() == "profile:smollm2-135m-0.25"
    assert parse_kv("auto", evict="h2o", budget=1024).label() == "auto+h2o@1024"
    # settings given over a profile show, so two tables' rows are told apart
    assert parse_kv("auto+rot-k").label() == "auto+rot-k"
    assert parse_kv("profile:smollm2-135m-0.25+rot+ring8").label() == "profile:smollm2-135m-0.25+rot+ring8"
    assert parse_kv("kivi-4/cb-3+rot-k+ring8").label() == "kivi-4/cb-3+rot-k+ring8"


def test_depth_beyond_trained_context_is_a_warning(tiny_dir):
    # the tiny model is trained for 512 positions
    r = run(["bench", "-m", str(tiny_dir), "--kv", "fp16", "-p", "0", "-n", "2", "-d", "600",
             "-r", "1", "--dtype", "fp32", "--fill", "synthetic"])
    assert r.exit_code == 0, r.stderr
    warn = [x for x in r.stderr.splitlines() if x.startswith("warning:")]
    assert warn == ["warning: a bench context of 602 exceeds the model's trained context "
                    "(512 tokens): latency and memory figures are still valid"]


def _records(depths, methods=("fp16", "kivi-4"), sd=1.5):
    return [B.BenchRecord(m, "tg", 8, d, 100.0, 1.0, 10.0 + i + d / 1000, 10.0, 1, {}, 1.0, 1, 3,
                          ms_per_token_sd=sd, model="tiny-q4", threads=2, backend="native",
                          cpu="AMD EPYC 9R14")
            for d in depths for i, m in enumerate(methods)]


@pytest.mark.parametrize("depths,kind", [([512], "bars"), ([512, 4096], "lines")])
def test_plot_title_error_bars_y_from_zero(tmp_path, monkeypatch, depths, kind):
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.container import BarContainer, ErrorbarContainer
    seen = {}
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, path, **k: seen.update(fig=fig))
    B.plot(_records(depths), str(tmp_path / "p.png"))
    ax = seen["fig"].axes[0]
    title = ax.get_title()
    assert "tiny-q4" in title and "AMD EPYC 9R14" in title and "2 threads" in title
    assert ax.get_ylim()[0] == 0
    containers = ax.containers
    if kind == "bars":
        bars = [c for c in containers if isinstance(c, BarContainer)]
        assert len(bars) == 1 and len(bars[0]) == 2
        assert [t.get_text() for t in ax.get_xticklabels()] == ["fp16", "kivi-4"]
        assert [b.get_height() for b in bars[0]] == pytest.approx([10.512, 11.512])
        assert bars[0].errorbar is not None                 # ± sd over repetitions
    else:
        errs = [c for c in containers if isinstance(c, ErrorbarContainer)]
        assert len(errs) == 2 and [t.get_text() for t in ax.get_legend().get_texts()] == ["fp16", "kivi-4"]


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "p.png"
    B.plot(_records([512]), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", ["bench.txt", "bench", "bench.png.bak"])
def test_plot_path_without_an_image_extension_fails_before_the_run(tmp_path, monkeypatch, name):
    """It failed with "internal error" after the whole run (savefig refuses the format)."""
    pytest.importorskip("matplotlib")
    from click.testing import CliRunner
    from kvrun.cli.main import main

    def no_run(*a, **k):
        raise AssertionError("the run started")
    monkeypatch.setattr("kvrun.engine.api.load", no_run)
    r = CliRunner().invoke(main, ["bench", "--kv", "fp16", "-p", "0", "-n", "1",
                                  "-o", str(tmp_path / name)])
    assert r.exit_code == 1 and "extension" in r.stderr and "internal" not in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []
