"""kvrun's transformer against transformers on tiny random Llama and Qwen2 models, and the
cache paths (prefill, decode, chunking) against one full forward."""
import pytest
import torch
import transformers

from kvrun.model.llama import Transformer
from ref_cache import RefCache
from tiny import tiny_config

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def hf_pair(arch, tie, scaling):
    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                  max_position_embeddings=512)
    if arch == "llama":
        hc = transformers.LlamaConfig(**common, rope_scaling=scaling)
        hf = transformers.LlamaForCausalLM(hc)
    else:
        hc = transformers.Qwen2Config(**common)
        hf = transformers.Qwen2ForCausalLM(hc)
    hf.eval()
    cfg = tiny_config(arch, tie_word_embeddings=tie, rms_norm_eps=hc.rms_norm_eps,
                           rope_scaling=scaling, rope_theta=10000.0)
    m = Transformer(cfg).float()
    sd = {k: v for k, v in hf.state_dict().items() if "rotary" not in k}
    if tie:
        sd.pop("lm_head.weight", None)
    m.load_weights(sd)
    return hf, m, cfg


@pytest.mark.parametrize("arch,tie,scaling", [
    ("llama", True, None),
    ("llama", False, {"rope_type": "linear", "factor": 2.0}),
    ("llama", True, LLAMA3_SCALING),
    ("qwen2", False, None),
])
def test_logits_match_transformers(arch, tie, scaling):
    hf, m, cfg = hf_pair(arch, tie, scaling)
    ids = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits.float()
    out = m(ids, RefCache(2, 2, 16, 150, torch.float32))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("chunks", [[37], [1] * 37, [5, 13, 19], [16, 16, 5]])
def test_prefill_decode_equals_full_forward(chunks):
    _, m, cfg = hf_pair("llama", True, None)
    ids = torch.randint(0, 256, (1, sum(chunks)), generator=torch.Generator().manual_seed(2))
    full = m(ids, RefCache(2, 2, 16, 64, torch.float32))
    cache = RefCache(2, 2, 16, 64, torch.float32)
    outs, s = [], 0
    for c in chunks:
        outs.append(m(ids[:, s:s + c], cache))
        s += c
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)
    assert cache.seq_len == ids.shape[1]


def test_gemv_copy_only_changes_precision():
    """The fp16 decode copy gives the same logits as fp32 up to fp16 weight rounding."""
    _, m, cfg = hf_pair("llama", True, None)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    cache = RefCache(2, 2, 16, 64, torch.float32)
    ref = [m(ids[:, i:i + 1], cache) for i in range(20)]
    m.set_gemv_dtype(torch.float16)
    cache.reset()
    out = [m(ids[:, i:i + 1], cache) for i in range(20)]
    m.set_gemv_dtype(None)
    torch.testing.assert_close(torch.cat(out, 1), torch.cat(ref, 1), atol=5e-3, rtol=5e-3)
    assert m.model.layers[0].mlp.up_proj.gemv_weight is None
