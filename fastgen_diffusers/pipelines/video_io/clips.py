"""Video clips given to the pipelines (a clip to extend, a VACE control video or mask): one parser for all."""

from __future__ import annotations

from typing import Any

import numpy as np
import PIL.Image
import torch


def clip_layout(video: Any, name: str) -> tuple[int, int, int, int]:
    """``(frames, channels, height, width)`` of PIL frames, an ``(F, C, H, W)`` tensor or an ``(F, H, W, C)`` array
    (a leading batch of 1 allowed); ``ValueError`` for anything else."""
    if isinstance(video, list) and video and all(isinstance(frame, PIL.Image.Image) for frame in video):
        sizes = {frame.size for frame in video}
        if len(sizes) != 1:
            raise ValueError(f"`{name}` frames must all have one size, got sizes {sorted(sizes)}.")
        width, height = sizes.pop()
        return len(video), len(video[0].getbands()), height, width
    if isinstance(video, (torch.Tensor, np.ndarray)):
        shape = tuple(video.shape)
        if len(shape) == 5 and shape[0] == 1:
            shape = shape[1:]
        if len(shape) == 4:
            if isinstance(video, torch.Tensor):
                return shape
            return shape[0], shape[3], shape[1], shape[2]
    shape = tuple(video.shape) if hasattr(video, "shape") else type(video).__name__
    raise ValueError(
        f"`{name}` must be a list of PIL images, a (frames, channels, height, width) tensor or a (frames, height, "
        f"width, channels) array, got {shape}."
    )


def first_frames(video: Any, num_frames: int, fill: float = 0.0) -> Any:
    """The first ``num_frames`` frames; tensors and arrays as a batch of one ``(1, F, ...)`` (``preprocess_video``).

    A clip shorter than ``num_frames`` (a continued rollout) is padded with frames of ``fill`` (0: black, 1: white,
    in [0, 1] units; PIL frames in their mode).
    """
    if video is None:
        return None
    if isinstance(video, list):
        missing = num_frames - len(video)
        if missing > 0:
            pad = PIL.Image.new(video[0].mode, video[0].size, tuple([int(fill * 255)] * len(video[0].getbands())))
            video = video + [pad] * missing
        return video[:num_frames]
    video = video if video.ndim == 5 else video[None]
    missing = num_frames - video.shape[1]
    if missing > 0:
        shape = (video.shape[0], missing, *video.shape[2:])
        if isinstance(video, torch.Tensor):
            pad = torch.full(shape, fill, dtype=video.dtype, device=video.device)
            video = torch.cat([video, pad], dim=1)
        else:
            scale = 255 if video.dtype == np.uint8 else 1
            video = np.concatenate([video, np.full(shape, fill * scale, dtype=video.dtype)], axis=1)
    return video[:, :num_frames]


def clip_frames(video: Any, name: str) -> list:
    """The frames of a clip, one item each: PIL images, ``(C, H, W)`` tensors or ``(H, W, C)`` arrays (checked by
    [`clip_layout`])."""
    clip_layout(video, name)
    if isinstance(video, list):
        return video
    return list(video[0] if video.ndim == 5 else video)
