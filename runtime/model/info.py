"""`kvrun info`: what a model directory holds.

`model_facts` gives typed values (numbers as numbers, booleans as booleans: `info --json`);
`model_info` the same facts as the display rows of the human table.
"""
from __future__ import annotations

from pathlib import Path

from .config import ModelConfig
from .loader import check_model_dir, load_config, weights_error


def weight_format(cfg: ModelConfig) -> str:
    """How the linear weights are stored, e.g. `int4 (group 32; embedding int8)` or `bf16`."""
    if cfg.weights == "int8":
        return "int8 (per channel; embedding int8)"
    if cfg.weights == "int4":
        return f"int4 (group {cfg.weight_group}; embedding int8)"
    return cfg.torch_dtype


def _count_parameters(f: Path) -> int:
    """Weights in model.safetensors, counted from its header (int4 codes: two per byte;
    scales and mins are quantization metadata, not weights)."""
    from safetensors import SafetensorError, safe_open
    n_params = 0
    try:
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                if name.endswith((".scales", ".mins")):
                    continue
                sl = st.get_slice(name)
                n = 1
                for s in sl.get_shape():
                    n *= s
                if name.endswith(".qweight") and sl.get_dtype() == "U8":
                    n *= 2
                n_params += n
    except (SafetensorError, OSError, ValueError) as e:
        raise weights_error(f, e) from None
    return n_params


def _quirks(cfg: ModelConfig) -> dict:
    """The family settings that differ from a Llama's (config.py), by their config names."""
    out = {}
    if cfg.qk_norm:
        out["qk_norm"] = cfg.qk_norm
    if cfg.nope_layers:
        out["nope_layers"] = list(cfg.nope_layers)
    for name, plain in (("embedding_multiplier", 1.0), ("attention_multiplier", 0.0),
                        ("logits_scaling", 1.0)):
        if getattr(cfg, name) != plain:
            out[name] = getattr(cfg, name)
    if cfg.query_pre_attn_scalar != cfg.head_dim:
        out["query_pre_attn_scalar"] = cfg.query_pre_attn_scalar
    if cfg.final_logit_softcapping is not None:
        out["final_logit_softcapping"] = cfg.final_logit_softcapping
    if cfg.rotary_dim != cfg.head_dim:
        out["rotary_dim"] = cfg.rotary_dim
    if cfg.attn_logit_softcapping is not None:
        out["attn_logit_softcapping"] = cfg.attn_logit_softcapping
    return out


def _scaling(scaling: dict) -> str:
    """Rope scaling for the human table: longrope's per-frequency factor lists counted,
    not printed (48 numbers each on Phi-3)."""
    return str({k: f"[{len(v)} factors]" if isinstance(v, list) else v for k, v in scaling.items()})


def model_facts(path) -> dict:
    """The model directory `path` described with typed values (the `info --json` record)."""
    return _describe(path)[1]


def _describe(path) -> tuple[ModelConfig, dict]:
    path = check_model_dir(path)
    cfg = load_config(path)
    f = path / "model.safetensors"
    n_params = _count_parameters(f)
    n_bytes = f.stat().st_size
    src = cfg.source or {}
    sliding = sum(1 for w in cfg.layer_windows if w)
    return cfg, {
        "path": str(Path(path).resolve()),
        "architecture": cfg.architecture,
        "parameters": n_params,
        "weights": {"format": cfg.weights if cfg.weights != "float" else cfg.torch_dtype,
                    "group": cfg.weight_group or None,
                    "embedding": "int8" if cfg.weights != "float" else cfg.torch_dtype,
                    "float_dtype": cfg.torch_dtype,
                    "bytes": n_bytes,
                    "bits_per_param": round(8 * n_bytes / max(n_params, 1), 4)},
        "layers": cfg.num_layers,
        "sliding_layers": sliding,
        "sliding_window": cfg.sliding_window if sliding else None,
        "rope_local_theta": cfg.rope_local_theta if sliding else None,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "context": cfg.max_position,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling or None,
        "quirks": _quirks(cfg),
        "vocab": cfg.vocab_size,
        "tied_embeddings": cfg.tie_word_embeddings,
        "chat_template": cfg.chat_template,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_ids": list(cfg.eos_token_ids),
        "source": {"format": src.get("format"), "path": src.get("path"),
                   "sha256": src.get("sha256"),
                   # a GGUF's linear weights by tensor type (what the default format follows)
                   "linear_types": src.get("linear_types")},
    }


def model_info(path) -> dict:
    """The human table of `kvrun info`: row name → display string (or number)."""
    cfg, d = _describe(path)
    w, src = d["weights"], d["source"]
    return {
        "path": d["path"],
        "architecture": d["architecture"],
        "parameters": f"{d['parameters'] / 1e6:.1f}M",
        "weights": f"{weight_format(cfg)}, {w['bytes'] / 2**20:.1f} MiB, "
                   f"{8 * w['bytes'] / max(d['parameters'], 1):.2f} bits/param",
        "layers": d["layers"] if not d["sliding_layers"] else
        (f"{d['layers']} ({d['sliding_layers']} sliding over {d['sliding_window']} tokens, "
         f"rope theta {d['rope_local_theta']:g}; {d['layers'] - d['sliding_layers']} global)"),
        "hidden / ffn": f"{d['hidden_size']} / {d['intermediate_size']}",
        "heads (q / kv)": f"{d['heads']} / {d['kv_heads']}, head dim {d['head_dim']}",
        "context": d["context"],
        "rope": f"theta {d['rope_theta']:g}" + (f", scaling {_scaling(cfg.rope_scaling)}" if cfg.rope_scaling else ""),
        **({"quirks": ", ".join(f"{k} {v}" for k, v in d["quirks"].items())} if d["quirks"] else {}),
        "vocab": d["vocab"],
        "tied embeddings": d["tied_embeddings"],
        "chat template": d["chat_template"],
        "bos / eos": f"{d['bos_token_id']} / {cfg.eos_token_ids}",
        "source": f"{src['format'] or '?'}: {src['path'] or '?'}",
        "source sha256": src["sha256"] or "?",
        **({"source linears": _shares(src["linear_types"])} if src["linear_types"] else {}),
    }


def _shares(types: dict[str, int]) -> str:
    """{'Q5_0': 634, 'Q4_K': 236} → 'Q5_0 73%, Q4_K 27%' (largest first)."""
    total = sum(types.values()) or 1
    return ", ".join(f"{t} {100 * n / total:.0f}%" for t, n in sorted(types.items(), key=lambda kv: -kv[1]))
