"""The model families kvrun converts from HF folders, each against transformers itself.

Per family a tiny random-weight checkpoint is built with transformers from the family's
config with its quirks (2 layers, GQA, head dims 64/96/128, tied and untied embeddings,
Granite's multipliers, Gemma's sliding + global layers and query scalar, Gemma 2's
attention logit soft-cap (5: small enough that the random scores exceed it, so the cap moves
the logits by O(1), which test_attention_softcap_is_what_moves_them checks), SmolLM3's NoPE
layer, Phi-3's fused projections, Qwen3-MoE's experts with a dense layer between sparse
ones; Mistral as a Llama), saved with `save_pretrained`, and converted with
`convert_hf` to fp32 weights. The oracle is that transformers model's own forward.
The sliding windows (16 tokens) wrap within the 64 tokens, so the rings overwrite slots.

- logits: a prefill chunk then single-token decode steps through kvrun's KV cache (fp32 and
  fp16 rows, and a compressed --kv), on the torch and the native backend (and Triton's
  interpreter, fp32 rows), against the oracle's full forward over the same 64 tokens;
- greedy tokens through `Model.stream`, identical to `generate`;
- GGUF (Qwen3, Qwen3-MoE with experts stacked as ffn_*_exps, OLMo 2, Granite, SmolLM3,
  Phi-3, Gemma 2): the same checkpoint written as llama.cpp's
  convert_hf_to_gguf.py names and lays out those architectures (gguf's own tensor-name
  table; Q/K permuted for Granite and SmolLM3, its LlamaModel subclasses; Granite's
  multipliers as *_scale metadata; SmolLM3 with llama.cpp's NoPE every 4th layer; Phi-3's
  projections fused as attn_qkv / ffn_up; Gemma 2's norms stored as 1 + w, its soft-caps and
  window as gemma2.* metadata), f32 tensors, converted with `convert_gguf`, gives the same
  logits;
- the native one-call decode step (int8 weights, fp32 GEMVs) against the eager forward of
  the same int8 model, for every family (OLMo 2's missing pre-norms and projection-wide q/k
  norms included).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os

# the Triton backend runs in its CPU interpreter here; set before kvrun.kernels.triton loads
os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
import torch

import kvrun
from kvrun.convert import convert_gguf, convert_hf
from kvrun.convert.gguf_file import hf_name
from kvrun.errors import KvrunError
from kvrun.kv.build import build_cache
from kvrun.model import native_rows, qlinear
from kvrun.model.native_step import NativeDecodeStep, supported
from hf_oracle import greedy_pair
from test_convert import _permute
from tiny import byte_level_tokenizer

PROMPT, STEPS = 40, 24                  # 64 tokens: one prefill chunk, then decode steps
CTX = 256                               # cache size (Triton's window writes need >= 160)
HAS_TRITON = importlib.util.find_spec("triton") is not None
VOCAB = 320                             # > the byte-level tokenizer's 259 ids

def longrope(n: int) -> dict:
    """HF longrope scaling with n distinct short and long factors (one per rotated pair)."""
    g = torch.Generator().manual_seed(n)
    return {"rope_type": "longrope", "short_factor": (1 + 3 * torch.rand(n, generator=g)).tolist(),
            "long_factor": (1 + 20 * torch.rand(n, generator=g)).tolist()}


# family → (transformers config class, its kwargs); every model: 2 layers, GQA where the
# family has it, intermediate sizes a multiple of 32 (the native GEMV's blocks)
FAMILIES = {
    "qwen3": ("Qwen3Config", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=128, intermediate_size=96, tie_word_embeddings=True,
                                  rope_theta=1e6)),
    # 3 layers, the middle one dense (mlp_only_layers); 8 experts of width 32, top-2
    "qwen3moe": ("Qwen3MoeConfig", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=32, intermediate_size=96, moe_intermediate_size=32,
                                        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                        num_hidden_layers=3, mlp_only_layers=[1],
                                        tie_word_embeddings=False)),
    "gemma2": ("Gemma2Config", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=64, intermediate_size=128, sliding_window=16,
                                    query_pre_attn_scalar=48, attn_logit_softcapping=5.0,
                                    final_logit_softcapping=30.0)),
    "gemma3": ("Gemma3TextConfig", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                                        head_dim=64, intermediate_size=128, sliding_window=16,
                                        layer_types=["sliding_attention", "full_attention"],
                                        query_pre_attn_scalar=48, final_logit_softcapping=30.0,
                                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                            "rope_theta": 1e6},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 1e4}})),
    "granite": ("GraniteConfig", dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                      intermediate_size=96, tie_word_embeddings=False,
                                      embedding_multiplier=12.0, attention_multiplier=0.03,
                                      residual_multiplier=0.22, logits_scaling=2.0)),
    "olmo2": ("Olmo2Config", dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
                                  intermediate_size=96, tie_word_embeddings=False)),
    "smollm3": ("SmolLM3Config", dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                      intermediate_size=96, tie_word_embeddings=True,
                                      no_rope_layers=[1, 0])),
    "mistral": ("MistralConfig", dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=1,
                                      intermediate_size=96, tie_word_embeddings=False,
                                      sliding_window=None)),
    "phi3": ("Phi3Config", dict(hidden_size=192, num_attention_heads=2, num_key_value_heads=1,
                                intermediate_size=128, tie_word_embeddings=False)),
    # Phi-4-mini's shape: RoPE on 3/4 of each head, longrope (the short factors: the cache's
    # CTX is within the original context; its attention factor sqrt(1 + ln 4 / ln 256))
    "phi4mini": ("Phi3Config", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=128, tie_word_embeddings=True,
                                    partial_rotary_factor=0.75, max_position_embeddings=1024,
                                    original_max_position_embeddings=CTX,
                                    rope_scaling=longrope(24))),
}
KV = ("fp32", "fp16", "kivi-4")


def _checkpoint(root, family: str, **over):
    """(HF folder, the transformers model) of a random 2-layer checkpoint of `family`
    (`over`: config keys replaced)."""
    import transformers
    cls, kw = FAMILIES[family]
    kw = {"num_hidden_layers": 2, **kw, **over}
    torch.manual_seed(0)
    cfg = getattr(transformers, cls)(**{"max_position_embeddings": 256, **kw}, vocab_size=VOCAB,
                                     rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                     initializer_range=0.15)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():      # norms are constant at init: make them count (Gemma's w is 0)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(mean=0.0 if family.startswith("gemma") else 1.0, std=0.3)
    model.float().eval()
    d = root / family
    model.save_pretrained(d)
    byte_level_tokenizer().save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    return d, model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers model, kvrun fp32 dir, kvrun int8 dir, the oracle's logits (T, V)
    over `ids`, ids)."""
    root = tmp_path_factory.mktemp(request.param)
    src, hf = _checkpoint(root, request.param)
    convert_hf(src, root / "fp32", dtype="fp32")
    convert_hf(src, root / "int8", dtype="fp32", weights="int8")
    ids = torch.randint(3, 259, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0].float()
    return request.param, hf, root / "fp32", root / "int8", ref, ids


