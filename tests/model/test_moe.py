"""Qwen3-MoE beyond test_families.py's checks (logits, greedy, GGUF, native step of the
top-2, renormalized, one-dense-layer checkpoint there): the variant without renormalized
top-k weights whose dense layers come from decoder_sparse_step, transformers 5's fused
expert tensors in a folder, and the native step reading only the experts a token chose.
"""
from __future__ import annotations

import json

import pytest
import torch

import kvrun
from kvrun.convert import convert_hf
from kvrun.errors import KvrunError
from kvrun.kv.build import build_cache
from kvrun.model import qlinear
from kvrun.model.config import ModelConfig
from kvrun.model.moe import SparseMoeBlock, route
from kvrun.model.native_step import NativeDecodeStep
from test_families import CTX, PROMPT, _checkpoint, _stepped


def _ids(n: int) -> torch.Tensor:
    return torch.randint(3, 259, (1, n), generator=torch.Generator().manual_seed(1))


def test_route_takes_the_top_k_of_the_fp32_softmax():
    logits = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 1.0, 1.0, 2.0]]))    # probs ∝ these
    w, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[3, 2], [0, 3]]
    torch.testing.assert_close(w, torch.tensor([[0.4, 0.3], [0.5, 0.25]]))
    w, _ = route(logits.half(), 2, renormalize=True)
    assert w.dtype == torch.float16
    torch.testing.assert_close(w.float(), torch.tensor([[4 / 7, 3 / 7], [2 / 3, 1 / 3]]), atol=1e-3, rtol=0)


def test_the_sparse_block_is_the_weighted_sum_of_each_tokens_experts():
    cfg = ModelConfig(architecture="qwen3moe", vocab_size=16, hidden_size=16, num_heads=2, num_kv_heads=1,
                      num_layers=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    block = SparseMoeBlock(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(2, 5, 16, generator=g)
    w, ids = route(block.gate(x.view(-1, 16)), 2, cfg.norm_topk_prob)
    want = torch.stack([sum(w[n, j] * block.experts[int(ids[n, j])](x.view(-1, 16)[n]) for j in range(2))
                        for n in range(10)]).view(2, 5, 16)
    torch.testing.assert_close(block(x), want, atol=1e-6, rtol=1e-5)


def test_unnormalized_top_k_and_sparse_step_equal_transformers(tmp_path, monkeypatch):
    """norm_topk_prob False; decoder_sparse_step 2 makes layers 0 and 2 of 4 dense. The
    eager forward on torch against transformers; the native step (int8, fp32 GEMVs)
    against the eager forward of the same int8 weights."""
    src, hf = _checkpoint(tmp_path, "qwen3moe", num_hidden_layers=4, decoder_sparse_step=2,
                          mlp_only_layers=[], norm_topk_prob=False)
    cfg = convert_hf(src, tmp_path / "fp32", dtype="fp32")
    assert (cfg.mlp_only_layers, cfg.norm_topk_prob) == ([0, 2], False)
    convert_hf(src, tmp_path / "int8", dtype="fp32", weights="int8")
    ids = _ids(PROMPT + 24)
    with torch.no_grad():
        ref = hf(ids).logits[0].float()
    monkeypatch.setenv("KVRUN_BACKEND", "torch")
    monkeypatch.setenv("KVRUN_ATTN", "fp32")
    m = kvrun.load(tmp_path / "fp32", dtype="fp32", kv="fp32", ctx=CTX, cache_ram_mb=0)
    got = _stepped(m.transformer, build_cache(m.cfg, CTX, "fp32"), ids)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)

    monkeypatch.setattr(qlinear.Int8Linear, "uses_fused_op", lambda self, rows: False)
    m8 = kvrun.load(tmp_path / "int8", dtype="fp32", kv="fp32", ctx=CTX, cache_ram_mb=0)
    want = _stepped(m8.transformer, build_cache(m8.cfg, CTX, "fp32"), ids)
    monkeypatch.setenv("KVRUN_BACKEND", "native")
    step = NativeDecodeStep(m8.transformer, gemv="fp32")
    cache = build_cache(m8.cfg, CTX, "fp32")
    out = [step.chunk(ids[:, :PROMPT], cache)[0]]
    out += [step(ids[:, t:t + 1], cache)[0] for t in range(PROMPT, ids.shape[1])]
    torch.testing.assert_close(torch.cat(out), want, atol=1e-4, rtol=1e-4)


def test_fused_expert_tensors_convert_as_per_expert_ones(tmp_path):
    """A folder with transformers 5's in-memory layout (experts.gate_up_proj (E, 2I, hidden),
    experts.down_proj (E, hidden, I)) gives the tensors of the per-expert folder; the
    router stays float in an int8 conversion."""
    from safetensors.torch import load_file, save_file
    src, hf = _checkpoint(tmp_path, "qwen3moe")
    fused = tmp_path / "fused"
    fused.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (fused / f).write_bytes((src / f).read_bytes())
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(fused / "model.safetensors"))
    for d in (src, fused):
        convert_hf(d, tmp_path / f"{d.name}-int8", dtype="fp32", weights="int8")
    a = load_file(str(tmp_path / "qwen3moe-int8" / "model.safetensors"))
    b = load_file(str(tmp_path / "fused-int8" / "model.safetensors"))
    assert a.keys() == b.keys() and "model.layers.0.mlp.experts.7.down_proj.qweight" in a
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert a["model.layers.0.mlp.gate.weight"].dtype == torch.float32


