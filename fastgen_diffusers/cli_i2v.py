"""``--image`` / ``--video`` for ``fastgen-diffusers generate``: image-to-video and clip extension.

``cli.generate`` wires these in three places: :func:`add_image_arguments` on its parser, :func:`load_i2v_pipeline`
instead of the text-to-video pipeline when :func:`wants_i2v`, and :func:`conditioning_kwargs` in the pipeline call.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

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
    from .pipelines import WanCausalImageToVideoPipeline

    if args.model is None:
        from .testing import tiny_components

        return WanCausalImageToVideoPipeline(**tiny_components(independent_first_frame=True))
    return WanCausalImageToVideoPipeline.from_pretrained(args.model, torch_dtype=dtype)


def conditioning_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``{"image": PIL image}`` or ``{"video": [PIL images]}`` loaded from ``--image`` / ``--video``; ``{}`` if
    neither. A missing file is a ``ValueError`` naming the option."""
    from diffusers.utils import load_image, load_video

    for name, loader in (("image", load_image), ("video", load_video)):
        path = getattr(args, name, None)
        if path is None:
            continue
        if not Path(path).is_file():
            raise ValueError(f"--{name} {path}: no such file.")
        return {name: loader(str(path))}
    return {}
