"""What a new user hit (issue 55), each pinned: an unknown -m names the registry and the
closest name; -f FILE / -f - give the prompt; -n -1 runs to EOS or a full context; a
profile of another model states both layer counts; stdout holds exactly the generated
text (no newline added after a --stop string, at EOS or at -n)."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from kvrun.cli.main import main
from tiny import make_tiny_model_dir


def _run(args, input=None):
    return CliRunner().invoke(main, args, input=input)


def _error(r) -> str:
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


@pytest.mark.parametrize("name, close", [("smollm2", "smollm2-135m"), ("Gemma-3", "gemma-3-270m"),
                                         ("llama-3-8b", None)])
def test_an_unknown_model_name_lists_the_registry_and_the_closest(name, close):
    err = _error(_run(["generate", "-m", name, "-p", "hi"]))
    assert "kvrun pull --list" in err and "smollm2-135m, gemma-3-270m" in err
    assert (f"did you mean '{close}'?" in err) if close else "did you mean" not in err


def test_pull_names_the_closest_too():
    err = _error(_run(["pull", "smollm"]))
    assert "unknown model 'smollm'" in err and "did you mean 'smollm2-135m'?" in err


def test_a_missing_path_is_still_a_missing_path():
    assert "/no/such/dir: no such file or directory" in _error(_run(["info", "/no/such/dir"]))


def test_prompt_from_a_file_or_stdin(tiny_dir, tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text("hello there")
    args = ["generate", "-m", str(tiny_dir), "-n", "5", "--temp", "0"]
    by_p = _run(args + ["-p", "hello there"])
    assert by_p.exit_code == 0, by_p.output
    assert _run(args + ["-f", str(f)]).stdout == by_p.stdout
    assert _run(args + ["-f", "-"], input="hello there").stdout == by_p.stdout
    assert "one of them" in _error(_run(args + ["-p", "x", "-f", str(f)]))
    assert "one of them" in _error(_run(args))
    assert "no such file" in _error(_run(args + ["-f", str(tmp_path / "nope.txt")]))


def test_n_minus_one_runs_until_the_context_is_full(tiny_dir):
    r = _run(["generate", "-m", str(tiny_dir), "-p", "hello", "-n", "-1", "-c", "24",
              "--temp", "0"])
    assert r.exit_code == 0, r.output
    assert "[stopped: context full]" in r.stderr and "generated: 2" in r.stderr  # 24 - prompt
    assert "-1 for until EOS" in _error(_run(["generate", "-p", "x", "-n", "-2"]))
    assert "-1 for until EOS" in _error(_run(["chat", "-n", "-5"]))


def test_a_profile_for_another_model_states_both_layer_counts(tmp_path):
    from kvrun.kv.profile import save_profile
    gemma = make_tiny_model_dir(tmp_path / "g", "gemma3")            # 6 layers, 1 global
    p = tmp_path / "p.json"
    save_profile(p, [("kivi-4", "kivi-2")] * 30, model={"name": "smol", "num_layers": 30})
    err = _error(_run(["generate", "-m", str(gemma), "-p", "x", "--kv-profile", str(p)]))
    assert "searched for smol (30 layers)" in err
    assert "this model has 6 layers, 1 of them full-attention" in err


def test_stdout_is_exactly_the_generated_text():
    args = ["generate", "-p", "The capital of France is", "--temp", "0", "-n", "24"]
    full = _run(args)
    assert full.exit_code == 0, full.output
    assert full.stdout and not full.stdout.endswith("\n")      # -n reached: no newline added
    stop = full.stdout.strip().split()[1]                       # a word the reply holds
    r = _run(args + ["--stop", stop])
    assert r.stdout == full.stdout[:full.stdout.index(stop)]    # nothing after the text
    assert "\n[prompt: " in r.stderr                            # the stats on a line of their own


def test_a_full_chat_context_names_reset_and_shift(tiny_dir):
    r = _run(["chat", "-m", str(tiny_dir), "-c", "100", "-n", "4", "--temp", "0"],
             input="hi there\n" * 3)                  # two turns fit, the third not
    assert r.exit_code == 0, r.output
    err = next(line for line in r.stderr.splitlines() if line.startswith("error: "))
    assert "prompt too long" in err and "/reset" in err and "--ctx-policy shift" in err


@pytest.mark.parametrize("cmd", ["ppl", "needle", "bench", "generate"])
def test_help_has_no_stray_argument_rows(cmd):
    text = _run([cmd, "--help"]).stdout
    rows = text[text.index("Other options:"):].splitlines()[1:]
    assert rows and all(r.startswith("  -") or r.startswith("      ") or not r.strip() for r in rows), rows


def test_bench_depth_is_d_and_ctx_is_its_hidden_old_name(tiny_dir):
    text = _run(["bench", "--help"]).stdout
    assert "-d, --depth" in text and "--ctx" not in text
    base = ["bench", "-m", str(tiny_dir), "--kv", "fp16", "-p", "0", "-n", "2", "-r", "1", "--json"]
    import json
    by_d, by_ctx = (_run(base + flag) for flag in (["-d", "48"], ["--ctx", "48"]))
    assert by_d.exit_code == by_ctx.exit_code == 0, by_d.output + by_ctx.output
    depth = lambda r: [x["depth"] for x in json.loads(r.stdout)]     # noqa: E731
    assert depth(by_d) == depth(by_ctx) == [48]
    assert "give -d only" in _error(_run(base + ["-d", "48", "--ctx", "48"]))


def test_the_readme_says_where_to_run_pip_and_what_the_pulls_cost():
    from pathlib import Path
    text = " ".join((Path(__file__).parents[2] / "README.md").read_text().split())
    setup = text[text.index("## Set up"):text.index("pip install . &&")]
    assert "Clone this repository and `cd` into its root" in setup
    assert "1.3 GB of wheels" not in text
    assert "≈ 330 MB of model wheels" in text and "holds ≈ 2.3 GB (`du -sh ~/.cache/kvrun`)" in text
