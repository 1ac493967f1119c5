"""What every causal pipeline does first with a call's arguments, before any other check.

[`prepare_call_options`] is the first step of the shared ``prepare_rollout`` template (``pipe(...)`` and
``pipe.stream(...)``): it checks that the pipeline can generate at all (a pipeline built with ``transformer=None``
serves ``encode_prompt`` only), checks every argument's type and values ([`validate_call_arguments`]), and applies
diffusers' ``num_videos_per_prompt`` by repeating the per-video inputs, as ``WanPipeline.encode_prompt`` repeats the
embeddings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any

import torch

from .validation import validate_call_arguments

# Inputs with one entry per prompt; anything else is shared by the batch (a single image, the control video, ...).
PER_PROMPT_ARGUMENTS = (
    "prompt",
    "negative_prompt",
    "prompt_embeds",
    "negative_prompt_embeds",
    "image_embeds",
    "image",
)


def require_transformer(pipe: Any) -> None:
    """``ValueError`` unless ``pipe`` has a transformer to generate with."""
    if getattr(pipe, "transformer", None) is None:
        raise ValueError(
            f"This {type(pipe).__name__} has no transformer (it was built or loaded with `transformer=None`, which "
            "serves `encode_prompt` alone); load it with a transformer to generate."
        )


def _repeat(value: Any, times: int, name: str) -> Any:
    """Each entry of a per-prompt input ``times`` times in a row (``[a, b]`` -> ``[a, a, b, b]``); what is given once
    for the whole batch (one image, batch-1 image embeddings, a negative prompt string) stays shared."""
    if isinstance(value, Mapping):  # a prompt schedule: every switch follows the batch
        return {frame: _repeat(entry, times, name) for frame, entry in value.items()}
    if isinstance(value, str):
        return value if name == "negative_prompt" else [value] * times
    if isinstance(value, list):
        shared = name == "image" and len(value) == 1
        return value if shared else [entry for entry in value for _ in range(times)]
    if isinstance(value, torch.Tensor):
        batched = value.ndim == 3 if name != "image" else value.ndim == 4
        if batched and (name in ("prompt_embeds", "negative_prompt_embeds") or value.shape[0] > 1):
            return value.repeat_interleave(times, dim=0)
    return value


def expand_videos_per_prompt(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """``arguments`` without ``num_videos_per_prompt``, every per-prompt input repeated that many times (a prompt
    string becomes a list, embeddings ``(B, L, D)`` become ``(B * n, L, D)``). ``latents`` and a list of generators
    must already cover ``B * n`` videos, as in diffusers."""
    arguments = dict(arguments)
    times = arguments.pop("num_videos_per_prompt", 1)
    if times is None or times == 1:
        return arguments
    for name in PER_PROMPT_ARGUMENTS:
        if arguments.get(name) is not None:
            arguments[name] = _repeat(arguments[name], times, name)
    return arguments


def prepare_call_arguments(pipe: Any, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The call's arguments checked and ready for ``prepare_rollout`` (see the module docstring)."""
    require_transformer(pipe)
    return expand_videos_per_prompt(validate_call_arguments(arguments))


def prepare_call_options(pipe: Any, options: Any) -> Any:
    """[`prepare_call_arguments`] on a call's options dataclass (``RolloutOptions`` and its subclasses): the
    options with their values checked, PIL images converted and ``num_videos_per_prompt`` applied (then 1)."""
    arguments = {field.name: getattr(options, field.name) for field in fields(options)}
    prepared = prepare_call_arguments(pipe, arguments)
    return replace(options, **prepared, num_videos_per_prompt=1)
