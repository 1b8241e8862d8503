"""What a llama.cpp user expects of the CLI around the commands: --help lists the common
options first, a -c beyond the trained context is one warning, `kvrun pull --weights`
makes the directories the README's `-m` flags name."""
import re

import pytest
from click.testing import CliRunner

from kvrun.cli.main import main

COMMON = ["-m", "-p", "-f", "-n", "-c", "--temp", "-s", "-t", "--kv"]


def run(args, input=None):
    return CliRunner().invoke(main, args, input=input)


def _sections(help_text: str) -> dict:
    """{section title: [first flag of each option row]} of a click --help page."""
    out, cur = {}, None
    for line in help_text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            cur = out.setdefault(line[:-1], [])
        elif cur is not None and re.match(r"^  -", line):
            cur.append(line.split()[0].rstrip(","))
    return out


@pytest.mark.parametrize("cmd", ["generate", "chat"])
def test_help_lists_the_common_options_first(cmd):
    r = run([cmd, "--help"])
    assert r.exit_code == 0
    sec = _sections(r.stdout)
    want = [o for o in COMMON if not (cmd == "chat" and o in ("-p", "-f"))]  # chat: no prompt
    assert sec["Common options"] == want
    other = sec["Other options"]
    assert other[-1] == "-h" and "--top-k" in other and not set(other) & set(COMMON)
    # the rest by long name: --kv-* options together
    kv = [i for i, o in enumerate(other) if o.startswith("--kv-")]
    assert kv == list(range(kv[0], kv[0] + len(kv)))


def test_kv_help_names_auto_and_profiles():
    # click may wrap inside a hyphenated word ("per-" / "layer"): join those back
    text = " ".join(run(["generate", "--help"]).stdout.split()).replace("- ", "-")
    kv = text[text.index("--kv TEXT"):]
    assert ("auto (the per-layer profile shipped for the model in use; a model without one gets "
            "the generic default, rotated kivi-4, labelled 'auto (generic ...)'") in kv
    assert ("profile:NAME (a shipped profile: gemma-3-270m-0.20, gemma-3-270m-0.25, gemma-3-270m-0.30, "
            "smollm2-135m-0.20, smollm2-135m-0.25-all, smollm2-135m-0.25, smollm2-135m-0.30)") in kv


@pytest.mark.parametrize("cmd,extra,stdin", [
    ("generate", ["-p", "hello", "-n", "2"], None),
    ("chat", ["-n", "2"], "hi\nagain\n/exit\n"),
])
def test_ctx_beyond_trained_context_warns_once(tiny_dir, cmd, extra, stdin):
    r = run([cmd, "-m", str(tiny_dir), "-c", "1024", "--temp", "0", *extra], input=stdin)
    assert r.exit_code == 0, r.stderr
    warn = [x for x in r.stderr.splitlines() if x.startswith("warning:")]
    assert warn == ["warning: -c 1024 exceeds the model's trained context (512 tokens): "
                    "text past 512 tokens may degrade"]
    ok = run([cmd, "-m", str(tiny_dir), "-c", "512", "--temp", "0", *extra], input=stdin)
    assert ok.exit_code == 0 and "warning:" not in ok.stderr


@pytest.mark.parametrize("weights", ["int4", "int8", "fp32"])
def test_pull_weights_prints_the_directory(monkeypatch, tmp_path, weights):
    from kvrun.engine import pull
    asked = []

    def fake(progress=None, home=None, weights=pull.DEFAULT_WEIGHTS):
        asked.append(weights)
        return pull.default_model_dir(tmp_path, weights)
    monkeypatch.setattr(pull, "ensure_default_model", fake)
    r = run(["pull", "--weights", weights])
    assert r.exit_code == 0 and asked == [weights]
    assert r.stdout.strip() == str(tmp_path / "models" / pull.MODEL_NAMES[weights])
    assert run(["pull"]).exit_code == 0 and asked[-1] == "int4"     # no flag: as before
    r = run(["pull", "--weights", "q5"])
    assert r.exit_code == 1 and "'q5' is not one of 'int4', 'int8', 'fp32'" in r.stderr


def test_pull_weights_converts_from_the_cached_gguf(smollm2_gguf, tmp_path, monkeypatch):
    """A real `kvrun pull --weights int8` into a fresh $KVRUN_HOME holding only the GGUF
    (no download): the directory it prints is a model the CLI runs."""
    from kvrun.engine import pull
    home = tmp_path / "home"
    (home / "gguf").mkdir(parents=True)
    (home / "gguf" / smollm2_gguf.name).symlink_to(smollm2_gguf)
    monkeypatch.setenv("KVRUN_HOME", str(home))
    monkeypatch.setattr(pull, "_pip_download", lambda *a: pytest.fail("must not download"))
    r = run(["pull", "--weights", "int8"])
    assert r.exit_code == 0, r.stderr
    d = home / "models" / "smollm2-135m-instruct-q8"
    assert r.stdout.strip() == str(d) and (d / "config.json").is_file()
    g = run(["generate", "-m", r.stdout.strip(), "-p", "The capital of France is", "-n", "3",
             "--temp", "0", "-c", "64"])
    assert g.exit_code == 0 and "Paris" in g.stdout
