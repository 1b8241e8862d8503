"""KV caches: the dense cache and the compressed arena (residual window + compressed tail)."""
from .cache import KV_DTYPES, DenseKVCache

__all__ = ["KV_DTYPES", "DenseKVCache"]
