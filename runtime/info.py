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
            sl = f.get_slice(name)
            n = 1
            for s in sl.get_shape():
                n *= s
            n_params += n
    n_bytes = (path / "model.safetensors").stat().st_size
    src = cfg.source or {}
    return {
        "path": str(Path(path).resolve()),
        "architecture": cfg.architecture,
        "parameters": f"{n_params / 1e6:.1f}M",
        "weights": f"{cfg.torch_dtype}, {n_bytes / 2**20:.1f} MiB",
        "layers": cfg.num_layers,
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
