"""Loading a kvrun model directory (runtime/model/loader.py): --dtype values, what a path
that is not a model directory is said to be, damaged weights, and the loaded weights."""
import shutil

import pytest
import torch
from safetensors.torch import load_file

from kvrun.errors import KvrunError
from kvrun.model.loader import check_model_dir, load_config, load_state, load_transformer, parse_dtype


@pytest.mark.parametrize("name,want", [("auto", (torch.float32, torch.float16)),
                                       ("fp32", (torch.float32, None)), ("bf16", (torch.bfloat16, None))])
def test_parse_dtype(name, want):
    assert parse_dtype(name) == want


def test_an_unknown_dtype_is_refused():
    with pytest.raises(KvrunError, match=r"unknown dtype 'fp8' \(auto, fp32, fp16, bf16\)"):
        parse_dtype("fp8")


def test_what_a_path_is_when_it_is_not_a_model_directory(tiny_dir, tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    hf = tmp_path / "hf"
    shutil.copytree(tiny_dir, hf)
    (hf / "model.safetensors").rename(hf / "model-00001-of-00002.safetensors")
    no_tok = tmp_path / "notok"
    shutil.copytree(tiny_dir, no_tok)
    (no_tok / "tokenizer.json").unlink()
    for path, msg in ((tmp_path / "gone", "no such file or directory"),
                      (gguf, "is a GGUF file: convert it first"),
                      (tmp_path, "no config.json"),
                      (hf, "looks like an HF checkpoint"),
                      (no_tok, "missing tokenizer.json")):
        with pytest.raises(KvrunError, match=msg):
            check_model_dir(path)
    assert check_model_dir(str(tiny_dir)) == tiny_dir


def test_truncated_weights_are_one_error(tiny_dir, tmp_path):
    d = tmp_path / "cut"
    shutil.copytree(tiny_dir, d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(KvrunError, match="the file is truncated or corrupt"):
        load_state(d)


def test_the_loaded_transformer_holds_the_files_weights(tiny_dir):
    cfg = load_config(tiny_dir)
    m = load_transformer(tiny_dir, cfg, torch.float32, None)
    state = load_file(str(tiny_dir / "model.safetensors"))
    got = m.state_dict()
    assert all(torch.equal(got[k], t) for k, t in state.items())
    assert not m.training
