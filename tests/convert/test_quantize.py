"""Weight quantization at conversion (kvrun.convert.quantize): int8 rows and int4 groups within
half a step of the source, GGUF's Q4_0 / Q4_1 blocks repacked bit for bit and Q4_K within its
fp16 rounding bound, which tensors are quantized to what, the default format a GGUF's types
imply, and a bad format or group refused in one line."""
import numpy as np
import pytest
import torch

from kvrun.convert.quantize import (check_weight_format, default_weights, dequantize, quantize,
                                    quantize_int4, quantize_int8, repack_gguf_q4)
from kvrun.errors import KvrunError
from kquants import q4_k_blocks


def _w(N=6, K=256, seed=0):
    return torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.1


def test_int8_rows_within_half_a_step():
    w = _w()
    w[2] = 0                                                             # a zero row stays zero
    p = quantize_int8(w)
    assert p["qweight"].dtype == torch.int8 and p["qweight"].abs().max() == 127
    err = (dequantize(p) - w).abs()
    assert torch.all(err <= p["scales"][:, None] / 2 + 1e-7) and not dequantize(p)[2].any()


@pytest.mark.parametrize("group", [32, 128])
def test_int4_groups_within_half_a_step(group):
    w = _w(seed=group)
    p = quantize_int4(w, group)
    assert p["qweight"].shape == (6, 128) and p["scales"].shape == (6, 256 // group)
    step = p["scales"].float().repeat_interleave(group, 1)
    assert torch.all((dequantize(p) - w).abs() <= step / 2 + 2e-3 * step + 1e-6)


def test_what_is_quantized_to_what():
    emb = quantize("model.embed_tokens.weight", _w(), "int4", 32)
    proj = quantize("model.layers.0.mlp.up_proj.weight", _w(), "int4", 64)
    assert set(emb) == {"model.embed_tokens.qweight", "model.embed_tokens.scales"}     # int8 rows
    assert set(proj) == {f"model.layers.0.mlp.up_proj.{k}" for k in ("qweight", "scales", "mins")}
    assert proj["model.layers.0.mlp.up_proj.scales"].shape == (6, 4)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_q4_blocks_repack_to_gguf_values(qtype):
    gguf = pytest.importorskip("gguf")
    T = gguf.GGMLQuantizationType
    w = _w().numpy()
    blocks = q4_k_blocks(w) if qtype == "Q4_K" else gguf.quants.quantize(w, T[qtype])
    want = torch.from_numpy(np.array(gguf.quants.dequantize(blocks, T[qtype]))).float()
    p = repack_gguf_q4(blocks, qtype, w.shape)
    if qtype == "Q4_K":        # scale and min rounded once to fp16: half an ulp of each
        s, m = (p[k].float().abs().repeat_interleave(32, 1) for k in ("scales", "mins"))
        assert torch.all((dequantize(p) - want).abs() <= 2.0 ** -11 * (15 * s + m) + 1e-7)
    else:
        torch.testing.assert_close(dequantize(p), want, rtol=0, atol=1e-7)


def test_default_weights_from_the_linear_types():
    assert default_weights({"Q4_K": 60, "Q6_K": 40}) == "int4"
    assert default_weights({"Q4_K": 40, "Q6_K": 35, "F16": 25}) == "int8"
    assert default_weights({"Q5_0": 30, "F32": 70}) == "float"
    assert default_weights({}) == "float"


def test_bad_format_or_group_is_refused():
    check_weight_format("int4", 64)
    with pytest.raises(KvrunError, match="unknown weight format 'int2'"):
        check_weight_format("int2", 32)
    with pytest.raises(KvrunError, match="int4 group must be one of 32, 64, 128 \\(got 48\\)"):
        check_weight_format("int4", 48)
