"""The default model's conversion (SmolLM2's Q4_1 GGUF → the pulled model dir): its config,
every tensor equal to gguf's dequantization, Q/K equal to transformers' own GGUF loader
(which undoes llama.cpp's Q/K permutation independently of kvrun).

Also the shared pieces of the converter tests: the tiny HF checkpoints built with
transformers (`_tiny_llama`, `_tiny_qwen2`, and their module fixtures `tiny_llama`,
`tiny_qwen2`), their chat templates, llama.cpp's Q/K permutation (`_permute`) and a GGUF
writer (`_write_gguf`), used by test_hf.py, test_gguf_file.py, test_templates.py,
test_convert_errors.py, test_convert_cli.py, test_pull.py, test_qweights.py and
test_families.py.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kvrun.convert.gguf_file import hf_name, linear_types, unpermute
from kvrun.files import file_sha256
from kvrun.model.config import ModelConfig
from kquants import q4_k_blocks

SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}")
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QWEN_TEMPLATE = (   # Qwen2 style: the system turn written with \n escapes, in an else branch
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + "
    "messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are "
    "a helpful assistant.<|im_end|>\\n' }}{%- endif %}")


# -- tiny HF checkpoints -------------------------------------------------------------------

def _tiny_hf(root: Path, arch: str, smollm2_dir: Path, **extra) -> tuple[Path, dict]:
    """Save a random 2-layer GQA checkpoint + SmolLM2's tokenizer; return (dir, state dict)."""
    import transformers
    torch.manual_seed(0)
    kw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=49152, max_position_embeddings=256,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    kw.update(extra)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
        template = SMOL_TEMPLATE
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
        template = QWEN_TEMPLATE
    with torch.no_grad():          # norms and biases are constant at init; make them count
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.normal_()
    d = root / f"hf-{arch}"
    model.save_pretrained(d, safe_serialization=True)
    shutil.copy(smollm2_dir / "tokenizer.json", d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}))
    return d, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _tiny_llama(root: Path, smollm2_dir: Path) -> tuple[Path, dict]:
    """Llama with a tied head and llama3 rope scaling."""
    return _tiny_hf(root, "llama", smollm2_dir, tie_word_embeddings=True,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 64})


def _tiny_qwen2(root: Path, smollm2_dir: Path) -> tuple[Path, dict]:
    """Qwen2 with an untied head, attention biases and rope theta 1e6."""
    return _tiny_hf(root, "qwen2", smollm2_dir, tie_word_embeddings=False, rope_theta=1e6)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm2_dir):
    return _tiny_llama(tmp_path_factory.mktemp("hf"), smollm2_dir)


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory, smollm2_dir):
    return _tiny_qwen2(tmp_path_factory.mktemp("hf"), smollm2_dir)


# -- GGUF ------------------------------------------------------------------------------------

def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf.py's permute (the direction kvrun undoes)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def test_smollm2_config(smollm2_dir, smollm2_gguf, smollm2_reader):
    cfg = ModelConfig.from_file(smollm2_dir / "config.json")
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == \
        ("llama", 30, 9, 3, 64)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (576, 1536, 49152)
    assert cfg.max_position == 8192 and cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5
    assert cfg.tie_word_embeddings and cfg.rope_scaling is None
    # GGUF: bos=<|im_start|>(1), eos=<|im_end|>(2), add_bos false; <|endoftext|>(0) also stops
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == [2, 0] and cfg.add_bos is False
    assert cfg.chat_template == "chatml"
    assert cfg.default_system == SMOL_SYSTEM
    assert cfg.torch_dtype == "fp32"
    # the source's linear layers by GGUF type, in parameters: every one of SmolLM2's 210 is
    # Q4_1 (file_type 3); the token embedding, tied to the head, is not a linear layer
    linears = linear_types(smollm2_reader)
    assert linears == {"Q4_1": 30 * (3 * 576 * 1536 + 2 * 576 * 576 + 2 * 192 * 576)}
    assert cfg.source == {"format": "gguf", "path": str(smollm2_gguf),
                          "sha256": file_sha256(smollm2_gguf), "file_type": 3,
                          "linear_types": linears}


