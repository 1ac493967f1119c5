"""KV-cache engines: per-branch storage of self- and cross-attention K/V for causal rollouts."""

from .base import BaseKVCacheEngine, CrossKVEntry, CrossKVMode, TagState, expected_self_cache_bytes
from .vanilla_engine import KVCacheEngine, VanillaKVCacheEngine

__all__ = [
    "BaseKVCacheEngine",
    "CrossKVEntry",
    "CrossKVMode",
    "KVCacheEngine",
    "TagState",
    "VanillaKVCacheEngine",
    "expected_self_cache_bytes",
]
