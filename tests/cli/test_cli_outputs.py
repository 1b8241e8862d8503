"""What the CLI reports and where it writes: the stats line's decode rate and context
shifts, and output paths checked before the work that would fill them."""
from __future__ import annotations

import time

from click.testing import CliRunner

from kvrun.cli.main import main


def run(args):
    return CliRunner().invoke(main, args)


def test_one_token_has_no_decode_rate(tiny_dir):
    """-n 1 samples from the prompt's logits and runs no decode step: it printed thousands
    of tok/s measured over one sample."""
    r = run(["generate", "-m", str(tiny_dir), "-p", "hello", "-n", "1", "--temp", "0"])
    assert r.exit_code == 0, r.output
    assert "generated: 1 tok, no decode step" in r.stderr


def test_stats_line_reports_context_shifts(tiny_dir):
    """200 tokens in a 64-token context shift it; the stats line says how often and how
    many tokens went (it said nothing). The tiny model's greedy text from "abc" runs the
    full 200 tokens."""
    args = ["generate", "-m", str(tiny_dir), "-n", "200", "-c", "64", "--ctx-policy", "shift",
            "--keep", "4", "--temp", "0", "--kv-residual", "32"]
    shifted = run(args + ["-p", "abc"])
    assert shifted.exit_code == 0, shifted.output
    assert "generated: 200 tok" in shifted.stderr
    # keep 4 (a 32-token window block), drop half of the other 32 of 64, 16 at a time
    assert "context shifted 9x, 144 tokens dropped" in shifted.stderr


def test_plot_and_profile_paths_are_checked_before_the_run(tiny_dir, tmp_path):
    t0 = time.perf_counter()
    for args in (["bench", "-m", str(tiny_dir), "--kv", "fp16", "-p", "0", "-n", "4",
                  "-o", str(tmp_path / "missing" / "x.png")],
                 ["bench", "-m", str(tiny_dir), "--kv", "fp16", "-p", "0", "-n", "4",
                  "-o", str(tmp_path)],
                 ["search", "-m", str(tiny_dir), "--calib", __file__, "--budget", "0.3",
                  "-o", str(tmp_path / "missing" / "p.json")]):
        r = run(args)
        assert r.exit_code == 1 and r.stderr.startswith("error: "), (args, r.output)
        assert "[bench]" not in r.stderr and "[search]" not in r.stderr
    assert list(tmp_path.iterdir()) == []
    assert time.perf_counter() - t0 < 60


def test_thread_counts_out_of_range_are_one_line(tiny_dir):
    """-t 1180591620717411303424 overflowed inside torch."""
    for t in ("0", "1180591620717411303424"):
        r = run(["generate", "-m", str(tiny_dir), "-p", "hi", "-n", "1", "-t", t])
        assert r.exit_code == 1 and r.stderr.count("\n") == 1 and "--threads" in r.stderr
