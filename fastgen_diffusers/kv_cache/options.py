"""Engine options that must hold together, checked once (constructor, pipelines, before any work).

An engine's positions mode (``rope_positions``), sink update (``sink_update``, ``sink_decay``) and storage dtype
(``kv_cache_dtype``) each live in their own module (:mod:`~fastgen_diffusers.kv_cache.positions`,
:mod:`~fastgen_diffusers.kv_cache.ema_sink`, :mod:`~fastgen_diffusers.kv_cache.quantize`); the rules that tie them to
each other and to the window are stated here, so that engines and pipelines raise the same ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import torch

from .positions import ROPE_POSITION_MODES, RopePositionMode
from .quantize import resolve_kv_cache_dtype
from .window import AttentionWindow

SINK_UPDATES = ("fixed", "ema")


def check_rope_and_sink_settings(
    window: AttentionWindow,
    rope_positions: Any,
    sink_update: Any,
    sink_decay: Any,
    *,
    window_name: str = "window_frames",
    sink_name: str = "sink_frames",
) -> RopePositionMode:
    """Raise ``ValueError`` for a positions mode or sink update that cannot work with ``window``; returns the mode.

    * ``rope_positions`` must be one of :data:`~fastgen_diffusers.kv_cache.positions.ROPE_POSITION_MODES`; ``"window"``
      and ``"anchor"`` need a sliding window (positions are slots of it, or the sink moved next to it);
    * ``sink_update`` must be ``"fixed"`` or ``"ema"``; ``"ema"`` needs sink frames and keys stored before RoPE (an
      average of keys rotated for different frames mixes their positions), so ``rope_positions`` other than
      ``"absolute"``;
    * ``sink_decay`` must be a number in ``(0, 1)``.
    """
    if not isinstance(rope_positions, str) or rope_positions not in ROPE_POSITION_MODES:
        raise ValueError(f"`rope_positions` must be one of {tuple(ROPE_POSITION_MODES)}, got {rope_positions!r}.")
    mode = ROPE_POSITION_MODES[rope_positions]
    if mode.needs_window and not window.bounded:
        raise ValueError(
            f"`rope_positions={rope_positions!r}` positions keys within the sliding window and its sink: set "
            f"`{window_name}` as well (or use rope_positions='absolute')."
        )
    if not isinstance(sink_update, str) or sink_update not in SINK_UPDATES:
        raise ValueError(f"`sink_update` must be one of {SINK_UPDATES}, got {sink_update!r}.")
    if isinstance(sink_decay, bool) or not isinstance(sink_decay, (int, float)) or not 0 < sink_decay < 1:
        raise ValueError(f"`sink_decay` must be a number in (0, 1) (exclusive), got {sink_decay!r}.")
    if sink_update == "ema":
        if not window.sink:
            raise ValueError(
                f"`sink_update='ema'` averages evicted frames into the sink: set `{sink_name}` > 0 (and "
                f"`{window_name}`), or use sink_update='fixed'."
            )
        if not mode.keys_before_rope:
            unrotated = tuple(name for name, entry in ROPE_POSITION_MODES.items() if entry.keys_before_rope)
            raise ValueError(
                "`sink_update='ema'` averages the keys of frames at different positions, which needs keys stored "
                f"before RoPE: use rope_positions in {unrotated}, not 'absolute' (or sink_update='fixed')."
            )
    return mode


def check_kv_cache_dtype(kv_cache_dtype: Any, sink_update: str = "fixed") -> torch.dtype | None:
    """The resolved 8-bit storage dtype (:func:`~fastgen_diffusers.kv_cache.quantize.resolve_kv_cache_dtype`), or a
    ``ValueError``: an unsupported dtype, or an 8-bit cache with ``sink_update="ema"``, whose updates of
    ``(1 - sink_decay)`` of a difference (0.001 for Reward Forcing) are far below the 8-bit resolution of the stored
    sink (1/254 of its range): re-quantized, the sink would not follow the EMA."""
    dtype = resolve_kv_cache_dtype(kv_cache_dtype)
    if dtype is not None and sink_update == "ema":
        raise ValueError(
            f"`sink_update='ema'` cannot be combined with an 8-bit `kv_cache_dtype` ({kv_cache_dtype!r}): each EMA "
            "step moves the stored sink by less than its 8-bit resolution. Use kv_cache_dtype=None or "
            "sink_update='fixed'."
        )
    return dtype
