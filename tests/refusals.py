"""Shared by the tests of bad files (tests/test_files.py, tests/engine/test_session.py): the
one-line errors a reader gives for paths that must be refused at once, never read until
they block (a FIFO nobody writes) or exhaust memory (/dev/zero)."""
from __future__ import annotations

import threading

from kvrun.errors import KvrunError


def refusals(read, paths, timeout: float) -> list[str]:
    """The KvrunError message `read(path)` raised for each path, in order (one per path
    that raised); each call runs on its own thread and must end within `timeout` s."""
    errors = []

    def one(p):
        try:
            read(p)
        except KvrunError as e:
            errors.append(str(e))
    for p in paths:
        t = threading.Thread(target=one, args=(p,), daemon=True)
        t.start()
        t.join(timeout)
        assert not t.is_alive(), f"reading {p} blocked"
    return errors
