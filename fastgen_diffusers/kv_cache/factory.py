"""Build the engine dict of a causal model from a few rollout options."""

from __future__ import annotations

from typing import Any

from ..settings.cache import ENGINE_KINDS
from .base import BaseKVCacheEngine
from .static_engine import StaticKVCacheEngine
from .vanilla_engine import VanillaKVCacheEngine

__all__ = ["ENGINE_KINDS", "make_engines"]


def make_engines(
    transformer: Any, kind: str = "static", *, max_frames: int | None = None, **engine_options: Any
) -> dict[str, BaseKVCacheEngine]:
    """One engine per branch of ``transformer`` (``transformer.kv_cache_branches()``), ready for
    ``transformer.set_kv_cache_engines(...)``.

    Args:
        transformer: a causal model (``WanCausalTransformer3DModel`` or ``WanCausalVACETransformer3DModel``).
        kind: ``"static"`` (preallocated, in place) or ``"vanilla"`` (list of chunk tensors).
        max_frames: latent frames of the rollout, so that static engines allocate once (ignored by ``"vanilla"``).
        engine_options: the engines' options, keyword by keyword (window, sink, key positions, sink rule, storage
            dtype: see :class:`BaseKVCacheEngine`; a call's are ``CacheSettings.engine_options()``).
    """
    if kind == "static":
        return {name: StaticKVCacheEngine(max_frames, **engine_options) for name in transformer.kv_cache_branches()}
    if kind == "vanilla":
        return {name: VanillaKVCacheEngine(**engine_options) for name in transformer.kv_cache_branches()}
    raise ValueError(f"`kind` must be one of {ENGINE_KINDS}, got {kind!r}.")
