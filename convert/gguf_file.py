"""GGUF file → kvrun model dir (weights at the file's bits where kvrun's formats hold them,
tokenizer rebuilt).

Read with `gguf.GGUFReader` (llama.cpp's own reader; never hand-parsed). Three things
differ from an HF checkpoint and are undone here:

1. Quantization: with no `weights` asked for, the format follows the file's linear layers
   (quantize.py `default_weights`: int4 for a mostly 4-bit file, int8 for Q5/Q6/Q8, float
   for F16/F32); only the types in `_SUPPORTED_NAMES` are accepted. Into int4, Q4_0/Q4_1
   blocks are repacked (group 32) byte for byte and Q4_K sub-blocks keep their codes with
   scale and min rounded once to fp16 (quantize.py `INT4_REPACKED`); every other tensor is
   dequantized with `gguf.quants.dequantize` and, for int8/int4, quantized again. Float
   tensors are cast to the target dtype.
2. Q/K row order: llama.cpp's convert_hf_to_gguf.py permutes the rows of the `llama`,
   `granite` and `smollm3` architectures' attn_q / attn_k (per head, (2, D/2) → (D/2, 2)) so its RoPE can rotate
   adjacent pairs; kvrun's RoPE is HF's rotate-half, so the rows are put back (`unpermute`).
   Qwen2, Qwen3 and OLMo 2 files are written without this permutation (llama.cpp runs
   them with NEOX-style RoPE, HF's rotate-half).
3. Names: `blk.N.attn_q` → `model.layers.N.self_attn.q_proj` etc. (`_NAMES`; Gemma 3's,
   Qwen3's and OLMo 2's norms map differently: `_NAMES_BY_ARCH`).
4. Granite: its multipliers are the `embedding_scale`, `attention.scale`, `logit_scale`
   metadata; `residual_scale` is folded into o_proj and down_proj as convert/hf_families.py
   does. SmolLM3: NoPE on every 4th layer, as llama.cpp assumes. Phi-3: its fused
   attn_qkv / ffn_up (gate | up) are split into Llama's projections (after quantizing, row
   by row: hf_families.split_fused); RoPE on `rope.dimension_count` channels of a head
   (Phi-4-mini) permutes attn_q / attn_k's rows as the HF converter does
   (hf_families.permute_rotary: llama.cpp runs phi3 NEOX-style on HF's row order);
   longrope comes as the rope_factors_short / _long tensors with
   `rope.scaling.original_context_length` and `rope.scaling.attn_factor`.
5. Gemma 2 and 3: llama.cpp stores their RMSNorm weights as 1 + w (its norm multiplies by
   the weight); kvrun keeps HF's w and computes (1 + w), so 1 is subtracted. Gemma's Q/K rows
   are not permuted (llama.cpp runs it with NEOX-style RoPE, HF's rotate-half). Gemma 2's
   soft-caps are `gemma2.attn_logit_softcapping` / `gemma2.final_logit_softcapping`.

The GGUF's reader already gives 2-D tensors as (rows, cols) = (out, in), the torch order,
although GGUF lists dims innermost first. The tokenizer comes from gguf_tokenizer.py.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from kvrun.model.config import ModelConfig
from kvrun.errors import KvrunError
from kvrun.files import file_sha256
from kvrun.kernels.rope import inv_frequencies, longrope_attention

from .gguf_tokenizer import tokenizer_from_gguf
from .hf_families import per_expert, permute_rotary, split_fused
from .quantize import (INT4_REPACKED, check_weight_format, default_weights, describe, float_dtype,
                       is_quantized, quantize, repack_gguf_q4, target_format)
from .templates import chat_stop_tokens, detect_chat_template
from .writer import (Progress, check_destination, expected_tensors, torch_dtype,
                     validate_tensors, write_model_dir)

# GGUF → kvrun architecture
_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3moe",
          "gemma2": "gemma2", "gemma3": "gemma3", "olmo2": "olmo2",
          "granite": "granite", "smollm3": "smollm3", "phi3": "llama"}
# llama.cpp's converter permutes attn_q / attn_k of the architectures it writes through its
# LlamaModel class (GraniteModel and SmolLM3Model subclass it)
_PERMUTED = ("llama", "granite", "smollm3")
# SmolLM3: the GGUF stores no NoPE layer list; llama.cpp (llama-model.cpp) fixes every 4th
SMOLLM3_NOPE_EVERY = 4
_SUPPORTED_NAMES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
                    "Q6_K")

_NAMES = {                                     # per-block GGUF suffix → HF module path
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
# Gemma 3 has four norms per block and QK-norm; its `ffn_norm` is the MLP's input norm, which
# HF calls pre_feedforward_layernorm (Llama's post_attention_layernorm is that norm).
_NAMES_GEMMA3 = {**_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                 "post_attention_norm": "post_attention_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm",
                 "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma 2: Gemma 3's four norms per block, no QK-norm
_NAMES_GEMMA2 = {k: v for k, v in _NAMES_GEMMA3.items() if k not in ("attn_q_norm", "attn_k_norm")}
# Qwen3: QK-norm per head beside Llama's norms; OLMo 2: its two post-norms and QK-norm over
# the projection, no pre-norms (`ffn_norm` absent)
_NAMES_QWEN3 = {**_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_NAMES_OLMO2 = {**_NAMES_QWEN3, "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3: fused projections under HF's fused names, split after reading (hf_families.split_fused)
_NAMES_PHI3 = {**_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Qwen3-MoE: the router, and each projection of all experts stacked (E, rows, cols) under a
# name of its own, split into kvrun's per-expert modules after reading (`_split_experts`)
_EXPERTS = {"ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
            "ffn_down_exps": "mlp.experts.down_proj"}
_NAMES_QWEN3MOE = {**_NAMES_QWEN3, "ffn_gate_inp": "mlp.gate", **_EXPERTS}
_NAMES_BY_ARCH = {"gemma2": _NAMES_GEMMA2, "gemma3": _NAMES_GEMMA3, "qwen3": _NAMES_QWEN3, "olmo2": _NAMES_OLMO2,
                  "phi3": _NAMES_PHI3, "qwen3moe": _NAMES_QWEN3MOE}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(name: str, arch: str = "llama") -> str | None:
    """GGUF tensor name → HF name; None for names kvrun has no module for."""
    if name in _TOP:
        return _TOP[name]
    names = _NAMES_BY_ARCH.get(arch, _NAMES)
    m = _BLOCK.match(name)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return None


_STACKED = re.compile(r"(.*)\.experts\.(\w+_proj)\.weight$")


def _split_experts(ts: dict) -> dict:
    """Stacked `….mlp.experts.{gate,up,down}_proj.weight` (E, rows, cols) into one tensor per
    expert, in place (hf_families.per_expert); returns `ts`."""
    for k in [k for k in ts if _STACKED.match(k)]:
        ts.update(per_expert(*_STACKED.match(k).groups(), ts.pop(k)))
    return ts


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of convert_hf_to_gguf.py's `permute`: w (n_head*D, ...) rows back to HF order.

    llama.cpp stores the row of (head h, half i, pair j) at h*D + 2j + i; HF at h*D + i*D/2 + j.
    """
    rows = w.shape[0]
    assert rows % (2 * n_head) == 0, f"{rows} rows do not split into {n_head} heads"
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])    # (H, D/2, 2, ...)
            .transpose(1, 2)                                           # (H, 2, D/2, ...)
            .reshape(w.shape))


