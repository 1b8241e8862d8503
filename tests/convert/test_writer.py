"""Writing a model dir (kvrun.convert.writer): the destination refused before anything is
read or created when it is the cwd, home or one of their parents, a killed conversion's temp
dir swept by the next, the dtype names, and a tensor set checked against the config's
shapes with a one-line error naming the tensor."""
from __future__ import annotations

import os

import pytest
import torch

from kvrun.convert.writer import check_destination, expected_shapes, torch_dtype, validate_tensors
from kvrun.errors import KvrunError
from tiny import tiny_config


def test_library_check_destination(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for bad in ("", " ", ".", str(tmp_path)):
        with pytest.raises(KvrunError):
            check_destination(bad, overwrite=True)
    home = tmp_path / "elsewhere" / "me"                # $HOME not above the cwd
    home.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    for bad in ("~", str(home.parent)):
        with pytest.raises(KvrunError, match="is the home directory or one of its parents"):
            check_destination(bad, overwrite=True)
    assert check_destination("new/dir", overwrite=False) == tmp_path / "new" / "dir"
    assert not (tmp_path / "new").exists()              # checking creates nothing


def test_a_killed_conversions_temp_dir_is_swept(tmp_path):
    """kill -9 mid-convert left a hidden 216 MB temp dir forever; the next conversion to
    the same destination removes it once its writer's PID no longer runs (a running
    writer's, or another destination's, stay)."""
    from kvrun.convert.writer import atomic_dir
    from test_files import _dead_pid
    out = tmp_path / "m"
    dead = tmp_path / f".m.tmp-{_dead_pid()}-0badf00d"
    live = tmp_path / ".m.tmp-1-0badf00d"                # pid 1 runs
    other = tmp_path / f".n.tmp-{_dead_pid()}-0badf00d"
    for d in (dead, live, other):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half")
    with atomic_dir(out) as tmp:
        assert f".m.tmp-{os.getpid()}-" in tmp.name
        (tmp / "config.json").write_text("{}")
    assert not dead.exists() and live.exists() and other.exists()
    assert (out / "config.json").read_text() == "{}"



def test_dtype_names():
    assert torch_dtype("bf16") is torch.bfloat16 and torch_dtype("fp32") is torch.float32
    with pytest.raises(KvrunError, match="int3"):
        torch_dtype("int3")


def test_validate_tensors_names_the_first_difference():
    cfg = tiny_config()
    good = {k: torch.zeros(s) for k, s in expected_shapes(cfg).items()}
    validate_tensors(cfg, good)                                          # no error
    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(KvrunError, match=f"missing 1 tensors the config needs \\(e.g. {q}\\)"):
        validate_tensors(cfg, {k: v for k, v in good.items() if k != q})
    with pytest.raises(KvrunError, match="1 tensors kvrun does not use \\(e.g. extra.weight\\)"):
        validate_tensors(cfg, {**good, "extra.weight": torch.zeros(1)})
    bad = (good[q].shape[0] + 1, good[q].shape[1])
    with pytest.raises(KvrunError, match=f"tensor {q} has shape \\({bad[0]}, {bad[1]}\\)"):
        validate_tensors(cfg, {**good, q: torch.zeros(bad)})
