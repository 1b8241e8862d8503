"""Writing a user's output file so that it is either whole or absent."""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .errors import KvrunError


def check_writable(path) -> Path:
    """Before any work: `path` can be created or replaced (its folder exists and is
    writable, and it is not a directory)."""
    p = Path(path)
    if p.is_dir():
        raise KvrunError(f"{path}: is a directory")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise KvrunError(f"{path}: no such directory {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise KvrunError(f"{path}: cannot write in {parent}")
    return p


@contextmanager
def atomic_output(path, suffix: str = ""):
    """Yields a temporary path beside `path`; when the block ends normally the temporary
    file replaces `path` in one rename, and on any error or interrupt it is removed, so a
    reader never sees half a file. `suffix` keeps an extension a writer looks at (.png)."""
    p = check_writable(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp" + suffix, dir=p.parent or ".")
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, p)
    except OSError as e:
        raise KvrunError(f"{path}: {e.strerror or e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
