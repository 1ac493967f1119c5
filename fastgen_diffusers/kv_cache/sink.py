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

__all__ = ["SinkRule", "sink_rule_of"]


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

    def pinned_range(self, num_frames: int) -> tuple[int, int]:
        """The pinned frames among the first ``num_frames``, as ``[first, last)``."""
        return 0, min(self.frames, num_frames)

    def sees(self, window: AttentionWindow, key_frame: int, chunk_end: int) -> bool:
        """Whether a query of the chunk ending at ``chunk_end`` sees key frame ``key_frame`` under ``window``: an
        earlier frame that is pinned or among the window's most recent ``window.room`` frames."""
        if key_frame >= chunk_end:
            return False
        return not window.bounded or self.pinned(key_frame) or key_frame >= chunk_end - window.room

    # ------------------------------------------------------------------ how they are updated
    def fold(self, first: int, last: int) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """Where the evicted frames ``[first, last)`` go: ``(pinned frames, evicted frames)`` ranges the EMA blends
        one to one, or ``None`` when the rule keeps its pinned frames as stored."""
        if self.update != "ema":
            return None
        return (0, last - first), (first, last)


def sink_rule_of(pins: SinkRule | AttentionWindow) -> SinkRule:
    """``pins`` itself, or the fixed rule of a window's sink frames (a call attending under its own window)."""
    return pins if isinstance(pins, SinkRule) else SinkRule(pins.sink)
