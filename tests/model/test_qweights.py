"""Weight-only quantized weights as converted (convert/quantize.py) and run: GGUF repacking
against `gguf.quants`' own quantize/dequantize, and whole tiny models converted at every
weight format against the fp32 conversion of the same file. The layers themselves
(runtime/model/qlinear.py): test_qlinear.py.
"""
from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import kvrun
from kvrun.convert import convert_gguf, convert_hf
from kvrun.convert.quantize import default_weights, op_dequantize, rel_error, repack_gguf_q4
from kvrun.errors import KvrunError
from kvrun.model.qlinear import Int4Linear, Int8Linear, dequantize_int4
from test_qlinear import _weights
from tiny import write_tiny_hf

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


# -- GGUF Q4_K super-blocks repacked; the format a GGUF converts to ---------------------------

@pytest.mark.parametrize("exact", [True, False])
def test_gguf_q4_k_repack_keeps_codes_and_rounds_scales_once(exact):
    """Random Q4_K super-blocks (any 6-bit scales, any codes) → int4 g32 parts. With d and
    dmin powers of two every d·sc and dmin·m is an fp16: bit for bit gguf's values. Otherwise
    each weight is within the docstring's bound of them (half an fp16 ulp of scale and min)."""
    import gguf
    N, K = 24, 512
    rng = np.random.default_rng(3)
    nb = N * K // 256
    blocks = rng.integers(0, 256, (nb, 144), dtype=np.uint8)
    if exact:
        d, dmin = (2.0 ** rng.integers(-14, -8, (nb, 1)) for _ in range(2))
    else:
        d, dmin = (rng.uniform(1e-4, 4e-3, (nb, 1)) for _ in range(2))
    blocks[:, 0:2] = d.astype(np.float16).view(np.uint8)
    blocks[:, 2:4] = dmin.astype(np.float16).view(np.uint8)
    data = blocks.reshape(N, K // 256 * 144)
    want = torch.from_numpy(np.array(gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q4_K)))
    parts = repack_gguf_q4(data, "Q4_K", (N, K))
    assert parts["qweight"].shape == (N, K // 2) and parts["scales"].dtype == torch.float16
    got = dequantize_int4(**parts)
    if exact:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        return
    s, m = (parts[k].float().repeat_interleave(32, 1) for k in ("scales", "mins"))
    bound = 2.0 ** -11 * (15 * s.abs() + m.abs()) * 1.001 + 1e-9
    assert ((got - want).abs() <= bound).all()
    assert (got != want).float().mean() > 0.5           # the rounding is real: the bound is tested


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_q4_repack_folds_a_scale_into_scale_and_min(qtype):
    """Granite's residual_scale: a power of two scales the repack exactly (the unscaled
    parts' values times it, bit for bit; for Q4_0/Q4_1 those are gguf's); 0.22 rounds scale
    and min once, within the Q4_K bound of gguf's values times 0.22."""
    import gguf
    from kquants import q4_k_blocks
    N, K = 16, 256
    w = _weights(N, K, seed=2).numpy()
    T = gguf.GGMLQuantizationType[qtype]
    data = q4_k_blocks(w) if qtype == "Q4_K" else gguf.quants.quantize(w, T)
    ref = torch.from_numpy(np.array(gguf.quants.dequantize(data, T)))
    exact = dequantize_int4(**repack_gguf_q4(data, qtype, (N, K), scale=0.25))
    torch.testing.assert_close(exact, dequantize_int4(**repack_gguf_q4(data, qtype, (N, K))) * 0.25,
                               rtol=0, atol=0)
    parts = repack_gguf_q4(data, qtype, (N, K), scale=0.22)
    s, m = (parts[k].float().repeat_interleave(32, 1) for k in ("scales", "mins"))
    bound = 2.0 ** -11 * (15 * s.abs() + m.abs()) * 1.001 + 1e-9
    assert ((dequantize_int4(**parts) - ref * 0.22).abs() <= bound).all()


@pytest.mark.parametrize("types,want", [
    ({"Q4_1": 100}, "int4"),
    ({"Q4_K": 60, "Q6_K": 40}, "int4"),                     # a Q4_K_M: Q6_K for some ffn_down
    ({"Q4_0": 50, "Q8_0": 50}, "int4"),
    ({"Q5_0": 634, "Q4_K": 236, "Q6_K": 118, "Q8_0": 15}, "int8"),   # Gemma 3 270M's Q4_K_M
    ({"Q8_0": 100}, "int8"),
    ({"Q6_K": 100}, "int8"),
    ({"F16": 60, "Q4_0": 40}, "float"),
    ({"F32": 10}, "float"),
    ({"MXFP4": 10}, "float"),          # not a type kvrun reads: the conversion refuses it by name
    ({}, "float"),
])
def test_default_weights_follow_the_linear_layers_bits(types, want):
    assert default_weights(types) == want


def test_tiny_q4_k_gguf_converts_to_int4_and_the_native_step_matches(smollm2_reader, tmp_path,
                                                                      monkeypatch):
    """A Q4_K_M-like GGUF (Q4_K down_proj of 256 columns, Q4_0 elsewhere, Q8_0 embedding):
    convert picks int4 with no format given, repacks every linear (Q4_K within the fp16
    bound of gguf's values), and the native step (fp32 GEMVs) equals the eager forward."""
    import gguf
    from test_convert import _write_gguf
    from kvrun.kv.build import build_cache
    from kvrun.model.native_step import NativeDecodeStep
    T = gguf.GGMLQuantizationType
    state = load_file(str(write_tiny_hf(tmp_path / "hf", I=256) / "model.safetensors"))
    state["model.embed_tokens.weight"] = torch.randn(49152, 64) * 0.3     # SmolLM2's vocab
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "llama", state, smollm2_reader, True,
                {"down_proj.weight": T.Q4_K, "_proj.weight": T.Q4_0, "embed_tokens.weight": T.Q8_0})
    convert_gguf(path, tmp_path / "f32", dtype="fp32", weights="float")
    lines = []
    cfg = convert_gguf(path, tmp_path / "q", dtype="fp32", log=lines.append)
    assert (cfg.weights, cfg.weight_group) == ("int4", 32)
    with pytest.raises(KvrunError, match="int4 group must be one of"):     # checked once chosen
        convert_gguf(path, tmp_path / "bad", group=48)
    assert not (tmp_path / "bad").exists()
    assert sum("<- Q4_K repacked" in ln for ln in lines) == 2
    assert sum("<- Q4_0 repacked" in ln for ln in lines) == 12
    f32, q = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("f32", "q"))
    for i in range(2):
        base = f"model.layers.{i}.mlp.down_proj"
        got = dequantize_int4(q[base + ".qweight"], q[base + ".scales"], q[base + ".mins"])
        s, m = (q[f"{base}.{k}"].float().repeat_interleave(32, 1) for k in ("scales", "mins"))
        assert ((got - f32[base + ".weight"]).abs() <= 2.0 ** -11 * (15 * s.abs() + m.abs()) * 1.001 + 1e-9).all()
    for cls in (Int4Linear, Int8Linear):          # the eager oracle: dequantized fp32 weights
        monkeypatch.setattr(cls, "uses_fused_op", lambda self, rows: False)
    monkeypatch.setenv("KVRUN_ATTN", "fp32")
    monkeypatch.setenv("KVRUN_BACKEND", "torch")
    ids = torch.tensor([[5, 300, 1200, 77, 4000, 12, 9, 31000]])
    m = kvrun.load(tmp_path / "q", dtype="fp32", kv="fp32", ctx=64, cache_ram_mb=0)
    cache = build_cache(m.cfg, 64, "fp32")
    want = torch.cat([m.transformer(ids[:, t:t + 1], cache)[0] for t in range(ids.shape[1])])
    monkeypatch.setenv("KVRUN_BACKEND", "native")
    cache = build_cache(m.cfg, 64, "fp32")
    step = NativeDecodeStep(m.transformer, gemv="fp32")
    got = []
    for t in range(ids.shape[1]):
        assert step.applies(ids[:, t:t + 1], cache)
        got.append(step(ids[:, t:t + 1], cache)[0])
    torch.testing.assert_close(torch.cat(got), want, atol=1e-4, rtol=1e-4)


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
    from click.testing import CliRunner
    from kvrun.cli.main import main
    from kvrun.model.info import model_info
    convert_gguf(path, tmp_path / "f32", dtype="fp32", weights="float")
    r = CliRunner().invoke(main, ["convert", str(path), "-o", str(tmp_path / "q4"), "-v"])
    assert r.exit_code == 0, r.stderr                          # no --weights: the file's own bits
    assert sum("repacked" in ln for ln in r.stderr.splitlines()) == 14
    assert r.stderr.strip().splitlines()[-1].endswith("(llama, 2 layers, int4 group 32)")
    info = model_info(tmp_path / "q4")
    assert info["weights"].startswith("int4 (group 32") and info["source linears"] == "Q4_1 100%"
    f32, q4 = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("f32", "q4"))
    for name in [k for k in f32 if k.endswith("_proj.weight")]:
        base = name[:-len(".weight")]
        got = dequantize_int4(q4[base + ".qweight"], q4[base + ".scales"], q4[base + ".mins"])
        torch.testing.assert_close(got, f32[name], rtol=0, atol=0, msg=name)
    a, b = kvrun.load(tmp_path / "f32", ctx=32), kvrun.load(tmp_path / "q4", ctx=32)
    ids = [5, 300, 1200, 77, 4000]
    assert rel_error(a.logits(ids), b.logits(ids)) < 0.02      # only the int8 embedding differs


