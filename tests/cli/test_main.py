"""kvrun.cli.main: the commands' output streams, and every user error is one `error:` line + non-zero
exit."""
import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from kvrun.cli.main import main
from tiny import make_tiny_model_dir


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
    (["-n", "-2"], "-n must be >= 0"),        # -1: until EOS (llama.cpp)
    (["--temp", "-1"], "--temp must be >= 0"),
    (["--top-p", "2"], "--top-p must be in (0, 1]"),
    (["-c", "0"], "ctx-size must be >= 1"),
    (["-c", "8"], "prompt too long"),
    (["-t", "0"], "--threads"),
    (["-b", "0"], "prefill chunk must be"),
    (["--kv", "fp13"], "unknown KV method"),
    (["--kv", "kivi-3"], "kivi-3 stores keys only"),
    (["--kv", "kivi-4/kivi-3"], "kivi-3 stores keys only"),
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
    p = subprocess.run([sys.executable, "-m", "kvrun.cli.main", "generate", "-m", "/nope", "-p", "x"],
                       capture_output=True, text=True)
    assert p.returncode == 1 and p.stderr.startswith("error: ") and "Traceback" not in p.stderr


def test_bad_backend_is_a_one_line_error(tmp_path):
    import os
    import subprocess
    import sys
    env = dict(os.environ, KVRUN_BACKEND="bogus")
    r = subprocess.run([sys.executable, "-m", "kvrun.cli.main", "bench", "--layer", "4,2,32",
                        "--ctx", "64", "--kv", "kivi-4", "-r", "1"], capture_output=True, text=True, env=env)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith("error: KVRUN_BACKEND='bogus'")
    assert "Traceback" not in r.stderr


# -- stop strings, chat commands, KV reporting ---------------------------

def stdout(r) -> str:
    """The exact stdout (click's Result.stdout turns \\r\\n into \\n)."""
    return r.stdout_bytes.decode("utf-8", "replace")


def printable_stop(text):
    """(stop, kept): the first two printable ASCII characters in a row of `text` that do not
    occur earlier; with the tiny byte-level tokenizer they are two tokens."""
    for k in range(len(text) - 1):
        s = text[k:k + 2]
        if s.isascii() and s.isprintable() and s not in text[:k + 1]:
            return s, text[:k]
    pytest.skip("no two printable ASCII characters in a row")


def test_generate_stop_string(tiny_dir):
    base = ["generate", "-m", str(tiny_dir), "-p", "hello", "-n", "32", "--temp", "0"]
    full = run(base)
    assert full.exit_code == 0, full.stderr
    stop, kept = printable_stop(stdout(full))
    r = run(base + ["--stop", "\x00never", "--stop", stop])
    assert r.exit_code == 0, r.stderr
    assert stdout(r) == kept                            # text before the stop, nothing after
    assert f"generated: {len(kept) + len(stop)} tok" in r.stderr   # one byte per token
    assert_user_error(run(base + ["--stop", ""]), "empty stop string")


def test_chat_stop_string(tiny_dir):
    base = ["chat", "-m", str(tiny_dir), "-n", "24", "--temp", "0"]
    full = run(base, input="hi\n")
    stop, kept = printable_stop(stdout(full)[:-1])
    r = run(base + ["--stop", stop], input="hi\n")
    assert r.exit_code == 0, r.stderr
    assert stdout(r) == kept + "\n"


def test_chat_help_unknown_command_banner_kv(tiny_dir):
    r = run(["chat", "-m", str(tiny_dir), "-n", "4", "--temp", "0", "--kv", "int8", "-c", "256"],
            input="/help\n/nope\n/ also unknown\n//slash \\\ncontinued\n/kv\n/clear\n/quit\nnot sent\n")
    assert r.exit_code == 0, r.stderr
    err = r.stderr.splitlines()
    banner = err[0]
    assert tiny_dir.name in banner and "KV int8" in banner and "context 256 tokens" in banner
    assert any(line.strip().startswith("/kv ") for line in err)             # /help lists it
    assert any(line.strip().startswith("/reset, /clear ") for line in err)
    assert "error: unknown command '/nope' (/help lists them" in r.stderr
    assert "error: unknown command '/'" in r.stderr
    # only "//slash" + its continuation line went to the model, as one message
    assert r.stderr.count("new prompt tok") == 1 and r.stdout.count("\n") == 1
    cached = int(r.stderr.split("| cache ")[1].split(" tok]")[0])
    kv = [line for line in err if line.startswith("KV cache:")]
    assert kv and kv[0].startswith(f"KV cache: int8, {cached} / 256 tokens held")
    assert "x fp16 at 256 tokens" in kv[0]
    report = r.stderr[r.stderr.index(kv[0]):].splitlines()[1:4]
    assert [line.split()[0] for line in report] == ["codes", "scales_zeros", "window"]
    assert "lowrank" not in r.stderr and "outliers" not in r.stderr   # 0 bytes: omitted
    assert "[conversation reset]" in r.stderr


@pytest.mark.parametrize("kv", ["fp16", "int8"])
def test_generate_stats_line_names_kv_bytes_ratio(tiny_dir, kv):
    from kvrun.kv.build import kv_bytes_at
    from kvrun.kv.report import fmt_bytes, fp16_bytes_per_token
    from kvrun.model.loader import load_config
    r = run(["generate", "-m", str(tiny_dir), "-p", "hello", "-n", "4", "--temp", "0",
             "--kv", kv, "-c", "512"])
    assert r.exit_code == 0, r.stderr
    cfg = load_config(tiny_dir)
    total = sum(kv_bytes_at(cfg, kv, 512).values())     # the codec formulas, not the arena
    ratio = total / (fp16_bytes_per_token(cfg) * 512)
    stats = r.stderr.strip().splitlines()[-1]
    assert f"| KV {kv} {fmt_bytes(total)} ({ratio:.3f}x fp16) |" in stats, stats
    # fp16's arena: at most one block (G = 32 tokens) beyond the context
    assert (1.0 <= ratio <= 1.0 + 32 / 512) == (kv == "fp16")


def test_chat_message_longer_than_context_is_one_error_line(tiny_dir):
    r = run(["chat", "-m", str(tiny_dir), "-n", "4", "--temp", "0", "-c", "64"],
            input="x" * 200 + "\n/kv\n")
    assert r.exit_code == 0, r.stderr
    err = r.stderr.splitlines()
    i = next(i for i, line in enumerate(err) if line.startswith("error: "))
    assert "prompt too long" in err[i] and err[i - 1].strip()   # no blank line before it
    assert any(line.startswith("KV cache: fp16, 0 / 64") for line in err[i:])   # chat goes on
