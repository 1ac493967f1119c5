"""fastgen-diffusers: causal (autoregressive, chunk-by-chunk, KV-cached) Wan video generation for diffusers."""

from diffusers.models.modeling_utils import ModelMixin  # noqa: F401  (saved pipelines resolve classes through it)

from .chunking import chunk_layout
from .context import CausalContext
from .kv_cache import (
    BaseKVCacheEngine,
    KVCacheEngine,
    StaticKVCacheEngine,
    VanillaKVCacheEngine,
    expected_self_cache_bytes,
    make_engines,
)
from .models import VACEHintCache, WanCausalTransformer3DModel, WanCausalVACETransformer3DModel
from .pipelines import (
    CausalRolloutMixin,
    ChunkOutput,
    MotionAwareStrength,
    WanCausalImageToVideoPipeline,
    WanCausalPipeline,
    WanCausalVACEPipeline,
    WanCausalVideoToVideoPipeline,
    causal_scheduler_from_config,
    causal_transformer_from_wan,
    causal_transformer_from_wan_vace,
    wan_transformer_from_causal,
)
from .processors import WanCausalAttnProcessor, WanCausalCrossAttnProcessor

__version__ = "0.1.0"

__all__ = [
    "BaseKVCacheEngine",
    "CausalContext",
    "CausalRolloutMixin",
    "ChunkOutput",
    "KVCacheEngine",
    "MotionAwareStrength",
    "StaticKVCacheEngine",
    "VACEHintCache",
    "VanillaKVCacheEngine",
    "WanCausalAttnProcessor",
    "WanCausalCrossAttnProcessor",
    "WanCausalImageToVideoPipeline",
    "WanCausalPipeline",
    "WanCausalVACEPipeline",
    "WanCausalVideoToVideoPipeline",
    "WanCausalTransformer3DModel",
    "WanCausalVACETransformer3DModel",
    "causal_scheduler_from_config",
    "causal_transformer_from_wan",
    "causal_transformer_from_wan_vace",
    "chunk_layout",
    "expected_self_cache_bytes",
    "make_engines",
    "wan_transformer_from_causal",
]
