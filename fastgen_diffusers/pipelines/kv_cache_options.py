"""The KV-cache options of a call: which engines, window, positions mode, sink update and storage dtype a rollout
gets, their checks (before any work) and the engines' configuration for the call's policy.

[`KVCacheOptionsMixin`] is a layer of [`CausalRolloutMixin`] (the host provides ``transformer`` and the kept-rollout
bookkeeping ``_free_rollouts``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..kv_cache import ENGINE_KINDS, AttentionWindow, make_engines
from ..kv_cache.base import check_ema_chunks, check_kv_cache_dtype, check_rope_and_sink_settings
from .guard import warn_discarding_kept_rollouts
from .options import RolloutOptions
from .policy_recompute import RECOMPUTE
from .policy_rolling import ANCHOR_POSITIONS, RollingPolicy

# window-relative RoPE and EMA sink (Reward Forcing): the engine options a call may set, and their defaults
KV_CACHE_POSITION_DEFAULTS = {"rope_positions": "absolute", "sink_update": "fixed", "sink_decay": 0.999}


def kv_cache_position_options(options: Any) -> dict[str, Any]:
    """The call's ``rope_positions`` / ``sink_update`` / ``sink_decay`` (resolved: defaults where still ``None``),
    as engine keyword arguments."""
    return {
        name: default if getattr(options, name, None) is None else getattr(options, name)
        for name, default in KV_CACHE_POSITION_DEFAULTS.items()
    }


def check_window_fits_chunks(
    attention_window: int | None, sink_frames: int, chunk_bounds: Sequence[tuple[int, int]]
) -> None:
    """Raise ``ValueError`` when a chunk cannot fit in the attention window (checked before any work).

    The rule is [`AttentionWindow.check_chunks`], the one the engines apply: a chunk's frames outside the sink must
    fit the window beside the sink (a chunk inside the sink, e.g. ``[0, 3)`` with sink 3 and window 4, fits).
    """
    AttentionWindow(attention_window, sink_frames).check_chunks(chunk_bounds)


def check_sink_update_fits_chunks(
    attention_window: int | None, sink_frames: int, sink_update: str, chunk_bounds: Sequence[tuple[int, int]]
) -> None:
    """Raise ``ValueError`` (before any work) when ``sink_update="ema"`` would meet an eviction of a frame count other
    than ``sink_frames`` in a rollout of ``chunk_bounds`` (the engines' rule, :func:`check_ema_eviction`)."""
    if sink_update == "ema":
        check_ema_chunks(AttentionWindow(attention_window, sink_frames), chunk_bounds)


class KVCacheOptionsMixin:
    """Configure and check the engines of a causal pipeline's transformer for a call."""

    def configure_kv_cache(
        self,
        kv_cache_engine: str | None,
        attention_window: int | None,
        sink_frames: int,
        chunk_bounds: Sequence[tuple[int, int]],
        # window-relative RoPE and EMA sink (Reward Forcing)
        rope_positions: str = "absolute",
        sink_update: str = "fixed",
        sink_decay: float = 0.999,
        # 8-bit KV cache
        kv_cache_dtype: torch.dtype | str | None = None,
    ) -> None:
        """Give the transformer fresh engines of kind ``kv_cache_engine`` (``"static"`` or ``"vanilla"``) with the
        sliding window ``attention_window`` / ``sink_frames`` (latent frames), sized for the rollout's chunks, and
        the positions mode and sink update ``rope_positions`` / ``sink_update`` / ``sink_decay``, storing self K/V as
        ``kv_cache_dtype`` (``None``: the compute dtype; 8-bit: ``torch.float8_e4m3fn``, ``torch.int8``).

        ``kv_cache_engine=None`` keeps the engines the transformer has (e.g. ones set with
        ``transformer.set_kv_cache_engines``). Called at the start of a rollout, whose caches are empty anyway.
        """
        check_window_fits_chunks(attention_window, sink_frames, chunk_bounds)
        if kv_cache_engine is None:
            return
        warn_discarding_kept_rollouts(self)
        self._free_rollouts()  # kept rollouts live in the engines being replaced
        engines = make_engines(
            self.transformer,
            kv_cache_engine,
            window_frames=attention_window,
            sink_frames=sink_frames,
            max_frames=chunk_bounds[-1][1],
            rope_positions=rope_positions,
            sink_update=sink_update,
            sink_decay=sink_decay,
            kv_cache_dtype=kv_cache_dtype,
        )
        self.transformer.set_kv_cache_engines(engines)

    def configure_rollout_cache(
        self,
        options: RolloutOptions,
        bounds: Sequence[tuple[int, int]],
        *,
        rolling: RollingPolicy | None = None,
        open_ended: bool = False,
    ) -> None:
        """[`configure_kv_cache`] for a call's rollout of chunks ``bounds`` under its policy: sized for the whole
        rollout (``open_ended``: for the first chunk, a live video whose length is unknown; a static engine grows),
        for the context and one chunk under ``kv_cache_policy="recompute"`` (the cache never holds more), or for the
        anchor and the last ``attention_window`` frames of a ``rolling`` policy (the anchor rotated at read time)."""
        cache_bounds = list(bounds[:1] if open_ended else bounds)
        cache_window = (options.attention_window, options.sink_frames)
        if options.kv_cache_policy == RECOMPUTE:
            cache_bounds = [(0, options.context_frames + max(end - start for start, end in bounds))]
        position_options = kv_cache_position_options(options)
        if rolling is not None:
            window = rolling.engine_window(bounds[0][1] - bounds[0][0])
            cache_window = (window.frames, window.sink)
            position_options = {**position_options, "rope_positions": ANCHOR_POSITIONS}
        self.configure_kv_cache(
            options.kv_cache_engine,
            *cache_window,
            cache_bounds,
            **position_options,
            kv_cache_dtype=options.kv_cache_dtype,
        )

    @staticmethod
    def check_kv_cache_inputs(
        kv_cache_engine: str | None,
        attention_window: int | None,
        sink_frames: int,
        # window-relative RoPE and EMA sink (Reward Forcing)
        rope_positions: str = "absolute",
        sink_update: str = "fixed",
        sink_decay: float = 0.999,
        # 8-bit KV cache
        kv_cache_dtype: torch.dtype | str | None = None,
    ) -> None:
        """Raise ``ValueError`` for an engine kind, window, positions mode, sink update or storage dtype the engines
        cannot serve (the window settings by [`AttentionWindow`], the others by the engines' own checks)."""
        if kv_cache_engine is not None and kv_cache_engine not in ENGINE_KINDS:
            raise ValueError(f"`kv_cache_engine` must be one of {ENGINE_KINDS} or None, got {kv_cache_engine!r}.")
        if kv_cache_engine is None and (attention_window is not None or sink_frames):
            raise ValueError("`attention_window`/`sink_frames` need a `kv_cache_engine` ('static' or 'vanilla').")
        custom = (rope_positions, sink_update, sink_decay) != tuple(KV_CACHE_POSITION_DEFAULTS.values())
        if kv_cache_engine is None and custom:
            raise ValueError(
                "`rope_positions`/`sink_update`/`sink_decay` configure the engines a `kv_cache_engine` ('static' or "
                "'vanilla') builds; with kv_cache_engine=None set them on your own engines."
            )
        window = AttentionWindow.from_arguments(attention_window, sink_frames)
        check_rope_and_sink_settings(
            window, rope_positions, sink_update, sink_decay, window_name="attention_window", sink_name="sink_frames"
        )
        if check_kv_cache_dtype(kv_cache_dtype, sink_update) is not None and kv_cache_engine is None:
            raise ValueError("`kv_cache_dtype` needs a `kv_cache_engine` ('static' or 'vanilla').")
