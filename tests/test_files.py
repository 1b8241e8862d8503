"""Output files are whole or absent: runtime/files.py, used by profiles and bench plots."""
from __future__ import annotations

import pytest

from kvrun.errors import KvrunError
from kvrun.files import atomic_output, check_writable


def test_written_whole_on_success(tmp_path):
    out = tmp_path / "p.json"
    out.write_text("old")
    with atomic_output(out) as tmp:
        tmp.write_text("new")
        assert out.read_text() == "old"              # not replaced until the block ends
    assert out.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_mode_follows_the_umask_like_open(tmp_path, mask):
    """A written file gets the mode open() would give it under the umask, not the 0600 of
    the temporary file it was written as (a profile or plot others could not read)."""
    import os
    old = os.umask(mask)
    try:
        with atomic_output(tmp_path / "p.json") as tmp:
            tmp.write_text("x")
    finally:
        os.umask(old)
    assert (tmp_path / "p.json").stat().st_mode & 0o777 == 0o666 & ~mask


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_nothing_left_on_error_or_interrupt(tmp_path, exc):
    out = tmp_path / "p.json"
    with pytest.raises(exc):
        with atomic_output(out) as tmp:
            tmp.write_text("half")
            raise exc()
    assert list(tmp_path.iterdir()) == []


def test_bad_destinations_before_any_work(tmp_path):
    for bad in (tmp_path, tmp_path / "missing" / "p.json"):
        with pytest.raises(KvrunError):
            check_writable(bad)
    assert check_writable(tmp_path / "ok.json") == tmp_path / "ok.json"


def test_save_profile_is_atomic(tmp_path, monkeypatch):
    """An interrupt while the profile is written leaves neither half a file nor a .tmp
    (it wrote `p.json.tmp` and left it behind)."""
    from pathlib import Path
    from kvrun.kv import profile as P
    out = tmp_path / "p.json"

    def half_then_interrupt(self, text, *a, **k):
        with open(self, "w") as f:
            f.write(text[: len(text) // 2])
        raise KeyboardInterrupt
    monkeypatch.setattr(Path, "write_text", half_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        P.save_profile(out, [("kivi-4", "kivi-4")])
    assert list(tmp_path.iterdir()) == []


# -- only a regular file is ever replaced ----------------------------------------------------------

def _special(kind, d):
    """A FIFO, a socket or a character device (/dev/null's numbers; root only) in `d`."""
    import os
    import socket
    p = d / kind
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(p))
        s.close()
    else:
        try:
            os.mknod(p, 0o666 | __import__("stat").S_IFCHR, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("mknod needs root")
    return p


@pytest.mark.parametrize("kind", ["fifo", "socket", "device"])
def test_a_special_file_is_never_replaced(tmp_path, kind):
    """A save over a device node, FIFO or socket is an error and leaves it as it was (it
    left a regular file in its place: saving over /dev/full replaced the system's)."""
    import os
    import stat
    p = _special(kind, tmp_path)
    mode = os.lstat(p).st_mode
    with pytest.raises(KvrunError, match="not a regular file"):
        with atomic_output(p) as tmp:
            tmp.write_text("x")
    assert os.lstat(p).st_mode == mode and not stat.S_ISREG(mode)
    assert [q.name for q in tmp_path.iterdir()] == [kind]


def test_dev_full_is_an_error_not_a_replacement():
    import os
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    with pytest.raises(KvrunError, match="not a regular file"):
        check_writable("/dev/full")


def test_a_symlink_to_a_file_writes_its_target(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    with atomic_output(link) as tmp:
        tmp.write_text("new")
    assert link.is_symlink() and target.read_text() == "new"


def test_private_mode(tmp_path):
    from kvrun.files import PRIVATE
    with atomic_output(tmp_path / "s", mode=PRIVATE) as tmp:
        tmp.write_text("x")
    assert (tmp_path / "s").stat().st_mode & 0o777 == 0o600


def _dead_pid() -> int:
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_killed_writers_temp_file_is_swept(tmp_path):
    """The temporary file of a writer that no longer runs (kill -9 mid-write) goes at the
    next write of the same output; a running writer's, another output's, stay."""
    import os
    dead = tmp_path / f".p.json.{_dead_pid()}-abc123.tmp"
    live = tmp_path / ".p.json.1-abc123.tmp"            # pid 1 runs
    other = tmp_path / f".q.json.{_dead_pid()}-abc123.tmp"
    for f in (dead, live, other):
        f.write_text("half")
    with atomic_output(tmp_path / "p.json") as tmp:
        assert f".{os.getpid()}-" in tmp.name
        tmp.write_text("x")
    assert not dead.exists() and live.exists() and other.exists()


# -- reading: a regular file, with a size bound --------------------------------------------------

def test_read_regular_refuses_fifo_and_devices_without_blocking(tmp_path):
    """A FIFO nobody writes, or /dev/zero, is refused at once (reading hung, or ran until
    MemoryError)."""
    import os
    from kvrun.files import read_regular
    from refusals import refusals
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    errors = refusals(lambda p: read_regular(p, 1 << 20), (fifo, "/dev/zero", tmp_path), 10)
    assert len(errors) == 3 and "not a regular file" in errors[0] and "directory" in errors[2]


def test_read_regular_size_bound(tmp_path):
    from kvrun.files import read_regular
    p = tmp_path / "big"
    with open(p, "wb") as f:
        f.truncate(1 << 30)                 # sparse: the size is checked before any read
    with pytest.raises(KvrunError, match="larger"):
        read_regular(p, 1 << 20)
    p.write_bytes(b"abc")
    assert read_regular(p, 3) == b"abc"


def test_lock_refuses_a_second_holder(tmp_path):
    import subprocess
    import sys
    from kvrun.files import FileLock
    f = tmp_path / "s.kvs"
    lock = FileLock(f, "session")
    with pytest.raises(KvrunError, match="in use"):
        FileLock(f, "session")
    other = subprocess.run([sys.executable, "-c", "import sys; from kvrun.files import FileLock\n"
                            "from kvrun.errors import KvrunError\ntry: FileLock(sys.argv[1])\n"
                            "except KvrunError as e: print(e); sys.exit(3)", str(f)],
                           capture_output=True, text=True)
    assert other.returncode == 3 and "in use" in other.stdout
    link = tmp_path / "link.kvs"
    link.symlink_to(f)
    with pytest.raises(KvrunError, match="in use"):     # the same file by another name
        FileLock(link)
    lock.release()
    FileLock(f).release()
