"""KV-cache engines: per-branch storage of self- and cross-attention K/V for causal rollouts."""

from .base import BaseKVCacheEngine, CrossKVEntry, CrossKVMode, TagState, expected_self_cache_bytes
from .factory import ENGINE_KINDS, make_engines
from .static_engine import StaticKVCacheEngine
from .vanilla_engine import KVCacheEngine, VanillaKVCacheEngine
from .window import AttentionWindow

__all__ = [
    "AttentionWindow",
    "BaseKVCacheEngine",
    "CrossKVEntry",
    "CrossKVMode",
    "ENGINE_KINDS",
    "KVCacheEngine",
    "StaticKVCacheEngine",
    "TagState",
    "VanillaKVCacheEngine",
    "expected_self_cache_bytes",
    "make_engines",
]
