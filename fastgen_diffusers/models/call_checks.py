"""Checks of a causal transformer call's inputs against the model, before any engine operation.

Each bad input is a ``ValueError`` that names the argument, what was expected and what came, raised before any
cache is touched (``CausalWanMixin._check_call`` runs these first, then asks every engine).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _check_tensor(name: str, value: Any, ndim: int, shape_doc: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"`{name}` must be a {shape_doc} tensor, got {type(value).__name__}.")
    if value.ndim != ndim:
        raise ValueError(f"`{name}` must be a {shape_doc} tensor, got shape {tuple(value.shape)}.")
    if value.is_meta:
        raise ValueError(f"`{name}` is on the meta device (it holds no values); pass a tensor with data.")
    if not value.is_floating_point():
        raise ValueError(f"`{name}` must be a floating-point tensor, got dtype {value.dtype}.")
    return value


def _check_dtype(name: str, value: torch.Tensor, dtype: torch.dtype | None) -> None:
    """``dtype``: the model's compute dtype (``None`` under autocast, which casts for itself)."""
    if dtype is not None and value.dtype != dtype:
        raise ValueError(
            f"`{name}` has dtype {value.dtype}, but the model computes in {dtype}: cast it with `.to({dtype})` "
            "(or run under `torch.autocast`)."
        )


def read_timestep(timestep: torch.Tensor) -> torch.Tensor:
    """A private host copy of ``timestep``'s values: the forward's one read of them (on an accelerator, one
    synchronisation), which the range check and the timestep-embedding memo (keyed by content) both use."""
    return timestep.detach().to("cpu", copy=True)


def same_timestep_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two host copies from [`read_timestep`] hold the same values, bit for bit (a host comparison)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() and a.element_size() in _SAME_SIZE_INTS:
        return torch.equal(a.view(_SAME_SIZE_INTS[a.element_size()]), b.view(_SAME_SIZE_INTS[b.element_size()]))
    return torch.equal(a, b)


_SAME_SIZE_INTS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def check_transformer_inputs(
    config: Any,
    hidden_states: Any,
    timestep: Any,
    encoder_hidden_states: Any,
    encoder_hidden_states_image: Any,
    *,
    start_frame: Any,
    cache_tag: Any,
    store_kv: Any,
    compute_dtype: Callable[[torch.device], torch.dtype | None],
    image_dim: int | None,
) -> torch.Tensor:
    """Raise ``ValueError`` for any input the forward cannot take; return the host copy of ``timestep``'s values
    ([`read_timestep`]: the only values read).

    ``compute_dtype(device)`` is the dtype the model computes in on ``device`` (``None`` under autocast, which casts
    for itself); ``image_dim`` is the width the model's image embedder takes (``None``: the model has none).
    """
    hidden_states = _check_tensor("hidden_states", hidden_states, 5, "(B, C, F, H, W)")
    if hidden_states.shape[1] != config.in_channels:
        raise ValueError(
            f"`hidden_states` must have {config.in_channels} channels (the model's `in_channels`), got "
            f"{hidden_states.shape[1]} (shape {tuple(hidden_states.shape)})."
        )
    if 0 in hidden_states.shape:
        raise ValueError(f"`hidden_states` is empty: shape {tuple(hidden_states.shape)}.")
    batch_size, device = hidden_states.shape[0], hidden_states.device
    dtype = compute_dtype(device)
    _check_dtype("hidden_states", hidden_states, dtype)

    conditioning = [("encoder_hidden_states", encoder_hidden_states, config.text_dim, "text_dim")]
    if encoder_hidden_states_image is not None:
        if image_dim is None:
            raise ValueError("`encoder_hidden_states_image` was given but this model has no image embedder.")
        conditioning.append(("encoder_hidden_states_image", encoder_hidden_states_image, image_dim, "image_dim"))
    for name, value, width, width_name in conditioning:
        value = _check_tensor(name, value, 3, f"(B, L, {width_name})")
        if value.shape[0] != batch_size:
            raise ValueError(f"`{name}` has batch {value.shape[0]}, `hidden_states` has batch {batch_size}.")
        if value.shape[1] == 0:
            raise ValueError(f"`{name}` has zero tokens (shape {tuple(value.shape)}); it needs at least one.")
        if value.shape[2] != width:
            raise ValueError(
                f"`{name}` must have width {width} (the model's `{width_name}`), got {value.shape[2]} "
                f"(shape {tuple(value.shape)})."
            )
        if value.device != device:
            raise ValueError(f"`{name}` is on {value.device}, `hidden_states` on {device}: put them on one device.")
        _check_dtype(name, value, dtype)

    if not isinstance(timestep, torch.Tensor):
        raise ValueError(f"`timestep` must be a tensor of shape (B,) or (B, F), got {type(timestep).__name__}.")
    if timestep.is_meta:
        raise ValueError("`timestep` is on the meta device (it holds no values); pass a tensor with data.")
    if timestep.dtype == torch.bool or timestep.is_complex():
        raise ValueError(f"`timestep` must be a real-valued tensor, got dtype {timestep.dtype}.")
    values = read_timestep(timestep)  # checked on the host: no further device read
    if values.numel() and bool(((values < 0) | (values > 1000) | values.isnan()).any()):
        raise ValueError(
            "`timestep` must hold model-scale timesteps in [0, 1000], got values in "
            f"[{values.min().item()}, {values.max().item()}]."
        )

    if isinstance(start_frame, bool) or not isinstance(start_frame, int):
        raise ValueError(f"`start_frame` must be an int, got {type(start_frame).__name__}.")
    if start_frame < 0:
        raise ValueError(
            f"`start_frame` must be >= 0 (the absolute latent index of the first frame), got {start_frame}."
        )
    if not isinstance(cache_tag, str):
        raise ValueError(f"`cache_tag` must be a string such as 'pos' or 'neg', got {cache_tag!r}.")
    if not isinstance(store_kv, bool):
        raise ValueError(f"`store_kv` must be True or False, got {store_kv!r}.")
    return values
