"""``PromptSchedule``: where a call switches prompts, how it blends a switch in, and what a switch does to the caches.

The rules of the prompt-switch options among themselves, each stated once here (the rules that combine them with
the cache settings or the policy are [`RolloutSettings`]'s):

* ``recache_sink`` is ``"rerun"`` or ``"keep"``; ``"keep"`` says what a recache does with the sink, so it needs
  ``recache=True``;
* ``kv_flush`` replaces the recache (it refuses ``recache=True``);
* ``rope_cut`` is a bool or switch frames of this schedule (``True`` needs a switch);
* a KV flush or a scene cut acts at the chunk a prompt takes effect: no ``prompt_transition_chunks`` above 1.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .base import ArgumentTypeError, SettingsValue, check_bool, check_int, setting, type_name

RECACHE_SINKS = ("rerun", "keep")

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
    the call's inputs, not settings) and what each switch does to the caches."""

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
    recache_sink: str = setting(
        "rerun",
        "What a recache does with the sink: 'rerun' (default: re-run the sink's chunks too) or 'keep' (LongLive's "
        "global sink: the sink keeps its K/V, the window's other frames are re-run in one forward; needs recache, "
        "attention_window and sink_frames).",
        stored=False,
    )
    kv_flush: bool = setting(
        False,
        "At each prompt switch keep only the sink and the last 2 latent frames in the self-attention cache "
        "(Infinity-RoPE's KV flush; needs attention_window, not with recache).",
        stored=False,
    )
    rope_cut: bool | tuple[int, ...] = setting(
        False,
        "Scene cut (Infinity-RoPE): the first chunk after a cut switch (True: every switch; or the switch frames "
        "that cut) runs at temporal RoPE positions 45, 46, ...; needs rope_positions 'window'.",
        stored=False,
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "switch_frames", tuple(self.switch_frames))
        check_int("prompt_transition_chunks", self.prompt_transition_chunks, minimum=0)
        check_bool("recache", self.recache)
        for frame in self.switch_frames:
            check_int("prompt", frame, minimum=1)
        if not isinstance(self.recache_sink, str) or self.recache_sink not in RECACHE_SINKS:
            raise ValueError(f"`recache_sink` must be one of {RECACHE_SINKS}, got {self.recache_sink!r}.")
        check_bool("kv_flush", self.kv_flush)
        object.__setattr__(self, "rope_cut", self._rope_cut())
        if self.recache_sink == "keep" and not self.recache:
            raise ValueError(
                "`recache_sink='keep'` says what a recache does with the sink: set `recache=True` too (or use "
                "recache_sink='rerun')."
            )
        edit = self.switch_edit
        if edit is not None and self.prompt_transition_chunks > 1:
            raise ValueError(
                f"`{edit}` acts at the chunk a prompt takes effect; `prompt_transition_chunks="
                f"{self.prompt_transition_chunks}` blends it in over several: use prompt_transition_chunks=0 with "
                f"{edit}."
            )
        if self.kv_flush and self.recache:
            raise ValueError("`kv_flush=True` replaces the recache (no forward at a switch): use recache=False.")

    def _rope_cut(self) -> bool | tuple[int, ...]:
        """``rope_cut`` checked against the switches: ``True`` / ``False``, or a tuple of switch frames (an empty
        sequence is ``False``)."""
        cut = self.rope_cut
        switches = sorted(self.switch_frames)
        if isinstance(cut, bool):
            if cut and not switches:
                raise ValueError(
                    "`rope_cut=True` cuts at every prompt switch: give a prompt schedule {frame: prompt} (or use "
                    "rope_cut=False)."
                )
            return cut
        if hasattr(cut, "tolist") and not isinstance(cut, (list, tuple)):  # a 1-D array
            cut = cut.tolist()
        if isinstance(cut, (str, bytes)) or not isinstance(cut, Sequence):
            raise ArgumentTypeError(
                f"`rope_cut` must be a bool or a sequence of prompt-switch frames, got {cut!r} ({type_name(cut)})."
            )
        frames = tuple(cut)
        unknown = [
            f for f in frames if isinstance(f, bool) or not isinstance(f, numbers.Integral) or f not in switches
        ]
        if unknown:
            raise ValueError(
                f"`rope_cut` frames {unknown} are not prompt switches; the schedule switches at {switches}."
            )
        return tuple(int(frame) for frame in frames) or False

    @property
    def switches(self) -> bool:
        return bool(self.switch_frames)

    @property
    def cut_frames(self) -> tuple[int, ...]:
        """The switch frames that are scene cuts (``rope_cut``)."""
        if self.rope_cut is True:
            return tuple(sorted(self.switch_frames))
        return self.rope_cut or ()

    @property
    def switch_edit(self) -> str | None:
        """The option that edits the self K/V at a switch in place of a plain switch (``"kv_flush"`` or
        ``"rope_cut"``), if any."""
        if self.kv_flush:
            return "kv_flush"
        return "rope_cut" if self.cut_frames else None

    def check_chunks(
        self, chunk_bounds: Sequence[tuple[int, int]], leading_frames: int = 0, temporal_factor: int = TEMPORAL_FACTOR
    ) -> None:
        """Raise ``ValueError`` unless every switch maps to a chunk of its own ([`switch_chunks`]) of a rollout of the
        chunks ``chunk_bounds`` (latent frames; ``leading_frames`` of them before the video's frame 0: VACE's
        reference images)."""
        video_bounds = [(max(start - leading_frames, 0), end - leading_frames) for start, end in chunk_bounds]
        switch_chunks(self.switch_frames, video_bounds, temporal_factor)