def _prefilled(step, cfg, ids):
    cache = build_cache(cfg, CTX, "fp32")
    step.chunk(ids[:, :PROMPT], cache)
    return cache


@pytest.mark.parametrize("gemv", ["int", "fp32"])
def test_native_step_reads_only_the_chosen_experts(tmp_path, monkeypatch, gemv):
    """NaN scales in every expert a token did not choose leave its logits bit for bit; NaN
    in one it chose does not (so the check can fail)."""
    src, _ = _checkpoint(tmp_path, "qwen3moe")
    convert_hf(src, tmp_path / "int8", dtype="fp32", weights="int8")
    monkeypatch.setenv("KVRUN_BACKEND", "native")
    m = kvrun.load(tmp_path / "int8", dtype="fp32", kv="fp32", ctx=CTX, cache_ram_mb=0)
    ids = _ids(PROMPT + 1)
    tok = ids[:, PROMPT:]
    step = NativeDecodeStep(m.transformer, gemv=gemv)
    caches = [_prefilled(step, m.cfg, ids) for _ in range(3)]      # before any weight changes
    want = step(tok, caches[0]).clone()
    moe = {i: set(p.moe.chosen[0].tolist()) for i, p in enumerate(step.plans) if p.moe is not None}
    assert sorted(moe) == [0, 2] and all(len(c) == 2 for c in moe.values()), moe
    layers = m.transformer.model.layers
    nan = float("nan")
    for i, chosen in moe.items():
        for e, expert in enumerate(layers[i].mlp.experts):
            if e not in chosen:
                for lin in (expert.gate_proj, expert.up_proj, expert.down_proj):
                    lin.scales.fill_(nan)
    got = NativeDecodeStep(m.transformer, gemv=gemv)(tok, caches[1])
    assert torch.equal(got, want)
    layers[2].mlp.experts[min(moe[2])].down_proj.scales.fill_(nan)
    assert not torch.equal(NativeDecodeStep(m.transformer, gemv=gemv)(tok, caches[2]), want)


def test_bad_expert_settings_are_one_line_errors(tmp_path):
    base = dict(architecture="qwen3moe", num_layers=2, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=32)
    for bad, match in (({"num_experts_per_tok": 5}, "num_experts_per_tok"),
                       ({"num_experts": 0}, "num_experts"),
                       ({"mlp_only_layers": [2]}, "mlp_only_layers"),
                       ({"architecture": "qwen3"}, "num_experts")):
        with pytest.raises(KvrunError, match=match) as e:
            ModelConfig(**{**base, **bad})
        assert "\n" not in str(e.value)
    src, _ = _checkpoint(tmp_path, "qwen3moe")
    hf = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**hf, "num_experts_per_tok": 9}))
    with pytest.raises(KvrunError, match="num_experts_per_tok"):
        convert_hf(src, tmp_path / "out", dtype="fp32")