def _stepped(transformer, cache, ids) -> torch.Tensor:
    """(T, V) logits of ids (1, T): PROMPT tokens as one chunk, then one token per step."""
    out = [transformer(ids[:, :PROMPT], cache)[0]]
    out += [transformer(ids[:, t:t + 1], cache)[0] for t in range(PROMPT, ids.shape[1])]
    return torch.cat(out)


@pytest.mark.parametrize("backend", ["torch", "native", "triton"])
def test_logits_equal_transformers(family, backend, monkeypatch):
    """Triton (its CPU interpreter, slow): the fp32 cache only."""
    name, _, d32, _, ref, ids = family
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.setenv("KVRUN_BACKEND", backend)
    monkeypatch.setenv("KVRUN_ATTN", "fp32")
    m = kvrun.load(d32, dtype="fp32", kv="fp32", ctx=CTX, cache_ram_mb=0)
    assert ref.std() > 0.5, "a degenerate oracle"
    for kv in KV if backend != "triton" else ("fp32",):
        got = _stepped(m.transformer, build_cache(m.cfg, CTX, kv), ids)
        assert got.shape == ref.shape and torch.isfinite(got).all(), (name, kv)
        if kv == "fp32":            # fp32 rounding only
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=lambda s: f"{name}: {s}")
        elif kv == "fp16":          # K/V rows rounded to fp16
            torch.testing.assert_close(got, ref, atol=2e-2 * ref.abs().max().item(), rtol=0,
                                       msg=lambda s: f"{name} fp16 cache: {s}")


