"""GGUF file → kvrun model dir (kvrun.convert.gguf_file): llama.cpp's tensor names mapped to
HF's, its Q/K row permutation undone, and a tiny HF checkpoint written as llama.cpp would
(some tensors quantized, llama3 rope factors as rope_freqs) converted back to the weights the
GGUF stores; a GGUF type kvrun does not convert is refused before anything is written."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kvrun.convert.gguf_file import convert_gguf, hf_name, unpermute
from kvrun.errors import KvrunError
from test_convert import _permute, _qtype, _write_gguf
from test_convert import tiny_llama, tiny_qwen2  # noqa: F401  (module fixtures)


def test_hf_name():
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.1.attn_k.bias") == "model.layers.1.self_attn.k_proj.bias"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("rope_freqs.weight") is None                  # no module: read, not stored
    # Gemma 2's norm after attention has a module of its own there, none in a Llama
    assert hf_name("blk.0.post_attention_norm.weight") is None
    assert hf_name("blk.0.post_attention_norm.weight", "gemma2") == \
        "model.layers.0.post_attention_layernorm.weight"


def _llama3_rope_freqs(head_dim, theta, factor, low, high, old_ctx) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes as rope_freqs.weight."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * np.pi * theta ** (i / head_dim)
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)



@pytest.mark.parametrize("n_head,head_dim,cols", [(4, 16, 8), (3, 6, 5), (9, 64, 1)])
def test_unpermute_inverts_llama_cpp_permute(n_head, head_dim, cols):
    w = torch.randn(n_head * head_dim, cols)
    torch.testing.assert_close(unpermute(_permute(w, n_head), n_head), w, rtol=0, atol=0)
    assert not torch.equal(_permute(w, n_head), w)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_round_trip_from_hf(arch, tiny_llama, tiny_qwen2, smollm2_reader, tmp_path):
    """HF weights → GGUF (Q/K permuted, some tensors F16/Q8_0/Q4_1) → kvrun: equal to the
    HF weights as the GGUF stores them (dequantized)."""
    import gguf
    T = gguf.GGMLQuantizationType
    src, state = tiny_llama if arch == "llama" else tiny_qwen2
    tied = arch == "llama"
    qtypes = {"up_proj.weight": T.Q8_0, "v_proj.weight": T.F16, "gate_proj.weight": T.Q4_1}
    freqs = _llama3_rope_freqs(16, 10000.0, 8.0, 1.0, 4.0, 8192) if arch == "llama" else None
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(path, arch, state, smollm2_reader, tied, qtypes, rope_freqs=freqs)
    cfg = convert_gguf(path, tmp_path / "out", dtype="fp32")
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(got) == set(state) - ({"lm_head.weight"} if tied else set())
    for k, v in got.items():
        want = state[k].float()
        q = _qtype(k, qtypes)
        if q is not None:       # what llama.cpp's quantizer kept, dequantized by gguf
            want = torch.from_numpy(np.array(gguf.quants.dequantize(
                gguf.quants.quantize(want.numpy(), q), q)))
        torch.testing.assert_close(v, want, rtol=0, atol=0, msg=k)
    assert (cfg.architecture, cfg.tie_word_embeddings, cfg.attention_bias) == \
        (arch, tied, arch == "qwen2")
    assert cfg.source["file_type"] == 7
    if arch == "llama":
        assert cfg.rope_scaling == {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192}
    else:
        assert cfg.rope_scaling is None and cfg.rope_theta == 1e6


def test_gguf_unsupported_quant_type(tiny_qwen2, smollm2_reader, tmp_path):
    import gguf
    path = tmp_path / "mxfp4.gguf"
    _write_gguf(path, "qwen2", tiny_qwen2[1], smollm2_reader, False,
                {"down_proj.weight": gguf.GGMLQuantizationType.MXFP4})
    with pytest.raises(KvrunError, match="uses GGUF type MXFP4, which kvrun does not convert"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()

