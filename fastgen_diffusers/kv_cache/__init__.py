"""KV-cache engines: per-branch storage of self- and cross-attention K/V for causal rollouts."""

from .accounting import expected_self_cache_bytes
from .base import SINK_UPDATES, BaseKVCacheEngine
from .cross import CrossKVEntry, CrossKVMode
from .factory import ENGINE_KINDS, make_engines
from .positions import ROPE_POSITION_MODES, RopePositionMode, RopePositions
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
    "ROPE_POSITION_MODES",
    "RopePositionMode",
    "RopePositions",
    "SINK_UPDATES",
    "StaticKVCacheEngine",
    "TagState",
    "VanillaKVCacheEngine",
    "expected_self_cache_bytes",
    "make_engines",
]
