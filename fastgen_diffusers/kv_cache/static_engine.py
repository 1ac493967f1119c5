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

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .accounting import expected_self_cache_bytes, tensor_bytes
from .base import BaseKVCacheEngine
from .quantize import QuantizedFrames, stored_tensors
from .tags import TagState
from .window import AttentionWindow


def _static_address(buffer: torch.Tensor) -> torch.Tensor:
    """Tell CUDA graph trees (``torch.compile(mode="reduce-overhead")``) that ``buffer`` keeps its address, so that the
    compiled attention's in-place writes into it are captured instead of disabling the graph. Unguarded: one graph
    serves the buffers of every block. No effect in eager."""
    if buffer.is_cuda:
        import torch._dynamo

        torch._dynamo.mark_static_address(buffer, guard=False)
    return buffer


@dataclass
class StaticSelfEntry:
    """Self-attention K/V buffers of one block and tag, each ``(B, capacity * S, H, D)`` (``S`` tokens per frame;
    :class:`QuantizedFrames` under ``kv_cache_dtype``)."""

    key: torch.Tensor | QuantizedFrames
    value: torch.Tensor | QuantizedFrames


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


@dataclass
class SlotCopy:
    """Tokens ``tokens`` of two buffers as they were before an in-place write; calling it writes them back."""

    key: torch.Tensor | QuantizedFrames
    value: torch.Tensor | QuantizedFrames
    tokens: slice
    kept_key: torch.Tensor | QuantizedFrames
    kept_value: torch.Tensor | QuantizedFrames

    def __call__(self) -> None:
        self.key[:, self.tokens] = self.kept_key
        self.value[:, self.tokens] = self.kept_value

    @property
    def nbytes(self) -> int:
        return tensor_bytes((*stored_tensors(self.kept_key), *stored_tensors(self.kept_value)))


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

    def _new_self_entry(self, state: TagState, max_frames: int | None) -> StaticSelfEntry:
        slots = self._capacity_for(max_frames or 1) * state.frame_seqlen
        shape = (state.batch_size, slots, state.num_heads, state.head_dim)
        if self.kv_cache_dtype is not None:
            return StaticSelfEntry(
                *(
                    QuantizedFrames.zeros(shape, state.frame_seqlen, self.kv_cache_dtype, state.device)
                    for _ in range(2)
                )
            )
        return StaticSelfEntry(
            _static_address(torch.zeros(shape, dtype=state.dtype, device=state.device)),
            _static_address(torch.zeros(shape, dtype=state.dtype, device=state.device)),
        )

    def _reserve(self, state: TagState, cache_tag: str, max_frames: int | None) -> None:
        if max_frames is None:
            return
        needed = self._capacity_for(max_frames) * state.frame_seqlen
        for per_tag in self._self_kv:
            entry: StaticSelfEntry = per_tag[cache_tag]
            capacity = entry.key.shape[1]
            if capacity >= needed:
                continue
            grown = max(needed, self.window.slots(2 * capacity // state.frame_seqlen) * state.frame_seqlen)
            entry.key = self._grow(entry.key, grown)
            entry.value = self._grow(entry.value, grown)

    @staticmethod
    def _grow(buffer: torch.Tensor | QuantizedFrames, slots: int) -> torch.Tensor | QuantizedFrames:
        grown = buffer.new_zeros((buffer.shape[0], slots, *buffer.shape[2:]))
        grown[:, : buffer.shape[1]] = buffer
        return _static_address(grown) if isinstance(grown, torch.Tensor) else grown

    # ------------------------------------------------------------------ slots
    def _slot_runs(self, first: int, last: int) -> list[tuple[int, int, int]]:
        """``(frame, slot, count)`` runs covering frames ``[first, last)`` (at most ``window - sink`` non-sink
        frames when the range passes the window)."""
        if first >= last:
            return []
        window = self.window
        if window.all_seen_until(last):
            return [(first, first, last - first)]
        runs = []
        if first < window.sink:
            runs.append((first, first, window.sink - first))
            first = window.sink
        slot = window.sink + (first - window.sink) % window.room
        count = min(last - first, window.frames - slot)
        runs.append((first, slot, count))
        if first + count < last:
            runs.append((first + count, window.sink, last - first - count))
        return runs

    def _write(
        self, entry: StaticSelfEntry, state: TagState, key: torch.Tensor, value: torch.Tensor, key_start: int, frames
    ) -> None:
        """Copy frames ``[first, last)`` of ``key``/``value`` (whose first frame is ``key_start``) into their slots."""
        first, last = frames
        seqlen = state.frame_seqlen
        for frame, slot, count in self._slot_runs(first, last):
            self._keep_for_undo(entry, slot, slot + count, seqlen)
            src = slice((frame - key_start) * seqlen, (frame - key_start + count) * seqlen)
            dst = slice(slot * seqlen, (slot + count) * seqlen)
            entry.key[:, dst] = self._encode_kv(key[:, src], state)
            entry.value[:, dst] = self._encode_kv(value[:, src], state)

    # ------------------------------------------------------------------ transactions
    def begin_transaction(self, cache_tag: str) -> None:
        """Also note which slots hold frames the tag holds now: an in-place write to them during the transaction
        first keeps their contents (:meth:`_keep_for_undo`). Writes to free slots keep nothing."""
        super().begin_transaction(cache_tag)
        state = self._tags.get(cache_tag)
        held_slots = []
        if state is not None:
            window = self.window
            frames = [(0, state.num_frames)]
            if window.bounded:
                frames = [
                    (0, min(window.sink, state.num_frames)),
                    (max(window.sink, state.evicted_before), state.num_frames),
                ]
            for first, last in frames:
                held_slots += [(slot, slot + count) for _, slot, count in self._slot_runs(first, last)]
        self._transaction.extra.update(held_slots=held_slots, unsaved={})

    def _snapshot_self_entry(self, entry: StaticSelfEntry | None):
        return None if entry is None else (entry, entry.key, entry.value)

    def _restore_self_entry(self, snapshot) -> StaticSelfEntry:
        entry, entry.key, entry.value = snapshot  # buffers grown during the transaction are dropped
        return entry

    def _keep_for_undo(self, entry: StaticSelfEntry, first_slot: int, last_slot: int, seqlen: int) -> None:
        """Before slots ``[first_slot, last_slot)`` of ``entry`` are overwritten in an open transaction, keep a copy
        of those that hold frames held when it began (each slot once) and record how to put it back."""
        transaction = self._transaction
        if transaction is None:
            return
        unsaved = transaction.extra["unsaved"].setdefault(id(entry), list(transaction.extra["held_slots"]))
        remaining = []
        for low, high in unsaved:
            first, last = max(low, first_slot), min(high, last_slot)
            if first >= last:
                remaining.append((low, high))
                continue
            tokens = slice(first * seqlen, last * seqlen)
            key, value = entry.key, entry.value
            transaction.undo.append(SlotCopy(key, value, tokens, key[:, tokens].clone(), value[:, tokens].clone()))
            remaining += [r for r in ((low, first), (last, high)) if r[0] < r[1]]
        transaction.extra["unsaved"][id(entry)] = remaining

    # ------------------------------------------------------------------ attention
    def _key_frames(self, cache_tag, start_frame, num_frames, first_chunk_frames, in_place, attention_window=None):
        """On the in-place path (:meth:`static_call`) the keys are the buffer's first slots, in slot order: the sink,
        then the ring, whose order is not frame order once the window has wrapped."""
        if not in_place:
            return super()._key_frames(
                cache_tag, start_frame, num_frames, first_chunk_frames, in_place, attention_window
            )
        return list(self._slot_frames(start_frame + num_frames))

    def _frame_pieces(self, entry: StaticSelfEntry, state: TagState, ranges):
        seqlen = state.frame_seqlen
        keys, values = [], []
        for first, last in ranges:
            for _, slot, count in self._slot_runs(first, last):
                tokens = slice(slot * seqlen, (slot + count) * seqlen)
                keys.append(self._decode_kv(entry.key[:, tokens], state))
                values.append(self._decode_kv(entry.value[:, tokens], state))
        return keys, values

    def _replace_sink(self, entry: StaticSelfEntry, state: TagState, key: torch.Tensor, value: torch.Tensor) -> None:
        seqlen = state.frame_seqlen
        frames = key.shape[1] // seqlen
        self._keep_for_undo(entry, 0, frames, seqlen)
        entry.key[:, : frames * seqlen] = self._encode_kv(key, state)
        entry.value[:, : frames * seqlen] = self._encode_kv(value, state)

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
            entry: StaticSelfEntry = per_tag[cache_tag]
            for _, slot, count in runs:
                self._keep_for_undo(entry, slot, slot + count, seqlen)
        capacity = self._self_kv[0][cache_tag].key.shape[1] if self._self_kv else 0
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
        if self.kv_cache_dtype is not None:
            raise RuntimeError("An 8-bit KV cache has no compute-dtype buffers to attend to in place.")
        entry: StaticSelfEntry = self._self_kv[block_idx][cache_tag]
        return entry.key, entry.value

    def commit_static_store(self, cache_tag: str, start_frame: int, num_frames: int) -> None:
        """Record a store whose K/V the attention of a :meth:`static_call` already wrote into their slots."""
        self._store_window(self._tags[cache_tag], start_frame, start_frame + num_frames)

    # ------------------------------------------------------------------ stores and edits
    def append_self_kv(self, block_idx, cache_tag, key, value, start_frame):
        entry: StaticSelfEntry = self._self_kv[block_idx][cache_tag]
        state = self._tags[cache_tag]
        end_frame = start_frame + key.shape[1] // state.frame_seqlen
        for frames in self._store_window(state, start_frame, end_frame):
            self._write(entry, state, key.detach(), value.detach(), start_frame, frames)

    def _truncate_self_entry(self, entry: StaticSelfEntry, state: TagState, end_frame: int) -> None:
        """Nothing to free: slots are fixed, and the tag state says which frames are held."""

    def _evict_self_entry(self, entry: StaticSelfEntry, state: TagState, before: int) -> None:
        """Nothing to free: evicted frames' slots are overwritten by the frames that replace them."""

    def _rotate_self_entry(
        self, entry: StaticSelfEntry, state: TagState, rotate: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        self._keep_for_undo(entry, 0, entry.key.shape[1] // state.frame_seqlen, state.frame_seqlen)
        entry.key[:, :] = self._encode_kv(rotate(self._decode_kv(entry.key, state)), state)

    def _copy_self_entry(self, entry: StaticSelfEntry) -> StaticSelfEntry:
        # Buffers are written in place, so a fork needs its own.
        return StaticSelfEntry(entry.key.clone(), entry.value.clone())

    def _self_entry_tensors(self, entry: StaticSelfEntry) -> list[torch.Tensor]:
        return [*stored_tensors(entry.key), *stored_tensors(entry.value)]

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
