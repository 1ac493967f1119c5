"""fastgen-diffusers: causal (autoregressive, chunk-by-chunk, KV-cached) Wan video generation for diffusers."""

from diffusers.models.modeling_utils import ModelMixin  # noqa: F401  (saved pipelines resolve classes through it)

from .chunking import chunk_layout
from .context import CausalContext
from .kv_cache import BaseKVCacheEngine, KVCacheEngine, VanillaKVCacheEngine, expected_self_cache_bytes
from .models import WanCausalTransformer3DModel
from .processors import WanCausalAttnProcessor, WanCausalCrossAttnProcessor

__version__ = "0.1.0"

__all__ = [
    "BaseKVCacheEngine",
    "CausalContext",
    "KVCacheEngine",
    "VanillaKVCacheEngine",
    "WanCausalAttnProcessor",
    "WanCausalCrossAttnProcessor",
    "WanCausalTransformer3DModel",
    "chunk_layout",
    "expected_self_cache_bytes",
]
