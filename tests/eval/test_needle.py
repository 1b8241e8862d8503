"""The needle-in-a-haystack builder (runtime/eval/needle.py) and `kvrun needle`."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parents[1]))
from kvrun.cli.main import main  # noqa: E402
from kvrun.errors import KvrunError  # noqa: E402
from kvrun.eval.needle import (Needle, NeedleRecord, build_prompt, format_table,  # noqa: E402
                               make_needle)
from tiny import make_tiny_model_dir  # noqa: E402
from tool_module import load_tool  # noqa: E402


def _chars(s):
    return [ord(c) for c in s]


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_needle_is_planted_at_its_depth(depth):
    filler = _chars("abcdefghij" * 100)
    nd = Needle("Oslo", "1234567")
    ids, at = build_prompt(_chars, filler, 400, depth, nd, offset=7)
    fact, cue = _chars(nd.fact), _chars(nd.cue)
    n_fill = 400 - len(fact) - len(cue)
    assert len(ids) == 400 and at == round(depth * n_fill)
    assert ids[at:at + len(fact)] == fact and ids[-len(cue):] == cue
    assert ids[:at] == filler[7:7 + at]                                 # filler from the offset
    assert ids[at + len(fact):-len(cue)] == filler[7 + at:7 + n_fill]


def test_needle_answers_and_errors():
    nd = make_needle(random.Random(0))
    assert len(nd.number) == 7 and nd.city in nd.cue and nd.number in nd.fact
    assert nd.found(f" {nd.number}.") and nd.found(f" {nd.number[:3]},{nd.number[3:]}")
    assert not nd.found(" 12") and not nd.found(nd.number[:-1])
    with pytest.raises(KvrunError, match="too small"):
        build_prompt(_chars, _chars("x" * 500), 50, 0.5, nd)
    with pytest.raises(KvrunError, match="filler text has"):
        build_prompt(_chars, _chars("x" * 100), 300, 0.5, nd)
    with pytest.raises(KvrunError, match="depth"):
        build_prompt(_chars, _chars("x" * 900), 300, 1.5, nd)


def test_cli_needle_runs_every_configuration(tmp_path):
    d = make_tiny_model_dir(tmp_path / "tiny")
    f = tmp_path / "fill.txt"
    f.write_text("Some filler sentence about nothing in particular. " * 40)
    r = CliRunner().invoke(main, ["needle", str(f), "-m", str(d), "-c", "300", "--depths", "0,1",
                                  "--trials", "1", "--kv", "fp16", "--evict", "h2o",
                                  "--kv-budget", "224", "--json"])
    assert r.exit_code == 0, r.output
    recs = json.loads(r.stdout[r.stdout.index("["):])
    assert [(x["method"], x["depth"]) for x in recs] == [
        ("fp16", 0.0), ("fp16", 1.0), ("fp16+h2o@224", 0.0), ("fp16+h2o@224", 1.0)]
    assert all(x["accuracy"] in (0.0, 1.0) and x["trials"] == 1 for x in recs)
    assert all(-1 <= x["lead"] <= 1 and (x["lead"] > 0) == (x["accuracy"] == 1) for x in recs)
    assert all(x["found"] == [x["accuracy"] == 1] and x["leads"] == [x["lead"]] for x in recs)
    r = CliRunner().invoke(main, ["needle", str(f), "-m", str(d), "--depths", "0.5,2"])
    assert r.exit_code != 0 and "--depths" in r.output


def test_needles_are_paired_with_the_reference_trial_by_trial():
    """lost/gained counts the same trial's needle in both methods, never totals: two methods
    with the same accuracy can lose and gain different needles; the largest lead is the
    reference's own on a needle the method lost."""
    ref, m = "fp16+snapkv@64", "kivi-4+snapkv@64"
    recs = [NeedleRecord(ref, 0.5, 2 / 3, 3, 1.0, 0.0, [True, True, False], [0.31, 0.02, -0.2]),
            NeedleRecord(m, 0.5, 2 / 3, 3, 1.0, 0.0, [False, True, True], [-0.1, 0.2, 0.1]),
            NeedleRecord(ref, 0.9, 1.0, 3, 1.0, 0.5, [True] * 3, [0.5] * 3),
            NeedleRecord(m, 0.9, 1 / 3, 3, 1.0, 0.0, [False, True, False], [-0.1, 0.4, -0.3])]
    lines = format_table(recs, ref=ref).splitlines()
    assert lines[-2].split() == [m, "lost", "1", "2", "3", "+0.500"]     # lost per depth, total
    assert lines[-1].split() == ["gained", "1", ".", "1"]                 # "." for none
    assert lines[-4].split() == ["method", "needles", "0.50", "0.90", "total", "ref", "lead"]
    assert "against" not in format_table(recs)                       # no reference: no pairs
    one = [NeedleRecord(x, 0.5, 1.0, 1, 1.0, 0.3, [True], [0.3]) for x in (ref, m)]
    assert format_table(one, ref=ref).splitlines()[-2].split() == [m, "lost", ".", ".", "-"]


