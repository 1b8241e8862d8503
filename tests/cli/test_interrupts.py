"""kvrun.cli.interrupts: a Ctrl-C inside an import is held until the import ends (issue 56)."""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from kvrun.cli import interrupts


def test_ctrl_c_inside_an_import_waits_for_its_end(tmp_path):
    """A KeyboardInterrupt in the middle of torch's or numpy's import left them half-loaded
    (a later import: "cannot load module more than once per process", an internal error)
    or was swallowed with an ImportError (the command ran on); it now arrives after the
    import, where the command's handlers turn it into "interrupted"."""
    (tmp_path / "slowmod.py").write_text("import os, signal, time\n"
                                         "os.kill(os.getpid(), signal.SIGINT)\n"
                                         "time.sleep(0.3)\ndone = True\n")
    code = ("import sys, time\nfrom kvrun.cli import interrupts\ninterrupts.install()\n"
            f"sys.path.insert(0, {str(tmp_path)!r})\n"
            # short sleeps up to 30 s: the watcher thread may be starved for seconds on a
            # loaded machine, and a pending signal is handled between bytecodes, not in a sleep
            "try:\n    import slowmod\n    t0 = time.time()\n"
            "    while time.time() - t0 < 30:\n        time.sleep(0.05)\n"
            "    print('not interrupted')\n"
            "except KeyboardInterrupt:\n    print('interrupted after', slowmod.done)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "interrupted after True", r.stdout + r.stderr


def test_importing_sees_an_import_on_the_stack(tmp_path, monkeypatch):
    (tmp_path / "probe_import.py").write_text(
        "import sys\nfrom kvrun.cli import interrupts\n"
        "SEEN = interrupts.importing(sys._getframe())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "probe_import", raising=False)
    import probe_import
    assert probe_import.SEEN is True
    assert interrupts.importing(sys._getframe()) is False and interrupts.importing(None) is False


def test_install_takes_over_only_the_default_handler():
    old = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        interrupts.install()
        assert signal.getsignal(signal.SIGINT) is interrupts._handler
        with pytest.raises(KeyboardInterrupt):           # outside an import: at once
            interrupts._handler(signal.SIGINT, sys._getframe())

        def own(signum, frame):
            pass
        signal.signal(signal.SIGINT, own)
        interrupts.install()
        assert signal.getsignal(signal.SIGINT) is own
    finally:
        signal.signal(signal.SIGINT, old)
