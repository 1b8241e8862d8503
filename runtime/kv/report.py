"""Human-readable KV-cache accounting: `/kv` and the banner in chat, the stats line of
`kvrun generate`. One summary (`kv_summary`) feeds all of them, so they always agree."""
from __future__ import annotations

from dataclasses import dataclass

from .build import fp16_bytes


def fp16_bytes_per_token(cfg) -> int:
    """Bytes one token costs in an uncompressed fp16 cache (K and V, all layers)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2


@dataclass
class KVSummary:
    label: str                      # the method (KVCache.label)
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
    return KVSummary(cache.label(), len(model.engine.cached), cache.max_ctx, parts,
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
    lines += model.cache.report()       # rings, eviction
    if model.engine.can_shift:          # --ctx-policy shift: say what it did so far
        e = model.engine
        lines.append(f"  context shift: keeps the first {model.cache.kv.context.n_keep} tokens, drops "
                     f"half of the rest when full; {e.n_shifts} shift{'s' if e.n_shifts != 1 else ''} "
                     f"so far, {e.n_dropped} tokens dropped")
    return "\n".join(lines)
