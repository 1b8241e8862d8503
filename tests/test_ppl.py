"""`kvrun ppl` on a tiny model: baseline first, KLD/top-1 computed against it, bad input refused."""
import json

import pytest
from click.testing import CliRunner

from kvrun.runtime.cli import main
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
    assert base["method"] == "fp16" and base["kld"] == 0 and base["top1"] == 1 and base["ratio"] == 1
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