def test_smollm2_weights_equal_gguf_dequantize(smollm2_dir, smollm2_reader):
    """Every stored tensor is exactly gguf's dequantization (Q/K un-permuted), in fp32."""
    import gguf
    cfg = ModelConfig.from_file(smollm2_dir / "config.json")
    got = load_file(str(smollm2_dir / "model.safetensors"))
    assert len(got) == len(smollm2_reader.tensors) == 272
    for t in smollm2_reader.tensors:
        want = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
        name = hf_name(t.name)
        if t.name.endswith("attn_q.weight"):
            want = unpermute(want, cfg.num_heads)
        elif t.name.endswith("attn_k.weight"):
            want = unpermute(want, cfg.num_kv_heads)
        torch.testing.assert_close(got[name], want.float(), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("layer", [0, 17, 29])
def test_smollm2_qk_match_transformers_gguf_loader(smollm2_dir, smollm2_reader,
                                                   hf_gguf_qk_fp32, layer):
    import gguf
    got = load_file(str(smollm2_dir / "model.safetensors"))
    raw = {t.name: t for t in smollm2_reader.tensors}
    for proj, gname, heads in (("q_proj", "attn_q", 9), ("k_proj", "attn_k", 3)):
        name = f"model.layers.{layer}.self_attn.{proj}.weight"
        ref = hf_gguf_qk_fp32[name]
        t = raw[f"blk.{layer}.{gname}.weight"]
        deq = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
        torch.testing.assert_close(unpermute(deq, heads), ref)               # fp32, exact path
        torch.testing.assert_close(got[name].float(), ref, rtol=0, atol=0)
        assert not torch.allclose(deq, ref)          # the file really is permuted


def _qtype(hf_name: str, qtypes: dict, default=None):
    return next((q for suffix, q in qtypes.items() if hf_name.endswith(suffix)), default)


def _write_gguf(path: Path, arch: str, state: dict, reader, tied: bool, qtypes: dict,
                rope_freqs: np.ndarray | None = None) -> None:
    """Write a tiny HF checkpoint as llama.cpp would: GGUF names, Q/K permuted for llama,
    some tensors quantized (qtypes: HF name suffix → type), SmolLM2's tokenizer metadata."""
    import gguf
    T = gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(state["model.embed_tokens.weight"].shape[1])
    w.add_feed_forward_length(state["model.layers.0.mlp.up_proj.weight"].shape[0])
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0 if arch == "llama" else 1e6)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(7)
    fields = reader.fields
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(fields["tokenizer.ggml.tokens"].contents())
    w.add_token_types(fields["tokenizer.ggml.token_type"].contents())
    w.add_token_merges(fields["tokenizer.ggml.merges"].contents())
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(fields["tokenizer.chat_template"].contents())
    inverse = {v: k for k, v in {"token_embd.weight": "model.embed_tokens.weight",
                                 "output_norm.weight": "model.norm.weight",
                                 "output.weight": "lm_head.weight"}.items()}
    for i in range(2):
        for g in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                  "attn_norm", "ffn_norm"):
            for kind in ("weight", "bias"):
                inverse[hf_name(f"blk.{i}.{g}.{kind}")] = f"blk.{i}.{g}.{kind}"
    for hf, t in state.items():
        if tied and hf == "lm_head.weight":
            continue
        name, data = inverse[hf], t.float()
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            data = _permute(data, 4 if "attn_q" in name else 2)
        data = data.numpy()
        qtype = _qtype(hf, qtypes, T.F32)
        if qtype == T.F32:
            w.add_tensor(name, data)
        else:
            blocks = q4_k_blocks(data) if qtype == T.Q4_K else gguf.quants.quantize(data, qtype)
            w.add_tensor(name, blocks, raw_dtype=qtype)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
