"""KV caches: the dense cache and the compressed arena (residual window + compressed tail)."""
from .arena import KVArena, build_cache, kv_bytes_at, kv_ratio_at, tail_capacity
from .cache import KV_DTYPES, DenseKVCache
from .config import KVConfig, parse_kv
from .profile import load_profile, save_profile

__all__ = ["KV_DTYPES", "DenseKVCache", "KVArena", "KVConfig", "build_cache", "kv_bytes_at",
           "kv_ratio_at", "load_profile", "parse_kv", "save_profile", "tail_capacity"]
