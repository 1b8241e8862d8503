"""Conversions that fail or are refused leave nothing behind: a write that dies (an error or
Ctrl-C) leaves no destination and no temporary directory, overwrite replaces only a kvrun
model directory and a failed replace keeps the old one, and each user error (a missing path,
a truncated GGUF, corrupt safetensors, an unsupported architecture or rope scaling, a shape
mismatch, a missing tokenizer, an unknown dtype) is a KvrunError naming the problem.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvrun.convert import convert_gguf, convert_hf
from kvrun.errors import KvrunError
from test_convert import _tiny_llama


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm2_dir):
    """test_convert.py's tiny Llama checkpoint: (dir, state dict)."""
    return _tiny_llama(tmp_path_factory.mktemp("hf"), smollm2_dir)


# -- atomic writes ---------------------------------------------------------------------------

def _leftovers(parent: Path, name: str) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]


@pytest.mark.parametrize("exc", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_failed_write_leaves_nothing(tiny_llama, tmp_path, monkeypatch, exc):
    import kvrun.convert.writer as writer

    def boom(*a, **k):
        raise exc
    monkeypatch.setattr(writer, "save_file", boom)
    with pytest.raises(type(exc)):
        convert_hf(tiny_llama[0], tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert _leftovers(tmp_path, "out") == []


def test_overwrite(tiny_llama, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(KvrunError, match=r"already exists and is not empty \(overwrite=True"):
        convert_hf(tiny_llama[0], out)                  # the library's own words
    # overwrite replaces only a kvrun model directory: this one may be a user's data
    with pytest.raises(KvrunError, match=r"not a kvrun model directory \(it holds 'stale.txt'\)"):
        convert_hf(tiny_llama[0], out, overwrite=True)
    assert (out / "stale.txt").read_text() == "old"
    (out / "stale.txt").unlink()
    convert_hf(tiny_llama[0], out, dtype="fp32")                 # a model dir to replace
    first = (out / "model.safetensors").read_bytes()
    import kvrun.convert.writer as writer
    real = writer.save_file
    monkeypatch.setattr(writer, "save_file", lambda *a, **k: (_ for _ in ()).throw(OSError("io")))
    with pytest.raises(KvrunError, match="cannot write .*: io"):
        convert_hf(tiny_llama[0], out, overwrite=True)
    assert (out / "model.safetensors").read_bytes() == first     # a failed replace keeps it
    monkeypatch.setattr(writer, "save_file", real)
    convert_hf(tiny_llama[0], out, overwrite=True)               # bf16 now
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors",
                                                      "tokenizer.json"]
    assert (out / "model.safetensors").read_bytes() != first
    assert _leftovers(tmp_path, "out") == []


# -- user errors -----------------------------------------------------------------------------

def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_paths(tmp_path):
    with pytest.raises(KvrunError, match="no such directory"):
        convert_hf(tmp_path / "nope", tmp_path / "out")
    with pytest.raises(KvrunError, match="no such file"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(KvrunError, match="config.json: no such file"):
        convert_hf(tmp_path / "empty", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_truncated_gguf(smollm2_gguf, tmp_path):
    bad = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as f:
        bad.write_bytes(f.read(1 << 20))
    with pytest.raises(KvrunError, match="not a valid GGUF file or truncated"):
        convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path, "out") == []


def test_corrupt_safetensors(tiny_llama, tmp_path):
    src = _copy(tiny_llama[0], tmp_path / "src")
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(KvrunError, match="corrupt or truncated safetensors"):
        convert_hf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _edit_config(src: Path, **changes) -> None:
    hf = json.loads((src / "config.json").read_text())
    hf.update(changes)
    (src / "config.json").write_text(json.dumps(hf))


def test_unsupported_architecture(tiny_llama, tmp_path):
    src = _copy(tiny_llama[0], tmp_path / "src")
    _edit_config(src, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(KvrunError, match="unsupported architecture 'GPT2LMHeadModel'"):
        convert_hf(src, tmp_path / "out")


def test_unsupported_rope_scaling(tiny_llama, tmp_path):
    src = _copy(tiny_llama[0], tmp_path / "src")
    _edit_config(src, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(KvrunError, match="unsupported rope scaling 'yarn'"):
        convert_hf(src, tmp_path / "out")


def test_shape_mismatch(tiny_llama, tmp_path):
    src = _copy(tiny_llama[0], tmp_path / "src")
    _edit_config(src, intermediate_size=128)
    with pytest.raises(KvrunError, match=r"mlp.gate_proj.weight has shape \(96, 64\), "
                                         r"the config implies \(128, 64\)"):
        convert_hf(src, tmp_path / "out")


def test_missing_tokenizer(tiny_llama, tmp_path):
    src = _copy(tiny_llama[0], tmp_path / "src")
    (src / "tokenizer.json").unlink()
    with pytest.raises(KvrunError, match="tokenizer.json is missing"):
        convert_hf(src, tmp_path / "out")


def test_bad_dtype(tiny_llama, tmp_path):
    with pytest.raises(KvrunError, match="unknown dtype 'int4'"):
        convert_hf(tiny_llama[0], tmp_path / "out", dtype="int4")