def _without_softcap(hf):
    """A copy of a transformers model whose attention logits are not soft-capped."""
    import copy
    off = copy.deepcopy(hf)
    off.config.attn_logit_softcapping = None
    for layer in off.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    return off


@pytest.mark.parametrize("family", ["gemma2"], indirect=True)       # the soft-capping family
@pytest.mark.parametrize("backend", ["torch", "native", "triton"])
def test_attention_softcap_is_what_moves_the_logits(family, backend, monkeypatch):
    """Gemma 2's attention soft-cap moves the oracle's logits by O(1) here (the checkpoint's
    scores exceed the cap of 5), and kvrun's cache built without it (the same model,
    attn_logit_softcapping None: softcap 0 in every kernel) lands on the uncapped oracle to
    fp32 rounding, as its capped cache lands on the capped one (test_logits_equal_transformers):
    the agreement there is the kernels' cap, not a cap that changes nothing."""
    import dataclasses
    name, hf, d32, _, ref, ids = family
    assert hf.config.attn_logit_softcapping
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    with torch.no_grad():
        ref_off = _without_softcap(hf)(ids).logits[0].float()
    assert (ref_off - ref).abs().max() > 0.5, "the cap does not move this checkpoint's logits"
    monkeypatch.setenv("KVRUN_BACKEND", backend)
    monkeypatch.setenv("KVRUN_ATTN", "fp32")
    m = kvrun.load(d32, dtype="fp32", kv="fp32", ctx=CTX, cache_ram_mb=0)
    off = dataclasses.replace(m.cfg, attn_logit_softcapping=None)
    got = _stepped(m.transformer, build_cache(off, CTX, "fp32"), ids)
    torch.testing.assert_close(got, ref_off, atol=1e-4, rtol=1e-4, msg=lambda s: f"{name}: {s}")


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_tokens_equal_transformers(family, backend, monkeypatch):
    name, hf, d32, _, _, ids = family
    monkeypatch.setenv("KVRUN_BACKEND", backend)
    m = kvrun.load(d32, dtype="fp32", kv="fp32", ctx=CTX, cache_ram_mb=0)
    mine, want = greedy_pair(m, hf, ids[0, :PROMPT].tolist(), 24)
    assert mine == want, name


def _write_gguf(path, arch: str, hf) -> None:
    """`hf` (a transformers model) as a GGUF of llama.cpp architecture `arch`, f32 tensors,
    with the byte-level tokenizer as gpt2-model metadata."""
    import gguf
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    D = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = c.rope_parameters
    if arch == "phi3":          # llama.cpp's Phi3MiniModel: no key length, the rotated dims
        w.add_rope_dimension_count(int(D * rope["partial_rotary_factor"]))
    else:
        w.add_key_length(D)
        w.add_value_length(D)
    if rope.get("rope_type") == "longrope":     # its attention factor from the context ratio, factor tensors
        orig = rope["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors((1 + math.log(c.max_position_embeddings / orig) / math.log(orig)) ** 0.5)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if arch != "gemma2":                        # llama.cpp writes none for Gemma 2 (10000)
        w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_file_type(0)
    if arch == "qwen3moe":
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if arch == "granite":                       # llama.cpp's GraniteModel: *_multiplier → *_scale
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_attention_scale(c.attention_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_logit_scale(c.logits_scaling)
    if arch == "gemma2":                        # llama.cpp's Gemma2Model
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)
    tok = byte_level_tokenizer()
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    # one merge ("a b" → id 259: convert requires merges), beyond the ids the tests feed
    w.add_token_list([t for t, _ in vocab] + ["ab"])
    w.add_token_types([3 if i < 3 else 1 for _, i in vocab] + [1])  # specials: CONTROL
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    names = [gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH[arch.upper()]]]
    inverse = {hf_name(f"{n.format(bid=i)}.weight", arch): f"{n.format(bid=i)}.weight"
               for n in names for i in range(c.num_hidden_layers)}
    for k, t in _stacked_experts(hf.state_dict()).items():
        t = t.detach().float()
        if arch in ("granite", "smollm3") and k.endswith(("q_proj.weight", "k_proj.weight")):
            t = _permute(t, c.num_attention_heads if "q_proj" in k else c.num_key_value_heads)
        if arch == "gemma2" and k.endswith("norm.weight"):
            t = t + 1                           # llama.cpp stores Gemma's (1 + w)
        if not (c.tie_word_embeddings and k == "lm_head.weight"):
            w.add_tensor(inverse[k], t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _stacked_experts(state: dict) -> dict:
    """transformers 5's fused experts (E, 2I, hidden) / (E, hidden, I) as llama.cpp stacks
    them: gate, up and down each (E, rows, cols), named as gguf_file.hf_name maps ffn_*_exps."""
    out = {}
    for k, t in state.items():
        if k.endswith("experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            out.update({k.replace("gate_up_proj", "gate_proj.weight"): gate,
                        k.replace("gate_up_proj", "up_proj.weight"): up})
        else:
            out[k + ".weight" if k.endswith("experts.down_proj") else k] = t
    return out


