"""`kvrun info` (runtime/model/info.py): what a model directory holds, as typed facts and as
the display rows."""
import pytest
from safetensors.torch import load_file

from kvrun.convert import convert_hf
from kvrun.errors import KvrunError
from kvrun.model.info import model_facts, model_info, weight_format
from test_qweights import tiny_hf  # noqa: F401  (a fixture: an HF-layout tiny llama)
from tiny import tiny_config


@pytest.mark.parametrize("kw,want", [(dict(weights="int8"), "int8 (per channel; embedding int8)"),
                                     (dict(weights="int4", weight_group=64), "int4 (group 64; embedding int8)"),
                                     (dict(torch_dtype="bf16"), "bf16")])
def test_weight_format_names_the_stored_kind(kw, want):
    assert weight_format(tiny_config(**kw)) == want


def test_facts_of_the_tiny_model(tiny_dir):
    d = model_facts(tiny_dir)
    assert (d["architecture"], d["layers"], d["heads"], d["kv_heads"], d["head_dim"]) == ("llama", 2, 4, 2, 16)
    assert d["parameters"] == sum(t.numel() for t in load_file(str(tiny_dir / "model.safetensors")).values())
    assert d["sliding_layers"] == 0 and d["sliding_window"] is None and d["quirks"] == {}
    assert d["weights"]["format"] == "fp32" and d["weights"]["group"] is None
    rows = model_info(tiny_dir)
    assert rows["heads (q / kv)"] == "4 / 2, head dim 16" and rows["layers"] == 2 and "quirks" not in rows


def test_info_of_a_missing_directory_is_one_error(tmp_path):
    with pytest.raises(KvrunError, match="no such file or directory"):
        model_facts(tmp_path / "nope")


def test_info_reports_format(tiny_hf, tmp_path):
    from kvrun.model.info import model_info
    convert_hf(tiny_hf, tmp_path / "q", weights="int4", group=32)
    d = model_info(tmp_path / "q")
    assert d["weights"].startswith("int4 (group 32; embedding int8)") and "MiB" in d["weights"]
    convert_hf(tiny_hf, tmp_path / "f", dtype="fp32")
    full = model_info(tmp_path / "f")
    assert d["parameters"] == full["parameters"]
