"""Typed call options: the arguments of a causal pipeline's ``__call__`` (and ``stream``) as one value.

``__call__`` builds its options from its arguments ([`call_options`]: a renamed argument fails loudly), the shared
prepare template reads them, and ``resolve_options`` builds the call's [`RolloutSettings`] once, the pipeline's
stored settings filling what the call left out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any

import numpy as np
import PIL.Image
import torch

from ...settings import POLICIES, CacheSettings, PromptSchedule, RolloutSettings, SamplingSettings, argument_names

# A call's default where it is not the settings' "unset" (guidance 1.0: no CFG, which an unset guidance means too).
CALL_DEFAULTS = {"guidance_scale": 1.0}


def _argument_default(name: str) -> Any:
    """The default of the flat settings argument ``name`` in a call (the settings field's, unless
    :data:`CALL_DEFAULTS` names it)."""
    if name in CALL_DEFAULTS:
        return CALL_DEFAULTS[name]
    for cls in (SamplingSettings, CacheSettings, PromptSchedule, RolloutSettings, *POLICIES.values()):
        for settings_field in fields(cls):
            if settings_field.name == name:
                return settings_field.default
    return None  # `kv_cache_policy`: none named


# The flat settings arguments of a call, one field each (their meaning and rules are the settings values').
SettingArguments = make_dataclass(
    "SettingArguments",
    [(name, Any, field(default=_argument_default(name))) for name in argument_names()],
    kw_only=True,
)
SettingArguments.__module__ = __name__


@dataclass(kw_only=True)
class RolloutOptions(SettingArguments):
    """The arguments of [`WanCausalPipeline.__call__`] (see there), ``return_dict`` included: its flat settings
    arguments ([`SettingArguments`]) and the rest."""

    prompt: str | list[str] | dict[int, Any] | None = None
    negative_prompt: str | list[str] | None = None
    height: int | None = 480
    width: int | None = 832
    num_frames: int = 81
    chunk_size: int | None = None
    generator: torch.Generator | list[torch.Generator] | None = None
    latents: torch.Tensor | None = None
    prompt_embeds: torch.Tensor | dict[int, torch.Tensor] | None = None
    negative_prompt_embeds: torch.Tensor | None = None
    output_type: str = "np"
    return_dict: bool = True
    attention_kwargs: dict[str, Any] | None = None
    callback_on_step_end: Callable[..., dict[str, torch.Tensor]] | Any | None = None
    callback_on_step_end_tensor_inputs: list[str] = field(default_factory=lambda: ["latents"])
    max_sequence_length: int = 512
    num_videos_per_prompt: int = 1
    # the call's settings as one value (its flat arguments at their defaults leave its values standing); after
    # `resolve_options`: the call's resolved settings
    settings: RolloutSettings | None = None


@dataclass(kw_only=True)
class ImageToVideoOptions(RolloutOptions):
    """[`RolloutOptions`] plus the image inputs of [`WanCausalImageToVideoPipeline.__call__`]."""

    image: PIL.Image.Image | np.ndarray | torch.Tensor | list[PIL.Image.Image] | None = None
    video: list[PIL.Image.Image] | torch.Tensor | np.ndarray | None = None
    image_embeds: torch.Tensor | None = None
    height: int | None = None
    width: int | None = None


@dataclass(kw_only=True)
class VACEOptions(RolloutOptions):
    """[`RolloutOptions`] plus the control inputs of [`WanCausalVACEPipeline.__call__`]."""

    video: Any = None
    mask: Any = None
    reference_images: PIL.Image.Image | list[PIL.Image.Image] | list[list[PIL.Image.Image]] | None = None
    conditioning_scale: float | Sequence[float] | torch.Tensor = 1.0
    vace_hint_refresh_interval: int = 1
    allow_lossy: bool = False


def call_options(options_class: type[RolloutOptions], arguments: Mapping[str, Any]) -> RolloutOptions:
    """``options_class`` built from a ``__call__``'s ``locals()``: every argument of the call by name (an argument the
    options lack fails loudly; a field the call does not take keeps its default)."""
    names = {f.name for f in fields(options_class)}
    call = {name: value for name, value in arguments.items() if name not in ("self", "__class__")}
    if set(call) - names:
        raise TypeError(f"{options_class.__name__} has no field for the call's {sorted(set(call) - names)}.")
    return options_class(**call)
