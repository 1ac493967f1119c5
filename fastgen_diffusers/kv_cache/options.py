"""Engine options that must hold together, checked once (constructor, pipelines, before any work).

An engine's positions mode (``rope_positions``), sink update (``sink_update``, ``sink_decay``) and storage dtype
(``kv_cache_dtype``) each live in their own module (:mod:`~fastgen_diffusers.kv_cache.positions`,
:mod:`~fastgen_diffusers.kv_cache.ema_sink`, :mod:`~fastgen_diffusers.kv_cache.quantize`); the rules that tie them to
each other and to the window are stated once, in :mod:`fastgen_diffusers.settings.cache`; the engines ask them here.
"""

from __future__ import annotations

from typing import Any

import torch

from ..settings.cache import SINK_UPDATES, check_key_positions, check_storage_dtype
from .positions import ROPE_POSITION_MODES, RopePositionMode
from .quantize import resolve_kv_cache_dtype
from .window import AttentionWindow

__all__ = ["SINK_UPDATES", "check_kv_cache_dtype", "check_rope_and_sink_settings"]


def check_rope_and_sink_settings(
    window: AttentionWindow,
    rope_positions: Any,
    sink_update: Any,
    sink_decay: Any,
) -> RopePositionMode:
    """Raise ``ValueError`` for a positions mode or sink update that cannot work with ``window`` (an engine's
    ``window_frames`` and ``sink_frames``; the rule: :func:`~fastgen_diffusers.settings.cache.check_key_positions`);
    returns the mode."""
    check_key_positions(
        window, rope_positions, sink_update, sink_decay, window_name="window_frames", sink_name="sink_frames"
    )
    return ROPE_POSITION_MODES[rope_positions]


def check_kv_cache_dtype(kv_cache_dtype: Any, sink_update: str = "fixed") -> torch.dtype | None:
    """The resolved 8-bit storage dtype (:func:`~fastgen_diffusers.kv_cache.quantize.resolve_kv_cache_dtype`), or a
    ``ValueError`` (the rule: :func:`~fastgen_diffusers.settings.cache.check_storage_dtype`)."""
    dtype = resolve_kv_cache_dtype(kv_cache_dtype)
    check_storage_dtype(kv_cache_dtype, sink_update)
    return dtype
