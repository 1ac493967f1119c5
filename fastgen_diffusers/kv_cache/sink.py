"""The sink rule: which frames an engine pins (keeps and attends to for ever) and how it updates them.

Every module that needs the pinned frames asks one :class:`SinkRule`, which the engine's ledger owns
(:mod:`~fastgen_diffusers.kv_cache.ledger`): the ledger's plan of a call (the frames its keys read, in order), the
masks (which key a query sees), the key positions (the ``"anchor"`` mode moves the pinned frames), the eviction and
the EMA fold, and the KV-cache attention bias (the anchor frame it spares). None of them restates the rule as
``range(sink)``; a new rule is a subclass overriding :meth:`SinkRule.pinned_frames` (and, when it keeps the pinned
frames elsewhere than at the front of the video, the slot map of a storage with fixed slots). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .window import AttentionWindow

__all__ = ["SegmentSinkRule", "SinkRule", "frame_ranges", "sink_rule_of"]


@dataclass(frozen=True)
class SinkRule:
    """Which frames are pinned in the cache (kept and attended to for ever) and how they are updated.

    Attributes:
        frames: the pinned frames are the first ``frames`` latent frames of the video (an engine's ``sink_frames``).
        update: ``"fixed"`` (a pinned frame keeps the K/V it was stored with) or ``"ema"`` (Reward Forcing: frames
            leaving the window are folded into the pinned ones, ``sink = decay * sink + (1 - decay) * evicted``).
        decay: the EMA's decay.
    """

    frames: int = 0
    update: str = "fixed"
    decay: float = 0.999

    anchor: ClassVar[int] = 0  # the frame a KV-cache attention bias spares: the video's first latent frame
    at_front: ClassVar[bool] = True  # the pinned frames are the video's first: a ring of fixed slots keeps them first
    prefix: ClassVar[bool] = True  # the pinned frames are exactly the first ``frames`` (see :meth:`require_prefix`)

    # ------------------------------------------------------------------ which frames
    def pinned(self, frame: int) -> bool:
        """Whether ``frame`` is pinned."""
        return frame < self.frames

    def pinned_frames(self, end_frame: int) -> tuple[int, ...]:
        """The pinned frames before ``end_frame``, ascending."""
        return tuple(range(min(self.frames, end_frame)))

    def count_before(self, frame: int) -> int:
        """How many pinned frames precede ``frame`` (a pinned frame's rank among the pinned ones)."""
        return min(self.frames, frame)

    def pinned_ranges(self, first: int, last: int) -> list[tuple[int, int]]:
        """The pinned frames of ``[first, last)`` as ascending ``[first, last)`` ranges."""
        return frame_ranges(frame for frame in self.pinned_frames(last) if frame >= first)

    def unpinned_ranges(self, first: int, last: int) -> list[tuple[int, int]]:
        """The frames of ``[first, last)`` that are not pinned (what an eviction may drop), as ascending ranges."""
        first = max(first, self.frames)
        return [(first, last)] if first < last else []

    def pinned_range(self, num_frames: int) -> tuple[int, int]:
        """The pinned frames among the first ``num_frames``, as ``[first, last)``."""
        return 0, min(self.frames, num_frames)

    def sees(self, window: AttentionWindow, key_frame: int, chunk_end: int) -> bool:
        """Whether a query of the chunk ending at ``chunk_end`` sees key frame ``key_frame`` under ``window``: an
        earlier frame that is pinned or among the window's most recent ``window.room`` frames."""
        if key_frame >= chunk_end:
            return False
        return not window.bounded or self.pinned(key_frame) or key_frame >= chunk_end - window.room

    def require_prefix(self, operation: str) -> None:
        """``ValueError`` unless the pinned frames are the video's first ``frames`` (:attr:`prefix`): ``operation``
        keeps or drops "the sink" as the first frames, which a rule pinning other frames would get wrong."""
        if not self.prefix:
            raise ValueError(
                f"{operation} treats the pinned frames as the video's first ones: it needs the prefix rule SinkRule, "
                f"got {self!r}."
            )

    # ------------------------------------------------------------------ how they are updated
    def fold(self, first: int, last: int) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """Where the evicted frames ``[first, last)`` go: ``(pinned frames, evicted frames)`` ranges the EMA blends
        one to one, or ``None`` when the rule keeps its pinned frames as stored."""
        if self.update != "ema":
            return None
        return (0, last - first), (first, last)


@dataclass(frozen=True)
class SegmentSinkRule(SinkRule):
    """Pins the first ``frames`` frames of every segment (e.g. prompt segment) starting at a frame of ``starts``.

    Fixed only (the EMA fold blends the frames at the front of the video), and only over a storage without fixed
    slots (a ring keeps its pinned frames first). Not a prefix (:meth:`SinkRule.require_prefix`): a call under its
    own attention window, a windowed recache and a recache keeping the sink refuse it; a truncation must fall on a
    stored chunk start.
    """

    starts: tuple[int, ...] = (0,)

    at_front: ClassVar[bool] = False
    prefix: ClassVar[bool] = False

    def __post_init__(self) -> None:
        starts = self.starts
        if not all(isinstance(s, int) and s >= 0 for s in starts) or any(
            b < a + self.frames for a, b in zip(starts, starts[1:])
        ):
            raise ValueError(
                f"`starts` must be ascending frames >= 0, at least frames={self.frames} apart, got {starts!r}."
            )
        if self.update != "fixed":
            raise ValueError(f"`update` of a SegmentSinkRule must be 'fixed', got {self.update!r}.")
        if starts and starts[0] != 0:  # the window shows its first `sink` frames as the sink (AttentionWindow.visible)
            raise ValueError(f"`starts` of a SegmentSinkRule must begin at frame 0, got {starts!r}.")

    def pinned(self, frame: int) -> bool:
        return any(start <= frame < start + self.frames for start in self.starts)

    def pinned_frames(self, end_frame: int) -> tuple[int, ...]:
        return tuple(f for start in self.starts for f in range(start, min(start + self.frames, end_frame)))

    def count_before(self, frame: int) -> int:
        return len(self.pinned_frames(frame))

    def unpinned_ranges(self, first: int, last: int) -> list[tuple[int, int]]:
        return frame_ranges(f for f in range(first, last) if not self.pinned(f))


def frame_ranges(frames) -> list[tuple[int, int]]:
    """Ascending frames as ``[first, last)`` ranges of consecutive frames."""
    ranges: list[tuple[int, int]] = []
    for frame in frames:
        if ranges and ranges[-1][1] == frame:
            ranges[-1] = (ranges[-1][0], frame + 1)
        else:
            ranges.append((frame, frame + 1))
    return ranges


def sink_rule_of(pins: SinkRule | AttentionWindow) -> SinkRule:
    """``pins`` itself, or the fixed rule of a window's sink frames (a call attending under its own window)."""
    return pins if isinstance(pins, SinkRule) else SinkRule(pins.sink)
