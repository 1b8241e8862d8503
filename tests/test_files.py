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