def open_gguf(path: str | Path):
    """GGUFReader over `path`, with one-line errors for missing, foreign or truncated files."""
    import gguf
    path = Path(path)
    if not path.is_file():
        raise KvrunError(f"{path}: no such file")
    try:
        reader = gguf.GGUFReader(str(path))
    except OSError as e:            # unreadable (permissions, I/O error): not a format problem
        raise KvrunError(f"{path}: cannot read it ({e.strerror or e})") from None
    except Exception as e:          # the reader raises ValueError/IndexError/… on bad bytes
        raise KvrunError(f"{path}: not a valid GGUF file or truncated ({e})") from None
    short = [t.name for t in reader.tensors if t.data.nbytes != t.n_bytes]
    if short:
        raise KvrunError(f"{path}: truncated GGUF file (tensor {short[0]} is incomplete)")
    return reader


def read_metadata(reader) -> dict:
    """All key/value fields as plain Python values (strings, numbers, lists)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = field.contents()
        except Exception as e:
            raise KvrunError(f"GGUF metadata field {key} is unreadable ({e})") from None
    return meta


def _rope_scaling(meta: dict, arch: str, head_dim: int, theta: float,
                  rope_freqs: np.ndarray | None) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor") or meta.get(f"{arch}.rope.scale_linear")
    if rope_freqs is not None:
        return _llama3_from_freqs(meta, arch, head_dim, theta, rope_freqs)
    if kind in (None, "none") and not factor:
        return None
    if kind in (None, "linear") and factor:
        return None if float(factor) == 1.0 else {"type": "linear", "factor": _f32(factor)}
    raise KvrunError(f"unsupported rope scaling {kind!r} in GGUF (supported: linear, llama3)")


ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")


def _longrope(meta: dict, arch: str, tensors: dict) -> dict:
    """longrope from llama.cpp's Phi-3 files: the factor tensors (one per rotated pair),
    the original context and the attention factor (when absent, derived from the context
    length as transformers and llama.cpp's converter derive it)."""
    if "rope_factors_short.weight" not in tensors:
        raise KvrunError("GGUF has rope_factors_long but no rope_factors_short")
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    if not orig:
        raise KvrunError(f"GGUF longrope without {arch}.rope.scaling.original_context_length")
    att = meta.get(f"{arch}.rope.scaling.attn_factor")
    if att is None:
        att = longrope_attention(int(meta.get(f"{arch}.context_length", orig)) / int(orig), int(orig))
    short, long = (_dequantize(tensors[n]).reshape(-1).astype(np.float64).tolist() for n in ROPE_FACTORS)
    return {"type": "longrope", "short_factor": short, "long_factor": long,
            "original_max_position_embeddings": int(orig), "attention_factor": float(att)}


def _llama3_from_freqs(meta, arch, head_dim, theta, rope_freqs) -> dict | None:
    """Llama 3.1-style files store llama3 scaling as per-frequency divisors (rope_freqs).

    The divisors are 1 for short wavelengths and `factor` for long ones; the scaling dict is
    recovered by trying Meta's published low/high factors and checking every frequency.
    """
    f = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    if f.shape[0] != head_dim // 2:
        raise KvrunError(f"GGUF rope_freqs has {f.shape[0]} entries, expected {head_dim // 2}")
    if np.allclose(f, 1.0):
        return None
    base = inv_frequencies(head_dim, theta, None).numpy()
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    for old_ctx in ([int(orig)] if orig else []) + [8192, 4096, 2048]:
        cand = {"type": "llama3", "factor": _f32(f.max()), "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": old_ctx}
        if np.allclose(base / f, inv_frequencies(head_dim, theta, cand).numpy(), rtol=1e-4):
            return cand
    raise KvrunError("GGUF rope_freqs do not match llama3 rope scaling; unsupported rope variant")


def _special_ids(meta: dict, template: str) -> tuple[int | None, list[int], bool]:
    """(bos id, eos ids, add_bos) from the tokenizer metadata.

    The declared eos is not always the token that ends a chat turn (SmolLM2 declares
    <|im_end|>, Llama 3 <|end_of_text|>), so the template family's turn-end tokens and the
    GGUF's eot/eom ids are added: generation must stop on any of them.
    """
    tokens = meta["tokenizer.ggml.tokens"]
    index = {t: i for i, t in enumerate(tokens)}
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos += [index.get(t) for t in chat_stop_tokens(template)]
    eos_ids = list(dict.fromkeys(int(i) for i in eos if i is not None and 0 <= i < len(tokens)))
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:     # llama.cpp's defaults: SentencePiece and llama3-BPE vocabs add BOS
        add_bos = (meta.get("tokenizer.ggml.model") == "llama"
                   or meta.get("tokenizer.ggml.pre") in ("llama3", "llama-v3", "llama-bpe"))
    return (int(bos) if bos is not None else None), eos_ids, bool(add_bos)


def config_from_gguf(meta: dict, reader, dtype: str) -> ModelConfig:
    """kvrun ModelConfig from GGUF metadata (+ the embedding shape and rope_freqs tensor)."""
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise KvrunError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(_ARCHS)})")
    tensors = {t.name: t for t in reader.tensors}

    def need(key):
        if f"{arch}.{key}" not in meta:
            raise KvrunError(f"GGUF metadata lacks {arch}.{key}")
        return meta[f"{arch}.{key}"]

    hidden, n_heads = int(need("embedding_length")), int(need("attention.head_count"))
    n_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_heads))
    rot = meta.get(f"{arch}.rope.dimension_count")
    # a phi3 file's rope dimension is the rotated part of a head (Phi-4-mini: 3/4 of it)
    head_dim = int(meta.get(f"{arch}.attention.key_length")
                   or (rot if arch != "phi3" else None) or hidden // n_heads)
    if rot is not None and int(rot) != head_dim and arch != "phi3":
        raise KvrunError(f"partial rotary embedding (rope over {rot} of {head_dim} dims) "
                         f"is not supported in {arch} files")
    theta = _f32(meta.get(f"{arch}.rope.freq_base", 10000.0))
    if "token_embd.weight" not in tensors:
        raise KvrunError("GGUF file has no token_embd.weight tensor")
    vocab = int(tensors["token_embd.weight"].shape[-1])      # GGUF dims are (cols, rows)
    rope_freqs = tensors.get("rope_freqs.weight")
    scaling = (_longrope(meta, arch, tensors) if "rope_factors_long.weight" in tensors else
               _rope_scaling(meta, arch, head_dim, theta,
                             None if rope_freqs is None else _dequantize(rope_freqs)))
    template, default_system = detect_chat_template(meta.get("tokenizer.chat_template"))
    extra = {}
    if arch in ("gemma2", "gemma3"):
        # Some GGUF converters drop the chat template; every Gemma 2 and 3 uses the same one.
        template = "gemma" if template == "none" else template
        extra = (_gemma3_fields(meta, head_dim) if arch == "gemma3" else
                 _gemma2_fields(meta, head_dim, hidden, n_heads))
    elif arch == "granite":
        extra = dict(embedding_multiplier=_f32(meta.get("granite.embedding_scale", 1.0)),
                     attention_multiplier=_f32(meta.get("granite.attention.scale", 0.0)),
                     logits_scaling=_f32(meta.get("granite.logit_scale", 1.0)))
    elif arch == "qwen3moe":
        extra = _qwen3moe_fields(meta, tensors, int(need("block_count")))
    elif arch == "smollm3":
        extra = dict(nope_layers=[i for i in range(int(need("block_count")))
                                  if (i + 1) % SMOLLM3_NOPE_EVERY == 0])
    bos, eos, add_bos = _special_ids(meta, template)
    return ModelConfig(**extra,
        architecture=_ARCHS[arch], vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")), num_layers=int(need("block_count")),
        num_heads=n_heads, num_kv_heads=n_kv, head_dim=head_dim,
        max_position=int(meta.get(f"{arch}.context_length", 4096)),
        rms_norm_eps=_f32(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta, rope_scaling=scaling, rotary_dim=int(rot or head_dim),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=bos, eos_token_ids=eos, add_bos=add_bos,
        chat_template=template, default_system=default_system, torch_dtype=dtype)


def _gemma3_fields(meta: dict, head_dim: int) -> dict:
    """Gemma 3 settings the GGUF leaves implicit, as llama.cpp (llama-model.cpp, GEMMA3) and
    HF's Gemma3TextConfig defaults fill them in: 5 of every 6 layers slide over
    `attention.sliding_window` tokens with RoPE base 10000 (the GGUF's freq_base is the global
    layers'); queries scaled by head_dim**-0.5 (query_pre_attn_scalar = head_dim, what every
    size but 27B uses: llama.cpp derives 27B's from its layer count, which kvrun refuses
    rather than guess); logits soft-capped only if the file says so (Gemma 2 did, 3 does not)."""
    if int(meta.get("gemma3.block_count", 0)) == 62:
        raise KvrunError("Gemma 3 27B scales queries by hidden/heads, not head_dim; "
                         "not supported yet")
    window = meta.get("gemma3.attention.sliding_window")
    if window is None:
        raise KvrunError("GGUF metadata lacks gemma3.attention.sliding_window")
    cap = meta.get("gemma3.final_logit_softcapping")
    return dict(sliding_window=int(window), rope_local_theta=10000.0,
                query_pre_attn_scalar=float(head_dim),
                final_logit_softcapping=_f32(cap) if cap else None)


def _qwen3moe_fields(meta: dict, tensors: dict, n_layers: int) -> dict:
    """Qwen3-MoE's expert settings: count, top-k and width from the metadata; llama.cpp
    renormalizes the top-k weights of this architecture always (norm_topk_prob); a layer
    without a router (ffn_gate_inp) keeps the dense MLP."""
    for key in ("expert_count", "expert_used_count", "expert_feed_forward_length"):
        if f"qwen3moe.{key}" not in meta:
            raise KvrunError(f"GGUF metadata lacks qwen3moe.{key}")
    return dict(num_experts=int(meta["qwen3moe.expert_count"]),
                num_experts_per_tok=int(meta["qwen3moe.expert_used_count"]),
                moe_intermediate_size=int(meta["qwen3moe.expert_feed_forward_length"]),
                norm_topk_prob=True,
                mlp_only_layers=[i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors])


def _gemma2_fields(meta: dict, head_dim: int, hidden: int, n_heads: int) -> dict:
    """Gemma 2 settings as llama.cpp (llama-model.cpp, GEMMA2) reads them: every 2nd layer
    global (the even ones slide over `attention.sliding_window` tokens), one RoPE base for
    all; queries scaled by head_dim**-0.5, but 27B's (46 layers) by (hidden/heads)**-0.5 (HF's
    query_pre_attn_scalar 144 = 4608/32); the attention and final logits soft-capped by the
    file's `attn_logit_softcapping` / `final_logit_softcapping` (convert_hf_to_gguf.py writes
    both for every Gemma 2)."""
    window = meta.get("gemma2.attention.sliding_window")
    if window is None:
        raise KvrunError("GGUF metadata lacks gemma2.attention.sliding_window")
    scalar = hidden / n_heads if int(meta.get("gemma2.block_count", 0)) == 46 else head_dim
    caps = {k: meta.get(f"gemma2.{k}") for k in ("attn_logit_softcapping", "final_logit_softcapping")}
    return dict(sliding_window=int(window), query_pre_attn_scalar=float(scalar),
                **{k: _f32(v) if v else None for k, v in caps.items()})


def _f32(v) -> float:
    """A float32 metadata value as the short decimal it was written from (1e-05, not 9.99…e-06)."""
    return float(str(np.float32(v)))


def _dequantize(t) -> np.ndarray:
    """float32 numpy array in torch (rows, cols) order."""
    import gguf
    qtype = gguf.GGMLQuantizationType(t.tensor_type)
    if qtype.name not in _SUPPORTED_NAMES:
        raise KvrunError(f"tensor {t.name} uses GGUF type {qtype.name}, which kvrun does not "
                         f"convert (supported: {', '.join(_SUPPORTED_NAMES)})")
    out = gguf.quants.dequantize(t.data, qtype)
    # a copy: F32 tensors are read-only views of the memory-mapped file
    return np.array(out, dtype=np.float32, order="C").reshape(_torch_shape(t))


def _quantized_parts(t, name: str, weights: str, group: int, log,
                     scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Stored int8/int4 parts of one GGUF tensor times `scale` (still in llama.cpp's Q/K row
    order)."""
    import gguf
    from kvrun.model.qlinear import int4_group
    qtype = gguf.GGMLQuantizationType(t.tensor_type).name
    shape = _torch_shape(t)
    fmt = target_format(name, weights)
    if fmt == "int4" and qtype in INT4_REPACKED and int4_group(shape[1], group) == 32:
        base = name[:-len(".weight")]
        parts = {f"{base}.{k}": v for k, v in repack_gguf_q4(t.data, qtype, shape, scale).items()}
        how = f"int4 g32 <- {qtype} repacked"
    else:
        w = torch.from_numpy(_dequantize(t))
        parts = quantize(name, w * scale if scale != 1.0 else w, weights, group)
        how = f"{fmt}{' g%d' % int4_group(shape[1], group) if fmt == 'int4' else ''} <- {qtype}"
    if log:
        log(describe(name, how, torch.from_numpy(_dequantize(t)) * scale, parts))
    return parts


def linear_types(reader) -> dict[str, int]:
    """GGUF type name → number of weights, over the tensors that become linear layers."""
    import gguf
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    out: dict[str, int] = {}
    for t in reader.tensors:
        name = hf_name(t.name, arch)
        if name is not None and name.endswith("_proj.weight"):
            q = gguf.GGMLQuantizationType(t.tensor_type).name
            out[q] = out.get(q, 0) + int(t.n_elements)
    return out


def file_weights(path: str | Path) -> str:
    """The weight format (float | int8 | int4) `convert_gguf` picks for this file when none is
    asked for: its linear layers' own bits (quantize.py `default_weights`)."""
    return default_weights(linear_types(open_gguf(path)))


def _torch_shape(t) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(t.shape))         # GGUF lists the innermost dim first


def convert_gguf(path: str | Path, out_dir: str | Path, dtype: str | None = "bf16",
                 progress: Progress | None = None, overwrite: bool = False,
                 weights: str | None = None, group: int = 32,
                 log: Callable[[str], None] | None = None) -> ModelConfig:
    """Convert a GGUF file (an architecture in `_ARCHS`) into a kvrun model dir at `out_dir`.

    `dtype` is the float tensors' dtype (None: quantize.py `float_dtype` of the format);
    `weights` float | int8 | int4 (with `group` columns per int4 scale) how linear weights
    are stored, None: the file's own bits (`file_weights`: int4 for a mostly 4-bit file,
    int8 for Q5/Q6/Q8, float for F16/F32).
    Returns the written config.
    `progress(done, total, name)` is called after each tensor; `log(line)`, when given,
    receives one line per quantized tensor with its error against the GGUF's values.
    """
    path = Path(path).expanduser().absolute()
    if dtype is not None:
        torch_dtype(dtype)                          # a bad dtype fails before any work
    if weights is not None:
        check_weight_format(weights, group)
    check_destination(out_dir, overwrite)
    reader = open_gguf(path)
    meta = read_metadata(reader)
    types = linear_types(reader)
    if weights is None:
        weights = default_weights(types)
        check_weight_format(weights, group)
    dtype = dtype or float_dtype(weights)
    target = torch_dtype(dtype)
    cfg = config_from_gguf(meta, reader, dtype)
    tokenizer = tokenizer_from_gguf(meta)
    if tokenizer.get_vocab_size(with_added_tokens=True) > cfg.vocab_size:
        raise KvrunError(f"GGUF tokenizer has {tokenizer.get_vocab_size()} tokens but the "
                         f"embedding only {cfg.vocab_size} rows")

    todo = [t for t in reader.tensors if t.name not in ("rope_freqs.weight", *ROPE_FACTORS)]
    arch = meta["general.architecture"]            # the GGUF's (phi3 runs as kvrun's llama)
    for t in todo:
        if hf_name(t.name, arch) is None:
            raise KvrunError(f"GGUF tensor {t.name} has no kvrun equivalent; "
                             "unsupported model variant")

    def unfused(ts: dict) -> dict:
        if arch == "phi3":
            split_fused(ts, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        return _split_experts(ts)
    # Check names and shapes on meta tensors first: no dequantizing a file that cannot load.
    validate_tensors(cfg, unfused({hf_name(t.name, arch): torch.empty(_torch_shape(t), device="meta")
                                   for t in todo}))
    cfg.weights, cfg.weight_group = weights, (group if weights == "int4" else 0)
    expected_tensors(cfg)                  # int4 needs rows that split into groups: fail now
    tensors: dict[str, torch.Tensor] = {}
    residual = _f32(meta.get("granite.residual_scale", 1.0)) if arch == "granite" else 1.0
    for i, t in enumerate(todo):
        name = hf_name(t.name, arch)
        n_perm = None
        if arch in _PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            n_perm = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
        scale = residual if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
        if _STACKED.match(name):
            # stacked experts: split, then quantized one expert at a time (each a linear layer)
            w = _split_experts({name: torch.from_numpy(_dequantize(t))})
            for k, v in w.items():
                tensors.update(quantize(k, v, weights, group) if weights != "float" else {k: v.to(target)})
        elif weights != "float" and is_quantized(name):
            parts = _quantized_parts(t, name, weights, group, log, scale)
            tensors.update({k: unpermute(v, n_perm) if n_perm else v for k, v in parts.items()})
        else:
            w = torch.from_numpy(_dequantize(t))
            if scale != 1.0:                # Granite's residual_scale (the module docstring)
                w = w * scale
            if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
                w = w - 1       # llama.cpp stores Gemma's (1 + w); kvrun keeps HF's w
            tensors[name] = (unpermute(w, n_perm) if n_perm else w).to(target)
        if progress:
            progress(i + 1, len(todo), name)

    unfused(tensors)
    if arch == "phi3":
        permute_rotary(tensors, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim)
    cfg.source = {"format": "gguf", "path": str(path), "sha256": file_sha256(path),
                  "file_type": meta.get("general.file_type"), "linear_types": types}
    write_model_dir(out_dir, cfg, tensors, tokenizer.to_str(), overwrite=overwrite)
    return cfg
