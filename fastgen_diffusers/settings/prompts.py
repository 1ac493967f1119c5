"""``PromptSchedule``: where a call switches prompts, how it blends a switch in, and whether it recaches."""

from __future__ import annotations

from dataclasses import dataclass

from .base import SettingsValue, check_bool, check_int, setting


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
