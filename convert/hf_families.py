"""What differs per model family when converting an HF folder: the kvrun architecture it
runs as, the config.json keys its quirks come from, and the tensor fix-ups done once here
so the runtime loads HF's module names with strict=True (convert/hf.py reads the rest,
which every family shares).

Each `Family` is read off the family's transformers modeling file (`models/<family>/`):

- Llama, Mistral, Qwen2: as they are (Qwen2: q/k/v biases).
- Qwen3: q/k RMSNorm per head before RoPE, head_dim from the config.
- Gemma 3 (text): (1 + w) norms stored as w (as kvrun's Gemma layer takes them), sliding
  and full layers from `layer_types`, local / global RoPE bases, query_pre_attn_scalar.
- Gemma 2: as Gemma 3 without q/k norms or a local RoPE base; sliding layers alternate
  (even layers slide when `layer_types` is absent, as Gemma2Config fills it); attention and
  final logits soft-capped (`attn_logit_softcapping`, `final_logit_softcapping`). Gemma 3's
  config has an attn_logit_softcapping too, which transformers' Gemma 3 never applies (and
  llama.cpp's converter asserts unset): not read, so its logits stay transformers'.
- Granite: embedding, attention and logits multipliers as config fields; its
  residual_multiplier scales the attention and MLP outputs before each residual add, so it
  is folded into o_proj and down_proj here (the native step then needs nothing for it).
- OLMo 2: post-norms only, q/k norm over the whole projection (runtime/model/olmo2.py).
- SmolLM3: `no_rope_layers` (1 = RoPE, 0 = NoPE) → `nope_layers`.
- Qwen3-MoE: Qwen3's attention with a sparse MLP (runtime/model/moe.py); `num_experts`
  (transformers 5 also says `num_local_experts`), top-k, expert width, `norm_topk_prob`;
  the dense layers are `mlp_only_layers` plus every layer `decoder_sparse_step` skips.
  Experts are stored one module per expert (`mlp.experts.N.gate_proj` …, what
  transformers writes); a folder with the fused 3-D `experts.gate_up_proj` /
  `experts.down_proj` (transformers 5's in-memory layout) is split into that.
- Phi-3: fused qkv_proj and gate_up_proj split into Llama's projections; then a Llama.
  Longrope / su scaling is read as every family's (hf.py `_rope`); Phi-4-mini's
  partial_rotary_factor becomes `rotary_dim`, with q and k's rows permuted per head
  (`permute_rotary`) so that kvrun's full-D RoPE rotates exactly HF's pairs.

Sliding-window settings of the Llama-layer families (Mistral v0.1, Qwen2/3's
`use_sliding_window`, Phi-3's `sliding_window`) are ignored: kvrun attends over the whole
context, so past the window its logits differ from transformers' (their layers are all
sliding, and kvrun's caches keep sliding layers only beside at least one full one).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from kvrun.errors import KvrunError


def _no_bias(name: str) -> Callable[[dict], dict]:
    """Fields of a family whose attention_bias would also bias o_proj (and mlp_bias the
    MLP), which kvrun's layers do not have: refused."""
    def fields(hf: dict) -> dict:
        if hf.get("mlp_bias") or hf.get("attention_bias"):
            raise KvrunError(f"{name} checkpoints with attention/MLP biases are not supported")
        return {}
    return fields


def _cap(hf: dict, key: str) -> float | None:
    """A soft-cap setting: None (or 0) is off."""
    x = hf.get(key)
    return float(x) if x else None


def _gemma_fields(hf: dict, name: str, every: int) -> dict:
    """What Gemma 2 and Gemma 3 share: the checks, the layer kinds (one global layer in
    `every` when the config lists none), the window, the query scalar and the final
    logits' soft-cap."""
    _no_bias(name)(hf)
    if hf.get("use_bidirectional_attention"):
        raise KvrunError(f"{name} with bidirectional attention (an embedding model) is not supported")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise KvrunError(f"{name} with hidden_activation {act!r} is not supported "
                         "(kvrun runs gelu_pytorch_tanh)")
    n = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types is None:           # transformers' default
        types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
    return dict(layer_types=list(types), sliding_window=int(hf.get("sliding_window") or 4096),
                query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or 256),
                final_logit_softcapping=_cap(hf, "final_logit_softcapping"),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)))


def _gemma2_fields(hf: dict) -> dict:
    """Gemma2Config: every 2nd layer global; one RoPE base for all (hf.py reads it); the
    attention logits soft-capped (modeling_gemma2 passes softcap to its attention)."""
    return dict(_gemma_fields(hf, "Gemma 2", 2), attn_logit_softcapping=_cap(hf, "attn_logit_softcapping"))


