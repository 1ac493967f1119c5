"""Typed call options: the arguments of a causal pipeline's ``__call__`` (and ``stream``) as one value.

``__call__`` builds its options from its arguments ([`call_options`]: a renamed argument fails loudly), the shared
prepare template reads them, and ``resolve_options`` builds the call's [`RolloutSettings`] once, the pipeline's
stored settings filling what the call left out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import PIL.Image
import torch

from ...settings import RolloutSettings


@dataclass(kw_only=True)
class RolloutOptions:
    """The arguments of [`WanCausalPipeline.__call__`] (see there), ``return_dict`` included."""

    prompt: str | list[str] | dict[int, Any] | None = None
    negative_prompt: str | list[str] | None = None
    height: int | None = 480
    width: int | None = 832
    num_frames: int = 81
    num_inference_steps: int | None = None
    timesteps: Sequence[float] | None = None
    sigmas: Sequence[float] | None = None
    first_chunk_timesteps: Sequence[float] | None = None
    guidance_scale: float = 1.0
    chunk_size: int | None = None
    context_noise: float | None = None
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
    keep_cache: bool = False
    recache: bool = False
    attention_window: int | None = None
    sink_frames: int | None = None
    kv_cache_engine: str | None = "static"
    num_videos_per_prompt: int = 1
    kv_cache_policy: str | None = None
    context_frames: int | None = None
    kv_cache_attention_bias: float | None = None
    # window-relative RoPE and EMA sink (Reward Forcing)
    rope_positions: str | None = None
    sink_update: str | None = None
    sink_decay: float | None = None
    # 8-bit KV cache: storage dtype of the self K/V (None: the compute dtype)
    kv_cache_dtype: torch.dtype | str | None = None
    # Krea's re-encoded anchor (recompute) and prompt transitions
    keep_first_frame: bool | None = None
    prompt_transition_chunks: int = 0
    # prompt-switch policies: LongLive's kept sink at a recache, Infinity-RoPE's KV flush and scene cuts
    recache_sink: str = "rerun"
    kv_flush: bool = False
    rope_cut: bool | Sequence[int] = False
    # the call's settings as one value (its flat arguments above at their defaults leave its values standing); after
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
