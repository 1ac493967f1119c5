"""Temporal RoPE positions of the keys an engine returns: one small rule per positions mode.

An engine built with ``rope_positions="absolute"`` (the default) stores self-attention keys after RoPE, rotated for
their frame's absolute temporal position (minus any re-basing offset): nothing is rotated at read time. Any other mode
stores keys **before** RoPE (after ``norm_k``) and the model rotates every key the attention reads at the position
its mode gives it, and the call's queries at the positions of the call's own frames:

* ``"window"`` (Reward Forcing): positions are slots of the visible window in frame order: the keys
  ``[sink | recent frames | this call]`` sit at ``0 .. k-1``, so the sink sits right before the recent frames, the
  call's queries at ``k - F .. k-1``, and no position ever reaches the window size (a stream never leaves the RoPE
  table and never needs re-basing).
* ``"anchor"`` (Rolling Forcing): every key at its absolute frame except the pinned frames (the anchor), which sit
  right before the oldest unpinned frame attended, in order; with nothing else cached they stay where they are.

A mode is a function ``(frames, pins, rope_offset) -> positions``: ``frames`` are the absolute latent frames of the
keys in the order the engine's ledger plans them (its prefix, then the call's own frames, or the static engine's slot
order on its in-place path), ``pins`` the ledger's :class:`~fastgen_diffusers.kv_cache.sink.SinkRule` (which of them
are pinned), the result one temporal position per frame. A new mode is one function here (:data:`POSITION_RULES`)
and its flags in :data:`fastgen_diffusers.settings.cache.KEY_POSITIONS`; :data:`ROPE_POSITION_MODES` pairs them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..settings.cache import KEY_POSITIONS
from .sink import SinkRule, sink_rule_of
from .window import AttentionWindow

PositionRule = Callable[[Sequence[int], SinkRule, int], list[int]]


def absolute_positions(frames: Sequence[int], pins: SinkRule, rope_offset: int) -> list[int]:
    """Every key at its frame's position, ``frame - rope_offset`` (the keys stored after RoPE are rotated so)."""
    return [frame - rope_offset for frame in frames]


def window_positions(frames: Sequence[int], pins: SinkRule, rope_offset: int) -> list[int]:
    """Every key at its rank among the attended frames in frame order (slots of ``[sink | recent | call]``)."""
    rank = {frame: slot for slot, frame in enumerate(sorted(frames))}
    return [rank[frame] for frame in frames]


def anchor_positions(frames: Sequence[int], pins: SinkRule | AttentionWindow, rope_offset: int) -> list[int]:
    """Every key at ``frame - rope_offset``, except the pinned frames (``pins``: the sink rule, or a window's sink):
    they are moved to sit right before the oldest unpinned frame attended, in the order of the rule's pinned frames
    (the anchor re-rotated to the front of the window)."""
    pins = sink_rule_of(pins)
    oldest = min((frame for frame in frames if not pins.pinned(frame)), default=None)
    if oldest is None:  # nothing but pinned frames: they stay where they are
        return [frame - rope_offset for frame in frames]
    front = oldest - pins.count_before(oldest)
    return [(front + pins.count_before(frame) if pins.pinned(frame) else frame) - rope_offset for frame in frames]


@dataclass(frozen=True)
class RopePositionMode:
    """One value of an engine's ``rope_positions``.

    Attributes:
        rule: ``(frames, pins, rope_offset) -> positions`` (see the module docstring).
        keys_before_rope: whether the engine stores keys un-rotated (rotated at read time by ``rule``).
        needs_window: whether the mode is only defined with a sliding window (``window_frames``).
        bounded: whether every position stays below the window size, so that a stream of any length stays inside
            the RoPE table (no re-basing, no limit on the video's length).
    """

    rule: PositionRule
    keys_before_rope: bool
    needs_window: bool = False
    bounded: bool = False


POSITION_RULES: dict[str, PositionRule] = {
    "absolute": absolute_positions,
    "window": window_positions,
    "anchor": anchor_positions,
}

# the flags of each mode are the settings' (KEY_POSITIONS, which the options are checked against); the rule is here
ROPE_POSITION_MODES: dict[str, RopePositionMode] = {
    name: RopePositionMode(POSITION_RULES[name], **flags._asdict()) for name, flags in KEY_POSITIONS.items()
}


@dataclass(frozen=True)
class RopePositions:
    """Temporal RoPE positions of one call (see :meth:`BaseKVCacheEngine.key_positions`).

    Attributes:
        keys: one position per key frame, in the order the engine returns the keys (``[visible prefix | call]``, or
            the static engine's slot order on its in-place path).
        queries: one position per frame of the call, in frame order.
    """

    keys: tuple[int, ...]
    queries: tuple[int, ...]


def check_chunk_positions(
    mode_name: str,
    window: AttentionWindow,
    frames: Sequence[int],
    start_frame: int,
    chunk_layout: Sequence[int],
    rope_offset: int = 0,
    pins: SinkRule | None = None,
) -> None:
    """Raise ``ValueError`` unless a call of several chunks gives every chunk the key positions of a call of that chunk
    alone, under positions mode ``mode_name`` (keys stored before RoPE).

    A call rotates the keys it attends to once, by the positions the mode gives ``frames`` (the keys of its first
    chunk: visible prefix and the call's frames, in any order); a later chunk attends to a subset of them (the mask).
    RoPE sees only differences of positions, so the call is exact iff, for every chunk, those positions of the keys it
    sees differ by one constant from the positions the mode gives them alone. ``"window"`` and ``"anchor"`` position
    keys by the frames attended, so once the window slides inside the call (a later chunk no longer sees some frames
    the first one sees) they differ: refused rather than a silently different result.
    """
    rule = ROPE_POSITION_MODES[mode_name].rule
    pins = sink_rule_of(window if pins is None else pins)
    in_call = dict(zip(frames, rule(frames, pins, rope_offset)))
    chunk_start = start_frame
    for chunk_frames in chunk_layout:
        chunk_end = chunk_start + chunk_frames
        seen = [frame for frame in frames if pins.sees(window, frame, chunk_end)]
        alone = rule(seen, pins, rope_offset)
        if len({in_call[frame] - position for frame, position in zip(seen, alone)}) > 1:
            raise ValueError(
                f"`rope_positions={mode_name!r}` positions keys by the frames a chunk attends to, and a call rotates "
                f"its keys once: in this call of chunks {tuple(chunk_layout)} at start_frame={start_frame}, the chunk "
                f"at latent frame {chunk_start} attends to a different window (window_frames={window.frames}, "
                f"sink_frames={window.sink}) than the first chunk, so its keys would sit at other positions than in a "
                "call of that chunk alone. Run one chunk per call once the window slides, make the call one chunk "
                "(`chunk_layout=(F,)`), or use rope_positions='absolute'."
            )
        chunk_start = chunk_end