def _gemma3_fields(hf: dict) -> dict:
    # every `sliding_window_pattern`-th layer global; the sliding layers' own RoPE base; no
    # attention soft-cap (the module docstring)
    fields = _gemma_fields(hf, "Gemma 3", int(hf.get("sliding_window_pattern") or 6))
    params = hf.get("rope_parameters") or {}
    local = params.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise KvrunError(f"Gemma 3's sliding layers with rope scaling {local['rope_type']!r} "
                         "are not supported")
    return dict(fields, rope_local_theta=float(local.get("rope_theta") or hf.get("rope_local_base_freq")
                                               or 10000.0))


def _granite_fields(hf: dict) -> dict:
    _no_bias("Granite")(hf)
    return dict(embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
                attention_multiplier=float(hf.get("attention_multiplier", 1.0)),
                logits_scaling=float(hf.get("logits_scaling", 1.0)))


def _granite_tensors(hf: dict, raw: dict[str, torch.Tensor]) -> None:
    """Fold residual_multiplier into the two projections that feed the residual adds."""
    m = float(hf.get("residual_multiplier", 1.0))
    if m == 1.0:
        return
    for k in raw:
        if k.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            raw[k] = raw[k].float() * m          # in fp32; cast to the target dtype later


def _smollm3_fields(hf: dict) -> dict:
    _no_bias("SmolLM3")(hf)
    n = int(hf["num_hidden_layers"])
    flags = hf.get("no_rope_layers")
    if flags is None:           # transformers' default: NoPE every `no_rope_layer_interval`-th
        every = int(hf.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % every != 0) for i in range(n)]
    if len(flags) != n:
        raise KvrunError(f"no_rope_layers lists {len(flags)} layers, the model has {n}")
    return dict(nope_layers=[i for i, rope in enumerate(flags) if not rope],
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)))


def _phi3_fields(hf: dict) -> dict:
    _no_bias("Phi-3")(hf)
    D = head_dim(hf)
    factor = (hf.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                     hf.get("partial_rotary_factor", 1.0))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise KvrunError(f"Phi-3 partial_rotary_factor must be a number in (0, 1], got {factor!r}")
    rd = int(D * factor)                        # HF's rotary dim: int(head_dim · factor)
    if rd % 2 or (D - rd) % 2:
        raise KvrunError(f"Phi-3 partial_rotary_factor {factor:g} rotates {rd} of {D} channels: "
                         "kvrun needs an even count of rotated and of passed-through channels")
    return {"rotary_dim": rd}


def head_dim(hf: dict) -> int:
    return int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))


def rotary_order(D: int, rotary_dim: int) -> torch.Tensor:
    """(D,) the HF channel each kvrun channel of a head holds: HF rotates channel i with
    i + rotary_dim/2 for i < rotary_dim/2 and passes the rest through; kvrun pairs i with
    i + D/2, so the first half takes HF's first rotated half then the first half of the
    passed-through channels, the second half their partners."""
    r, p = rotary_dim // 2, (D - rotary_dim) // 2
    a = torch.arange(D)
    return torch.cat([a[:r], a[2 * r:2 * r + p], a[r:2 * r], a[2 * r + p:]])


def permute_rotary(raw: dict[str, torch.Tensor], H: int, Hkv: int, D: int, rotary_dim: int) -> None:
    """q_proj / k_proj rows put in `rotary_order` per head, in place: the same permutation
    on q and k leaves every q·k as it was. Every stored part is permuted along its rows (a
    float `weight`, or a quantized one's `qweight` / `scales` / `mins`)."""
    if rotary_dim == D:
        return
    order = rotary_order(D, rotary_dim)
    proj = re.compile(r".*\.self_attn\.([qk])_proj\.\w+$")
    for k in [k for k in raw if proj.match(k)]:
        n = H if proj.match(k).group(1) == "q" else Hkv
        w = raw[k]
        if w.shape[0] != n * D:
            raise KvrunError(f"tensor {k} has {w.shape[0]} rows, the config implies {n * D}")
        raw[k] = w.reshape(n, D, *w.shape[1:])[:, order].reshape(w.shape).contiguous()


def split_fused(raw: dict[str, torch.Tensor], H: int, Hkv: int, D: int) -> None:
    """Phi-3's fused qkv_proj (rows q | k | v) and gate_up_proj (rows gate | up) into Llama's
    projections, in place. Every stored part is split along its rows (dim 0): a float
    `weight`, or the quantized `qweight` / `scales` / `mins` of one (one scale row per
    weight row), so the GGUF converter splits after quantizing too."""
    fused = re.compile(r"(.*)\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(\w+)$")
    for k in [k for k in raw if fused.match(k)]:
        prefix, which, part = fused.match(k).groups()
        w = raw.pop(k)
        if which == "self_attn.qkv_proj":
            if w.shape[0] != (H + 2 * Hkv) * D:
                raise KvrunError(f"tensor {k} has {w.shape[0]} rows, the config implies {(H + 2 * Hkv) * D}")
            names, pieces = ("q_proj", "k_proj", "v_proj"), w.split([H * D, Hkv * D, Hkv * D])
            names = [f"self_attn.{n}" for n in names]
        else:
            names, pieces = ("mlp.gate_proj", "mlp.up_proj"), w.chunk(2)
        raw.update({f"{prefix}.{n}.{part}": t.contiguous() for n, t in zip(names, pieces)})


