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
compute dtype, so every call of an 8-bit engine takes the gathering path: :meth:`StaticKVCacheEngine.static_call`
returns ``None``, the visible slots are dequantized block by block and concatenated with the call's K/V, and a store
quantizes the chunk into its slots. Slots, the ring, capacity and the undo copies (scales included) are unchanged;
what is lost is the fixed-shape fast path (``benchmarks/bench_kv8.py`` measures the cost).

Capacity: ``max_frames`` (constructor) allocates that many frame slots up front (capped at ``window_frames``). When a
call needs more slots than allocated, the buffers grow to at least twice their size (a copy of what they hold), so
growth happens a logarithmic number of times in a rollout; pass ``max_frames`` to allocate once.
:meth:`StaticKVCacheEngine.allocated_self_cache_bytes` reports the allocated capacity;
:meth:`~BaseKVCacheEngine.self_cache_bytes` the K/V actually held (the cache formula over the held tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .accounting import expected_self_cache_bytes
from .base import BaseKVCacheEngine
from .storage import SlotCopy, SlotStorage
from .tags import TagState
from .window import AttentionWindow

StaticSelfEntry = SlotStorage  # the storage of one block and tag (its former name)
__all__ = ["SlotCopy", "StaticCall", "StaticKVCacheEngine", "StaticSelfEntry"]


@dataclass(eq=False)
class StaticCall:
    """Where one call's K/V go in the fixed buffers and which slots it attends to (see
    :meth:`StaticKVCacheEngine.static_call`).

    Attributes:
        write_index: ``(F*S,)`` int64 buffer token index of every token of the call, in frame order.
        valid_length: ``(V, 0)`` empty tensor whose first size is the number of buffer slots (tokens) the call attends
            to, the buffer's first ones. A shape, not a Python int: ``torch.compile`` sees it as a dynamic size
            (marked so), so one graph serves every chunk and every window position with no recompile, and attention
            reads exactly the valid slots (no work on masked keys).
        slot_frames: the latent frame each of those valid slots holds once the call's K/V are written, slot by slot
            (frame order until a window's ring wraps, then the sink followed by the ring's order): what attention
            reads, for a per-key attention bias.
    """

    write_index: torch.Tensor
    valid_length: torch.Tensor
    slot_frames: tuple[int, ...] = ()

    @property
    def valid_tokens(self) -> int:
        return self.valid_length.shape[0]


class StaticKVCacheEngine(BaseKVCacheEngine):
    """Preallocated, in-place KV cache with the contract and numbers of the vanilla engine.

    Args:
        max_frames: frames to allocate per tag up front (the rollout's latent frame count); ``None`` sizes the
            buffers from the first call and grows them by doubling when needed.
        window_frames: sliding attention window in latent frames (see :class:`BaseKVCacheEngine`); the buffers then
            never exceed ``window_frames`` frames.
        sink_frames: first frames kept for ever inside the window.
        rope_positions, sink_update, sink_decay: window-relative RoPE and the EMA sink (see
            :class:`BaseKVCacheEngine`).
        kv_cache_dtype: ``None`` or 8-bit storage (``torch.float8_e4m3fn``, ``torch.int8``): quantized buffers, and
            every call takes the gathering path (no in-place fast path; see the module docstring).
    """

    storage_class = SlotStorage

    def __init__(
        self,
        max_frames: int | None = None,
        *,
        window_frames: int | None = None,
        sink_frames: int = 0,
        # window-relative RoPE and EMA sink (Reward Forcing)
        rope_positions: str = "absolute",
        sink_update: str = "fixed",
        sink_decay: float = 0.999,
        # 8-bit KV cache
        kv_cache_dtype: torch.dtype | str | None = None,
    ) -> None:
        super().__init__(
            window_frames=window_frames,
            sink_frames=sink_frames,
            rope_positions=rope_positions,
            sink_update=sink_update,
            sink_decay=sink_decay,
            kv_cache_dtype=kv_cache_dtype,
        )
        if max_frames is not None and (isinstance(max_frames, bool) or not isinstance(max_frames, int)):
            raise ValueError(f"`max_frames` must be None or a positive int, got {max_frames!r}.")
        if max_frames is not None and max_frames < 1:
            raise ValueError(f"`max_frames` must be None or a positive int, got {max_frames}.")
        self.max_frames = max_frames
        self._last_static_call: tuple[tuple, StaticCall] | None = None

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

    # ------------------------------------------------------------------ attention
    def _key_frames(self, cache_tag, start_frame, num_frames, first_chunk_frames, in_place, attention_window=None):
        """On the in-place path (:meth:`static_call`) the keys are the buffer's first slots, in slot order: the sink,
        then the ring, whose order is not frame order once the window has wrapped."""
        if not in_place:
            return super()._key_frames(
                cache_tag, start_frame, num_frames, first_chunk_frames, in_place, attention_window
            )
        return list(self._slot_frames(start_frame + num_frames))

    # ------------------------------------------------------------------ fixed-shape attention (compiled rollouts)
    def static_call(
        self,
        cache_tag: str,
        start_frame: int,
        num_frames: int,
        first_chunk_frames: int,
        attention_window: AttentionWindow | None = None,
    ) -> StaticCall | None:
        """The fixed-buffer plan of a call, shared by every block of the branch; ``None`` for a call it cannot serve
        (not at the end of the cache, several chunks, gradients on, a windowed recache, a call under its own
        ``attention_window``, whose frames are not the buffers' holding window, or an 8-bit cache, whose buffers
        attention cannot read in place): that call gathers its prefix instead.

        The call's K/V are written at :attr:`StaticCall.write_index` into :meth:`static_buffers` (by the attention
        processor) and attention reads the buffers' valid slots. Slots that hold frames the open transaction must be
        able to restore are kept first, as :meth:`_write` does. Built once per chunk (every step of a chunk and its
        store share it).
        """
        state = self._tags.get(cache_tag)
        if state is None or start_frame != state.num_frames or first_chunk_frames != num_frames:
            return None
        # a windowed recache attends to the held frames only, a per-call window to its own frames, not the buffers'
        if state.recaching or attention_window is not None or self.kv_cache_dtype is not None:
            return None
        if torch.is_grad_enabled():
            return None
        if state.flushed_before > self.window.visible(start_frame, num_frames)[1]:
            return None  # a KV flush dropped frames the window would show: gather the held ones
        seqlen = state.frame_seqlen
        end_frame = start_frame + num_frames
        runs = self._slot_runs(start_frame, end_frame)
        for per_tag in self._self_kv:
            entry = per_tag[cache_tag]
            for _, slot, count in runs:
                self._keep_for_undo(entry, slot, slot + count, seqlen)
        capacity = self._self_kv[0][cache_tag].num_slots * seqlen if self._self_kv else 0
        key = (start_frame, num_frames, seqlen, capacity, state.device, state.dtype)
        if self._last_static_call is not None and self._last_static_call[0] == key:
            return self._last_static_call[1]
        write_index = torch.cat(
            [torch.arange(slot * seqlen, (slot + count) * seqlen, device=state.device) for _, slot, count in runs]
        )
        valid_length = torch.empty(self.window.slots(end_frame) * seqlen, 0, device=state.device)
        torch._dynamo.maybe_mark_dynamic(valid_length, 0)
        call = StaticCall(write_index, valid_length, self._slot_frames(end_frame))
        self._last_static_call = (key, call)
        return call

    def _slot_frames(self, end_frame: int) -> tuple[int, ...]:
        """The frame each of the first ``window.slots(end_frame)`` slots holds once frames ``[0, end_frame)`` have
        been written (the sink and the most recent frames under a window)."""
        window = self.window
        if window.all_seen_until(end_frame):
            return tuple(range(end_frame))
        frames = [0] * window.frames
        for first, last in ((0, window.sink), (end_frame - window.room, end_frame)):
            for frame, slot, count in self._slot_runs(first, last):
                frames[slot : slot + count] = range(frame, frame + count)
        return tuple(frames)

    def static_buffers(self, block_idx: int, cache_tag: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed-size K/V buffers ``(B, capacity * S, H, D)`` of one block and tag (not for an 8-bit cache)."""
        view = self._self_kv[block_idx][cache_tag].view()
        if view is None:
            raise RuntimeError("An 8-bit KV cache has no compute-dtype buffers to attend to in place.")
        return view

    def commit_static_store(self, cache_tag: str, start_frame: int, num_frames: int) -> None:
        """Record a store whose K/V the attention of a :meth:`static_call` already wrote into their slots."""
        self._store_window(self._tags[cache_tag], start_frame, start_frame + num_frames)

    # ------------------------------------------------------------------ memory
    def self_cache_bytes(self, cache_tag: str | None = None) -> int:
        """Bytes of the K/V held: the cache formula over :meth:`held_frames` in the storage dtype, plus the scales
        of an 8-bit cache (never the allocated capacity, which :meth:`allocated_self_cache_bytes` reports)."""
        return self.self_cache_scale_bytes(cache_tag) + sum(
            expected_self_cache_bytes(
                self.num_blocks,
                state.batch_size,
                state.num_heads,
                self.held_frames(tag) * state.frame_seqlen,
                state.head_dim,
                self._storage_dtype(state),
            )
            for tag, state in self._tags.items()
            if cache_tag is None or tag == cache_tag
        )
