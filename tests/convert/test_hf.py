"""HF checkpoint folder → kvrun model dir (kvrun.convert.hf): the weights stored exactly (in
the dtype asked for, a tied head not stored), the config and chat template read from the
checkpoint, and the converted model giving transformers' logits."""
from __future__ import annotations

import torch
from safetensors.torch import load_file

from kvrun.convert.hf import convert_hf
from kvrun.files import file_sha256
from kvrun.model.config import ModelConfig
from test_convert import SMOL_SYSTEM
from test_convert import tiny_llama, tiny_qwen2  # noqa: F401  (module fixtures)
from tiny import write_tiny_hf


def test_hf_llama_fp32_weights_exact(tiny_llama, tmp_path):
    src, ref = tiny_llama
    cfg = convert_hf(src, tmp_path / "out", dtype="fp32")
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(got) == set(ref) - {"lm_head.weight"}          # tied head is not stored
    for k, v in got.items():
        torch.testing.assert_close(v, ref[k], rtol=0, atol=0)
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == \
        ("llama", 2, 4, 2, 16)
    assert cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.rope_scaling == {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    assert cfg.chat_template == "chatml"
    assert cfg.default_system == SMOL_SYSTEM
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids[0] == 2 and 0 in cfg.eos_token_ids
    assert cfg.source["format"] == "hf" and cfg.source["path"] == str(src)
    assert cfg.source["sha256"] == file_sha256(src / "model.safetensors")
    on_disk = ModelConfig.from_file(tmp_path / "out" / "config.json")
    assert on_disk == cfg


def test_hf_qwen2_bias_and_bf16(tiny_qwen2, tmp_path):
    src, ref = tiny_qwen2
    cfg = convert_hf(src, tmp_path / "out")                   # default dtype: bf16
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(got) == set(ref)                               # untied: lm_head kept
    assert "model.layers.1.self_attn.k_proj.bias" in got
    for k, v in got.items():
        assert v.dtype == torch.bfloat16
        torch.testing.assert_close(v, ref[k].to(torch.bfloat16), rtol=0, atol=0)
    assert cfg.architecture == "qwen2" and cfg.attention_bias and cfg.rope_theta == 1e6
    assert cfg.rope_scaling is None and cfg.torch_dtype == "bf16"
    assert cfg.default_system == "You are a helpful assistant."
    assert (tmp_path / "out" / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()


def test_hf_logits_match_transformers(tiny_qwen2, tmp_path):
    """End to end: converted weights in kvrun's Transformer give the HF model's logits."""
    import transformers
    from ref_cache import RefCache
    from kvrun.model.llama import Transformer
    src, _ = tiny_qwen2
    cfg = convert_hf(src, tmp_path / "out", dtype="fp32")
    model = Transformer(cfg).float()
    model.load_weights(load_file(str(tmp_path / "out" / "model.safetensors")))
    ids = torch.tensor([[1, 4093, 198, 6004, 2, 198, 33, 34, 35]])
    cache = RefCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 32, dtype=torch.float32)
    hf = transformers.Qwen2ForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        want = hf(ids).logits
    torch.testing.assert_close(model(ids, cache), want, rtol=1e-4, atol=1e-4)



def test_a_checkpoint_without_a_chat_template(tmp_path):
    """write_tiny_hf's byte-level llama: no tokenizer_config.json, so no template family; the
    weights come through exactly and the config is the checkpoint's."""
    src = write_tiny_hf(tmp_path / "hf", C=64, I=96)
    cfg = convert_hf(src, tmp_path / "out", dtype="fp32")
    got, ref = load_file(str(tmp_path / "out" / "model.safetensors")), load_file(str(src / "model.safetensors"))
    assert got.keys() == ref.keys()
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads) == (64, 96, 4, 2)
    assert cfg.chat_template == "none" and cfg.default_system is None