GGUF_OVER_KEYS = ("nope_layers", "mlp_only_layers")     # what GGUF_OVER changes
GGUF_FAMILIES = {"qwen3": "qwen3", "qwen3moe": "qwen3moe", "olmo2": "olmo2", "granite": "granite",
                 "smollm3": "smollm3", "phi3": "phi3", "phi4mini": "phi3",
                 "gemma2": "gemma2"}   # family → llama.cpp architecture
# checkpoints as llama.cpp writes the family: SmolLM3 NoPE on every 4th of 4 layers, HF's
# default; Qwen3-MoE experts in every layer (llama.cpp's qwen3moe has no dense layers); Gemma 2
# queries scaled by head_dim**-0.5 (query_pre_attn_scalar = head_dim, as every size but 27B)
GGUF_OVER = {"smollm3": dict(num_hidden_layers=4, no_rope_layers=None), "qwen3moe": dict(mlp_only_layers=[]),
             "gemma2": dict(query_pre_attn_scalar=64)}


@pytest.mark.parametrize("family", list(GGUF_FAMILIES), indirect=True)   # gemma3: test_gemma3.py
def test_gguf_of_the_checkpoint_equals_transformers(family, tmp_path, monkeypatch):
    name, hf, _, _, ref, ids = family
    if name in GGUF_OVER:
        _, hf = _checkpoint(tmp_path, name, **GGUF_OVER[name])
        with torch.no_grad():
            ref = hf(ids).logits[0].float()
    _write_gguf(tmp_path / "m.gguf", GGUF_FAMILIES[name], hf)
    for weights in ("float", "int8"):
        cfg = convert_gguf(tmp_path / "m.gguf", tmp_path / weights, dtype="fp32", weights=weights)
        assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    want = {**QUIRKS[name], **({"query_pre_attn_scalar": 64.0} if name == "gemma2" else {})}
    assert {k: getattr(cfg, k) for k in want if k not in GGUF_OVER_KEYS} == \
        {k: v for k, v in want.items() if k not in GGUF_OVER_KEYS}
    assert cfg.nope_layers == ([3] if name == "smollm3" else [])
    monkeypatch.setenv("KVRUN_ATTN", "fp32")
    m = kvrun.load(tmp_path / "float", dtype="fp32", kv="fp32", ctx=CTX, cache_ram_mb=0)
    got = _stepped(m.transformer, build_cache(m.cfg, CTX, "fp32"), ids)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=lambda s: f"{name} GGUF: {s}")
    # the int8 conversion's weights: those of the same checkpoint converted from its HF folder
    from safetensors.torch import load_file
    from_hf = tmp_path / "hf-int8"
    convert_hf(_checkpoint(tmp_path / "again", name, **GGUF_OVER.get(name, {}))[0],
               from_hf, dtype="fp32", weights="int8")
    a, b = load_file(str(tmp_path / "int8" / "model.safetensors")), load_file(str(from_hf / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6 if a[k].is_floating_point() else 1, rtol=1e-5, msg=k)


def test_gemma2_gguf_settings_are_llama_cpps():
    """What a Gemma 2 GGUF leaves implicit, as llama.cpp fills it in: queries scaled by
    head_dim**-0.5, but 27B's (46 layers) by (hidden/heads)**-0.5 (HF's 144); the soft-caps
    and the window from the metadata, a file without the window refused in one line."""
    from kvrun.convert.gguf_file import _gemma2_fields
    meta = {"gemma2.attention.sliding_window": 4096, "gemma2.attn_logit_softcapping": 50.0,
            "gemma2.final_logit_softcapping": 30.0, "gemma2.block_count": 46}
    assert _gemma2_fields(meta, 128, 4608, 32) == dict(
        sliding_window=4096, query_pre_attn_scalar=144.0, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0)
    assert _gemma2_fields({**meta, "gemma2.block_count": 26}, 256, 2304, 8)["query_pre_attn_scalar"] == 256.0
    with pytest.raises(KvrunError, match="sliding_window"):
        _gemma2_fields({"gemma2.block_count": 26}, 256, 2304, 8)


def test_gemma3_ignores_an_attention_softcap_as_transformers_does(tmp_path, monkeypatch):
    """Gemma3TextConfig has an attn_logit_softcapping, which transformers' Gemma 3 attention
    never applies (llama.cpp's converter asserts it unset): a Gemma 3 checkpoint that sets it
    converts without it and gives transformers' logits."""
    src, hf = _checkpoint(tmp_path, "gemma3", attn_logit_softcapping=3.0)
    cfg = convert_hf(src, tmp_path / "fp32", dtype="fp32")
    assert cfg.attn_logit_softcapping is None
    ids = torch.randint(3, 259, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits[0].float()
    monkeypatch.setenv("KVRUN_ATTN", "fp32")
    m = kvrun.load(tmp_path / "fp32", dtype="fp32", kv="fp32", ctx=CTX, cache_ram_mb=0)
    got = _stepped(m.transformer, build_cache(m.cfg, CTX, "fp32"), ids)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_native_step_equals_the_eager_forward(family, monkeypatch):
    """The one-call native step (int8 weights, fp32 GEMVs) against the eager forward of the
    same weights dequantized, on the torch backend (test_decode_layer.py's oracle)."""
    name, _, _, d8, _, ids = family
    monkeypatch.setattr(qlinear.Int8Linear, "uses_fused_op", lambda self, rows: False)
    monkeypatch.setenv("KVRUN_ATTN", "fp32")
    monkeypatch.setenv("KVRUN_BACKEND", "torch")
    m = kvrun.load(d8, dtype="fp32", kv="fp32", ctx=CTX, cache_ram_mb=0)
    want = _stepped(m.transformer, build_cache(m.cfg, CTX, "fp32"), ids)
    assert supported(m.transformer), name
    monkeypatch.setenv("KVRUN_BACKEND", "native")
    cache = build_cache(m.cfg, CTX, "fp32")
    step = NativeDecodeStep(m.transformer, gemv="fp32")
    assert step.applies_chunk(ids[:, :PROMPT], cache)
    out = [step.chunk(ids[:, :PROMPT], cache)[0]]
    for t in range(PROMPT, ids.shape[1]):
        assert step.applies(ids[:, t:t + 1], cache) and native_rows.row(cache, m.cfg.num_heads) is not None
        out.append(step(ids[:, t:t + 1], cache)[0])
    torch.testing.assert_close(torch.cat(out), want, atol=1e-4, rtol=1e-4, msg=lambda s: f"{name}: {s}")


def test_refused_variants_say_why(tmp_path):
    """A family variant kvrun cannot run is one line naming the quirk, not a wrong model."""
    src, _ = _checkpoint(tmp_path, "phi3")
    hf = json.loads((src / "config.json").read_text())
    cases = {"longrope short_factor must be a list of 48": {"rope_parameters": {
                 **longrope(47), "rope_theta": 1e4, "original_max_position_embeddings": 128}},
             "longrope scaling without original_max": {"rope_parameters": {**longrope(48), "rope_theta": 1e4},
                                                       "original_max_position_embeddings": None},
             "rotates 49 of 96 channels": {"partial_rotary_factor": 0.511,
                                           "rope_parameters": {"rope_theta": 1e4, "rope_type": "default",
                                                               "partial_rotary_factor": 0.511}},
             "biases": {"attention_bias": True}}
    for why, patch in cases.items():
        (src / "config.json").write_text(json.dumps({**hf, **patch}))
        with pytest.raises(KvrunError, match=why) as e:
            convert_hf(src, tmp_path / why.split()[0], dtype="fp32")
        assert "\n" not in str(e.value)
    (src / "config.json").write_text(json.dumps({**hf, "architectures": ["MixtralForCausalLM"]}))
    with pytest.raises(KvrunError, match="unsupported architecture 'MixtralForCausalLM'") as e:
        convert_hf(src, tmp_path / "moe", dtype="fp32")
    for arch in ("Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "GraniteForCausalLM",
                 "Olmo2ForCausalLM", "SmolLM3ForCausalLM", "Phi3ForCausalLM", "LlamaForCausalLM"):
        assert arch in str(e.value)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_longrope_short_and_long_factors_equal_transformers(tmp_path, backend, monkeypatch):
    """Phi-3 (full rotary, head dim 96) with longrope, original context 32: a cache of 32
    tokens runs the short factors, as transformers does for a sequence within 32 tokens; a
    cache of 256 the long ones, as transformers does for a sequence past 32 (attention
    factor sqrt(1 + ln 32 / ln 32) = sqrt 2 in both); greedy tokens past 32 too."""
    src, hf = _checkpoint(tmp_path, "phi3", rope_scaling=longrope(48), max_position_embeddings=1024,
                          original_max_position_embeddings=32)
    cfg = convert_hf(src, tmp_path / "fp32", dtype="fp32")
    assert cfg.rope_scaling["attention_factor"] == pytest.approx(2 ** 0.5)
    from kvrun.model.info import model_info
    assert "'long_factor': '[48 factors]'" in model_info(tmp_path / "fp32")["rope"]
    monkeypatch.setenv("KVRUN_BACKEND", backend)
    monkeypatch.setenv("KVRUN_ATTN", "fp32")
    ids = torch.randint(3, 259, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(1))
    for ctx, T in ((32, 32), (CTX, PROMPT + STEPS)):
        with torch.no_grad():
            ref = hf(ids[:, :T]).logits[0].float()
        m = kvrun.load(tmp_path / "fp32", dtype="fp32", kv="fp32", ctx=ctx, cache_ram_mb=0)
        cache = build_cache(m.cfg, ctx, "fp32")
        out = [m.transformer(ids[:, :16], cache)[0]]
        out += [m.transformer(ids[:, t:t + 1], cache)[0] for t in range(16, T)]
        torch.testing.assert_close(torch.cat(out), ref, atol=1e-4, rtol=1e-4, msg=lambda s: f"-c {ctx}: {s}")
    pos = torch.arange(8)
    assert not torch.equal(m.transformer.rope.tables(pos, torch.float32, 32)[0],
                           m.transformer.rope.tables(pos, torch.float32, 33)[0])   # two factor sets
    # a batch's rows, each in its own cache: each row on its cache's set
    cos, sin = m.transformer.rope.tables(pos[:2], torch.float32, [32, CTX])
    assert torch.equal(cos[0], m.transformer.rope.tables(pos[:1], torch.float32, 32)[0][0])
    assert torch.equal(sin[1], m.transformer.rope.tables(pos[1:2], torch.float32, CTX)[1][0])
    mine, want = greedy_pair(m, hf, ids[0, :PROMPT].tolist(), 24)   # a prompt past 32: HF's long set
    assert mine == want
    # a saved cache goes back only into a cache on the same factor set (sessions, prefix cache)
    from kvrun.kv.snapshot import OtherSize
    held = build_cache(m.cfg, CTX, "fp32")
    m.transformer(ids[:, :16], held)
    snap = held.snapshot()
    with pytest.raises(OtherSize, match="another RoPE frequency set"):
        build_cache(m.cfg, 32, "fp32").restore(snap)
    again = build_cache(m.cfg, 128, "fp32")
    again.restore(snap)
    assert again.seq_len == 16


def test_context_shift_leaves_the_channels_rope_passes_through():
    """Partial rotary (48 of 64 channels, kvrun's pairing (i, i + 32) after convert's row
    permutation): a shift re-rotates the 24 rotated pairs by -nd at longrope's short
    frequencies and leaves the 16 passed-through channels bit for bit."""
    from kvrun.kv.config import KVConfig
    from tiny import tiny_config
    scaling = {"type": "longrope", **{k: v for k, v in longrope(24).items() if k != "rope_type"},
               "original_max_position_embeddings": 1024, "attention_factor": 1.2}
    cfg = tiny_config(hidden_size=256, num_heads=4, head_dim=64, rotary_dim=48, rope_scaling=scaling)
    cache = build_cache(cfg, 128, KVConfig.from_settings(k_method="fp32", v_method="fp32",
                                                         ctx_policy="shift", n_keep=4))
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 2, 128, 64, generator=g) for _ in range(2))
    cache.ingest(k, v)
    a, nd = cache.shift_plan()
    assert cache.shift() == nd
    got = cache.all_rows()[0]                                            # (L, Hkv, n, D)
    kept = torch.cat([k[:, :, :a], k[:, :, a + nd:]], 2)
    passed = torch.cat([torch.arange(24, 32), torch.arange(56, 64)])
    assert torch.equal(got[..., passed], kept[..., passed])
    # HF's frequencies of the rotated pairs: 1 / (short_factor · theta^(2i / 48))
    inv = 1 / (torch.tensor(scaling["short_factor"], dtype=torch.float64)
               * cfg.rope_theta ** (torch.arange(0, 48, 2, dtype=torch.float64) / 48))
    c, s_ = torch.cos(-nd * inv), torch.sin(-nd * inv)
    x1, x2 = kept[:, :, a:, :24].double(), kept[:, :, a:, 32:56].double()
    want = torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], -1).float()
    torch.testing.assert_close(torch.cat([got[:, :, a:, :24], got[:, :, a:, 32:56]], -1), want,
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(got[:, :, :a], k[:, :, :a])                      # the kept prefix as it was


QUIRKS = {   # family → what its converted config.json must say
    "qwen3": dict(architecture="qwen3", qk_norm="head", head_dim=128, tie_word_embeddings=True),
    "qwen3moe": dict(architecture="qwen3moe", qk_norm="head", head_dim=32, num_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                     mlp_only_layers=[1]),
    "gemma2": dict(architecture="gemma2", qk_norm="", layer_types=["sliding_attention", "full_attention"],
                   sliding_window=16, query_pre_attn_scalar=48.0, rope_theta=1e4, rope_scaling=None,
                   attn_logit_softcapping=5.0, final_logit_softcapping=30.0, tie_word_embeddings=True),
    "gemma3": dict(architecture="gemma3", qk_norm="head", layer_types=FAMILIES["gemma3"][1]["layer_types"],
                   sliding_window=16, query_pre_attn_scalar=48.0, rope_theta=1e6, rope_local_theta=1e4,
                   rope_scaling={"type": "linear", "factor": 2.0}, final_logit_softcapping=30.0),
    "granite": dict(architecture="granite", embedding_multiplier=12.0, attention_multiplier=0.03,
                    logits_scaling=2.0, tie_word_embeddings=False),
    "olmo2": dict(architecture="olmo2", qk_norm="proj"),
    "smollm3": dict(architecture="smollm3", nope_layers=[1], tie_word_embeddings=True),
    "mistral": dict(architecture="llama", head_dim=32, num_kv_heads=1),
    "phi3": dict(architecture="llama", head_dim=96, rotary_dim=96, rope_scaling=None),
    "phi4mini": dict(architecture="llama", head_dim=64, rotary_dim=48, num_kv_heads=2,
                     rope_scaling={"type": "longrope", **{k: pytest.approx(v) for k, v in longrope(24).items()
                                                          if k != "rope_type"},
                                   "original_max_position_embeddings": CTX,
                                   "attention_factor": pytest.approx(1.25 ** 0.5)}),
}


def test_config_carries_the_quirks(family):
    from kvrun.model.config import ModelConfig
    name, _, d32, _, _, _ = family
    cfg = ModelConfig.from_file(d32 / "config.json")
    assert {k: getattr(cfg, k) for k in QUIRKS[name]} == QUIRKS[name]
    if cfg.attn_logit_softcapping:              # `kvrun info` names it among the quirks
        from kvrun.model.info import model_facts, model_info
        assert model_facts(d32)["quirks"]["attn_logit_softcapping"] == cfg.attn_logit_softcapping
        assert f"attn_logit_softcapping {cfg.attn_logit_softcapping}" in model_info(d32)["quirks"]
