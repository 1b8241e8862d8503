"""tools/design_figures.py: each figure the docstrings cite is measured (a positive time),
and the bf16 scale/zero error is computed from the default model's int4 weights."""
import pytest

from tool_module import load_tool


def test_every_timed_figure_is_measured():
    tool = load_tool("design_figures")
    rows = tool.weight_ops(reps=2) + tool.conversions(reps=2) + tool.flush(reps=2)
    names = [n for n, _ in rows]
    assert "int8 op, 1 rows, torch.bfloat16" in names and "dequantize int4 + fp32 GEMM, 512 rows" in names
    assert "uint8 → fp32" in names and "KIVI-4 K flush, torch store" in names
    assert all(v > 0 for _, v in rows)


def test_bf16_scale_error_is_small_but_not_zero():
    """The fused op's bf16 (scale, zero) round the stored fp16 pair: a relative error of the
    weights above 0 and below bf16's 2^-9 relative step (0.2 %), times a few."""
    tool = load_tool("design_figures")
    pytest.importorskip("safetensors")
    (_, pct), = tool.scale_error()
    assert 0.01 < pct < 1.0
