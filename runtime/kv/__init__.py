"""KV caches: the arena (a full-precision window + a tail, compressed or not) and the ring of
sliding-window layers beside it (ring.py), behind one contract (contract.py)."""
from .arena import KVArena
from .build import build_cache, check_kv, kv_bytes_at, kv_ratio_at, make_cache
from .layout import arena_layers, tail_capacity
from .cache import KV_DTYPES
from .contract import KVCache
from .config import KVConfig, parse_kv
from .profile import load_profile, save_profile
from .ring import LayeredKVCache, SlidingWindowKV

__all__ = ["KV_DTYPES", "KVArena", "KVCache", "KVConfig", "LayeredKVCache", "SlidingWindowKV",
           "arena_layers", "build_cache", "check_kv", "kv_bytes_at", "kv_ratio_at", "load_profile", "make_cache",
           "parse_kv", "save_profile", "tail_capacity"]
