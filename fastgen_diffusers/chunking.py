"""How a run of latent frames is split into causal chunks.

One rule serves every caller (the transformer's block-causal mask, the rollout pipelines, training code):
the first chunk absorbs the remainder, or is a single frame when ``independent_first_frame`` is set. The rollout's
leaf value types live here too: a [`ChunkSpan`] (index, start, end) and a [`ChunkPlan`] (spans + per-chunk schedule).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


def chunk_layout(num_frames: int, chunk_size: int, independent_first_frame: bool = False) -> tuple[int, ...]:
    """Frame counts of the chunks that ``num_frames`` latent frames are split into.

    Examples: ``chunk_layout(21, 3) == (3,) * 7``, ``chunk_layout(8, 3) == (5, 3)``,
    ``chunk_layout(2, 3) == (2,)``, ``chunk_layout(7, 3, independent_first_frame=True) == (1, 3, 3)``.
    """
    if num_frames < 1:
        raise ValueError(f"`num_frames` must be a positive number of latent frames, got {num_frames}.")
    if chunk_size < 1:
        raise ValueError(f"`chunk_size` must be a positive number of latent frames, got {chunk_size}.")
    if independent_first_frame:
        rest = num_frames - 1
        return (1,) + (chunk_layout(rest, chunk_size) if rest else ())
    num_chunks, remainder = divmod(num_frames, chunk_size)
    if num_chunks == 0:
        return (num_frames,)
    return (chunk_size + remainder,) + (chunk_size,) * (num_chunks - 1)


def chunk_bounds(layout: tuple[int, ...], start_frame: int = 0) -> list[tuple[int, int]]:
    """Absolute ``[start, end)`` latent-frame ranges of the chunks of ``layout`` placed at ``start_frame``."""
    bounds = []
    start = start_frame
    for size in layout:
        bounds.append((start, start + size))
        start += size
    return bounds


def check_given_frames(
    name: str,
    num_given: int,
    num_frames: int,
    chunk_bounds: Sequence[tuple[int, int]],
    chunk_size: int,
    independent_first_frame: bool,
    temporal_factor: int = 4,
) -> None:
    """Raise ``ValueError`` unless the ``num_given`` pixel frames of ``name`` (``"image"``: 1, or a ``"video"`` clip)
    that a T2V student takes as its first chunks fill whole chunks of a rollout of ``num_frames`` pixel frames split
    into ``chunk_bounds`` (``chunk_size``, ``independent_first_frame``: the transformer's chunking), and leave some to
    generate: ``temporal_factor``k+1 frames ending a chunk."""
    temporal = temporal_factor
    if num_given % temporal != 1:
        raise ValueError(
            f"`{name}` has {num_given} frames; a clip must have {temporal}k+1 frames (1, {temporal + 1}, "
            f"{2 * temporal + 1}, ...) to encode to whole latent frames."
        )
    num_context = (num_given - 1) // temporal + 1
    if num_context >= (num_frames - 1) // temporal + 1:
        raise ValueError(
            f"`num_frames={num_frames}` leaves nothing to generate after the {num_given} given frames of `{name}`: "
            f"ask for more than {num_given} frames."
        )
    ends = [end for _, end in chunk_bounds]
    if num_context in ends:
        return
    fits = [(end - 1) * temporal + 1 for end in ends[:-1]]
    hint = (
        " A single image is a chunk of its own only with `independent_first_frame=True` (for a student trained that "
        "way: `WanCausalTransformer3DModel.from_pretrained(path, subfolder='transformer', independent_first_frame="
        "True)`); otherwise extend a `video` clip."
        if num_given == 1
        else ""
    )
    raise ValueError(
        f"`{name}` encodes to {num_context} latent frames, which do not fill whole chunks of this rollout (chunks end "
        f"at latent frames {ends}; chunk_size={chunk_size}, independent_first_frame={independent_first_frame}). "
        f"Accepted clip lengths: {fits} frames.{hint}"
    )


@dataclass(frozen=True)
class ChunkSpan:
    """One chunk of a rollout: its position ``index`` and its latent frames ``[start, end)``."""

    index: int
    start: int
    end: int

    @property
    def num_frames(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ChunkPlan:
    """The chunks a policy runs and the sampling schedule of each.

    Args:
        spans: the chunks, in order, contiguous.
        schedules: one ``scheduler.set_timesteps`` keyword dict per span (Causal Forcing++ samples its first chunk on
            other timesteps than the later ones).
    """

    spans: tuple[ChunkSpan, ...]
    schedules: tuple[Mapping[str, Any], ...]

    def __post_init__(self) -> None:
        if len(self.spans) != len(self.schedules):
            raise ValueError(
                f"A chunk plan needs one schedule per span: {len(self.spans)} spans, {len(self.schedules)} schedules."
            )

    @classmethod
    def from_bounds(
        cls,
        bounds: Sequence[tuple[int, int]],
        schedule: Mapping[str, Any],
        *,
        first_index: int = 0,
        first_schedule: Mapping[str, Any] | None = None,
    ) -> ChunkPlan:
        """A plan over ``bounds`` (``[start, end)`` pairs) numbered from ``first_index``: every chunk on
        ``schedule``, except chunk 0 on ``first_schedule`` when given."""
        spans = tuple(ChunkSpan(i, start, end) for i, (start, end) in enumerate(bounds, first_index))
        schedules = tuple(
            first_schedule if span.index == 0 and first_schedule is not None else schedule for span in spans
        )
        return cls(spans, schedules)

    def __len__(self) -> int:
        return len(self.spans)

    def __iter__(self) -> Iterator[tuple[ChunkSpan, Mapping[str, Any]]]:
        return iter(zip(self.spans, self.schedules))

    @property
    def bounds(self) -> list[tuple[int, int]]:
        return [(span.start, span.end) for span in self.spans]

    @property
    def end(self) -> int:
        """One past the last latent frame of the plan."""
        return self.spans[-1].end


@dataclass(frozen=True)
class OpenEndedChunkPlan:
    """The chunks of an endless stream: those of ``head``, then chunks of ``chunk_size`` latent frames on
    ``schedule`` for as long as they are asked for. Iterating it never ends, and it has no ``spans``: its chunks are
    not known up front (a policy that needs them refuses it)."""

    head: ChunkPlan
    chunk_size: int
    schedule: Mapping[str, Any]

    def __iter__(self) -> Iterator[tuple[ChunkSpan, Mapping[str, Any]]]:
        yield from self.head
        index, start = len(self.head) + self.head.spans[0].index, self.head.end
        while True:
            yield ChunkSpan(index, start, start + self.chunk_size), self.schedule
            index, start = index + 1, start + self.chunk_size
