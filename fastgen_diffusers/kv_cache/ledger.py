"""The ledger: an engine's torch-free bookkeeping, apart from the tensors (as llama.cpp keeps cells apart from memory).

One :class:`Ledger` per engine knows, per cache tag, which frames are stored and which are held (the window and the
:class:`SinkRule`), where each frame lives in the storage (its slot), the keys' RoPE positions and what a forward's
transaction must restore; and it plans each call: the slots a call writes, the frames it reads in order, each key's
position, what a call or a store evicts and which evicted frames the sink rule folds into the sink. The engine asks
the ledger, then applies the plan to its storages (:mod:`~fastgen_diffusers.kv_cache.storage`); the ledger touches no
tensor and imports no torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .positions import RopePositionMode, RopePositions, check_chunk_positions
from .sink import SinkRule, frame_ranges
from .tags import TagState, TagTable
from .window import AttentionWindow, check_ema_eviction

__all__ = ["Eviction", "KeyPlan", "Ledger", "SinkRule", "plan_keys", "visible_prefix"]


@dataclass(frozen=True)
class KeyPlan:
    """The keys one call reads, as the ledger plans them: what the masks of a multi-chunk call are built from.

    Attributes:
        start_frame: the call's first frame.
        frames: the latent frame of every key frame, in the order attention reads them (the gathered prefix in frame
            order, then the call's frames).
        pinned: per key frame, whether the sink rule pins it (seen by every later query, whatever the window).
    """

    start_frame: int
    frames: tuple[int, ...]
    pinned: tuple[bool, ...]

    @property
    def prefix_pinned(self) -> int:
        """Pinned key frames of the cached prefix."""
        return sum(p for f, p in zip(self.frames, self.pinned) if f < self.start_frame)

    @property
    def prefix_recent(self) -> int:
        """Unpinned key frames of the cached prefix."""
        return sum(not p for f, p in zip(self.frames, self.pinned) if f < self.start_frame)

    def pattern(self) -> tuple[int | None, ...]:
        """Per key frame its offset from the call's start, ``None`` for a pinned frame of the prefix (seen by every
        query of the call, wherever it is): what a mask's pattern depends on."""
        return tuple(
            None if p and f < self.start_frame else f - self.start_frame for f, p in zip(self.frames, self.pinned)
        )


def plan_keys(pins: SinkRule, start_frame: int, num_frames: int, prefix: Sequence[int]) -> KeyPlan:
    """The :class:`KeyPlan` of a call reading the cached frames ``prefix`` (frame order) then its own frames."""
    frames = (*prefix, *range(start_frame, start_frame + num_frames))
    return KeyPlan(start_frame, frames, tuple(pins.pinned(frame) for frame in frames))


def visible_prefix(window: AttentionWindow, pins: SinkRule, start_frame: int, recent_start: int) -> list[int]:
    """The cached frames a call at ``start_frame`` reads, in frame order: the pinned frames before it and the unpinned
    frames from ``recent_start`` on (``recent_start``: :meth:`AttentionWindow.visible`, clipped to what is held)."""
    recent = [frame for frame in range(recent_start, start_frame) if not pins.pinned(frame)]
    pinned = pins.pinned_frames(start_frame) if window.bounded else ()
    if not pinned or not recent or pinned[-1] < recent[0]:
        return [*pinned, *recent]
    return sorted({*pinned, *recent})


@dataclass(frozen=True)
class Eviction:
    """What a call's start evicts: frames ``[first, last)``, after folding them into the pinned frames
    (``fold``: :meth:`SinkRule.fold`) when the rule says so."""

    first: int
    last: int
    fold: tuple[tuple[int, int], tuple[int, int]] | None = None


