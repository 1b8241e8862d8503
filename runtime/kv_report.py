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
    ev = getattr(cache, "ev", None)
    if ev is not None:                  # token eviction: what the bounded arena holds
        kept = [nt + w for nt, w in zip(cache.n_tail, cache.n_win)]
        lines.append(f"  eviction: {cache.kv.evict}, budget {cache.kv.budget} tokens/layer, "
                     f"holding {min(kept)}-{max(kept)} per layer, {sum(ev.n_drop)} evicted in all")
    return "\n".join(lines)
