"""KV-cache engines: per-branch storage of self- and cross-attention K/V for causal rollouts."""

from ..settings.cache import KV_CACHE_DTYPE_NAMES
from .accounting import expected_scale_bytes, expected_self_cache_bytes
from .base import SINK_UPDATES, BaseKVCacheEngine
from .cross import CrossKVEntry, CrossKVMode
from .factory import ENGINE_KINDS, make_engines
from .positions import ROPE_POSITION_MODES, RopePositionMode, RopePositions
from .quantize import QuantizedFrames, resolve_kv_cache_dtype
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
    "KV_CACHE_DTYPE_NAMES",
    "QuantizedFrames",
    "ROPE_POSITION_MODES",
    "RopePositionMode",
    "RopePositions",
    "SINK_UPDATES",
    "StaticKVCacheEngine",
    "TagState",
    "VanillaKVCacheEngine",
    "expected_scale_bytes",
    "expected_self_cache_bytes",
    "make_engines",
    "resolve_kv_cache_dtype",
]
