"""Build the engine dict of a causal model from a few rollout options."""

from __future__ import annotations

from typing import Any

import torch

from ..settings.cache import ENGINE_KINDS
from .base import BaseKVCacheEngine
from .static_engine import StaticKVCacheEngine
from .vanilla_engine import VanillaKVCacheEngine

__all__ = ["ENGINE_KINDS", "make_engines"]


def make_engines(
    transformer: Any,
    kind: str = "static",
    *,
    window_frames: int | None = None,
    sink_frames: int = 0,
    max_frames: int | None = None,
    # window-relative RoPE and EMA sink (Reward Forcing)
    rope_positions: str = "absolute",
    sink_update: str = "fixed",
    sink_decay: float = 0.999,
    # 8-bit KV cache
    kv_cache_dtype: torch.dtype | str | None = None,
) -> dict[str, BaseKVCacheEngine]:
    """One engine per branch of ``transformer`` (``transformer.kv_cache_branches()``), ready for
    ``transformer.set_kv_cache_engines(...)``.

    Args:
        transformer: a causal model (``WanCausalTransformer3DModel`` or ``WanCausalVACETransformer3DModel``).
        kind: ``"static"`` (preallocated, in place) or ``"vanilla"`` (list of chunk tensors).
        window_frames: sliding attention window in latent frames, own frames and sink included (``None``: no window).
        sink_frames: first latent frames kept for ever inside the window.
        max_frames: latent frames of the rollout, so that static engines allocate once (ignored by ``"vanilla"``).
        rope_positions, sink_update, sink_decay: window-relative RoPE and the EMA sink (see
            :class:`~fastgen_diffusers.kv_cache.BaseKVCacheEngine`).
        kv_cache_dtype: ``None`` (default: the compute dtype) or 8-bit storage of the self K/V,
            ``torch.float8_e4m3fn`` or ``torch.int8`` (or its name); see :class:`BaseKVCacheEngine`.
    """
    options = {
        "window_frames": window_frames,
        "sink_frames": sink_frames,
        "rope_positions": rope_positions,
        "sink_update": sink_update,
        "sink_decay": sink_decay,
        "kv_cache_dtype": kv_cache_dtype,
    }
    if kind == "static":
        return {name: StaticKVCacheEngine(max_frames, **options) for name in transformer.kv_cache_branches()}
    if kind == "vanilla":
        return {name: VanillaKVCacheEngine(**options) for name in transformer.kv_cache_branches()}
    raise ValueError(f"`kind` must be one of {ENGINE_KINDS}, got {kind!r}.")
