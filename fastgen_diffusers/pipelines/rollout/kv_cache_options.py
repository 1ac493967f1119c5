"""The KV-cache engines of a call: the engines' configuration for the call's cache settings and policy (the settings'
rules are checked when they are built: :class:`~fastgen_diffusers.settings.CacheSettings`).

[`KVCacheOptionsMixin`] is a layer of [`CausalRolloutMixin`] (the host provides ``transformer`` and the kept-rollout
bookkeeping ``_free_rollouts``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...kv_cache import make_engines
from .guard import warn_discarding_kept_rollouts
from .options import RolloutOptions
from .policy_rolling import RollingPolicy


class KVCacheOptionsMixin:
    """Configure and check the engines of a causal pipeline's transformer for a call."""

    def configure_kv_cache(
        self, kv_cache_engine: str | None, chunk_bounds: Sequence[tuple[int, int]], **engine_options: Any
    ) -> None:
        """Give the transformer fresh engines of kind ``kv_cache_engine`` (``"static"`` or ``"vanilla"``), sized for
        the rollout's chunks, with the engine settings ``engine_options`` (the keyword arguments of ``make_engines``:
        [`CacheSettings.engine_options`], the window and sink, key positions, sink rule and storage dtype).

        ``kv_cache_engine=None`` keeps the engines the transformer has (e.g. ones set with
        ``transformer.set_kv_cache_engines``). Called at the start of a rollout, whose caches are empty anyway; the
        window against the chunks was checked with the call's settings ([`CacheSettings.check_chunks`]).
        """
        if kv_cache_engine is None:
            return
        warn_discarding_kept_rollouts(self)
        self._free_rollouts()  # kept rollouts live in the engines being replaced
        engines = make_engines(self.transformer, kv_cache_engine, max_frames=chunk_bounds[-1][1], **engine_options)
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
        for the frames the policy's cache holds at most ([`PolicySettings.cache_frames`]: the context and one chunk
        under recompute), or for the anchor and the last ``attention_window`` frames of a ``rolling`` policy (the
        anchor rotated at read time)."""
        cache_bounds = list(bounds[:1] if open_ended else bounds)
        cache = options.settings.cache
        engine_options = cache.engine_options()
        policy = options.settings.active_policy
        frames = policy.cache_frames(max(end - start for start, end in bounds))
        if frames is not None:
            cache_bounds = [(0, frames)]
        if policy.engine_rope_positions is not None:
            engine_options["rope_positions"] = policy.engine_rope_positions
        if rolling is not None:
            window = rolling.engine_window(bounds[0][1] - bounds[0][0])
            engine_options.update(window_frames=window.frames, sink_frames=window.sink)
        self.configure_kv_cache(options.kv_cache_engine, cache_bounds, **engine_options)
