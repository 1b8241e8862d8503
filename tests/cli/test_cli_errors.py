"""What a careless or hostile user types ends in one
`error:` line and exit status 1 (usage errors included), non-UTF-8 input is decoded with
U+FFFD, `info --json` is typed, bench's title names the weight format."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvrun.cli.main import main
from tiny import make_tiny_model_dir, write_tiny_hf


def run(args, input=None):
    return CliRunner().invoke(main, args, input=input)


def one_error_line(r, fragment: str) -> None:
    assert r.exit_code == 1, (r.exit_code, r.output)
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and fragment in err[0], r.stderr
    assert "Traceback" not in r.output


# -- usage errors: one line, exit 1 (item 17) ---------------------------------------------

@pytest.mark.parametrize("args,fragment", [
    (["generate", "--foo"], "No such option '--foo'"),
    (["generate", "--temperatur", "1", "-p", "x"], "Did you mean '--temp'?"),
    (["generate", "-s", "abc", "-p", "x"], "'abc' is not a valid integer"),
    (["generate", "-n", "1.5", "-p", "x"], "'1.5' is not a valid integer"),
    (["generate"], "give the prompt with -p TEXT or -f FILE"),
    (["generate", "-p"], "Option '-p' requires an argument"),
    (["generate", "-p", "x", "--dtype", "int3"], "'int3' is not one of"),
    (["nosuch"], "No such command 'nosuch'"),
    (["convert", "x.gguf"], "Missing option '-o'"),
    (["ppl"], "Missing argument 'FILE'"),
])
def test_usage_errors_are_one_line_exit_1(args, fragment):
    r = run(args)
    one_error_line(r, fragment)
    assert "--help" in r.stderr                         # where to look next


def test_help_and_version_still_exit_0():
    for args in (["--help"], ["generate", "--help"], ["--version"], []):
        r = run(args)
        assert r.exit_code == 0 and r.stdout and not r.stderr, args


@pytest.mark.parametrize("args,fragment", [
    (["-s", "1180591620717411303424"], "--seed must be an integer in [0, 2^64)"),
    (["-s", "-1"], "--seed must be an integer in [0, 2^64)"),
    (["--repeat-last-n", "-1"], "--repeat-last-n must be >= 0"),
    (["--temp", "nan"], "--temp"),
])
def test_sampling_flags_one_line(tiny_dir, args, fragment):
    one_error_line(run(["generate", "-m", str(tiny_dir), "-p", "x", "-n", "1", *args]), fragment)


def test_console_script_usage_error_exit_1():
    p = subprocess.run([sys.executable, "-m", "kvrun.cli.main", "generate", "--nope"],
                       capture_output=True, text=True)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and p.stderr.startswith("error: ")


# -- comma lists and text files (item 17) ---------------------------------------------------

@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("text") / "t.txt"
    f.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    return f


@pytest.mark.parametrize("args,fragment", [
    (["needle", "{T}", "--no-baseline", "--kv", ","], "--kv: empty list"),
    (["needle", "{T}", "--kv", "fp16,,int8"], "--kv: empty item in 'fp16,,int8'"),
    (["needle", "{T}", "--depths", "0.5,"], "--depths: empty item"),
    (["ppl", "{T}", "--kv", "int8,"], "--kv: empty item"),
    (["bench", "-d", "4k,,8k"], "-d: empty item in '4k,,8k'"),
    (["bench", "-p", ","], "-p: empty list"),
    (["bench", "--kv", ",int8"], "--kv: empty item"),
    (["bench", "--batch", "1,,4"], "--batch: empty item"),
    (["search", "--calib", "{T}", "--budget", "0.3", "-o", "x.json", "--bits", "2,,4"], "--bits"),
])
def test_empty_list_items_are_errors(tiny_dir, text_file, args, fragment):
    args = [str(text_file) if a == "{T}" else a for a in args] + ["-m", str(tiny_dir)]
    one_error_line(run(args), fragment)


def test_text_file_that_is_a_directory(tmp_path):
    for cmd in (["ppl", str(tmp_path)], ["needle", str(tmp_path)],
                ["search", "--calib", str(tmp_path), "--budget", "0.3", "-o", "x.json"]):
        one_error_line(run(cmd), f"{tmp_path}: is a directory, not a text file")
    one_error_line(run(["ppl", str(tmp_path / "nope.txt")]), "nope.txt: no such file")
    one_error_line(run(["ppl", "/dev/zero"]), "/dev/zero: not a regular file or a pipe")


def test_text_file_from_a_pipe(tiny_dir, tmp_path):
    """`kvrun ppl <(zcat text.gz)`: a FIFO is read like a file."""
    import threading
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    text = "The quick brown fox jumps over the lazy dog. " * 40
    writer = threading.Thread(target=lambda: fifo.write_text(text))
    writer.start()
    r = run(["ppl", str(fifo), "-m", str(tiny_dir), "-c", "64", "--windows", "1"])
    writer.join(10)
    assert r.exit_code == 0, r.stderr


# -- model files that cannot be read (item 13) -----------------------------------------------

@pytest.mark.parametrize("cut", [0, 5, 1000, "half"])
def test_info_on_truncated_weights(tmp_path, cut):
    bad = make_tiny_model_dir(tmp_path / "bad")
    f = bad / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2 if cut == "half" else cut])
    for cmd in (["info", str(bad)], ["info", str(bad), "--json"],
                ["generate", "-m", str(bad), "-p", "x", "-n", "1"]):
        one_error_line(run(cmd), "truncated or corrupt")


def test_unreadable_weights_and_directory(tmp_path, monkeypatch):
    """PermissionError is said as such, not as a missing or corrupt file. Simulated: the
    tests run as root, which reads through permission bits."""
    import builtins
    from kvrun.model import loader
    d = make_tiny_model_dir(tmp_path / "m")
    real_open = builtins.open

    def no_weights(path, *a, **k):
        if str(path).endswith("model.safetensors"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *a, **k)
    monkeypatch.setattr(builtins, "open", no_weights)
    for cmd in (["info", str(d)], ["generate", "-m", str(d), "-p", "x"]):
        one_error_line(run(cmd), f"{d / 'model.safetensors'}: permission denied")
    monkeypatch.setattr(builtins, "open", real_open)

    def no_listing(path):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))
    monkeypatch.setattr(loader.os, "listdir", no_listing)
    for cmd in (["info", str(d)], ["generate", "-m", str(d), "-p", "x"]):
        one_error_line(run(cmd), f"{d}: permission denied")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads through permission bits")
def test_unreadable_real(tmp_path):
    d = make_tiny_model_dir(tmp_path / "m")
    (d / "model.safetensors").chmod(0)
    one_error_line(run(["info", str(d)]), "permission denied")
    (d / "model.safetensors").chmod(0o644)
    d.chmod(0)
    try:
        one_error_line(run(["info", str(d)]), "permission denied")
    finally:
        d.chmod(0o755)


# -- stdout that cannot be written (item 13) -------------------------------------------------

@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
@pytest.mark.parametrize("args", [["pull", "--list"], ["info", "{M}", "--json"], ["--help"],
                                  ["generate", "--help"], ["--version"], [],
                                  ["generate", "-m", "{M}", "-p", "hi", "-n", "4", "--temp", "0"]])
def test_stdout_to_dev_full(tiny_dir, args):
    args = [str(tiny_dir) if a == "{M}" else a for a in args]
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "kvrun.cli.main", *args], stdout=full,
                           stderr=subprocess.PIPE, text=True)
    err = [x for x in p.stderr.splitlines() if x.startswith(("error", "Exception", "Traceback"))]
    assert p.returncode == 1 and err == ["error: cannot write output: No space left on device"], \
        p.stderr


def test_closed_pipe_is_quiet(tiny_dir):
    """`kvrun ... | head -1`: the reader left; no error text, SIGPIPE's status."""
    p = subprocess.Popen([sys.executable, "-m", "kvrun.cli.main", "generate", "-m",
                          str(tiny_dir), "-p", "hi", "-n", "400", "--temp", "0", "-c", "512"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.read(1)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait() == 141 and "error" not in err and "Exception" not in err, err


# -- non-UTF-8 input (item 9) -----------------------------------------------------------------

BAD = b"caf\xe9\xff"


def test_generate_non_utf8_stdin_and_argv(tiny_dir):
    """Bytes that are not UTF-8 become U+FFFD (one warning), in stdin and in -p: the
    prompt is then the same as if U+FFFD had been typed."""
    base = [sys.executable, "-m", "kvrun.cli.main", "generate", "-m", str(tiny_dir),
            "-n", "4", "--temp", "0", "-c", "64"]
    piped = subprocess.run(base + ["-p", "-"], input=BAD, capture_output=True)
    argv = subprocess.run(base + ["-p", BAD.decode("utf-8", "surrogateescape")],
                          capture_output=True)
    typed = subprocess.run(base + ["-p", "caf\ufffd\ufffd"], capture_output=True)
    for p in (piped, argv):
        assert p.returncode == 0, p.stderr
        assert b"warning: the prompt is not valid UTF-8; invalid bytes replaced with U+FFFD" \
            in p.stderr
        assert p.stdout == typed.stdout
        assert b"prompt: 9 tok" in p.stderr   # byte-level tokens: c a f + 2 x U+FFFD (3 bytes)
    assert b"warning" not in typed.stderr


def test_chat_survives_a_non_utf8_line(tiny_dir):
    p = subprocess.run([sys.executable, "-m", "kvrun.cli.main", "chat", "-m", str(tiny_dir),
                        "-n", "2", "--temp", "0", "-c", "256"],
                       input=b"hi\n" + BAD + b"\n/kv\n", capture_output=True)
    err = p.stderr.decode()
    assert p.returncode == 0, err
    assert "warning: this line is not valid UTF-8; invalid bytes replaced with U+FFFD" in err
    assert err.count("new prompt tok") == 2 and "KV cache:" in err   # both sent, then /kv


# -- info --json typed, bench title (item 16) --------------------------------------------------

def test_info_json_is_typed(tiny_dir):
    d = json.loads(run(["info", str(tiny_dir), "--json"]).stdout)
    assert isinstance(d["parameters"], int) and d["parameters"] > 0
    assert d["weights"]["format"] == "fp32" and isinstance(d["weights"]["bytes"], int)
    assert isinstance(d["weights"]["bits_per_param"], float)
    assert d["tied_embeddings"] is False or d["tied_embeddings"] is True
    assert isinstance(d["context"], int) and isinstance(d["rope_theta"], float)
    assert d["eos_token_ids"] == [2] and d["layers"] == 2 and d["sliding_layers"] == 0
    human = run(["info", str(tiny_dir)]).stdout                 # the table is unchanged
    assert "parameters" in human and "M\n" in human.split("parameters")[1].split("weights")[0]


def test_info_json_quantized(tmp_path):
    hf = write_tiny_hf(tmp_path / "hf")
    assert run(["convert", str(hf), "-o", str(tmp_path / "q"), "--weights", "int4"]).exit_code == 0
    d = json.loads(run(["info", str(tmp_path / "q"), "--json"]).stdout)
    assert d["weights"]["format"] == "int4" and d["weights"]["group"] == 32
    assert d["weights"]["embedding"] == "int8" and 4 < d["weights"]["bits_per_param"] < 16


def test_bench_title_names_the_weight_format(tiny_dir, tmp_path):
    hf = write_tiny_hf(tmp_path / "hf")
    titles = {}
    for w in ("int8", "fp32"):
        assert run(["convert", str(hf), "-o", str(tmp_path / w), "--weights", w]).exit_code == 0
        r = run(["bench", "-m", str(tmp_path / w), "-p", "8", "-n", "2", "-r", "1", "--kv", "fp16"])
        assert r.exit_code == 0, r.stderr
        titles[w] = r.stdout.splitlines()[0]
    assert "| weights int8 (per channel; embedding int8) |" in titles["int8"]
    assert "| weights fp32 |" in titles["fp32"]
    r = run(["bench", "-m", str(tmp_path / "int8"), "-n", "2", "-r", "1", "--kv", "fp16",
             "--batch", "1"])
    assert r.exit_code == 0 and "| weights int8 (per channel; embedding int8) |" in r.stdout


# -- what the probe found (absurd values, empty strings) ---------------------------------------

HUGE = "1180591620717411303424"


@pytest.mark.parametrize("args,fragment", [
    (["bench", "-m", "{M}", "-p", "8", "-n", "2", "--ctx", "-1"], "--ctx: values must be >= 0"),
    (["bench", "-m", "{M}", "-p", "8", "-n", "2", "--ctx", "1,2"], "--ctx takes one value"),
    (["bench", "--layer", "4,2,32", "--ctx", HUGE], "beyond what this benchmark allocates (1M)"),
    (["bench", "--layer", f"{HUGE},2,32", "--ctx", "64"], "H x D = "),
    (["bench", "-m", "{M}", "--batch", HUGE], "--batch: at most 4096 sequences"),
    (["bench", "-m", "{M}", "--batch", "1", "--kv-budget-mb", "nan"], "--kv-budget-mb must be"),
    (["bench", "-m", "{M}", "-s", HUGE], "'-s' / '--seed'"),
    (["bench", "-m", "{M}", "-s", "-1"], "'-s' / '--seed'"),
    (["needle", "{T}", "-m", "{M}", "--trials", HUGE], "'--trials'"),
    (["needle", "{T}", "-m", "{M}", "-s", HUGE], "'-s' / '--seed'"),
    (["generate", "-m", "{M}", "-p", "x", "--kv", ""], "--kv is empty"),
    (["generate", "-m", "{M}", "-p", "x", "--kv-v", " "], "--kv-v is empty"),
    (["generate", "-m", "", "-p", "x"], "the model path is empty"),
    (["info", ""], "the model path is empty"),
    (["ppl", ""], "the text file name is empty"),
    (["chat", "-m", "{M}", "-n", "-2"], "-n must be >= 0"),      # -1: until EOS (llama.cpp)
    (["serve", "-m", "{M}", "--port", "1", "--cache-ram", "-5"], "--cache-ram must be"),
    (["serve", "-m", "{M}", "--port", "1", "--cache-ram", "inf"], "--cache-ram must be"),
    (["chat", "-m", "{M}", "--session", "/nonexistent/dir/s.kvs"], "no such directory"),
])
def test_absurd_values_one_line(tiny_dir, text_file, args, fragment):
    sub = {"{M}": str(tiny_dir), "{T}": str(text_file)}
    one_error_line(run([sub.get(a, a) for a in args], input="hi\n"), fragment)


def test_unexpected_exception_is_one_line_unless_debug(tiny_dir, monkeypatch):
    """A bug still reaches the user as one line; --debug gives the traceback."""
    from kvrun.model import info
    monkeypatch.setattr(info, "model_facts", lambda p: 1 / 0)
    r = run(["info", str(tiny_dir), "--json"])
    one_error_line(r, "internal error (ZeroDivisionError: division by zero)")
    r = run(["--debug", "info", str(tiny_dir), "--json"])
    assert isinstance(r.exception, ZeroDivisionError)


def test_convert_odd_sources_and_configs(tmp_path):
    one_error_line(run(["convert", "/dev/null", "-o", str(tmp_path / "o")]), "not a regular file")
    hf = write_tiny_hf(tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    for change, fragment in [({"num_attention_heads": 0}, "num_heads must be an integer >= 1"),
                             ({"vocab_size": "abc"}, "bad value"),
                             ({"architectures": "GPT2LMHeadModel"}, "'GPT2LMHeadModel'")]:
        (hf / "config.json").write_text(json.dumps({**cfg, **change}))
        one_error_line(run(["convert", str(hf), "-o", str(tmp_path / "o")]), fragment)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("field,value", [("hidden_size", "x"), ("num_heads", 0),
                                         ("rope_theta", None), ("num_layers", True)])
def test_model_config_with_bad_numbers(tmp_path, field, value):
    d = make_tiny_model_dir(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, field: value}))
    for cmd in (["info", str(d)], ["generate", "-m", str(d), "-p", "x", "-n", "1"]):
        one_error_line(run(cmd), f"config: {field} must be")


def test_endless_stdin_prompt_is_refused(tiny_dir, monkeypatch):
    from kvrun.cli import main as cli
    monkeypatch.setattr(cli, "STDIN_LIMIT", 1000)
    one_error_line(run(["generate", "-m", str(tiny_dir), "-p", "-"], input="x" * 1001),
                   "the prompt on stdin is over")
    assert run(["generate", "-m", str(tiny_dir), "-p", "-", "-n", "1"],
               input="x" * 100).exit_code == 0


def test_endless_chat_line_is_refused(tiny_dir, monkeypatch):
    from kvrun.cli import chat as chat_repl
    monkeypatch.setattr(chat_repl, "LINE_LIMIT", 1000)
    r = run(["chat", "-m", str(tiny_dir), "-n", "1", "-c", "256"], input="x" * 1001)
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert r.stderr.strip().splitlines()[-1].startswith("error: an input line is over")