def _phi3_tensors(hf: dict, raw: dict[str, torch.Tensor]) -> None:
    H = int(hf["num_attention_heads"])
    Hkv, D = int(hf.get("num_key_value_heads") or H), head_dim(hf)
    split_fused(raw, H, Hkv, D)
    permute_rotary(raw, H, Hkv, D, _phi3_fields(hf)["rotary_dim"])


def _qwen3moe_fields(hf: dict) -> dict:
    _no_bias("Qwen3-MoE")(hf)
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise KvrunError(f"Qwen3-MoE with hidden_act {act!r} is not supported (kvrun runs silu)")
    if hf.get("shared_expert_intermediate_size"):
        raise KvrunError("MoE checkpoints with a shared expert (Qwen2-MoE) are not supported")
    n, step = int(hf["num_hidden_layers"]), int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or []) | {i for i in range(n) if (i + 1) % step}
    return dict(num_experts=int(hf.get("num_experts") or hf.get("num_local_experts") or 0),
                num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0),
                moe_intermediate_size=int(hf.get("moe_intermediate_size") or 0),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)), mlp_only_layers=sorted(dense))


def per_expert(prefix: str, proj: str, stacked: torch.Tensor) -> dict[str, torch.Tensor]:
    """One projection of every expert stacked (E, rows, cols) as one tensor per expert,
    `{prefix}.experts.N.{proj}.weight`: the layout kvrun loads (the module docstring);
    shared with the GGUF converter's ffn_*_exps."""
    return {f"{prefix}.experts.{e}.{proj}.weight": stacked[e].contiguous() for e in range(stacked.shape[0])}


def _qwen3moe_tensors(hf: dict, raw: dict[str, torch.Tensor]) -> None:
    """transformers 5's fused expert tensors, where a folder has them, into per-expert ones."""
    for k in [k for k in raw if k.endswith(".mlp.experts.gate_up_proj")]:
        prefix = k[:-len(".experts.gate_up_proj")]
        gate, up = raw.pop(k).chunk(2, dim=1)                # (E, 2I, hidden): gate rows first
        down = raw.pop(f"{prefix}.experts.down_proj", None)
        if down is None:
            raise KvrunError(f"{k} has no {prefix}.experts.down_proj beside it")
        for proj, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            raw.update(per_expert(prefix, proj, w))


@dataclass(frozen=True)
class Family:
    arch: str                                       # the kvrun architecture it runs as
    fields: Callable[[dict], dict] = lambda hf: {}  # ModelConfig fields beyond the shared ones
    tensors: Callable[[dict, dict], None] | None = None   # in-place fix-up of the state dict


def _llama_fields(hf: dict) -> dict:
    return _no_bias("llama")(hf)


def _qwen2_fields(hf: dict) -> dict:
    """Qwen2's q/k/v biases are the architecture's (config.py); an MLP bias is not."""
    if hf.get("mlp_bias"):
        raise KvrunError("Qwen2 checkpoints with MLP biases are not supported")
    return {}


FAMILIES = {   # HF architecture name → Family
    "LlamaForCausalLM": Family("llama", _llama_fields),
    "MistralForCausalLM": Family("llama", _llama_fields),
    "Qwen2ForCausalLM": Family("qwen2", _qwen2_fields),
    "Qwen3ForCausalLM": Family("qwen3", _no_bias("Qwen3")),
    "Qwen3MoeForCausalLM": Family("qwen3moe", _qwen3moe_fields, _qwen3moe_tensors),
    "Gemma2ForCausalLM": Family("gemma2", _gemma2_fields),
    "Gemma3ForCausalLM": Family("gemma3", _gemma3_fields),
    "GraniteForCausalLM": Family("granite", _granite_fields, _granite_tensors),
    "Olmo2ForCausalLM": Family("olmo2", _no_bias("OLMo 2")),
    "SmolLM3ForCausalLM": Family("smollm3", _smollm3_fields),
    "Phi3ForCausalLM": Family("llama", _phi3_fields, _phi3_tensors),
}
MODEL_TYPES = {   # config.json's model_type, for a config without `architectures`
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM", "phi3": "Phi3ForCausalLM",
}
