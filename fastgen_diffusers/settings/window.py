"""``AttentionWindow``: the one statement of the sliding-window and sink rule.

Self-Forcing's ``local_attn_size`` / ``sink_size``: a chunk of latent frames ``[s, e)`` attends to at most ``frames``
latent frames in total, counting its own frames and the first ``sink`` frames of the video, which are never evicted.
It sees frame ``k`` iff ``k < e`` and (``k < sink`` or ``k >= e - (frames - sink)``). Everything else follows:

* the cached frames a call's first chunk sees (:meth:`AttentionWindow.visible`); later chunks of a multi-chunk call
  see a subset of that prefix;
* a chunk must see all of its own frames, so its non-sink frames must fit ``frames - sink``
  (:meth:`AttentionWindow.check_chunks`). Sink frames of a chunk do not count: with ``sink=3`` and ``frames=4`` the
  chunk ``[0, 3)`` fits (every frame of it is a sink frame), ``[3, 6)`` does not;
* what a cache keeps: the sink and, after a store ending at ``e``, the frames from :meth:`AttentionWindow.recent_start`
  on (:meth:`AttentionWindow.kept_ranges`, :meth:`AttentionWindow.held_frames`).

Engines (eviction, slots), masks (which key a query sees) and pipelines (layout checks before any work) all ask
this value; none restates the rule. The EMA eviction rule of ``sink_update="ema"`` (:func:`check_ema_eviction`) is
stated here too, once: it is a rule of the window alone.
``AttentionWindow()`` (``frames=None``) is no window: every earlier frame is seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def _check_settings(frames: Any, sink: Any, frames_name: str, sink_name: str) -> None:
    if frames is not None and (isinstance(frames, bool) or not isinstance(frames, int) or frames < 1):
        raise ValueError(f"`{frames_name}` must be None or a positive number of latent frames, got {frames!r}.")
    if isinstance(sink, bool) or not isinstance(sink, int) or sink < 0:
        raise ValueError(f"`{sink_name}` must be a number of latent frames >= 0, got {sink!r}.")
    if sink and frames is None:
        raise ValueError(f"`{sink_name}={sink}` needs a sliding window: set `{frames_name}` as well.")
    if frames is not None and sink >= frames:
        raise ValueError(
            f"`{sink_name}` must leave room in the window for the chunk itself: got {sink_name}={sink} with "
            f"{frames_name}={frames} (expected {sink_name} < {frames_name})."
        )


@dataclass(frozen=True)
class AttentionWindow:
    """A sliding attention window of ``frames`` latent frames whose first ``sink`` frames are kept for ever.

    Args:
        frames: latent frames a chunk attends to at most, its own frames and the sink included; ``None``: no window.
        sink: the first latent frames of the video, kept and attended to by every chunk (needs ``frames``).
    """

    frames: int | None = None
    sink: int = 0

    def __post_init__(self) -> None:
        _check_settings(self.frames, self.sink, "attention_window", "sink_frames")

    @classmethod
    def from_arguments(
        cls,
        frames: Any,
        sink: Any = 0,
        *,
        frames_name: str = "attention_window",
        sink_name: str = "sink_frames",
    ) -> AttentionWindow:
        """Build from user arguments; a bad value is a ``ValueError`` naming the caller's argument names."""
        _check_settings(frames, sink, frames_name, sink_name)
        return cls(frames, sink)

    # ------------------------------------------------------------------ the rule
    @property
    def bounded(self) -> bool:
        """Whether frames ever leave the window."""
        return self.frames is not None

    @property
    def room(self) -> int | None:
        """Frames of the window left for non-sink frames (a chunk's own and the most recent others)."""
        return None if self.frames is None else self.frames - self.sink

    def recent_start(self, chunk_end: int) -> int:
        """First non-sink frame a chunk ending at ``chunk_end`` sees (0 without a window)."""
        if self.frames is None:
            return 0
        return max(self.sink, chunk_end - self.room)

    def sees(self, key_frame, chunk_end):
        """Whether a query of the chunk ending at ``chunk_end`` sees key frame ``key_frame`` (ints or tensors)."""
        before_end = key_frame < chunk_end
        if self.frames is None:
            return before_end
        return before_end & ((key_frame < self.sink) | (key_frame >= chunk_end - self.room))

    def visible(self, start_frame: int, first_chunk_frames: int) -> tuple[int, int]:
        """``(sink_end, recent_start)``: the cached frames a call at ``start_frame`` whose first chunk has
        ``first_chunk_frames`` frames sees are ``[0, sink_end)`` and ``[recent_start, start_frame)``.

        ``(0, 0)`` without a window (every frame before ``start_frame``).
        """
        if self.frames is None:
            return 0, 0
        sink_end = min(self.sink, start_frame)
        recent_start = start_frame + first_chunk_frames - self.room
        return sink_end, min(max(sink_end, recent_start), start_frame)

    def visible_frames(self, start_frame: int, first_chunk_frames: int) -> int:
        """How many cached frames the first chunk of a call at ``start_frame`` sees."""
        sink_end, recent_start = self.visible(start_frame, first_chunk_frames)
        return sink_end + start_frame - recent_start

    def all_seen_until(self, end_frame: int) -> bool:
        """Whether every frame before ``end_frame`` is still inside the window (nothing has left it yet)."""
        return self.frames is None or end_frame <= self.frames

    def slots(self, frames: int) -> int:
        """Frame slots a cache needs to hold ``frames`` frames (at most the window)."""
        return frames if self.frames is None else min(frames, self.frames)

    # ------------------------------------------------------------------ what a cache keeps
    def kept_ranges(self, start_frame: int, end_frame: int) -> list[tuple[int, int]]:
        """The parts of a store of frames ``[start_frame, end_frame)`` that a cache keeps (the sink and the frames
        from :meth:`recent_start` on), as ascending ``[first, last)`` ranges."""
        if self.frames is None:
            return [(start_frame, end_frame)]
        ranges = []
        if start_frame < self.sink:
            ranges.append((start_frame, min(end_frame, self.sink)))
        first_recent = max(start_frame, self.recent_start(end_frame))
        if first_recent < end_frame:
            if ranges and ranges[-1][1] == first_recent:
                ranges[-1] = (ranges[-1][0], end_frame)
            else:
                ranges.append((first_recent, end_frame))
        return ranges

    def held_frames(self, num_frames: int, evicted_before: int) -> int:
        """Frames held of ``num_frames`` stored when the non-sink frames before ``evicted_before`` are evicted."""
        if self.frames is None:
            return num_frames
        sink_held = min(self.sink, num_frames)
        return sink_held + max(0, num_frames - max(self.sink, evicted_before))

    # ------------------------------------------------------------------ checks
    def non_sink_frames(self, chunk_start: int, chunk_end: int) -> int:
        """Frames of the chunk ``[chunk_start, chunk_end)`` that are not sink frames."""
        return max(0, chunk_end - max(chunk_start, self.sink))

    def check_chunks(self, chunk_bounds: Sequence[tuple[int, int]]) -> None:
        """Raise ``ValueError`` unless every chunk ``[start, end)`` sees all of its own frames (its non-sink frames
        fit :attr:`room`)."""
        if self.frames is None:
            return
        for start, end in chunk_bounds:
            own = self.non_sink_frames(start, end)
            if own > self.room:
                raise ValueError(
                    f"The chunk of latent frames [{start}, {end}) does not fit the attention window: "
                    f"`attention_window={self.frames}` with `sink_frames={self.sink}` leaves {self.room} frames for "
                    f"a chunk's own non-sink frames, this chunk has {own}. Use an `attention_window` of at least "
                    f"{own + self.sink} (or smaller chunks)."
                )

    def check_layout(self, start_frame: int, chunk_layout: Sequence[int]) -> None:
        """:meth:`check_chunks` for a call at ``start_frame`` split into chunks of ``chunk_layout`` frames."""
        bounds, start = [], start_frame
        for frames in chunk_layout:
            bounds.append((start, start + frames))
            start += frames
        self.check_chunks(bounds)

    def check_held(
        self, start_frame: int, first_chunk_frames: int, evicted_before: int, what: str = "the cache"
    ) -> None:
        """Raise ``ValueError`` when the first chunk of a call at ``start_frame`` sees frames that ``what`` no longer
        holds (its non-sink frames before ``evicted_before`` are evicted)."""
        _, recent_start = self.visible(start_frame, first_chunk_frames)
        if recent_start < start_frame and recent_start < evicted_before:
            raise ValueError(
                f"A call at start_frame={start_frame} whose first chunk has {first_chunk_frames} frames attends to "
                f"cached frames [{recent_start}, {start_frame}) of {what}, but the attention window "
                f"(attention_window={self.frames}, sink_frames={self.sink}) no longer holds the frames before "
                f"{evicted_before}. Re-run the rollout from an earlier stored frame."
            )

    def check_call_window(
        self,
        call_window: AttentionWindow,
        start_frame: int,
        first_chunk_frames: int,
        evicted_before: int,
        what: str = "the cache",
    ) -> None:
        """Raise ``ValueError`` unless the first chunk of a call at ``start_frame`` attending under its own
        ``call_window`` sees only frames that ``what``, holding under this window (the *holding* window), still holds
        (the sink, and the non-sink frames from ``evicted_before`` on). Without a holding window every frame is
        held."""
        if self.frames is None:
            return
        if not call_window.bounded:
            raise ValueError(
                "An unbounded `attention_window` attends to every earlier frame, but the engine holds only its "
                f"window (window_frames={self.frames}, sink_frames={self.sink}); give the call a bounded window "
                "within it."
            )
        held_from = max(self.sink, evicted_before)  # non-sink frames before it are gone
        sink_end, recent_start = call_window.visible(start_frame, first_chunk_frames)
        for first, last in ((0, sink_end), (recent_start, start_frame)):
            gone_first, gone_last = max(first, self.sink), min(last, held_from)
            if gone_first < gone_last:
                raise ValueError(
                    f"A call at start_frame={start_frame} under attention_window={call_window.frames} "
                    f"(sink {call_window.sink}) attends to frames [{gone_first}, {gone_last}) that {what} no longer "
                    f"holds (the engine's window_frames={self.frames}, sink_frames={self.sink} keeps the sink and the "
                    f"frames from {held_from} on). Give the engine a window holding every frame its calls attend to."
                )


