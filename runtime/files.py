"""Files: a user's output written whole or not at all (and only ever over a regular file),
inputs read with a size bound (and only from a regular file: a FIFO or a device is refused
without blocking), a lock beside a file that one writer at a time may hold, the sha256 of
inputs, and the folder kvrun keeps its models and profiles in ($KVRUN_HOME)."""
from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path

from . import knobs
from .errors import KvrunError

PRIVATE = 0o600                 # files that hold a user's prompts (sessions, prefix-cache entries)


def check_writable(path) -> Path:
    """Before any work: `path` can be created or replaced (its folder exists and is
    writable, and it is absent or a regular file, or a symlink to one: never a directory,
    a device, a FIFO or a socket). Returns the path that will be written (a symlink's
    target, so the link stays)."""
    p = Path(path)
    if not str(path).strip():
        raise KvrunError("the output file name is empty")
    try:
        st = os.stat(p)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise KvrunError(f"{path}: {e.strerror or e}") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise KvrunError(f"{path}: is a directory")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise KvrunError(f"{path}: not a regular file (a device, FIFO or socket); kvrun only "
                         f"replaces regular files")
    if p.is_symlink():
        p = Path(os.path.realpath(p))
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


# -- temporary files: named by the writer's pid, so a killed writer's are provably stale -------
_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)-\w+\.tmp")


def temp_owner(name: str) -> int | None:
    """The pid in the name of one of `atomic_output`'s temporary files, else None."""
    m = _TEMP.match(name)
    return int(m["pid"]) if m else None


def pid_running(pid: int) -> bool:
    """Whether process `pid` runs on this machine (one we may not signal runs too)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_stale_temp(name: str) -> bool:
    """`name` is a temporary file of `atomic_output` whose writer no longer runs."""
    pid = temp_owner(name)
    return pid is not None and pid != os.getpid() and not pid_running(pid)


def sweep_stale_temps(d: Path, name: str | None = None) -> int:
    """Remove from `d` the temporary files (regular files, never followed) of writers that
    no longer run (killed mid-write); with `name`, only those of the output `name`.
    Returns how many were removed."""
    n = 0
    try:
        entries = list(os.scandir(d))
    except OSError:
        return 0
    for e in entries:
        m = _TEMP.match(e.name)
        if m is None or (name is not None and m["name"] != name) or not is_stale_temp(e.name):
            continue
        try:
            if e.is_file(follow_symlinks=False):
                os.unlink(e.path)
                n += 1
        except OSError:
            pass
    return n


@contextmanager
def atomic_output(path, suffix: str = "", mode: int | None = None):
    """Yields a temporary path beside `path`; when the block ends normally the temporary
    file replaces `path` in one rename, and on any error or interrupt it is removed, so a
    reader never sees half a file. Only a regular file is ever replaced (`check_writable`,
    checked again just before the rename). `suffix` keeps an extension a writer looks at
    (.png); `mode`: the file's permissions (default: as open() would create it under the
    umask; PRIVATE for a user's prompts). The temporary file is named with this process's
    pid, and the temporary files of a killed writer of the same output are removed first."""
    p = check_writable(path)
    sweep_stale_temps(p.parent, p.name)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.{os.getpid()}-", suffix=".tmp" + suffix,
                               dir=p.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask() if mode is None else mode)
        check_writable(p)                       # something else may have appeared there
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


def read_regular(path, limit: int, what: str = "file", follow: bool = True) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them; a KvrunError naming
    `what` otherwise. Opened non-blocking and checked with fstat before any read, so a FIFO
    or a device (/dev/zero) is refused at once instead of hanging or filling memory, and
    the size is checked before the file is read. follow=False: never through a symlink (one
    swapped in after a caller's check is refused at open)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise KvrunError(f"{path}: no such {what}") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise KvrunError(f"{path}: a symlink, not a {what}") from None
        raise KvrunError(f"{path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise KvrunError(f"{path}: is a directory, not a {what}")
        if not stat.S_ISREG(st.st_mode):
            raise KvrunError(f"{path}: not a regular file (a FIFO, device or socket), not a {what}")
        if st.st_size > limit:
            raise KvrunError(f"{path}: {st.st_size} bytes, larger than any {what} this can "
                             f"read ({limit} bytes)")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)                # it may have grown since the fstat
    except OSError as e:
        raise KvrunError(f"{path}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise KvrunError(f"{path}: larger than any {what} this can read ({limit} bytes)")
    return data


class FileLock:
    """An exclusive lock on `path` for this process: a flock on the hidden file
    `.<name>.lock` beside it, or beside the file a symlink at `path` names (the file itself
    is replaced by renames, so it cannot hold a lock). A second holder, in this process or another, gets a KvrunError at once instead
    of waiting; the lock ends with `release()` or with the process. The lock file stays (a
    lock file removed while another process opens it would let two hold it)."""

    def __init__(self, path, what: str = "file"):
        p = Path(os.path.realpath(path))         # two symlinks to one file: one lock
        lock = p.parent / f".{p.name}.lock"
        try:
            self.fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, PRIVATE)
        except OSError as e:
            raise KvrunError(f"{path}: cannot lock ({lock.name}: {e.strerror or e})") from None
        try:
            if not stat.S_ISREG(os.fstat(self.fd).st_mode):
                raise KvrunError(f"{path}: cannot lock ({lock.name} is not a regular file)")
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise KvrunError(f"{path}: {what} in use by another kvrun (only one may write it "
                             f"at a time)") from None
        except BaseException:
            os.close(self.fd)
            raise
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)                   # closing the descriptor drops the flock
            self.fd = None

    def __enter__(self) -> "FileLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


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
        home = knobs.home()
    return Path(home).expanduser().absolute()