def test_weights_kld_tool(tiny_hf, tmp_path, monkeypatch, capsys):
    """tools/weights_kld.py: a conversion against itself is KL 0 and top-1 100 %; int4 of the
    same checkpoint moves the distribution (KL > 0) and scores the same tokens."""
    import json
    import sys
    from tool_module import load_tool
    convert_hf(tiny_hf, tmp_path / "ref", dtype="fp32")
    convert_hf(tiny_hf, tmp_path / "q4", dtype="fp32", weights="int4")
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog, " * 8)
    monkeypatch.setattr(sys, "argv", ["weights_kld", str(text), str(tmp_path / "ref"),
                                      str(tmp_path / "ref"), str(tmp_path / "q4"),
                                      "-c", "64", "--windows", "2", "--json"])
    load_tool("weights_kld").main()
    same, q4 = json.loads(capsys.readouterr().out)
    assert (same["kl"], same["top1"], same["tokens"]) == (0.0, 1.0, 64)
    assert same["ppl"] == same["ppl_ref"] == q4["ppl_ref"]
    assert 0 < q4["kl"] < 1 and 0 < q4["top1"] <= 1 and q4["tokens"] == 64


def test_bad_weight_options(tiny_hf, tmp_path):
    with pytest.raises(KvrunError, match="unknown weight format"):
        convert_hf(tiny_hf, tmp_path / "x", weights="int3")
    with pytest.raises(KvrunError, match="int4 group must be one of"):
        convert_hf(tiny_hf, tmp_path / "x", weights="int4", group=48)
    assert not (tmp_path / "x").exists()
