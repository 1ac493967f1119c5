"""``SamplingSettings``: how each chunk is denoised (steps or timesteps, the first chunk's schedule, guidance) and
the timestep of the pass that stores it in the KV cache."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .base import SettingsValue, as_floats, check_real, merge_values, setting

NUM_TRAIN_TIMESTEPS = 1000
DEFAULT_STEPS = 4
SCHEDULE_FIELDS = ("num_inference_steps", "timesteps", "sigmas")


def guidance_scale_accepted(value: float) -> bool:
    """Whether a finite ``guidance_scale`` means something: 0 or 1 (no classifier-free guidance: as in diffusers, CFG
    runs only above 1, and 0 is the value distilled models are often given) or above 1 (the CFG weight). A value in
    ``(0, 1)`` would silently run without guidance."""
    return value == 0 or value >= 1


def _check_schedule(name: str, values: tuple[float, ...] | None, upper: float) -> None:
    if values is None:
        return
    if len(values) == 0:
        raise ValueError(f"`{name}` must hold at least one step, got an empty list.")
    if any(not 0.0 <= v <= upper for v in values):
        raise ValueError(f"`{name}` must lie within [0, {upper}], got {list(values)}.")
    if any(b >= a for a, b in zip(values, values[1:])):
        raise ValueError(f"`{name}` must be strictly decreasing, got {list(values)}.")


def merge_schedule(stored: Mapping[str, Any], call: Mapping[str, Any]) -> dict[str, Any]:
    """``call``'s sampling values over ``stored``'s, field by field, with one rule for the schedule: a call naming
    its own schedule (a step count, timesteps or sigmas) takes neither the stored timesteps nor the stored first-chunk
    timesteps."""
    stored = dict(stored)
    if any(call.get(name) is not None for name in SCHEDULE_FIELDS):
        stored.update(dict.fromkeys((*SCHEDULE_FIELDS, "first_chunk_timesteps")))
    return merge_values(SamplingSettings, stored, call)


@dataclass(frozen=True)
class SamplingSettings(SettingsValue):
    """How every chunk is sampled. ``None`` fields are unset: a stored value (or the default) stands."""

    merge_rule = staticmethod(merge_schedule)  # a call's own schedule replaces the stored one

    num_inference_steps: int | None = setting(
        None,
        "Denoising steps per chunk; without it (and without timesteps/sigmas) the model's stored timesteps are "
        f"used, else {DEFAULT_STEPS}.",
    )
    timesteps: tuple[float, ...] | None = setting(
        None, "Model-scale timesteps in [0, 1000], strictly decreasing, used as given (overrides the step count)."
    )
    sigmas: tuple[float, ...] | None = setting(
        None, "Sigmas in [0, 1], strictly decreasing, shifted by the scheduler (overrides the step count)."
    )
    first_chunk_timesteps: tuple[float, ...] | None = setting(
        None, "Model-scale timesteps of the first chunk only (Causal Forcing++); later chunks use the schedule above."
    )
    guidance_scale: float | None = setting(
        None, "Classifier-free guidance weight: 0 or 1 (default) run no CFG, above 1 runs the negative branch."
    )
    context_noise: float | None = setting(
        None, "Timestep of the pass that writes each finished chunk into the KV cache (0: the clean chunk)."
    )
    shift: float | None = setting(None, "Flow-matching shift of the scheduler (folded into stored timesteps).")

    def __post_init__(self) -> None:
        for name in ("timesteps", "sigmas", "first_chunk_timesteps"):
            object.__setattr__(self, name, as_floats(name, getattr(self, name)))
        _check_schedule("timesteps", self.timesteps, NUM_TRAIN_TIMESTEPS)
        _check_schedule("first_chunk_timesteps", self.first_chunk_timesteps, NUM_TRAIN_TIMESTEPS)
        _check_schedule("sigmas", self.sigmas, 1.0)
        if self.timesteps is not None and self.sigmas is not None:
            raise ValueError("Pass at most one of `timesteps` and `sigmas`, not both.")
        steps = self.num_inference_steps
        if steps is not None and self.timesteps is None and self.sigmas is None:
            if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
                raise ValueError(f"`num_inference_steps` must be a positive integer, got {steps!r}.")
        if self.guidance_scale is not None:
            check_real("guidance_scale", self.guidance_scale)
            if not guidance_scale_accepted(self.guidance_scale):
                raise ValueError(
                    "`guidance_scale` must be a finite number >= 1 or 0 (0 and 1 disable classifier-free guidance), "
                    f"got {self.guidance_scale}."
                )
        if self.context_noise is not None:
            check_real("context_noise", self.context_noise)
            if not 0.0 <= float(self.context_noise) <= NUM_TRAIN_TIMESTEPS:
                raise ValueError(
                    f"`context_noise` must be a timestep within [0, {NUM_TRAIN_TIMESTEPS}], got {self.context_noise}."
                )
        if self.shift is not None:
            check_real("shift", self.shift)
            if self.shift <= 0:
                raise ValueError(f"`shift` must be a positive number, got {self.shift}.")

    @property
    def steps(self) -> int:
        """Denoising steps per chunk (after the first chunk), the default filled in."""
        if self.timesteps is not None:
            return len(self.timesteps)
        if self.sigmas is not None:
            return len(self.sigmas)
        return DEFAULT_STEPS if self.num_inference_steps is None else self.num_inference_steps
