"""The `kvrun` console script (pyproject.toml's [project.scripts]). Before anything else
it installs the SIGINT handler that holds a Ctrl-C until the import it lands in ends
(runtime/cli/interrupts.py), then imports the command line: a Ctrl-C while click, the
commands or torch load exits 130 with "interrupted", as one during a command does
(runtime/cli/common.py), instead of a KeyboardInterrupt traceback or a half-loaded module.
The window before the handler is only the interpreter's own start-up."""
from __future__ import annotations

import sys

from .interrupts import install


def main() -> None:
    install()
    try:
        from .main import main as cli
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted\n")
        sys.exit(130)
    cli()
