"""``--image`` / ``--video`` for ``fastgen-diffusers generate``: image-to-video and clip extension.

``cli.generate`` wires these in three places: :func:`add_image_arguments` on its parser, :func:`load_i2v_pipeline`
instead of the text-to-video pipeline when :func:`wants_i2v`, and :func:`conditioning_kwargs` in the pipeline call.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .checks import read_media

if TYPE_CHECKING:
    import torch


def add_image_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the mutually exclusive ``--image PATH`` and ``--video PATH`` options."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--image",
        type=Path,
        help="first frame (png/jpg): image-to-video with WanCausalImageToVideoPipeline; resized to --height/--width",
    )
    group.add_argument(
        "--video",
        type=Path,
        help="clip to extend (mp4/gif, 4k+1 frames filling whole chunks; T2V students only); output includes it",
    )


def wants_i2v(args: argparse.Namespace) -> bool:
    """Whether ``--image`` or ``--video`` was given."""
    return getattr(args, "image", None) is not None or getattr(args, "video", None) is not None


def load_i2v_pipeline(args: argparse.Namespace, dtype: torch.dtype):
    """The [`WanCausalImageToVideoPipeline`] of ``--model``, or, without it, the tiny random T2V student with a
    ``[1, 3, 3, ...]`` chunk layout (so that a single image is a chunk of its own)."""
    from ..pipelines import WanCausalImageToVideoPipeline

    if args.model is None:
        from ..testing import tiny_components

        return WanCausalImageToVideoPipeline(**tiny_components(independent_first_frame=True))
    return WanCausalImageToVideoPipeline.from_pretrained(args.model, dtype=dtype)


def conditioning_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``{"image": PIL image}`` or ``{"video": [PIL images]}`` read from ``--image`` / ``--video``; ``{}`` if neither.
    Runs before the model loads: an unreadable file is a :class:`UsageError` naming the option (whether a clip fills
    whole chunks and leaves some to generate is checked with the rollout's chunks: ``cli.layout``)."""
    if getattr(args, "image", None) is not None:
        return {"image": read_media("image", args.image, "image")}
    if getattr(args, "video", None) is None:
        return {}
    return {"video": read_media("video", args.video, "video")}
