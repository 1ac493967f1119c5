"""fastgen-diffusers: causal (autoregressive, chunk-by-chunk, KV-cached) Wan video generation for diffusers.

The public names load lazily (PEP 562 module ``__getattr__``): ``import fastgen_diffusers`` imports neither torch nor
diffusers, so ``fastgen-diffusers --help`` answers at once; the first use of a name imports the module that defines it.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module (relative to this package) that defines it
_EXPORTS = {
    "chunk_layout": ".chunking",
    "CausalContext": ".context",
    "BaseKVCacheEngine": ".kv_cache",
    "KVCacheEngine": ".kv_cache",
    "StaticKVCacheEngine": ".kv_cache",
    "VanillaKVCacheEngine": ".kv_cache",
    "expected_self_cache_bytes": ".kv_cache",
    "make_engines": ".kv_cache",
    "AutoencoderTinyWan": ".models",
    "VACEHintCache": ".models",
    "WanCausalTransformer3DModel": ".models",
    "WanCausalVACETransformer3DModel": ".models",
    "CausalRolloutMixin": ".pipelines",
    "ChunkOutput": ".pipelines",
    "WanCausalImageToVideoPipeline": ".pipelines",
    "WanCausalPipeline": ".pipelines",
    "WanCausalVACEPipeline": ".pipelines",
    "WanCausalVideoToVideoPipeline": ".pipelines",
    "MotionAwareStrength": ".pipelines",
    "causal_scheduler_from_config": ".pipelines",
    "causal_transformer_from_wan": ".pipelines",
    "causal_transformer_from_wan_vace": ".pipelines",
    "wan_transformer_from_causal": ".pipelines",
    "RolloutSettings": ".settings",
    "WanCausalAttnProcessor": ".processors",
    "WanCausalCrossAttnProcessor": ".processors",
}
# Saved pipelines name this package as the library of their components; diffusers' loader looks up its base classes
# (`getattr(library, "ModelMixin", None)`) on it to tell how to load them.
_LOADER_NAMES = {"ModelMixin": "diffusers.models.modeling_utils"}

__all__ = [
    "AutoencoderTinyWan",
    "BaseKVCacheEngine",
    "CausalContext",
    "CausalRolloutMixin",
    "ChunkOutput",
    "KVCacheEngine",
    "MotionAwareStrength",
    "RolloutSettings",
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
]  # the names of _EXPORTS (tests/test_cli_errors.py checks)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    elif name in _LOADER_NAMES:
        value = getattr(importlib.import_module(_LOADER_NAMES[name]), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)  # a submodule, e.g. `fastgen_diffusers.pipelines`
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_LOADER_NAMES})


if TYPE_CHECKING:  # static analysers and IDEs see the eager imports
    from diffusers.models.modeling_utils import ModelMixin  # noqa: F401

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
    from .models import AutoencoderTinyWan, VACEHintCache, WanCausalTransformer3DModel, WanCausalVACETransformer3DModel
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
