"""A library `Model`'s prefix cache across calls: the server's PrefixCache
(runtime/engine/prefix_cache.py) behind the Model's one Engine.

Why a Model needs it: the engine's own prefix reuse keeps what its one cache still holds
as a fresh prefill would (generate.py). With a lossless cache (fp16, fp32) that is every
shared prefix of consecutive prompts; with a compressed one (`auto`, tada-4, kivi-4 …) the
tokens past the window were compressed as the previous prompt and its reply went on, so a
new prompt that shares only a system prompt with the last one is re-prefilled from 0, and
prompt A after prompt B after prompt A is always a full prefill. The PrefixCache keeps the
states a prefill passes through at each chunk boundary (snapshots, host RAM, LRU under a
byte bound), so a Model resumes from the longest one of them: the same output as the cold
prefill, bit for bit, by the same argument as the server's.

The bound is `load(cache_ram_mb=...)`: by default 1/32 of the machine's memory, at most
1024 MiB (runtime/engine/prefix_budget.py); 0 turns it off. `Model.prefix_cache.stats()`:
`requests` counts the prompts looked up in it (those the engine's own reuse kept nothing
of, and those an entry beat), `hits` the ones restored from it, `hit_tokens` their ids.
"""
from __future__ import annotations

from .prefix_cache import PrefixCache

MiB = 1 << 20


class ModelPrefix:
    """The Engine's `prefix` hooks (generate.py PrefixHooks) over one PrefixCache, for the
    KV config `kv` (a KVConfig: entries restore into caches of that config only)."""

    def __init__(self, kv, budget_mb: float):
        self.kv = kv
        self.cache = PrefixCache(int(budget_mb * MiB))

    def resume(self, engine, prompt: list[int], have: int) -> int:
        """The prompt ids to keep: `have` (what the engine's own reuse kept), or more when an
        entry holds a longer prefix (restored into the engine, replacing its state)."""
        if have:
            e = self.cache.best(self.kv, prompt, engine.max_ctx, engine.prefill_chunk)
            if e is None or len(e.tokens) <= have:
                return have
        # the engine holds nothing of the prompt (truncated to 0), or an entry holds more
        return self.cache.resume(self.kv, engine, prompt)     # 0: a cold start, engine reset

    def checkpoint(self, engine) -> None:
        """The engine's prefill reached a chunk boundary from a fresh prefill's state: keep it."""
        self.cache.add(self.kv, engine)
