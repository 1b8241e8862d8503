"""Human-readable KV-cache accounting: `/kv` and the banner in chat, the stats line of
`kvrun generate`. One summary (`kv_summary`) feeds all of them, so they always agree."""
from __future__ import annotations

from dataclasses import dataclass

from . import arena_layers, kv_bytes_at
from .cache import KV_DTYPES

DENSE_NAMES = {dtype: name for name, dtype in KV_DTYPES.items()}


def fp16_bytes_per_token(cfg) -> int:
    """Bytes one token costs in an uncompressed fp16 cache (K and V, all layers)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2


def fp16_bytes(cfg, n_tokens: int) -> int:
    """Bytes of the fp16 cache of n_tokens: the baseline every "x fp16" ratio divides by
    (a model with sliding-window layers holds only their window: kv_bytes_at)."""
    return sum(kv_bytes_at(cfg, "fp16", n_tokens).values())


def kv_label(cache) -> str:
    """The cache's method as --kv names it: the arena's KVConfig label (tada-4, kivi-4/kivi-2,
    auto, profile:NAME, ...), or the dense cache's dtype (fp16, bf16, fp32)."""
    kv = getattr(cache, "kv", None)
    return kv.label() if kv is not None else DENSE_NAMES[getattr(cache, "inner", cache).k.dtype]


@dataclass
class KVSummary:
    label: str                      # the method (kv_label)
    tokens: int                     # tokens the conversation holds in the cache
    max_ctx: int                    # -c: tokens the cache was allocated for
    parts: dict[str, int]           # allocated bytes by component, empty ones left out
    fp16_bytes: int                 # an fp16 cache of max_ctx tokens

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def ratio(self) -> float:
        """Allocated bytes / an fp16 cache for the same context."""
        return self.total / self.fp16_bytes

    def short(self) -> str:
        """One phrase for a stats line: `KV tada-4 1.23 MiB (0.281x fp16)`."""
        return f"KV {self.label} {fmt_bytes(self.total)} ({self.ratio:.3f}x fp16)"


def kv_summary(model) -> KVSummary:
    cache = model.cache
    parts = {k: v for k, v in cache.nbytes().items() if v > 0}
    return KVSummary(kv_label(cache), len(model.engine.cached), cache.max_ctx, parts,
                     fp16_bytes(model.cfg, cache.max_ctx))


def fmt_bytes(n: float) -> str:
    """Bytes in binary units, three significant digits or so (tiny test models included)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def format_kv(model) -> str:
    """`/kv`: method, tokens held, allocated bytes and their ratio to fp16, then the bytes by
    component (components a method does not use are left out)."""
    s = kv_summary(model)
    lines = [f"KV cache: {s.label}, {s.tokens} / {s.max_ctx} tokens held, {fmt_bytes(s.total)} "
             f"allocated ({s.ratio:.3f}x fp16 at {s.max_ctx} tokens)"]
    lines += [f"  {k:<16} {fmt_bytes(v):>12}" for k, v in s.parts.items()]
    cache = model.cache
    ring = getattr(cache, "ring", None)
    if ring is not None:                # sliding-window layers: a ring of their window each
        n, full = ring.n_layers, arena_layers(model.cfg)
        width = "fp16" if ring.bits == 16 else f"{ring.bits}-bit per token"
        lines.append(f"  ring: {n} sliding-window layers of {n + full}, {ring.W} tokens each, "
                     f"{width}; the method applies to the {full} full-attention layers")
        cache = cache.inner
    if model.engine.can_shift:          # --ctx-policy shift: say what it did so far
        e = model.engine
        lines.append(f"  context shift: keeps the first {cache.kv.n_keep} tokens, drops half of "
                     f"the rest when full; {e.n_shifts} shift{'s' if e.n_shifts != 1 else ''} "
                     f"so far, {e.n_dropped} tokens dropped")
    ev = getattr(cache, "ev", None)
    if ev is not None:                  # token eviction: what the bounded arena holds
        kept = [nt + w for nt, w in zip(cache.n_tail, cache.n_win)]
        lines.append(f"  eviction: {cache.kv.evict}, budget {cache.kv.budget} tokens/layer, "
                     f"holding {min(kept)}-{max(kept)} per layer, {sum(ev.n_drop)} evicted in all")
    return "\n".join(lines)
