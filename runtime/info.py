"""`kvrun info`: what a model directory holds."""
from __future__ import annotations

from pathlib import Path

from .loader import check_model_dir, load_config


def model_info(path) -> dict:
    path = check_model_dir(path)
    cfg = load_config(path)
    from safetensors import safe_open
    n_params, n_bytes = 0, 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in f.keys():
            if name.endswith((".scales", ".mins")):        # quantization metadata, not weights
                continue
            sl = f.get_slice(name)
            n = 1
            for s in sl.get_shape():
                n *= s
            if name.endswith(".qweight") and sl.get_dtype() == "U8":
                n *= 2                                      # two int4 codes per byte
            n_params += n
    n_bytes = (path / "model.safetensors").stat().st_size
    fmt = cfg.torch_dtype
    if cfg.weights == "int8":
        fmt = "int8 (per channel; embedding int8)"
    elif cfg.weights == "int4":
        fmt = f"int4 (group {cfg.weight_group}; embedding int8)"
    src = cfg.source or {}
    return {
        "path": str(Path(path).resolve()),
        "architecture": cfg.architecture,
        "parameters": f"{n_params / 1e6:.1f}M",
        "weights": f"{fmt}, {n_bytes / 2**20:.1f} MiB, {8 * n_bytes / max(n_params, 1):.2f} bits/param",
        "layers": cfg.num_layers if not any(cfg.layer_windows) else
        (f"{cfg.num_layers} ({sum(1 for w in cfg.layer_windows if w)} sliding over "
         f"{cfg.sliding_window} tokens, rope theta {cfg.rope_local_theta:g}; "
         f"{cfg.layer_windows.count(0)} global)"),
        "hidden / ffn": f"{cfg.hidden_size} / {cfg.intermediate_size}",
        "heads (q / kv)": f"{cfg.num_heads} / {cfg.num_kv_heads}, head dim {cfg.head_dim}",
        "context": cfg.max_position,
        "rope": f"theta {cfg.rope_theta:g}" + (f", scaling {cfg.rope_scaling}" if cfg.rope_scaling else ""),
        "vocab": cfg.vocab_size,
        "tied embeddings": cfg.tie_word_embeddings,
        "chat template": cfg.chat_template,
        "bos / eos": f"{cfg.bos_token_id} / {cfg.eos_token_ids}",
        "source": f"{src.get('format', '?')}: {src.get('path', '?')}",
        "source sha256": src.get("sha256", "?"),
    }
