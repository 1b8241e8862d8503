"""Making a model's KV cache, and its bytes before it is made.

`make_cache` is the one entry point the engine and the evaluations use: it resolves the
KV config for the model (`--kv auto` → its profile), refuses a cache larger than the
machine's memory, and builds the KVArena (every method: fp16 is an arena whose tail holds
rows as they are), with a ring for sliding-window layers beside it (the one sliding-window
implementation). `kv_bytes_at` gives the bytes of that cache by component from the codecs'
storage layouts, without allocating.
"""
from __future__ import annotations

import math


from kvrun.kernels.backend import Backend, choose
from kvrun.kernels.codecs.base import COMPONENTS
from kvrun.kernels.rope import inv_frequencies
from ..errors import KvrunError
from ..machine import memory_bytes
from .arena import KVArena, codec_factory, window_dtype, window_slots
from .arena_evict import tail_sizes
from .config import KVConfig, parse_kv
from .layout import arena_layers, layer_windows
from .ring import LayeredKVCache, SlidingWindowKV, ring_bits, ring_layout


def _as_config(kv) -> KVConfig:
    return kv if isinstance(kv, KVConfig) else parse_kv(kv)


def check_kv(cfg, kv_config) -> KVConfig:
    """The KV config for this model (`--kv auto`: its shipped profile), checked against the
    model's geometry (one clear line if it does not fit)."""
    kv = _as_config(kv_config).for_model(cfg)
    kv.check_model(cfg.head_dim, arena_layers(cfg), cfg.num_kv_heads)
    if kv.ring is not None and not any(layer_windows(cfg)):
        raise KvrunError(f"a ring width ({kv.ring} bits) was given, but this model has no "
                         f"sliding-window layers to keep in rings")
    if any(layer_windows(cfg)) and kv.context.on_full == "shift":
        raise KvrunError("--ctx-policy shift is not supported on a model with sliding-window "
                         "layers (a shift would cut the windows they attend to): raise -c instead")
    if cfg.nope_layers and kv.context.on_full == "shift":
        # the shift re-rotates every cached key by RoPE's -nd angle; NoPE layers have none
        raise KvrunError("--ctx-policy shift is not supported on a model with NoPE layers "
                         "(SmolLM3): raise -c instead")
    return kv



def ring_bytes(cfg, kv: KVConfig, n_tokens: int) -> int:
    """Bytes of the sliding-window layers' rings for a cache of n_tokens, from the ring
    store's own layout (min(window, n) slots per layer, K and V)."""
    windows = layer_windows(cfg)
    n_slide = len(windows) - windows.count(0)
    if not n_slide:
        return 0
    parts = ring_layout(n_slide, cfg.num_kv_heads, min(max(windows), n_tokens), cfg.head_dim,
                        ring_bits(kv), window_dtype(kv), kv.v_group)
    return 2 * sum(math.prod(shape) * dt.itemsize for shape, dt in parts)


def build_cache(cfg, ctx: int, kv_config="fp16", device="cpu", backend: Backend | None = None):
    """The KV cache for a model config: the KVArena of its full-attention layers; a model
    with sliding-window layers gets them in a ring beside it (ring.LayeredKVCache). Both
    soft-cap the attention logits where the model does (attn_logit_softcapping, Gemma 2).
    backend: the kernels' backend (kernels/backend.py; the model's, from kvrun.load), None:
    chosen here for `device`."""
    kv = check_kv(cfg, kv_config)
    backend = backend or choose(device)
    windows = layer_windows(cfg)
    inv = inv_frequencies(**cfg.rope_args(), ctx=ctx)     # the model's tables for this cache's size
    cap = cfg.attn_logit_softcapping or 0.0
    full = KVArena(windows.count(0), cfg.num_kv_heads, cfg.head_dim, ctx, kv, inv, device,
                   n_heads=cfg.num_heads, backend=backend, softcap=cap)
    if not any(windows):
        return full
    ring = SlidingWindowKV(len(windows) - windows.count(0), cfg.num_kv_heads, cfg.head_dim,
                           max(windows), ctx, window_dtype(kv), device, ring_bits(kv), kv.v_group,
                           "v" in kv.rotation.which, backend=backend, softcap=cap,
                           n_heads=cfg.num_heads)
    return LayeredKVCache(windows, full, ring)


