"""CLI behaviour: output streams, and every user error is one `error:` line + non-zero exit."""
import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from kvrun.runtime.cli import main
from tiny import make_tiny_model_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("m") / "tiny")


def run(args, input=None):
    return CliRunner().invoke(main, args, input=input)


def assert_user_error(r, fragment):
    assert r.exit_code != 0, r.output
    err = r.stderr.strip().splitlines()
    assert err and err[-1].startswith("error: ") and fragment in err[-1], r.stderr
    assert "Traceback" not in r.output + r.stderr


def test_generate_streams_text_to_stdout_stats_to_stderr(tiny_dir):
    r = run(["generate", "-m", str(tiny_dir), "-p", "hello", "-n", "8", "--temp", "0"])
    assert r.exit_code == 0, r.stderr
    assert "tok/s" in r.stderr and "tok/s" not in r.stdout
    assert "peak RSS" in r.stderr


def test_generate_reads_stdin(tiny_dir):
    a = run(["generate", "-m", str(tiny_dir), "-p", "-", "-n", "6", "--temp", "0"], input="hello")
    b = run(["generate", "-m", str(tiny_dir), "-p", "hello", "-n", "6", "--temp", "0"])
    assert a.exit_code == 0 and a.stdout == b.stdout


def test_chat_repl_commands(tiny_dir):
    r = run(["chat", "-m", str(tiny_dir), "-n", "4", "--temp", "0"],
            input="hi\n/kv\n/reset\nhello again\n/exit\n")
    assert r.exit_code == 0, r.stderr
    assert "KV cache:" in r.stderr and "[conversation reset]" in r.stderr
    assert r.stderr.count("new prompt tok") == 2


def test_info_json(tiny_dir):
    r = run(["info", str(tiny_dir), "--json"])
    assert r.exit_code == 0
    d = json.loads(r.stdout)
    assert d["architecture"] == "llama" and d["layers"] == 2


@pytest.mark.parametrize("args,fragment", [
    (["-m", "/no/such/dir"], "no such file or directory"),
    (["-n", "-1"], "-n must be >= 0"),
    (["--temp", "-1"], "--temp must be >= 0"),
    (["--top-p", "2"], "--top-p must be in (0, 1]"),
    (["-c", "0"], "ctx-size must be >= 1"),
    (["-c", "8"], "prompt too long"),
    (["-t", "0"], "threads must be >= 1"),
    (["-b", "0"], "prefill chunk must be >= 1"),
    (["--kv", "fp13"], "unknown KV method"),
    (["--kv", "kivi-3"], "unknown KV method"),
    (["--kv", "kivi-4", "--kv-residual", "100"], "multiple"),
])
def test_generate_user_errors(tiny_dir, args, fragment):
    base = ["generate", "-p", "a prompt that is longer than eight tokens", "-n", "2"]
    if "-m" not in args:
        base += ["-m", str(tiny_dir)]
    assert_user_error(run(base + args), fragment)


def test_truncated_weights(tiny_dir, tmp_path):
    bad = make_tiny_model_dir(tmp_path / "bad")
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert_user_error(run(["generate", "-m", str(bad), "-p", "x", "-n", "1"]), "truncated or corrupt")


def test_corrupt_config_and_missing_tokenizer(tmp_path):
    bad = make_tiny_model_dir(tmp_path / "bad")
    (bad / "config.json").write_text("{not json")
    assert_user_error(run(["generate", "-m", str(bad), "-p", "x"]), "not valid JSON")
    bad2 = make_tiny_model_dir(tmp_path / "bad2")
    (bad2 / "tokenizer.json").unlink()
    assert_user_error(run(["generate", "-m", str(bad2), "-p", "x"]), "missing tokenizer.json")


def test_unsupported_architecture_and_mismatch(tmp_path):
    bad = make_tiny_model_dir(tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "architecture": "gpt_neox"}))
    assert_user_error(run(["generate", "-m", str(bad), "-p", "x"]), "unsupported architecture")
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_size": 96}))
    assert_user_error(run(["generate", "-m", str(bad), "-p", "x"]), "weights do not match the config")
    (bad / "config.json").write_text(json.dumps({**cfg, "num_layers": 3}))
    assert_user_error(run(["generate", "-m", str(bad), "-p", "x"]), "missing")


def test_gguf_path_given_as_model(tmp_path):
    g = tmp_path / "x.gguf"
    g.write_bytes(b"GGUF")
    assert_user_error(run(["generate", "-m", str(g), "-p", "x"]), "convert it first")


def test_console_script_exit_code_and_no_traceback():
    p = subprocess.run([sys.executable, "-m", "kvrun.runtime.cli", "generate", "-m", "/nope", "-p", "x"],
                       capture_output=True, text=True)
    assert p.returncode == 1 and p.stderr.startswith("error: ") and "Traceback" not in p.stderr


def test_bad_backend_is_a_one_line_error(tmp_path):
    import os
    import subprocess
    import sys
    env = dict(os.environ, KVRUN_BACKEND="bogus")
    r = subprocess.run([sys.executable, "-m", "kvrun.runtime.cli", "bench", "--layer", "4,2,32",
                        "--ctx", "64", "--kv", "kivi-4", "-r", "1"], capture_output=True, text=True, env=env)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith("error: KVRUN_BACKEND='bogus'")
    assert "Traceback" not in r.stderr
