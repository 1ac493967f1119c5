"""Type and value checks of the pipelines' call arguments, before any model runs.

Each check looks at one argument alone and raises an [`ArgumentTypeError`] (a ``TypeError`` that is also a
``ValueError``: wrong type) or a ``ValueError`` (right type, bad value) whose message starts with the argument's name
in backticks and says what is accepted. What needs more than the
argument itself (shapes against the transformer's config, batch sizes, chunk fits) stays in the pipelines'
``check_inputs``; those run after these, on arguments of the right type.

[`validate_call_arguments`] applies the checks to every argument a call passes, by name, so the pipelines, their
``stream()`` and the kept-rollout methods share one table. PIL images in a mode other than RGB are converted the way
``diffusers.utils.load_image`` does (``image.convert("RGB")``); modes that cannot be converted without losing their
values (16- and 32-bit integer or float images) are refused.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import PIL.Image
import torch

from ...settings.base import ArgumentTypeError, check_bool, check_int, check_real, type_name
from ...settings.sampling import guidance_scale_accepted

# Modes whose conversion to RGB (or L for masks) keeps the picture: palette, alpha, grey, CMYK, ...
CONVERTIBLE_MODES = ("1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB", "HSV")
PIXEL_RANGE = (0.0, 1.0)


def check_number_sequence(name: str, values: Any) -> None:
    """A flat list, tuple, 1-D array or 1-D tensor of finite real numbers (ranges and order are checked later)."""
    if isinstance(values, (torch.Tensor, np.ndarray)):
        if values.ndim != 1:
            raise ArgumentTypeError(
                f"`{name}` must be a flat list of numbers, got an array of shape {tuple(values.shape)}."
            )
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ArgumentTypeError(f"`{name}` must be a list of numbers, got {type_name(values)}.")
    for value in values:
        if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_meta:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ArgumentTypeError(
                f"`{name}` must be a flat list of numbers, got an element {value!r} ({type_name(value)})."
            )
        if not math.isfinite(value):
            raise ValueError(f"`{name}` must hold finite numbers, got {list(values)}.")


def check_tensor(name: str, tensor: Any, *, floating: bool = True) -> None:
    """A ``torch.Tensor`` with real storage (not on the ``meta`` device), floating point and finite everywhere."""
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentTypeError(f"`{name}` must be a torch.Tensor, got {type_name(tensor)}.")
    if tensor.is_meta:
        raise ValueError(
            f"`{name}` is on the meta device (a shape without data, e.g. from `init_empty_weights`); pass a tensor "
            "with values."
        )
    if floating and not tensor.is_floating_point():
        raise ArgumentTypeError(f"`{name}` must be a floating-point tensor, got dtype {tensor.dtype}.")
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise ValueError(f"`{name}` holds {bad} non-finite values (NaN or Inf); every value must be finite.")


def check_embeddings(name: str, embeds: Any) -> None:
    """Text or image embeddings: a finite floating ``(batch, tokens, dim)`` tensor with at least one token."""
    check_tensor(name, embeds)
    if embeds.ndim != 3:
        raise ValueError(f"`{name}` must be a (batch, tokens, dim) tensor, got shape {tuple(embeds.shape)}.")
    if embeds.shape[0] == 0 or embeds.shape[1] == 0:
        raise ValueError(f"`{name}` must hold at least one sequence of at least one token, got {tuple(embeds.shape)}.")


def check_prompt(name: str, prompt: Any) -> None:
    """A string or a non-empty list of strings."""
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, list) or not prompt:
        raise ArgumentTypeError(f"`{name}` must be a string or a non-empty list of strings, got {type_name(prompt)}.")
    for item in prompt:
        if not isinstance(item, str):
            raise ArgumentTypeError(
                f"`{name}` must be a list of strings, got an element {item!r} ({type_name(item)})."
            )


def check_schedule(name: str, value: Any, check: Callable[[str, Any], None]) -> None:
    """``value`` or, for a prompt schedule ``{pixel_frame: value}``, every value of it, passes ``check``."""
    if not isinstance(value, Mapping):
        check(name, value)
        return
    for frame, entry in value.items():
        if entry is None:
            raise ArgumentTypeError(f"`{name}` schedule entry at frame {frame!r} is None; give every switch a prompt.")
        check(f"{name}[{frame!r}]", entry)


def check_pixels(name: str, pixels: torch.Tensor | np.ndarray) -> None:
    """A tensor or array of pixels: real values, finite, within the documented [0, 1] range."""
    if isinstance(pixels, np.ndarray):
        if not np.issubdtype(pixels.dtype, np.number) or np.issubdtype(pixels.dtype, np.complexfloating):
            raise ArgumentTypeError(f"`{name}` must be an array of numbers in [0, 1], got dtype {pixels.dtype}.")
        pixels = torch.from_numpy(np.asarray(pixels, dtype=np.float32))
    check_tensor(name, pixels, floating=False)
    if pixels.numel() == 0:
        raise ValueError(f"`{name}` is empty, got shape {tuple(pixels.shape)}.")
    low, high = float(pixels.min()), float(pixels.max())
    if low < PIXEL_RANGE[0] or high > PIXEL_RANGE[1]:
        raise ValueError(
            f"`{name}` values must lie in [0, 1], got [{low:g}, {high:g}]: divide 8-bit pixels by 255, map [-1, 1] "
            "pixels with (x + 1) / 2."
        )


def to_mode(name: str, image: PIL.Image.Image, modes: tuple[str, ...]) -> PIL.Image.Image:
    """``image`` as it is if its mode is in ``modes``, else converted to ``modes[0]``; ``ValueError`` for modes whose
    values a conversion would clip (32-bit integer and float images, 16-bit ones)."""
    if image.mode in modes:
        return image
    if image.mode not in CONVERTIBLE_MODES:
        raise ValueError(
            f"`{name}` is a PIL image in mode {image.mode!r}, which cannot be converted to {modes[0]} without "
            f"clipping its values; convert it to 8-bit RGB first (accepted modes: {CONVERTIBLE_MODES})."
        )
    return image.convert(modes[0])


def check_images(name: str, value: Any, modes: tuple[str, ...] = ("RGB",)) -> Any:
    """Images or frames: a PIL image, a list of them (or a list holding one list: VACE's references), or a tensor /
    array of pixels in [0, 1]. Returns ``value`` with its PIL images converted to ``modes`` (see [`to_mode`])."""
    if isinstance(value, PIL.Image.Image):
        return to_mode(name, value, modes)
    if isinstance(value, (torch.Tensor, np.ndarray)):
        check_pixels(name, value)
        return value
    if isinstance(value, list):
        converted = []
        for index, item in enumerate(value):
            if isinstance(item, list):
                converted.append(check_images(f"{name}[{index}]", item, modes))
            elif isinstance(item, PIL.Image.Image):
                converted.append(to_mode(f"{name}[{index}]", item, modes))
            elif isinstance(item, (torch.Tensor, np.ndarray)):
                check_pixels(f"{name}[{index}]", item)
                converted.append(item)
            else:
                raise ArgumentTypeError(
                    f"`{name}` must hold PIL images, tensors or arrays, got an element of type {type_name(item)}."
                )
        return converted
    raise ArgumentTypeError(
        f"`{name}` must be a PIL image, a list of PIL images, a tensor or an array in [0, 1], got {type_name(value)}."
    )


def check_conditioning_scale(name: str, value: Any) -> None:
    """A finite number, or a list / tensor of finite numbers (one per VACE layer)."""
    if isinstance(value, torch.Tensor):
        check_tensor(name, value)
    elif isinstance(value, (list, tuple, np.ndarray)):
        check_number_sequence(name, value)
    else:
        check_real(name, value)


def check_generator(name: str, value: Any) -> None:
    """A ``torch.Generator`` or a list of them."""
    generators = value if isinstance(value, list) else [value]
    for generator in generators:
        if not isinstance(generator, torch.Generator):
            raise ArgumentTypeError(
                f"`{name}` must be a torch.Generator or a list of them, got {type_name(generator)}."
            )


def check_callable(name: str, value: Any) -> None:
    if not callable(value):
        raise ArgumentTypeError(f"`{name}` must be callable, got {type_name(value)}.")


def _positive_int(name: str, value: Any) -> None:
    check_int(name, value, minimum=1)


def _non_negative_int(name: str, value: Any) -> None:
    check_int(name, value, minimum=0)


def _guidance(name: str, value: Any) -> None:
    check_real(name, value)
    if not guidance_scale_accepted(value):
        raise ValueError(
            f"`{name}` must be a finite number >= 1 or 0 (0 and 1 disable classifier-free guidance), got {value}."
        )


# Call argument -> its check; `None` is accepted for every argument here and left to the pipeline's rules.
ARGUMENT_CHECKS: dict[str, Callable[[str, Any], None]] = {
    "prompt": lambda name, value: check_schedule(name, value, check_prompt),
    "negative_prompt": check_prompt,
    "prompt_embeds": lambda name, value: check_schedule(name, value, check_embeddings),
    "negative_prompt_embeds": check_embeddings,
    "image_embeds": check_embeddings,
    "latents": check_tensor,
    "height": _positive_int,
    "width": _positive_int,
    "num_frames": check_int,
    "num_inference_steps": check_int,
    "num_videos_per_prompt": _positive_int,
    "timesteps": check_number_sequence,
    "sigmas": check_number_sequence,
    "guidance_scale": _guidance,
    "context_noise": check_real,
    "chunk_size": check_int,
    "attention_window": check_int,
    "sink_frames": _non_negative_int,
    "max_sequence_length": check_int,
    "vace_hint_refresh_interval": check_int,
    "conditioning_scale": check_conditioning_scale,
    "generator": check_generator,
    "callback_on_step_end": check_callable,
    "keep_cache": check_bool,
    "recache": check_bool,
    "return_dict": check_bool,
    "allow_lossy": check_bool,
    "keep_first_frame": check_bool,
    "prompt_transition_chunks": _non_negative_int,
}
# Image arguments -> the PIL modes they take as they are (the first is what other modes are converted to).
# VACE's `reference_images` are checked by its pipeline, which refuses modes other than RGB and L.
IMAGE_ARGUMENTS = {"image": ("RGB",), "video": ("RGB",), "mask": ("L", "RGB")}


def validate_call_arguments(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """Check every argument of ``arguments`` (a pipeline call's, by name) that has a rule here; return them with PIL
    images converted to the modes the pipelines take. Unknown names and ``None`` values pass untouched."""
    checked = dict(arguments)
    for name, value in arguments.items():
        if value is None:
            continue
        if name in IMAGE_ARGUMENTS:
            checked[name] = check_images(name, value, IMAGE_ARGUMENTS[name])
        elif name in ARGUMENT_CHECKS:
            ARGUMENT_CHECKS[name](name, value)
    return checked
