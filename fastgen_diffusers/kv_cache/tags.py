"""Tag bookkeeping: what each cache tag holds (layout, stored chunks, window position), apart from the tensors.

As llama.cpp keeps its cells (which position is where) apart from the K/V storage, an engine's ledger
(:mod:`~fastgen_diffusers.kv_cache.ledger`) keeps one :class:`TagTable` that answers every question about frames and
boundaries; the storage only holds tensors. Torch-free, like the ledger.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .window import AttentionWindow

if TYPE_CHECKING:  # the bookkeeping imports no torch; layouts name a dtype and a device
    import torch


@dataclass
class TagState:
    """Layout and stored frames of one cache tag, shared by all blocks of an engine."""

    batch_size: int
    frame_seqlen: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    chunk_starts: list[int] = field(default_factory=list)  # start frame of every stored chunk, ascending
    num_frames: int = 0  # frames stored so far ("ever stored" for windowed engines)
    evicted_before: int = 0  # windowed engines: the non-sink frames before it are no longer held
    rope_offset: int = 0  # cached keys are rotated for temporal positions ``frame - rope_offset`` (RoPE re-basing)
    recaching: bool = False  # a windowed recache is open: its calls attend to the held frames only (see skip_evicted)
    flushed_before: int = 0  # a KV flush dropped the non-sink frames before it: calls attend to the held frames
    rope_cut: int | None = None  # a scene cut: the calls' own frames sit at temporal positions rope_cut, +1, ...

    def layout(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "frame_seqlen": self.frame_seqlen,
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "device": self.device,
        }

    def copy(self) -> TagState:
        return dataclasses.replace(self, chunk_starts=list(self.chunk_starts))

    def forget_evicted_chunks(self, sink_frames: int, pinned: Callable[[int], bool] | None = None) -> None:
        """Drop the starts of the chunks a window has evicted whole, so that a long windowed stream keeps
        O(window) of them: no call can start there any more, and a truncation there cuts no held chunk
        (:meth:`truncatable`). Kept: the sink's chunks, the chunks starting at a frame ``pinned`` says is pinned (a
        sink rule's later pinned frames), the first start after the sink (where a recache truncates), and the chunks
        from the one holding ``evicted_before`` on."""
        if self.evicted_before <= sink_frames:
            return
        starts = self.chunk_starts
        after_sink = next((s for s in starts if s >= sink_frames), None)
        held_from = max((s for s in starts if s <= self.evicted_before), default=0)
        self.chunk_starts = [
            s for s in starts if s < sink_frames or s == after_sink or s >= held_from or (pinned and pinned(s))
        ]

    def truncatable(self, end_frame: int, sink_frames: int) -> bool:
        """Whether a truncation at ``end_frame`` leaves no held frame whose K/V saw a dropped frame: at a stored chunk
        start, or from the first chunk after the sink's up to ``evicted_before``, where every frame before it but the
        sink's is evicted (a window forgets the chunk starts there, :meth:`forget_evicted_chunks`, yet a rewind may
        go back to them: the tag then holds the sink only)."""
        if end_frame in self.chunk_starts:
            return True
        after_sink = next((s for s in self.chunk_starts if s >= sink_frames), None)
        return after_sink is not None and after_sink <= end_frame <= self.evicted_before


class TagTable:
    """The :class:`TagState` of every cache tag of one engine, and the rules about frames and chunk boundaries."""

    def __init__(self) -> None:
        self._states: dict[str, TagState] = {}

    # ------------------------------------------------------------------ mapping
    def get(self, cache_tag: str) -> TagState | None:
        return self._states.get(cache_tag)

    def __getitem__(self, cache_tag: str) -> TagState:
        return self._states[cache_tag]

    def __contains__(self, cache_tag: object) -> bool:
        return cache_tag in self._states

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TagTable) and self._states == other._states

    def items(self):
        return self._states.items()

    def num_frames(self, cache_tag: str) -> int:
        state = self._states.get(cache_tag)
        return 0 if state is None else state.num_frames

    # ------------------------------------------------------------------ edits
    def create(self, cache_tag: str, **layout: Any) -> TagState:
        state = self._states[cache_tag] = TagState(**layout)
        return state

    def set(self, cache_tag: str, state: TagState | None) -> None:
        """Put ``state`` (``None``: no state) under ``cache_tag``; restores a snapshot."""
        if state is None:
            self._states.pop(cache_tag, None)
        else:
            self._states[cache_tag] = state

    def remove(self, cache_tag: str | None = None) -> None:
        """Forget ``cache_tag`` (every tag when ``None``)."""
        if cache_tag is None:
            self._states = {}
        else:
            self._states.pop(cache_tag, None)

    def copy_tag(self, source_tag: str, target_tag: str) -> None:
        self._states[target_tag] = self._states[source_tag].copy()

    # ------------------------------------------------------------------ rules
    def check_call(
        self,
        cache_tag: str,
        window: AttentionWindow,
        start_frame: int,
        chunk_layout: Sequence[int],
        layout: dict[str, Any],
        check_held: bool = True,
    ) -> None:
        """Raise ``ValueError`` if a call at ``start_frame`` split into ``chunk_layout`` with entries of ``layout``
        (:meth:`TagState.layout`) cannot be served by what ``cache_tag`` holds. ``check_held=False`` leaves the check
        that ``window`` sees only held frames to the caller (a call attending under its own window)."""
        if start_frame < 0:
            raise ValueError(f"`start_frame` must be >= 0, got {start_frame}.")
        window.check_layout(start_frame, chunk_layout)
        state = self._states.get(cache_tag)
        stored = 0 if state is None else state.num_frames
        if start_frame > stored:
            raise ValueError(
                f"`start_frame={start_frame}` leaves a hole: cache_tag {cache_tag!r} holds frames [0, {stored}) only. "
                f"Run (with store_kv=True) the frames before it first, or start at a frame <= {stored}."
            )
        if state is None:
            return
        if start_frame not in state.chunk_starts and start_frame != stored:
            raise ValueError(
                f"`start_frame={start_frame}` is inside a stored chunk of cache_tag {cache_tag!r}; calls must start "
                f"at a chunk boundary the cache can serve: one of {sorted(set(state.chunk_starts + [stored]))}."
            )
        if check_held and not state.recaching and state.evicted_before > state.flushed_before:
            window.check_held(start_frame, chunk_layout[0], state.evicted_before, f"cache_tag {cache_tag!r}")
        for name, expected in state.layout().items():
            given = layout[name]  # a torch.device for "device" (the engine normalizes it)
            if given != expected:
                hint = " (a different resolution)" if name == "frame_seqlen" else ""
                raise ValueError(
                    f"cache_tag {cache_tag!r} holds entries with {name}={expected}, but this call has "
                    f"{name}={given}{hint}. Call `clear_caches()` (or use another cache_tag) before changing it."
                )

    def check_truncate(self, cache_tag: str, end_frame: int, sink_frames: int = 0) -> bool:
        """Whether truncating ``cache_tag`` at ``end_frame`` drops anything; ``ValueError`` (before any change) when
        the truncation would cut a held chunk (:meth:`TagState.truncatable`; ``sink_frames``: the pinned frames)."""
        state = self._states.get(cache_tag)
        if state is None or end_frame >= state.num_frames:
            return False
        if not state.truncatable(end_frame, sink_frames):
            evicted = f" or frames past the sink up to the evicted {state.evicted_before}" * (state.evicted_before > 0)
            raise ValueError(
                f"Cannot truncate cache_tag {cache_tag!r} at frame {end_frame}: stored chunks start at "
                f"{state.chunk_starts}; truncate at one of them{evicted}."
            )
        return True

    def truncate(self, cache_tag: str, end_frame: int) -> None:
        """Record that every frame ``>= end_frame`` of ``cache_tag`` is gone."""
        state = self._states[cache_tag]
        state.chunk_starts = [s for s in state.chunk_starts if s < end_frame]
        state.num_frames = min(state.num_frames, end_frame)
        state.evicted_before = min(state.evicted_before, state.num_frames)

    def record_store(
        self, cache_tag: str, start_frame: int, num_frames: int, chunk_layout: Sequence[int] | None = None
    ) -> None:
        """Record that frames ``[start_frame, start_frame + num_frames)`` exist as the chunks ``chunk_layout`` (frame
        counts; one chunk when ``None``), each a boundary a later call may use; later frames are gone."""
        state = self._states[cache_tag]
        starts = [start_frame]
        for frames in (chunk_layout or (num_frames,))[:-1]:
            starts.append(starts[-1] + frames)
        state.chunk_starts = [s for s in state.chunk_starts if s < start_frame] + starts
        state.num_frames = start_frame + num_frames
