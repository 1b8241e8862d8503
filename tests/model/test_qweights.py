"""Weight-only quantized weights (runtime/model/qlinear.py, convert/quantize.py).

References: a dense F.linear over the dequantized weights (the layers), `gguf.quants`'
own quantize/dequantize (the GGUF repacking), and the fp32 conversion of the same file
(whole tiny models converted at every weight format).
"""
from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import kvrun
from kvrun.convert import convert_gguf, convert_hf
from kvrun.convert.quantize import (op_dequantize, quantize_int4, quantize_int8, rel_error,
                                    repack_gguf_q4)
from kvrun.model import qlinear
from kvrun.errors import KvrunError
from kvrun.model.qlinear import (Int4Linear, Int8Linear, dequantize_int4, dequantize_int8,
                                   int4_group, pack_int4, unpack_int4)
from tiny import write_tiny_hf

SHAPES = [(576, 1536), (192, 576), (1536, 576), (40, 96)]        # (out N, in K)
BF16 = lambda t: t.to(torch.bfloat16).float()                     # noqa: E731


def _weights(N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    w[:, ::7] += 0.02                    # groups with a nonzero mean: the min/zero matters
    return w


def _int8_layer(w, bias=None):
    lin = Int8Linear(w.shape[1], w.shape[0], bias=bias is not None)
    parts = quantize_int8(w)
    lin.qweight.copy_(parts["qweight"])
    lin.scales.copy_(parts["scales"])
    if bias is not None:
        lin.bias.data.copy_(bias)
    lin.prepare()
    return lin


def _int4_layer(w, group, bias=None):
    g = int4_group(w.shape[1], group)
    lin = Int4Linear(w.shape[1], w.shape[0], g, bias=bias is not None)
    parts = quantize_int4(w, g)
    for k in ("qweight", "scales", "mins"):
        getattr(lin, k).copy_(parts[k])
    if bias is not None:
        lin.bias.data.copy_(bias)
    lin.prepare()
    return lin


# -- layers vs a dequantized reference ------------------------------------------------------

@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 200])      # fused op (≤ 32 rows) and dequant + GEMM
def test_int8_linear_equals_dequantized_reference(N, K, rows):
    w, b = _weights(N, K), torch.randn(N) * 0.1
    lin = _int8_layer(w, b)
    x = torch.randn(2, rows, K) if rows == 200 else torch.randn(rows, K)
    y = lin(x)
    ref = F.linear(x, dequantize_int8(lin.qweight, lin.scales), b)
    if not lin.uses_fused_op(x.numel() // K):   # fp32 dequantized path: same numbers
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    else:   # the op sees bf16 activations and scales and rounds its output to bf16
        emu = F.linear(BF16(x), lin.qweight.float() * BF16(lin.scales)[:, None], b)
        torch.testing.assert_close(y, emu, rtol=1e-2, atol=2e-3 * emu.abs().max().item())
        assert rel_error(ref, y) < 1e-2
    assert rel_error(F.linear(x, w, b), ref) < 1e-2           # int8 itself is close to w


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 4, 100])
def test_int4_linear_equals_dequantized_reference(N, K, group, rows):
    w, b = _weights(N, K, seed=1), torch.randn(N) * 0.1
    lin = _int4_layer(w, group, b)
    assert K % lin.group == 0 and lin.group <= group
    x = torch.randn(rows, K)
    y = lin(x)
    ref = F.linear(x, dequantize_int4(lin.qweight, lin.scales, lin.mins), b)
    assert lin.uses_fused_op(rows) == (rows <= qlinear.QUANT_OP_MAX_ROWS and N % 16 == 0)
    if not lin.uses_fused_op(rows):
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    else:
        parts = {"qweight": lin.qweight, "scales": lin.scales, "mins": lin.mins}
        emu = F.linear(BF16(x), op_dequantize(parts), b)
        torch.testing.assert_close(y, emu, rtol=1e-2, atol=2e-3 * emu.abs().max().item())
        assert rel_error(ref, y) < 1e-2
    assert rel_error(F.linear(x, w, b), ref) < 0.15           # 4-bit RTN on Gaussian weights


