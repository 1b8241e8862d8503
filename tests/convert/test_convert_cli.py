"""`kvrun convert` on the command line: its progress display (a plain line per ~10 % when
stderr is a log, one redrawn line on a terminal) and the one `error:` line when the
destination exists, which names --force (and --force then replaces it).
"""
from __future__ import annotations

import pytest

from test_convert import _tiny_llama


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm2_dir):
    """test_convert.py's tiny Llama checkpoint: (dir, state dict)."""
    return _tiny_llama(tmp_path_factory.mktemp("hf"), smollm2_dir)


# -- kvrun convert: progress display and the "exists" message ----------------------------------

def test_cli_convert_progress_plain_lines_in_a_log(tiny_llama, tmp_path):
    """stderr not a terminal (a log, CI): a plain line per ~10 %, no carriage returns."""
    from click.testing import CliRunner
    from kvrun.cli.main import main
    r = CliRunner().invoke(main, ["convert", str(tiny_llama[0]), "-o", str(tmp_path / "out"),
                                  "--dtype", "fp32"])
    assert r.exit_code == 0, r.stderr
    assert "\r" not in r.stderr and "\x1b" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("[convert]")]
    n = int(lines[-1].split()[1].split("/")[1])
    assert 2 <= len(lines) <= 11 and lines[-1].startswith(f"[convert] {n}/{n} tensors (100%)")


def test_progress_redraws_one_line_on_a_terminal():
    import io
    from kvrun.progress import CountProgress
    out = io.StringIO()
    p = CountProgress("[convert]", "tensors", stream=out, tty=True)
    for i in range(1, 201):
        p(i, 200, f"model.layers.{i}.weight")
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")            # one line, ended once
    assert text.startswith("\r[convert] 1/200 tensors (0%)")
    last = text.rsplit("\r", 1)[1]
    assert last.startswith("[convert] 200/200 tensors (100%)") and "\x1b[K" in last
    assert "weight" not in last                                      # the final state: no name


def test_cli_convert_exists_error_names_force(tiny_llama, tmp_path):
    from click.testing import CliRunner
    from kvrun.cli.main import main
    out = tmp_path / "out"
    args = ["convert", str(tiny_llama[0]), "-o", str(out), "--dtype", "fp32"]
    assert CliRunner().invoke(main, args).exit_code == 0
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1 and "Traceback" not in r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "--force replaces it" in err[0]
    assert "overwrite=True" not in err[0]                  # Python's word, not the CLI's
    before = (out / "config.json").stat().st_mtime_ns
    r = CliRunner().invoke(main, args + ["--force"])
    assert r.exit_code == 0, r.stderr
    assert (out / "config.json").stat().st_mtime_ns != before
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors",
                                                      "tokenizer.json"]
