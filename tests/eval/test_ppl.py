"""`kvrun ppl` on a tiny model: baseline first, KLD/top-1 computed against it, bad input refused."""
import json

import pytest
from click.testing import CliRunner

from kvrun.cli.main import main
from tiny import make_tiny_model_dir

TEXT = "The quick brown fox jumps over the lazy dog. " * 40


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("m") / "tiny", hidden_size=128)   # D 32


def test_ppl_json_records(tiny_dir, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    r = CliRunner().invoke(main, ["ppl", str(f), "-m", str(tiny_dir), "-c", "512", "--windows", "2",
                                  "--kv", "kivi-2,fp16", "--json", "--dtype", "fp32"])
    assert r.exit_code == 0, r.stderr
    base, kivi = json.loads(r.stdout)
    assert base["method"] == "fp16" and base["kld"] == 0 and base["top1"] == 1
    assert 1 <= base["ratio"] <= 1 + 32 / 512             # fp16's arena: one block of slack at most
    assert base["n_scored"] == kivi["n_scored"] == 2 * 255
    assert kivi["kld"] > 0 and kivi["ratio_32k"] < 0.3
    assert kivi["dppl"] == pytest.approx(100 * (kivi["ppl"] / base["ppl"] - 1))


@pytest.mark.parametrize("args,fragment", [
    (["-c", "7"], "even number >= 8"),
    (["-c", "4096"], "need at least -c 4096"),
    (["--kv", "kivi-9"], "unknown KV method"),
    (["--windows", "0"], "--windows must be >= 1"),
])
def test_ppl_bad_input(tiny_dir, tmp_path, args, fragment):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    r = CliRunner().invoke(main, ["ppl", str(f), "-m", str(tiny_dir), "--dtype", "fp32"] + args)
    assert r.exit_code == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: ") and fragment in r.stderr


def test_ppl_missing_and_binary_file(tiny_dir, tmp_path):
    r = CliRunner().invoke(main, ["ppl", str(tmp_path / "nope.txt"), "-m", str(tiny_dir)])
    assert r.exit_code == 1 and "no such file" in r.stderr
    b = tmp_path / "b.bin"
    b.write_bytes(b"\xff\xfe\x00\x80" * 10)
    r = CliRunner().invoke(main, ["ppl", str(b), "-m", str(tiny_dir)])
    assert r.exit_code == 1 and "not UTF-8" in r.stderr


def test_progress_lines_carry_elapsed_and_eta(tiny_dir):
    import kvrun
    from kvrun.eval.ppl import perplexity
    m = kvrun.load(tiny_dir, dtype="fp32", ctx=8)
    lines = []
    perplexity(m, TEXT, 512, ["kivi-2"], n_windows=2, progress=lines.append)
    windows = [x for x in lines if x.startswith("[ppl] window")]
    assert [x.split(":")[0] for x in windows] == ["[ppl] window 1/2", "[ppl] window 2/2"]
    assert all(" elapsed, ETA " in x for x in windows)
    assert windows[-1].endswith("ETA 0 s")                      # nothing left after the last
    # the first window also reports each eighth of its scored half (one long window of
    # many caches printed nothing for minutes)
    eighths = [x for x in lines if x.startswith("[ppl] scoring window 1/2: ")]
    assert [x.split()[4] for x in eighths] == ["12%", "25%", "38%", "50%", "62%", "75%", "88%", "100%"]
    assert all(" elapsed, ETA " in x for x in eighths)


def test_ctrl_c_returns_the_windows_done(tiny_dir):
    """Ctrl-C after window 2 of 3 (the progress callback raises, as a signal would between
    windows): PartialResults carries records over exactly those 2 windows, equal to a run
    asked for 2 windows."""
    import kvrun
    from kvrun.errors import PartialResults
    from kvrun.eval.ppl import perplexity
    m = kvrun.load(tiny_dir, dtype="fp32", ctx=8)

    def progress(line):
        if line.startswith("[ppl] window 2/"):
            raise KeyboardInterrupt
    with pytest.raises(PartialResults) as e:
        perplexity(m, TEXT * 2, 512, ["kivi-2"], n_windows=3, progress=progress)
    assert (e.value.done, e.value.total) == (2, 3)
    two = perplexity(m, TEXT * 2, 512, ["kivi-2"], n_windows=2)
    got = e.value.records
    assert [r.method for r in got] == ["fp16", "kivi-2"]
    for a, b in zip(got, two):
        assert a.n_scored == b.n_scored == 2 * 255
        assert (a.ppl, a.kld, a.top1) == pytest.approx((b.ppl, b.kld, b.top1), rel=1e-6)


def test_ctrl_c_mid_window_keeps_only_whole_windows(tiny_dir, monkeypatch):
    """An interrupt inside window 2, after the baseline scored a chunk of it but before
    kivi-2 did, must not leave the baseline with more tokens than kivi-2."""
    import kvrun
    from kvrun.eval import ppl as P
    m = kvrun.load(tiny_dir, dtype="fp32", ctx=8)
    real, calls = P.chunk_logprobs, {"n": 0}
    per_window = 2 * len(range(256, 511, 32))           # 2 methods, the scored half in chunks

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == per_window + 4:    # window 2, its second chunk's second method
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(P, "chunk_logprobs", flaky)
    with pytest.raises(P.PartialResults) as e:
        P.perplexity(m, TEXT * 2, 512, ["kivi-2"], n_windows=3)
    assert e.value.done == 1 and [r.n_scored for r in e.value.records] == [255, 255]


@pytest.mark.parametrize("as_json", [False, True])
def test_cli_ctrl_c_prints_partial_table_and_exits_130(tiny_dir, tmp_path, monkeypatch, as_json):
    from kvrun.eval import ppl as P
    f = tmp_path / "t.txt"
    f.write_text(TEXT * 2)
    real, calls = P._score_methods, {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(P, "_score_methods", flaky)
    r = CliRunner().invoke(main, ["ppl", str(f), "-m", str(tiny_dir), "-c", "512", "--windows", "3",
                                  "--kv", "kivi-2", "--dtype", "fp32"] + (["--json"] if as_json else []))
    assert r.exit_code == 130 and "Traceback" not in r.stderr
    assert "interrupted: results over the first 2 of 3 windows" in r.stderr
    if as_json:
        assert [x["n_scored"] for x in json.loads(r.stdout)] == [510, 510]
    else:
        rows = r.stdout.strip().splitlines()
        assert rows[0].split()[:2] == ["method", "ppl"] and [x.split()[0] for x in rows[2:]] == [
            "fp16", "kivi-2"]


def test_cli_ctrl_c_in_the_first_window_is_a_plain_interrupt(tiny_dir, tmp_path, monkeypatch):
    from kvrun.eval import ppl as P
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    monkeypatch.setattr(P, "_score_methods", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    r = CliRunner().invoke(main, ["ppl", str(f), "-m", str(tiny_dir), "-c", "512", "--dtype", "fp32"])
    assert r.exit_code == 130 and r.stdout == "" and "interrupted" in r.stderr


def test_ppl_warns_beyond_trained_context(tiny_dir, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT * 2)
    r = CliRunner().invoke(main, ["ppl", str(f), "-m", str(tiny_dir), "-c", "1024", "--windows", "1",
                                  "--dtype", "fp32"])
    assert r.exit_code == 0, r.stderr
    assert [x for x in r.stderr.splitlines() if x.startswith("warning:")] == [
        "warning: -c 1024 exceeds the model's trained context (512 tokens): "
        "text past 512 tokens may degrade"]


def test_table_columns_stay_aligned_with_long_labels():
    from kvrun.eval.ppl import PplRecord, format_table
    recs = [PplRecord(m, 17.5, 0.1, 0.01, 0.95, 8000, 0.35, 0.3, 100, 1.0)
            for m in ("fp16", "profile:smollm2-135m-0.25", "kivi-4/kivi-2@64+rot")]
    rows = format_table(recs).splitlines()
    ends = {len(x) for x in rows}
    assert len(ends) == 1                                   # every row as wide as the header
    assert {x.index("17.5000") + 7 for x in rows[2:]} == {rows[0].index("ppl") + 3}   # right-aligned


def test_ppl_reads_a_profile_once(tiny_dir, tmp_path):
    """A profile file rewritten while `kvrun ppl` runs changes neither the caches nor the
    ratio columns: the spec is parsed once, before the first window."""
    import kvrun
    from kvrun.eval.ppl import perplexity
    from kvrun.kv.profile import save_profile
    m = kvrun.load(tiny_dir, ctx=512, dtype="fp32")
    n = m.cfg.num_layers
    p = tmp_path / "prof.json"
    save_profile(p, [("kivi-2", "kivi-2")] * n, model="tiny")

    def rewrite(line):                      # the first window's progress line
        save_profile(p, [("fp16", "fp16")] * n, model="tiny")
    before = perplexity(m, TEXT, 512, [f"profile:{p}"], n_windows=2)[1]
    save_profile(p, [("kivi-2", "kivi-2")] * n, model="tiny")
    during = perplexity(m, TEXT, 512, [f"profile:{p}"], n_windows=2, progress=rewrite)[1]
    assert before.ratio_32k < 0.3
    assert (during.ratio, during.ratio_32k, during.kld) == (before.ratio, before.ratio_32k, before.kld)
