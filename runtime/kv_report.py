"""Human-readable KV-cache accounting (`/kv` in chat, `kvrun info`)."""
from __future__ import annotations


def fp16_bytes_per_token(cfg) -> int:
    """Bytes one token costs in an uncompressed fp16 cache (K and V, all layers)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2


def format_kv(model) -> str:
    cache = model.cache
    parts = cache.nbytes()
    total = sum(parts.values())
    ref = fp16_bytes_per_token(model.cfg) * cache.max_ctx
    lines = [f"KV cache: {len(model.engine.cached)} / {cache.max_ctx} tokens, "
             f"{total / 2**20:.2f} MiB allocated ({total / ref:.3f}x fp16 at {cache.max_ctx} tokens)"]
    lines += [f"  {k:<16} {v / 2**20:10.2f} MiB" for k, v in parts.items()]
    return "\n".join(lines)