def check_ema_eviction(
    window: AttentionWindow, start_frame: int, chunk_layout: Sequence[int], evicted_before: int, store_kv: bool
) -> int:
    """Raise ``ValueError`` unless the EMA sink can take what a call evicts; returns the new ``evicted_before``.

    ``sink_update="ema"`` folds the frames a call evicts when it begins into the sink frame by frame, so every
    eviction must remove exactly ``sink`` frames (Reward Forcing: chunks of the sink's size), and a store of several
    chunks must not evict more when it ends. A different count is refused rather than guessed (Reward Forcing's code
    would copy the evicted frames over the sink then, a case its released setting never reaches).
    """
    _, recent_start = window.visible(start_frame, chunk_layout[0])
    first = max(window.sink, evicted_before)
    evicted = recent_start - first
    if 0 < evicted != window.sink:
        raise ValueError(
            f"`sink_update='ema'` folds the frames leaving the window into the sink frame by frame, so every eviction "
            f"must remove exactly sink_frames={window.sink} frames; the chunk at latent frame {start_frame} evicts "
            f"{evicted} (frames [{first}, {recent_start})). Use chunks of {window.sink} frames (a latent frame count "
            "that is a multiple of them, so that no chunk absorbs a remainder) with the window minus the sink a "
            "multiple of them (Reward Forcing: chunks of 3, window 9, sink 3), or sink_update='fixed'."
        )
    end_frame = start_frame + sum(chunk_layout)
    if store_kv and len(chunk_layout) > 1 and window.recent_start(end_frame) > max(first, recent_start):
        raise ValueError(
            f"`sink_update='ema'` updates the sink when a call begins; a store of several chunks "
            f"({tuple(chunk_layout)} frames at latent frame {start_frame}) would evict more frames when it ends. "
            "Store one chunk per call once the window slides, or use sink_update='fixed'."
        )
    return max(evicted_before, recent_start)


def check_ema_chunks(window: AttentionWindow, chunk_bounds: Sequence[tuple[int, int]]) -> None:
    """:func:`check_ema_eviction` for a rollout of one-chunk calls ``chunk_bounds`` (checked before any work)."""
    evicted_before = 0
    for start, end in chunk_bounds:
        evicted_before = check_ema_eviction(window, start, (end - start,), evicted_before, store_kv=True)