def kv_bytes_at(cfg, kv_config, n_tokens: int) -> dict[str, int]:
    """Bytes by component of the cache build_cache(cfg, n_tokens, kv_config) would allocate,
    computed from the codecs' storage layouts without allocating. Sliding-window layers add
    their rings as "ring" (ring_bytes)."""
    kv = check_kv(cfg, kv_config)
    windows = layer_windows(cfg)
    L, Hkv, D = windows.count(0), cfg.num_kv_heads, cfg.head_dim
    ring = {"ring": ring_bytes(cfg, kv, n_tokens)} if any(windows) else {}
    out = dict.fromkeys(COMPONENTS, 0)
    get = codec_factory(kv)
    for (km, vm), S in zip(kv.layer_methods(L), tail_sizes(kv, L, n_tokens)):
        for c in (get(km, "k"), get(vm, "v")):
            for s in c.slots(Hkv, D, S):
                out[s.component] += s.nbytes
    out["window"] += 2 * L * Hkv * window_slots(kv, n_tokens) * D * window_dtype(kv).itemsize
    return {**out, **ring}


def fp16_bytes(cfg, n_tokens: int) -> int:
    """K and V of n_tokens as fp16 rows, nothing more (llama.cpp's f16 cache of n_tokens):
    the full-attention layers hold every token, the sliding layers min(window, n) of them.
    The denominator of every ratio kvrun reports (the fp16 arena's spare window slots, at
    most one block of G tokens per layer, are not in it)."""
    per_row = 2 * cfg.num_kv_heads * cfg.head_dim * 2
    return sum(per_row * (min(w, n_tokens) if w else n_tokens) for w in layer_windows(cfg))


def kv_ratio_at(cfg, kv_config, n_tokens: int) -> float:
    """Total KV bytes holding n_tokens (window included) / fp16_bytes(n_tokens)."""
    return sum(kv_bytes_at(cfg, kv_config, n_tokens).values()) / fp16_bytes(cfg, n_tokens)


def make_cache(cfg, ctx: int, kv: "str | KVConfig" = "fp16", backend: Backend | None = None):
    """A KV cache for `ctx` tokens (`kv` is a --kv spec such as "fp16" or "tada-4", or a
    KVConfig): the arena; sliding-window layers (Gemma 3) keep a ring of their window beside
    it (ring.py). backend: as build_cache's."""
    kv = (kv if isinstance(kv, KVConfig) else parse_kv(kv)).for_model(cfg)   # auto: its profile
    kv.check_profile(cfg)                   # a profile searched for another model is refused
    need = sum(kv_bytes_at(cfg, kv, ctx).values())
    have = memory_bytes()
    if have is not None and need > have:
        raise KvrunError(f"context size {ctx}: the {kv.label()} KV cache would take "
                         f"{need / 2**30:.1f} GiB, more than this machine's {have / 2**30:.1f} GiB "
                         f"of memory (lower -c/--ctx-size or pick a smaller --kv)")
    try:
        return build_cache(cfg, ctx, kv, backend=backend)
    except (MemoryError, RuntimeError) as e:        # torch's allocator raises RuntimeError
        if isinstance(e, RuntimeError) and "allocate" not in str(e):
            raise
        raise KvrunError(f"context size {ctx}: cannot allocate the {kv.label()} KV cache "
                         f"({need / 2**30:.1f} GiB): out of memory") from None


def kv_bytes_per_token(cfg, kv: "str | KVConfig", n_tokens: int) -> float:
    """Bytes per token of a cache sized for `n_tokens` (window and metadata included),
    computed from the codec formulas without allocating."""
    return sum(kv_bytes_at(cfg, kv, n_tokens).values()) / n_tokens