@pytest.mark.parametrize("group", [32, 64])
def test_int4_pack_round_trip_and_rtn_bound(group):
    codes = torch.randint(0, 16, (24, 192), generator=torch.Generator().manual_seed(3))
    packed = pack_int4(codes, group)
    assert packed.shape == (24, 96) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed, group, torch.int64), codes)
    # stored layout: byte j of a group = column j (low nibble) and j + G/2 (high nibble)
    assert packed[0, 0].item() == codes[0, 0].item() | (codes[0, group // 2].item() << 4)
    w = _weights(24, 192, seed=4)
    parts = quantize_int4(w, group)
    err = (dequantize_int4(**parts) - w).abs().view(24, -1, group)
    assert (err <= parts["scales"].float()[..., None] / 2 + 1e-6).all()


def test_int4_group_fallback():
    assert int4_group(576, 128) == 64 and int4_group(1536, 128) == 128
    assert int4_group(96, 64) == 32 and int4_group(40, 32) == 0


# -- GGUF Q4_0 / Q4_1 blocks repacked ---------------------------------------------------------

@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("N,K", [(192, 576), (576, 1536)])
def test_gguf_q4_repack_dequantizes_exactly(qtype, N, K):
    import gguf
    T = gguf.GGMLQuantizationType[qtype]
    w = _weights(N, K, seed=5).numpy()
    blocks = gguf.quants.quantize(w, T)                                     # (N, bytes) uint8
    want = torch.from_numpy(np.array(gguf.quants.dequantize(blocks, T)))
    parts = repack_gguf_q4(blocks, qtype, (N, K))
    torch.testing.assert_close(dequantize_int4(**parts), want, rtol=0, atol=0)
    # the layer computes with exactly these weights on the prefill path ...
    lin = Int4Linear(K, N, 32)
    for k, v in parts.items():
        getattr(lin, k).copy_(v)
    lin.prepare()
    x = torch.randn(64, K)
    torch.testing.assert_close(lin(x), F.linear(x, want), rtol=1e-5, atol=1e-5)
    # ... and with bf16 scale/zero in the fused decode op: quantified, well under 1 %
    assert rel_error(want, op_dequantize(parts)) < 5e-3


def test_smollm2_q4_1_tensors_repack_exactly(smollm2_reader):
    """Real Q4_1 tensors of the default model: exact, and the bf16 op error is ~0.2 %."""
    import gguf
    for t in smollm2_reader.tensors:
        if t.name not in ("blk.0.attn_q.weight", "blk.7.ffn_down.weight", "blk.29.attn_v.weight"):
            continue
        shape = tuple(int(d) for d in reversed(t.shape))
        want = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
        parts = repack_gguf_q4(t.data, "Q4_1", shape)
        torch.testing.assert_close(dequantize_int4(**parts), want, rtol=0, atol=0)
        assert rel_error(want, op_dequantize(parts)) < 4e-3, t.name


# -- whole tiny models at every weight format -------------------------------------------------

@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """An HF-layout llama folder (2 layers, ffn 96: int4 rows of 64 and 96 columns)."""
    return write_tiny_hf(tmp_path_factory.mktemp("hfq"))


FORMATS = [("fp32", "float", 32), ("bf16", "float", 32), ("fp16", "float", 32),
           ("fp32", "int8", 32), ("fp32", "int4", 32), ("fp32", "int4", 64), ("bf16", "int4", 128)]


@pytest.mark.parametrize("dtype,weights,group", FORMATS)
def test_tiny_model_every_format_generates(tiny_hf, tmp_path, dtype, weights, group):
    convert_hf(tiny_hf, tmp_path / "ref", dtype="fp32")
    ref = kvrun.load(tmp_path / "ref", ctx=64)
    lines = []
    cfg = convert_hf(tiny_hf, tmp_path / "q", dtype=dtype, weights=weights, group=group,
                     log=lines.append)
    assert (cfg.weights, cfg.weight_group) == (weights, group if weights == "int4" else 0)
    stored = load_file(str(tmp_path / "q" / "model.safetensors"))
    if weights == "float":
        assert not lines and "model.embed_tokens.weight" in stored
    else:
        assert len(lines) == 15 and "err" in lines[0]          # 14 linears + the embedding
        assert stored["model.embed_tokens.qweight"].dtype == torch.int8
        qw = stored["model.layers.0.mlp.down_proj.qweight"]
        assert qw.dtype == (torch.uint8 if weights == "int4" else torch.int8)
        assert not any(k.startswith("lm_head.") for k in stored)               # tied
    m = kvrun.load(tmp_path / "q", ctx=64)
    ids = m.tokenize("hello quantized world")
    full, want = m.logits(ids), ref.logits(ids)
    # random tiny models amplify weight noise; the layer tests above bound the layers tightly
    tol = {"fp32": 1e-5, "bf16": 0.05, "fp16": 0.01}[dtype] if weights == "float" else \
        {"int8": 0.05, "int4": 0.4}[weights]
    assert rel_error(want, full) < tol
    steps = [m.engine.prefill(ids[:1])] + [m.engine.decode_step(t) for t in ids[1:]]
    assert rel_error(full, torch.stack(steps)) < 0.03           # fused decode op ≈ prefill
    m.reset()
    events = list(m.stream("abc", 6, temp=0))
    assert events[-1].finish_reason in ("length", "stop") and sum(e.token_id is not None
                                                                  for e in events) >= 1


def test_tiny_gguf_q4_1_to_int4_is_exact(tiny_hf, smollm2_reader, tmp_path):
    """A GGUF whose linears are Q4_1: int4 g32 stores exactly gguf's values (Q/K rows
    un-permuted like the fp32 conversion), and its model matches the fp32 conversion."""
    import gguf
    from test_convert import _write_gguf
    state = load_file(str(tiny_hf / "model.safetensors"))
    state = {k: v for k, v in state.items()}
    state["model.embed_tokens.weight"] = torch.randn(49152, 64) * 0.3     # SmolLM2's vocab
    T = gguf.GGMLQuantizationType
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "llama", state, smollm2_reader, True,
                {"_proj.weight": T.Q4_1, "embed_tokens.weight": T.Q8_0})
    convert_gguf(path, tmp_path / "f32", dtype="fp32")
    lines = []
    convert_gguf(path, tmp_path / "q4", dtype="fp32", weights="int4", group=32, log=lines.append)
    assert sum("repacked" in ln for ln in lines) == 14
    f32, q4 = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("f32", "q4"))
    for name in [k for k in f32 if k.endswith("_proj.weight")]:
        base = name[:-len(".weight")]
        got = dequantize_int4(q4[base + ".qweight"], q4[base + ".scales"], q4[base + ".mins"])
        torch.testing.assert_close(got, f32[name], rtol=0, atol=0, msg=name)
    a, b = kvrun.load(tmp_path / "f32", ctx=32), kvrun.load(tmp_path / "q4", ctx=32)
    ids = [5, 300, 1200, 77, 4000]
    assert rel_error(a.logits(ids), b.logits(ids)) < 0.02      # only the int8 embedding differs


def test_bad_weight_options(tiny_hf, tmp_path):
    with pytest.raises(KvrunError, match="unknown weight format"):
        convert_hf(tiny_hf, tmp_path / "x", weights="int3")
    with pytest.raises(KvrunError, match="int4 group must be one of"):
        convert_hf(tiny_hf, tmp_path / "x", weights="int4", group=48)
    assert not (tmp_path / "x").exists()


def test_info_reports_format(tiny_hf, tmp_path):
    from kvrun.model.info import model_info
    convert_hf(tiny_hf, tmp_path / "q", weights="int4", group=32)
    d = model_info(tmp_path / "q")
    assert d["weights"].startswith("int4 (group 32; embedding int8)") and "MiB" in d["weights"]
    convert_hf(tiny_hf, tmp_path / "f", dtype="fp32")
    full = model_info(tmp_path / "f")
    assert d["parameters"] == full["parameters"]