def test_needle_ctrl_c_prints_the_cells_done(tmp_path, monkeypatch):
    """Ctrl-C after the first (method, depth) cell: the table shows that cell, '-' for the
    others, the progress line had an ETA, and the exit code is 130."""
    from kvrun.eval import needle as N
    d = make_tiny_model_dir(tmp_path / "tiny")
    f = tmp_path / "fill.txt"
    f.write_text("Some filler sentence about nothing in particular. " * 40)
    real, calls = N.build_prompt, {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:                   # the second cell's first trial
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(N, "build_prompt", flaky)
    r = CliRunner().invoke(main, ["needle", str(f), "-m", str(d), "-c", "300", "--depths", "0,1",
                                  "--trials", "1", "--kv", "int8"])
    assert r.exit_code == 130 and "Traceback" not in r.stderr
    assert "interrupted: results over the first 1 of 4 cells" in r.stderr
    assert "ETA" in r.stderr
    first = r.stderr.splitlines()[[i for i, x in enumerate(r.stderr.splitlines())
                                   if x.startswith("[needle]")][0]]
    assert first.startswith("[needle] 4 trials of 300-token prompts (2 KV configurations x "
                            "2 depths x 1 needle): about ")        # the estimate, before any
    rows = [x.split() for x in r.stdout.strip().splitlines()]
    assert rows[0] == ["method", "0.00", "1.00", "mean"]
    assert rows[2][0] == "fp16" and rows[2][2] == "-" and rows[3] == ["int8", "-", "-", "-"]


class _Scripted:
    """An engine whose logits are scripted per step: step i favours want[i] by the given
    probabilities over a 6-token vocabulary."""

    def __init__(self, steps):
        self.steps, self.i = steps, 0

    def _logits(self):
        p = torch.tensor(self.steps[self.i])
        self.i += 1
        return p.log()

    def prefill(self, ids):
        return self._logits()

    def decode_step(self, tok):
        return self._logits()


class _Digits:
    def decode(self, ids):
        return "".join(" " if t == 0 else str(t) for t in ids)


@pytest.mark.parametrize("steps, text, lead", [
    # right = [0, 3, 5]; the lowest lead is step 1's 0.5 - 0.3
    ([[.9, .02, .02, .02, .02, .02], [.1, .05, .05, .5, .3, 0], [0, 0, 0, 0, .2, .8]], " 35", 0.2),
    # step 1 prefers 4: the lead is negative there, and the later steps (off the answer) are
    # not counted even where the right token wins
    ([[.9, .02, .02, .02, .02, .02], [.1, .05, .05, .3, .5, 0], [0, 0, 0, 0, 0, 1.]], " 45", -0.2),
])
def test_answer_lead_follows_the_right_tokens(steps, text, lead):
    from kvrun.eval.needle import answer_with_lead
    answer, got = answer_with_lead(_Scripted(steps), _Digits(), [1, 2], [0, 3, 5], 3, stop_ids=set())
    assert answer == text and got == pytest.approx(lead, abs=1e-6)


def test_answer_stops_at_a_stop_id():
    from kvrun.eval.needle import answer_with_lead
    steps = [[.9, .02, .02, .02, .02, .02], [0, 0, .1, .1, .1, .7], [1., 0, 0, 0, 0, 0]]
    answer, lead = answer_with_lead(_Scripted(steps), _Digits(), [1], [0, 3], 3, stop_ids={5})
    assert answer == " " and lead == pytest.approx(0.1 - 0.7)


def test_evict_overlap_tool_compares_kept_tokens(tmp_path, capsys):
    """tools/evict_overlap.py: fp16 against itself keeps the same slots (share 1.000); each
    codec gets a row; a missing file or an unknown policy is one error line."""
    tool = load_tool("evict_overlap")
    d = make_tiny_model_dir(tmp_path / "tiny", num_heads=2, num_kv_heads=1)    # D 32: KIVI's groups
    f = tmp_path / "fill.txt"
    f.write_text("Some filler sentence about nothing in particular. " * 40)
    args = [str(f), "-m", str(d), "-c", "300", "--depth", "0.5", "--evict", "h2o", "--kv-budget", "224",
            "-b", "64", "-t", "1"]
    tool.main(args + ["--kv", "int8,kivi-4"])
    rows = [r.strip("| ").split(" | ") for r in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["fp16", "int8", "kivi-4"]
    assert rows[0][1] == "1.000" and all(0 < float(r[1]) <= 1 for r in rows)
    assert all(int(r[2]) >= 0 for r in rows)
    for file, policy in ((tmp_path / "missing.txt", "h2o"), (f, "bogus")):
        with pytest.raises(SystemExit, match="^error: "):
            tool.main([str(file), "-m", str(d), "-c", "300", "--evict", policy, "--kv-budget", "224"])


def test_evict_overlap_key_error(tmp_path, capsys):
    """tools/evict_overlap.py --key-error: per layer, an fp32 tail's kept keys are the fp16
    cache's at the same positions up to fp16 rounding (a wrong position map would put them
    ~1.4 apart), 4-bit KIVI keys' are off by a few percent, more than int8's; a --trial
    outside --trials is one error line."""
    tool = load_tool("evict_overlap")
    d = make_tiny_model_dir(tmp_path / "tiny", num_heads=2, num_kv_heads=1)    # D 32: KIVI's groups
    f = tmp_path / "fill.txt"
    f.write_text("Some filler sentence about nothing in particular. " * 40)
    args = [str(f), "-m", str(d), "-c", "300", "--depth", "0.5", "--evict", "snapkv", "--kv-budget", "224",
            "-b", "64", "-t", "1", "--trials", "2", "--trial", "1"]
    tool.main(args + ["--kv", "fp32,int8,kivi-4", "--key-error"])
    out = capsys.readouterr().out.split("kept keys' relative error")[1].splitlines()
    rows = [r.strip("| ").split(" | ") for r in out if r.startswith("| ") and r[2].isdigit()]
    assert len(rows) == 2                                               # the tiny model's layers
    for r in rows:
        (e32, f32, _), (e8, f8, _), (e4, f4, _) = (map(float, c.split(" / ")) for c in r[2:])
        assert e32 < 1e-3 and f32 < 1e-3
        assert 0 < e8 < e4 < 0.2 and 0 < f8 < f4 < 0.2
    with pytest.raises(SystemExit, match="^error: --trial"):
        tool.main(args[:-4] + ["--trials", "2", "--trial", "2"])


def test_evict_replay_k_layer_sets_one_layers_keys():
    """tools/evict_replay.py --k-layer L=METHOD (or L0-L1=METHOD): the codec's keys of those
    layers only, its values and the other layers as they were; a layer out of range, a
    reversed range or an unknown method is a KvrunError (the tool's one error line)."""
    from kvrun.errors import KvrunError
    from kvrun.kv import parse_kv
    tool = load_tool("evict_replay")
    spec = tool.with_k_layers(parse_kv("kivi-4/kivi-2"), ["2=int8", "0 = cb-4"], 4)
    assert spec.layer_methods(4) == [("cb-4", "kivi-2"), ("kivi-4", "kivi-2"), ("int8", "kivi-2"),
                                     ("kivi-4", "kivi-2")]
    spec = tool.with_k_layers(spec, ["1=fp16"], 4)
    assert spec.layer_methods(4)[:2] == [("cb-4", "kivi-2"), ("fp16", "kivi-2")]
    assert [k for k, _ in tool.with_k_layers(spec, ["1-3=int8"], 4).layer_methods(4)] == ["cb-4"] + ["int8"] * 3
    for bad in ("4=int8", "-1=int8", "int8", "x=int8", "1=bogus", "3-1=int8", "2-4=int8"):
        with pytest.raises(KvrunError):
            tool.with_k_layers(parse_kv("kivi-4"), [bad], 4)


def test_evict_replay_forces_fp16s_selection(tmp_path, capsys):
    """tools/evict_replay.py: a cache replaying fp16 + policy's choices keeps fp16's tokens in
    every layer and head; fp16 beside itself answers with the reference's lead, own choice or
    forced; a replay that cannot be exact, a missing file or an unknown policy is one error
    line."""
    import kvrun
    from kvrun.engine.generate import Engine
    from kvrun.kv import parse_kv
    from kvrun.kv.build import make_cache
    tool = load_tool("evict_replay")
    d = make_tiny_model_dir(tmp_path / "tiny", num_heads=2, num_kv_heads=2)    # D 32, heads choose apart
    m = kvrun.load(str(d), dtype="fp32", ctx=8, threads=1)
    # 5 chunks of 64: every flush after the first is a chunk of 2 G (a flush of G re-packs one
    # block of per-channel keys and need not keep the policy's choice)
    ids = torch.randint(3, m.cfg.vocab_size, (320,), generator=torch.Generator().manual_seed(3)).tolist()
    log, kept = {}, {}
    for kv, hook in (("fp16", tool.recording), ("kivi-4", tool.replaying)):
        cache = make_cache(m.cfg, 330, parse_kv(kv, evict="snapkv", budget=224, residual=32, group=32,
                                                snap_window=8))
        hook(cache.ev, log)
        with torch.inference_mode():
            Engine(m.transformer, m.tokenizer, cache, 64).prefill(ids)
        assert cache.ev.n_compactions > 0
        kept[kv] = [cache.ev.kept_positions(l) for l in range(cache.L)]
    assert all(torch.equal(a, b) for a, b in zip(kept["fp16"], kept["kivi-4"]))
    assert any(not torch.equal(k[0], k[1]) for k in kept["fp16"])    # the two KV heads keep apart
    f = tmp_path / "fill.txt"
    f.write_text("Some filler sentence about nothing in particular. " * 40)
    args = [str(f), "-m", str(d), "-c", "320", "--depths", "0.5", "--trials", "2", "--evict", "h2o",
            "--kv-budget", "224", "-b", "64", "-t", "1"]
    tool.main(args + ["--kv", "fp16,kivi-4", "--own-last"])
    out = capsys.readouterr().out.splitlines()
    rows = [r.strip("| ").split(" | ") for r in out[2:4]]
    assert [r[:2] for r in rows] == [["0.5", "0"], ["0.5", "1"]] and all(len(r) == 10 for r in rows)
    assert all(r[2] == r[3] == r[4] == r[5] for r in rows)    # fp16 beside fp16: every run alike
    assert out[-1].startswith("kivi-4 + h2o: of ")
    # 300 tokens in chunks of 64 end with a flush of one block: 4-bit keys then re-pack one
    # block only, the replay cannot be exact, and the tool says so instead of printing leads
    with pytest.raises(SystemExit, match="^error: layer .* the replay kept other tokens"):
        tool.main([a if a != "320" else "300" for a in args] + ["--kv", "kivi-4"])
    for file, policy in ((tmp_path / "missing.txt", "h2o"), (f, "bogus")):
        with pytest.raises(SystemExit, match="^error: "):
            tool.main([str(file), "-m", str(d), "-c", "300", "--evict", policy, "--kv-budget", "224"])
