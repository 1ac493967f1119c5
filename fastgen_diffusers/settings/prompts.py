"""``PromptSchedule``: where a call switches prompts, how it blends a switch in, and whether it recaches."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .base import SettingsValue, check_bool, check_int, setting

TEMPORAL_FACTOR = 4  # Wan VAEs: latent frame s >= 1 starts at pixel frame 4s - 3


def switch_chunks(
    frames: Iterable[int], chunk_bounds: Sequence[tuple[int, int]], temporal_factor: int = TEMPORAL_FACTOR
) -> dict[int, int]:
    """``{pixel_frame: chunk_index}``: a prompt switch at a pixel frame takes effect at the first chunk (``[start,
    end)`` latent frames of the video) whose first pixel frame is at or after it. ``ValueError`` for a switch past the
    last chunk's start, or two switches at one chunk."""
    firsts = [0 if start == 0 else temporal_factor * start - (temporal_factor - 1) for start, _ in chunk_bounds]
    chunks: dict[int, int] = {}
    for frame in frames:
        index = next((i for i, first in enumerate(firsts) if first >= frame), None)
        if index is None:
            raise ValueError(
                f"The prompt switch at pixel frame {frame} is past the last chunk, which starts at pixel frame "
                f"{firsts[-1]}; chunks start at pixel frames {firsts}."
            )
        if index in chunks.values():
            raise ValueError(
                f"Two prompt switches take effect at the same chunk (starting at pixel frame {firsts[index]}); "
                f"chunks start at pixel frames {firsts}: keep one switch per chunk."
            )
        chunks[frame] = index
    return chunks


@dataclass(frozen=True)
class PromptSchedule(SettingsValue):
    """The prompt switches of a call (the pixel frames of a dict ``prompt`` after frame 0; the prompts themselves are
    the call's inputs, not settings)."""

    switch_frames: tuple[int, ...] = setting(
        (), "Pixel frames (after 0) where the prompt switches: the keys of a dict prompt.", stored=False
    )
    prompt_transition_chunks: int = setting(
        0, "Blend each prompt switch in linearly over this many chunks (0 and 1 switch at once).", stored=False
    )
    recache: bool = setting(
        False,
        "At each prompt switch, recompute the self K/V of the earlier chunks under the new prompt (LongLive).",
        stored=False,
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "switch_frames", tuple(self.switch_frames))
        check_int("prompt_transition_chunks", self.prompt_transition_chunks, minimum=0)
        check_bool("recache", self.recache)
        for frame in self.switch_frames:
            check_int("prompt", frame, minimum=1)

    @property
    def switches(self) -> bool:
        return bool(self.switch_frames)

    def check_chunks(
        self, chunk_bounds: Sequence[tuple[int, int]], leading_frames: int = 0, temporal_factor: int = TEMPORAL_FACTOR
    ) -> None:
        """Raise ``ValueError`` unless every switch maps to a chunk of its own ([`switch_chunks`]) of a rollout of the
        chunks ``chunk_bounds`` (latent frames; ``leading_frames`` of them before the video's frame 0: VACE's
        reference images)."""
        video_bounds = [(max(start - leading_frames, 0), end - leading_frames) for start, end in chunk_bounds]
        switch_chunks(self.switch_frames, video_bounds, temporal_factor)