class Ledger:
    """The bookkeeping of one engine: its tags (:class:`~fastgen_diffusers.kv_cache.tags.TagTable`), the window
    and sink rule, the positions mode and the slot map of its storage.

    Args:
        window: the engine's (holding) window.
        sink: the :class:`SinkRule` of its pinned frames (its ``frames`` are the window's ``sink``).
        positions: the positions mode of its keys (``rope_positions``) and its name.
        fixed_slots: the storage's slots are preallocated and reused (frames map to a ring under a window), else a
            slot is a frame.
    """

    def __init__(
        self, window: AttentionWindow, sink: SinkRule, positions: RopePositionMode, positions_name: str, fixed_slots
    ) -> None:
        self.window = window
        self.sink = sink
        self.positions = positions
        self.positions_name = positions_name
        self.fixed_slots = bool(fixed_slots)
        if self.fixed_slots and window.bounded and not sink.at_front:
            raise ValueError(
                "A storage with fixed slots keeps the pinned frames in the first slots of its ring, but the sink rule "
                f"{type(sink).__name__} pins later frames: use a storage without fixed slots (the vanilla engine's)."
            )
        self.tags = TagTable()

    # ------------------------------------------------------------------ reads
    def state(self, cache_tag: str) -> TagState | None:
        return self.tags.get(cache_tag)

    def num_frames(self, cache_tag: str) -> int:
        return self.tags.num_frames(cache_tag)

    def held_frames(self, cache_tag: str) -> int:
        """Frames of ``cache_tag`` whose K/V the engine holds (the pinned frames and the frames not evicted)."""
        state = self.tags.get(cache_tag)
        if state is None or not self.window.bounded:
            return 0 if state is None else state.num_frames
        held = self.sink.unpinned_ranges(state.evicted_before, state.num_frames)
        return len(self.sink.pinned_frames(state.num_frames)) + sum(last - first for first, last in held)

    def rope_offset(self, cache_tag: str) -> int:
        state = self.tags.get(cache_tag)
        return 0 if state is None else state.rope_offset

    def pins(self, attention_window: AttentionWindow | None = None) -> SinkRule:
        """The sink rule a call reads under: the engine's, or the fixed rule of a call's own window's sink (its first
        frames: ``ValueError`` when the engine's rule pins other frames)."""
        if attention_window is None:
            return self.sink
        self.sink.require_prefix("A call under its own `attention_window`")
        return SinkRule(attention_window.sink)

    def held_visible(
        self,
        cache_tag: str,
        start_frame: int,
        first_chunk_frames: int,
        attention_window: AttentionWindow | None = None,
    ) -> tuple[int, int]:
        """``(sink_end, recent_start)``: the window's visible frames clipped to what ``cache_tag`` holds (only the
        calls of a windowed recache see fewer frames); a call under its own ``attention_window`` sees that window's."""
        if attention_window is not None:
            return attention_window.visible(start_frame, first_chunk_frames)
        sink_end, recent_start = self.window.visible(start_frame, first_chunk_frames)
        state = self.tags.get(cache_tag)
        if state is not None and self.window.bounded:
            recent_start = max(recent_start, min(max(state.evicted_before, sink_end), start_frame))
        return sink_end, recent_start

    def prefix_frames(
        self,
        cache_tag: str,
        start_frame: int,
        first_chunk_frames: int = 1,
        attention_window: AttentionWindow | None = None,
    ) -> list[int]:
        """The frames of a call's gathered prefix, in frame order: the sink rule's pinned and the recent frames."""
        window = self.window if attention_window is None else attention_window
        _, recent_start = self.held_visible(cache_tag, start_frame, first_chunk_frames, attention_window)
        return visible_prefix(window, self.pins(attention_window), start_frame, recent_start)

    def prefix_ranges(
        self,
        cache_tag: str,
        start_frame: int,
        first_chunk_frames: int = 1,
        attention_window: AttentionWindow | None = None,
    ) -> list[tuple[int, int]]:
        """:meth:`prefix_frames` as ascending ``[first, last)`` frame ranges (what a gathered prefix reads)."""
        return frame_ranges(self.prefix_frames(cache_tag, start_frame, first_chunk_frames, attention_window))

    def key_plan(
        self,
        cache_tag: str,
        start_frame: int,
        chunk_layout: Sequence[int],
        attention_window: AttentionWindow | None = None,
    ) -> KeyPlan:
        """The keys a gathered call reads in order, each with whether it is pinned (what its masks are built from)."""
        prefix = self.prefix_frames(cache_tag, start_frame, chunk_layout[0], attention_window)
        return plan_keys(self.pins(attention_window), start_frame, sum(chunk_layout), prefix)

    def key_frames(
        self,
        cache_tag: str,
        start_frame: int,
        num_frames: int,
        first_chunk_frames: int,
        in_place: bool,
        attention_window: AttentionWindow | None = None,
    ) -> list[int]:
        """The frame of every key frame a call reads, in its order: the gathered prefix then the call's frames, or,
        read in place, the storage's first slots in slot order (the ring's order once a window has wrapped)."""
        if in_place:
            if not self.fixed_slots:
                raise ValueError("This engine's storage has no in-place attention path.")
            return list(self.slot_frames(start_frame + num_frames))
        prefix = self.prefix_frames(cache_tag, start_frame, first_chunk_frames, attention_window)
        return [*prefix, *range(start_frame, start_frame + num_frames)]

    def key_positions(
        self,
        cache_tag: str,
        start_frame: int,
        num_frames: int,
        first_chunk_frames: int,
        *,
        in_place: bool = False,
        attention_window: AttentionWindow | None = None,
    ) -> RopePositions:
        """Temporal RoPE positions of the keys a call reads (in its order) and of its queries, by the positions
        mode; a RoPE cut moves the call's own frames."""
        frames = self.key_frames(cache_tag, start_frame, num_frames, first_chunk_frames, in_place, attention_window)
        pins = self.pins(attention_window)
        positions = dict(zip(frames, self.positions.rule(frames, pins, self.rope_offset(cache_tag))))
        state = self.tags.get(cache_tag)
        if state is not None and state.rope_cut is not None:
            positions.update({start_frame + i: state.rope_cut + i for i in range(num_frames)})
        return RopePositions(
            tuple(positions[frame] for frame in frames),
            tuple(positions[frame] for frame in range(start_frame, start_frame + num_frames)),
        )

    # ------------------------------------------------------------------ the slot map
    def slot_runs(self, first: int, last: int) -> list[tuple[int, int, int]]:
        """``(frame, slot, count)`` runs covering frames ``[first, last)``: with fixed slots, frame ``f`` at slot
        ``f`` until the window wraps, then the pinned frames at their frames and every later frame at
        ``sink + (f - sink) % (window - sink)`` (a ring); otherwise slot ``f``."""
        if first >= last:
            return []
        window = self.window
        if not self.fixed_slots or window.all_seen_until(last):
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

    def slot_ranges(self, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """The slot ranges holding the frames of the ascending frame ranges ``ranges``, in frame order."""
        return [(slot, slot + count) for first, last in ranges for _, slot, count in self.slot_runs(first, last)]

    def freed_slot_ranges(self, first: int, last: int) -> list[tuple[int, int]]:
        """The slot ranges that held frames ``[first, last)`` once they are gone (a ring holds at most its last
        ``window - sink`` non-pinned frames)."""
        if first >= last:
            return []
        if self.fixed_slots and self.window.bounded and first >= self.window.sink:
            first = max(first, last - self.window.room)
        return self.slot_ranges(((first, last),))

    def evicted_slot_ranges(self, first: int, last: int) -> list[tuple[int, int]]:
        """The slot ranges an eviction of ``[first, last)`` frees: those of its unpinned frames (the sink rule's)."""
        return [
            slots
            for low, high in self.sink.unpinned_ranges(first, last)
            for slots in self.freed_slot_ranges(low, high)
        ]

    def slot_frames(self, end_frame: int) -> tuple[int, ...]:
        """The frame each of the first ``window.slots(end_frame)`` slots holds once frames ``[0, end_frame)`` have
        been written (the pinned and the most recent frames under a window)."""
        window = self.window
        if window.all_seen_until(end_frame):
            return tuple(range(end_frame))
        frames = [0] * window.frames
        for first, last in ((0, window.sink), (end_frame - window.room, end_frame)):
            for frame, slot, count in self.slot_runs(first, last):
                frames[slot : slot + count] = range(frame, frame + count)
        return tuple(frames)

    def held_slots(self, cache_tag: str) -> list[tuple[int, int]]:
        """The slot ranges holding the frames ``cache_tag`` holds now."""
        state = self.tags.get(cache_tag)
        if state is None:
            return []
        frames = [(0, state.num_frames)]
        if self.window.bounded:
            pinned = self.sink.pinned_ranges(0, state.num_frames)
            frames = sorted([*pinned, *self.sink.unpinned_ranges(state.evicted_before, state.num_frames)])
        return self.slot_ranges(frames)

    # ------------------------------------------------------------------ checks (write nothing)
    def check_call(
        self,
        cache_tag: str,
        start_frame: int,
        chunk_layout: Sequence[int],
        layout: dict[str, Any],
        attention_window: AttentionWindow | None = None,
        store_kv: bool = False,
    ) -> None:
        """Raise ``ValueError`` if a call cannot be served by what ``cache_tag`` holds (see
        :meth:`~fastgen_diffusers.kv_cache.BaseKVCacheEngine.check_call`)."""
        folds = self.sink.update == "ema"
        if attention_window is None:
            self.tags.check_call(cache_tag, self.window, start_frame, chunk_layout, layout)
            state = self.tags.get(cache_tag)
            if folds and state is not None and not state.recaching:
                check_ema_eviction(self.window, start_frame, tuple(chunk_layout), state.evicted_before, store_kv)
        else:
            if folds:
                raise ValueError(
                    "A call under its own `attention_window` evicts nothing, so it cannot fold evicted frames into an "
                    "EMA sink: use sink_update='fixed' with per-call windows."
                )
            self.tags.check_call(cache_tag, attention_window, start_frame, chunk_layout, layout, check_held=False)
            self.check_call_window(cache_tag, attention_window, start_frame, chunk_layout[0])
        state = self.tags.get(cache_tag)
        if state is not None and state.recaching and len(chunk_layout) > 1:
            # its first chunk sees the held frames only, which the block masks (frame rule) do not describe
            raise ValueError(
                f"A windowed recache of cache_tag {cache_tag!r} (see `skip_evicted`) re-runs one chunk per call; got "
                f"a call of chunks {tuple(chunk_layout)} at start_frame={start_frame}."
            )
        if self.positions.keys_before_rope and len(chunk_layout) > 1:
            window = self.window if attention_window is None else attention_window
            layout_ = tuple(chunk_layout)
            frames = self.key_frames(cache_tag, start_frame, sum(layout_), layout_[0], False, attention_window)
            check_chunk_positions(
                self.positions_name,
                window,
                frames,
                start_frame,
                layout_,
                self.rope_offset(cache_tag),
                self.pins(attention_window),
            )

    def check_call_window(
        self, cache_tag: str, attention_window: AttentionWindow, start_frame: int, first_chunk_frames: int
    ) -> None:
        """Raise ``ValueError`` unless a call attending under its own ``attention_window`` sees only held frames."""
        if not isinstance(attention_window, AttentionWindow):
            raise ValueError(
                f"`attention_window` must be an AttentionWindow or None, got {type(attention_window).__name__}."
            )
        state = self.tags.get(cache_tag)
        if state is not None:
            self.window.check_call_window(
                attention_window, start_frame, first_chunk_frames, state.evicted_before, f"cache_tag {cache_tag!r}"
            )

    # ------------------------------------------------------------------ plans (record what they decide)
    def reads_in_place(
        self,
        cache_tag: str,
        start_frame: int,
        num_frames: int,
        first_chunk_frames: int,
        attention_window: AttentionWindow | None = None,
    ) -> bool:
        """Whether the bookkeeping lets a storage with fixed slots serve the call in place: one chunk at the end of
        the cache, no windowed recache, no per-call window, no KV flush hiding frames the window would show."""
        state = self.tags.get(cache_tag)
        if state is None or start_frame != state.num_frames or first_chunk_frames != num_frames:
            return False
        # a windowed recache attends to the held frames only, a per-call window to its own frames, not the buffers'
        if state.recaching or attention_window is not None:
            return False
        # a KV flush dropped frames the window would show: gather the held ones
        return state.flushed_before <= self.window.visible(start_frame, num_frames)[1]

    def begin_call(
        self,
        cache_tag: str,
        start_frame: int,
        first_chunk_frames: int,
        attention_window: AttentionWindow | None = None,
    ) -> Eviction | None:
        """Record what a call about to run evicts (its window's non-pinned frames before it) and return it, with
        the sink rule's fold (none inside a windowed recache); a call under its own window evicts nothing."""
        state = self.tags.get(cache_tag)
        if not self.window.bounded or state is None or attention_window is not None:
            return None
        _, recent_start = self.window.visible(start_frame, first_chunk_frames)
        unpinned = self.sink.unpinned_ranges(state.evicted_before, recent_start)
        if not unpinned:
            return None
        first = unpinned[0][0]
        fold = None if state.recaching else self.sink.fold(first, recent_start)
        state.evicted_before = recent_start
        return Eviction(first, recent_start, fold)

    def store_window(self, cache_tag: str, start_frame: int, end_frame: int) -> list[tuple[int, int]]:
        """Frame ranges of a store of ``[start_frame, end_frame)`` that the engine keeps; records what the window
        evicts (idempotent: every block's store asks)."""
        state = self.tags[cache_tag]
        if self.window.bounded:
            # frames >= start_frame are replaced by this store; the window then evicts what precedes recent_start
            recent_start = self.window.recent_start(end_frame)
            state.evicted_before = max(min(state.evicted_before, start_frame), recent_start)
        return self.kept_ranges(start_frame, end_frame)

    def kept_ranges(self, start_frame: int, end_frame: int) -> list[tuple[int, int]]:
        """The parts of a store of ``[start_frame, end_frame)`` the engine keeps: its pinned frames and the frames a
        window still shows after it (:meth:`AttentionWindow.recent_start`), as ascending ranges."""
        if not self.window.bounded:
            return [(start_frame, end_frame)]
        recent = min(max(start_frame, self.window.recent_start(end_frame)), end_frame)
        pinned = self.sink.pinned_ranges(start_frame, recent)
        if pinned and pinned[-1][1] == recent:
            return [*pinned[:-1], (pinned[-1][0], end_frame)] if recent < end_frame else pinned
        return [*pinned, (recent, end_frame)] if recent < end_frame else pinned

    def commit_store(
        self, cache_tag: str, start_frame: int, num_frames: int, chunk_layout: Sequence[int] | None = None
    ) -> None:
        """Record that frames ``[start_frame, start_frame + num_frames)`` exist, as the chunks ``chunk_layout``."""
        self.tags.record_store(cache_tag, start_frame, num_frames, chunk_layout)
        if self.window.bounded:
            self.tags[cache_tag].forget_evicted_chunks(self.window.sink, self.sink.pinned)

    # ------------------------------------------------------------------ edits (return the frames they drop)
    def truncate(self, cache_tag: str, end_frame: int) -> tuple[int, int] | None:
        """Record that every frame ``>= end_frame`` is gone; the frames dropped, or ``None``. Under a rule that is
        not a prefix, only at a stored chunk start (past the first chunk after the sink, later pinned frames may be
        held: ``ValueError`` before any change)."""
        state = self.tags.get(cache_tag)
        if (
            not self.sink.prefix
            and state is not None
            and end_frame < state.num_frames
            and end_frame not in state.chunk_starts
        ):
            raise ValueError(
                f"Cannot truncate cache_tag {cache_tag!r} at frame {end_frame}: under {type(self.sink).__name__} a "
                f"truncation must fall on a stored chunk start, {state.chunk_starts}."
            )
        if not self.tags.check_truncate(cache_tag, end_frame, self.window.sink):
            return None
        dropped = (end_frame, self.tags[cache_tag].num_frames)
        self.tags.truncate(cache_tag, end_frame)
        return dropped

    def skip_evicted(self, cache_tag: str, resume_frame: int) -> tuple[int, int]:
        """Open a windowed recache (see :meth:`~fastgen_diffusers.kv_cache.BaseKVCacheEngine.skip_evicted`); the
        non-pinned frames it drops. Needs the prefix sink rule (``ValueError`` before any change)."""
        self.sink.require_prefix("A windowed recache (`skip_evicted`)")
        state = self.tags[cache_tag]
        if resume_frame < state.num_frames:
            raise ValueError(f"Cannot skip to frame {resume_frame}: cache_tag {cache_tag!r} holds {state.num_frames}.")
        if not self.window.bounded or resume_frame <= self.window.sink:
            raise ValueError("A windowed recache needs a window and a resume frame past the sink.")
        if state.num_frames < resume_frame and state.num_frames not in state.chunk_starts:
            # the skipped frames count as one stored chunk, so that a later recache may truncate there again
            state.chunk_starts.append(state.num_frames)
        state.num_frames = resume_frame
        state.evicted_before = max(state.evicted_before, resume_frame)
        state.recaching = True
        return self.window.sink, resume_frame

    def end_recache(self, cache_tag: str) -> None:
        state = self.tags.get(cache_tag)
        if state is not None:
            state.recaching = False

    def flush(self, cache_tag: str, keep_frames: int) -> tuple[int, int] | None:
        """KV flush: keep only the pinned (the sink rule's) and the last ``keep_frames`` stored frames; the range
        whose unpinned frames drop (an eviction's, :meth:`evicted_slot_ranges`), or ``None``."""
        state = self.tags.get(cache_tag)
        if state is None:
            return None
        if not self.window.bounded:
            raise ValueError("A KV flush keeps the sink and the last frames: it needs an engine with `window_frames`.")
        first = next(f for f in itertools.count() if not self.sink.pinned(f))  # the first frame a flush may drop
        before = max(state.num_frames - keep_frames, first, state.evicted_before)
        if before <= state.evicted_before:
            return None
        state.evicted_before = state.flushed_before = before
        return first, before

    def set_rope_cut(self, cache_tag: str, position: int | None) -> None:
        if position is not None and not self.positions.keys_before_rope:
            raise ValueError(
                "A RoPE cut moves the call's frames to other positions at read time: it needs keys stored before "
                f"RoPE (rope_positions='window'), got rope_positions={self.positions_name!r}."
            )
        state = self.tags.get(cache_tag)
        if state is not None:
            state.rope_cut = position
