"""A preallocated KV cache: per block and tag, K/V buffers written in place and read as views.

Every frame has a fixed slot in the buffers. Without a window, frame ``f`` lives in slot ``f``. With a window of
``W`` frames and ``S`` sink frames, the buffers hold ``W`` slots: the sink frames keep slots ``0 .. S-1`` and every
later frame ``f`` takes slot ``S + (f - S) % (W - S)`` of a ring. The hot call of a rollout (a call at the end of
what is stored, the denoising steps and the store of a new chunk) writes its own K/V into their slots and attends
to the view ``buffer[:, :visible]``:

* without a window, the view is frames ``[0, start + F)`` in order;
* with a window, once the video is longer than the window, the view is the whole buffer: the sink plus the ring,
  which then holds exactly the frames the chunk attends to (its own frames and the most recent others). The ring
  order is not frame order, which attention over keys without a mask does not see (keys carry their RoPE
  positions; keys stored before RoPE are rotated at read time by slot, in the ring's order:
  :meth:`~BaseKVCacheEngine.key_positions` with ``in_place=True``). Calls that need a mask (several chunks) or that
  start before the end of the cache gather the prefix in frame order and concatenate, as the vanilla engine does.

So a rollout allocates nothing per step and, with a window, every call attends to views of one shape, which is what
``torch.compile`` / CUDA graph capture need. Calls with gradients (training) take the concatenating path, since an
in-place write would be part of the graph.

An 8-bit engine (``kv_cache_dtype``) holds its buffers quantized (:class:`QuantizedFrames`: 1 byte per element and a
float32 scale per sample, frame and head). Attention cannot read those in place, and a call's own K/V must stay in the
compute dtype, so every call of an 8-bit engine takes the gathering path: its storage has no in-place view, so
:meth:`~BaseKVCacheEngine.plan_call` plans no in-place read, the visible slots are dequantized block by block and
concatenated with the call's K/V, and a store quantizes the chunk into its slots. Slots, the ring, capacity and the
undo copies (scales included) are unchanged; what is lost is the fixed-shape fast path
(``benchmarks/bench_kv8.py`` measures the cost).

Capacity: ``max_frames`` (constructor) allocates that many frame slots up front (capped at ``window_frames``). When a
call needs more slots than allocated, the buffers grow to at least twice their size (a copy of what they hold), so
growth happens a logarithmic number of times in a rollout; pass ``max_frames`` to allocate once.
:meth:`StaticKVCacheEngine.allocated_self_cache_bytes` reports the allocated capacity;
:meth:`~BaseKVCacheEngine.self_cache_bytes` the K/V actually held (the cache formula over the held tokens).
"""

from __future__ import annotations

from typing import Any

from .base import BaseKVCacheEngine
from .storage import SlotCopy, SlotStorage
from .tags import TagState

__all__ = ["SlotCopy", "StaticKVCacheEngine"]


class StaticKVCacheEngine(BaseKVCacheEngine):
    """Preallocated, in-place KV cache with the contract and numbers of the vanilla engine.

    Args:
        max_frames: frames to allocate per tag up front (the rollout's latent frame count); ``None`` sizes the
            buffers from the first call and grows them by doubling when needed.
        engine_options: the options of :class:`BaseKVCacheEngine` (window, sink, key positions, sink rule, storage
            dtype); the buffers never exceed the window's ``window_frames`` frames, and an 8-bit ``kv_cache_dtype``
            quantizes them, every call then taking the gathering path (no in-place fast path; see the module
            docstring).
    """

    storage_class = SlotStorage

    def __init__(self, max_frames: int | None = None, **engine_options: Any) -> None:
        super().__init__(**engine_options)
        if max_frames is not None and (isinstance(max_frames, bool) or not isinstance(max_frames, int)):
            raise ValueError(f"`max_frames` must be None or a positive int, got {max_frames!r}.")
        if max_frames is not None and max_frames < 1:
            raise ValueError(f"`max_frames` must be None or a positive int, got {max_frames}.")
        self.max_frames = max_frames

    # ------------------------------------------------------------------ capacity
    def _capacity_for(self, frames: int) -> int:
        """Frame slots needed to serve ``frames`` frames (at most the window)."""
        return self.window.slots(max(frames, self.max_frames or 0))

    def _initial_slots(self, max_frames: int | None) -> int:
        return self._capacity_for(max_frames or 1)

    def _reserve(self, state: TagState, cache_tag: str, max_frames: int | None) -> None:
        if max_frames is None:
            return
        needed = self._capacity_for(max_frames)
        for per_tag in self._self_kv:
            per_tag[cache_tag].reserve(needed, most=self.window.frames)
