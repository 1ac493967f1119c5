"""KV-cache engines: per-branch storage of self- and cross-attention K/V for causal rollouts."""

from .accounting import expected_self_cache_bytes
from .base import BaseKVCacheEngine
from .cross import CrossKVEntry, CrossKVMode
from .factory import ENGINE_KINDS, make_engines
from .static_engine import StaticKVCacheEngine
from .tags import TagState
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
