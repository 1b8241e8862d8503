"""kvrun.cli.entry: the `kvrun` console script installs the Ctrl-C handler before it imports the
command line, so a Ctrl-C while it loads exits 130 with "interrupted" (issue 56)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvrun.cli import entry


def test_the_console_script_starts_under_the_interrupt_handler():
    import tomllib
    root = Path(__file__).resolve().parents[2]
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kvrun"].split("#")[0].strip() == "kvrun.cli.entry:main"


def test_ctrl_c_while_the_cli_is_imported_is_interrupted_not_a_traceback():
    code = ("import sys\n"
            "class Boom:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'kvrun.cli.main':\n"
            "            raise KeyboardInterrupt\n"
            "sys.meta_path.insert(0, Boom())\n"
            "from kvrun.cli.entry import main\nmain()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 130 and r.stderr.strip() == "interrupted", r.stderr


def test_the_handler_is_installed_before_the_command_line_is_imported(monkeypatch):
    import kvrun.cli.main as cli_main
    order = []
    monkeypatch.setattr(entry, "install", lambda: order.append("install"))
    monkeypatch.setattr(cli_main, "main", lambda: order.append("cli"))
    entry.main()
    assert order == ["install", "cli"]
