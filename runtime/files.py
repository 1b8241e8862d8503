"""Files: a user's output written whole or not at all, the sha256 of inputs, and the folder
kvrun keeps its models and profiles in ($KVRUN_HOME)."""
from __future__ import annotations

import hashlib
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
    check_can_create_in(parent)
    return p


def check_can_create_in(d: Path) -> None:
    """A KvrunError unless entries can be created in the directory `d`: probed with a temp
    directory, since os.access does not see a read-only mount as root, nor ACLs."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kvrun-probe-", dir=d))
    except OSError as e:
        raise KvrunError(f"cannot write in {d} ({e.strerror})") from None


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
        os.chmod(tmp, 0o666 & ~_umask())        # as open() would create it, not mkstemp's 0600
        os.replace(tmp, p)
    except OSError as e:
        raise KvrunError(f"{path}: {e.strerror or e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_sha256(*paths) -> str:
    """One sha256 over the bytes of `paths`, concatenated in the order given (a GGUF, a
    wheel, or the shards of an HF checkpoint in sorted-name order)."""
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def kvrun_home(home: str | Path | None = None) -> Path:
    """`home`, else $KVRUN_HOME, else ~/.cache/kvrun."""
    if home is None:
        home = os.environ.get("KVRUN_HOME") or Path.home() / ".cache" / "kvrun"
    return Path(home).expanduser().absolute()
