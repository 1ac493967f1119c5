"""``--input-video`` / ``--strength`` / ``--motion-aware`` for ``fastgen-diffusers generate``: live video-to-video.

``cli.generate`` wires these in like ``cli_i2v``: :func:`add_input_video_arguments` on its parser,
:func:`check_input_video_arguments` among the pre-load checks (before the size defaults are filled in: with
``--input-video`` the output size is the video's unless ``--height``/``--width`` resize it),
:func:`input_video_kwargs` to read the frames before the model loads, :func:`load_v2v_pipeline` instead of the
text-to-video pipeline and :func:`strength_argument` in the pipeline call. Nothing here imports torch or the pipelines
at module level (``--help`` is timed, and the CLI tests block the model modules while a bad command line runs).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .checks import CONDITIONED_INPUTS, SIZE_MULTIPLE, read_media
from .common import TEMPORAL_FACTOR, UsageError, flag, transformer_layout

if TYPE_CHECKING:
    import torch

DEFAULT_STRENGTH = 0.7
# `--input-video` restyles a video: these flags condition generation another way and are refused with it.
OTHER_INPUTS = CONDITIONED_INPUTS


def add_input_video_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--input-video``, ``--strength`` and ``--motion-aware`` (a group of their own)."""
    group = parser.add_argument_group("video-to-video (WanCausalVideoToVideoPipeline)")
    group.add_argument(
        "--input-video",
        type=Path,
        metavar="PATH",
        help="video to restyle chunk by chunk (mp4/gif); the output has its size (or --height x --width, resized "
        "to) and the frames of its whole chunks (the first --num-frames, when given)",
    )
    group.add_argument(
        "--strength",
        type=float,
        metavar="FLOAT",
        help=f"how much of each input chunk is re-imagined, in [0, 1]: 0 returns the input, 1 is text-to-video "
        f"(default: {DEFAULT_STRENGTH})",
    )
    group.add_argument(
        "--motion-aware",
        action="store_true",
        help="lower the strength below --strength while the input moves fast (MotionAwareStrength)",
    )


def wants_v2v(args: argparse.Namespace) -> bool:
    """Whether ``--input-video`` was given."""
    return getattr(args, "input_video", None) is not None


def check_input_video_arguments(args: argparse.Namespace) -> None:
    """The checks of the video-to-video flags that need neither the video's frames nor a model; fills in the default
    ``--strength``. Runs before the size defaults are filled in."""
    if not wants_v2v(args):
        if args.strength is not None or args.motion_aware:
            name = "--strength" if args.strength is not None else "--motion-aware"
            raise UsageError(f"{name} needs --input-video (the video to restyle).")
        return
    others = [name for name in OTHER_INPUTS if getattr(args, name, None)]
    if others:
        names = "/".join(flag(name) for name in others)
        raise UsageError(f"--input-video cannot be combined with {names} (it is the video to restyle).")
    if args.strength is None:
        args.strength = DEFAULT_STRENGTH
    if not (math.isfinite(args.strength) and 0.0 <= args.strength <= 1.0):
        raise UsageError(
            f"--strength must be in [0, 1] (0 returns the input, 1 is text-to-video), got {args.strength}."
        )
    if (args.height is None) != (args.width is None):
        raise UsageError(
            "--input-video: pass both --height and --width (the frames are resized to them) or neither (the "
            "video's own size)."
        )
    if not Path(args.input_video).is_file():
        raise UsageError(f"--input-video {args.input_video}: no such file.")


def first_chunk_frames(model: str | None) -> int | None:
    """Pixel frames of the first chunk of ``--model``'s student (``1 + 4(n - 1)``, ``n`` its first chunk's latent
    frames), from its transformer's chunking (``cli.common.transformer_layout``: its ``transformer/config.json``, or
    the built-in tiny model's); ``None`` when that is not at hand (the pipeline checks it then)."""
    layout = transformer_layout(model)
    if layout is None:
        return None
    if layout["independent_first_frame"]:
        return 1
    return 1 + TEMPORAL_FACTOR * (layout["chunk_size"] - 1)


def input_video_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``{"video": [PIL frames]}`` read from ``--input-video`` (``{}`` without it), before the model loads; sets
    ``args.height``/``args.width`` to the output size and ``args.num_frames`` to the frames used.

    The frames are resized to ``--height`` x ``--width`` when given; otherwise the video's size must be a multiple of
    16. ``--num-frames`` (4k+1) keeps the first frames. A file that does not decode, a size that is not a multiple of
    16, or fewer frames than ``--num-frames`` or than the student's first chunk is a :class:`UsageError` naming the
    flag. Frames after the last whole chunk are dropped by the pipeline, with a warning."""
    if not wants_v2v(args):
        return {}
    path = args.input_video
    frames = read_media("input_video", path, "video")
    frames = [frame if frame.mode == "RGB" else frame.convert("RGB") for frame in frames]
    if args.num_frames is not None:
        if len(frames) < args.num_frames:
            raise UsageError(
                f"--input-video {path}: has {len(frames)} frames, fewer than --num-frames {args.num_frames}."
            )
        frames = frames[: args.num_frames]
    needed = first_chunk_frames(args.model)
    if needed is not None and len(frames) < needed:
        raise UsageError(f"--input-video {path}: has {len(frames)} frames; the student's first chunk needs {needed}.")
    width, height = size = frames[0].size
    if args.height is None:
        if height % SIZE_MULTIPLE or width % SIZE_MULTIPLE:
            near_width, near_height = (max(SIZE_MULTIPLE, round(n / SIZE_MULTIPLE) * SIZE_MULTIPLE) for n in size)
            raise UsageError(
                f"--input-video {path}: frames are {width}x{height}, not multiples of {SIZE_MULTIPLE}; pass --width "
                f"and --height to resize them (e.g. --width {near_width} --height {near_height})."
            )
        args.height, args.width = height, width
    elif (width, height) != (args.width, args.height):
        import PIL.Image

        frames = [frame.resize((args.width, args.height), PIL.Image.Resampling.BICUBIC) for frame in frames]
    args.num_frames = len(frames)
    return {"video": frames}


def strength_argument(args: argparse.Namespace) -> float | Any:
    """The pipeline's ``strength``: ``--strength``, or with ``--motion-aware`` a [`MotionAwareStrength`] whose still
    input gets ``--strength`` (its other settings the defaults, the sensitivity capped at ``--strength``)."""
    if not args.motion_aware:
        return args.strength
    from ..pipelines import MotionAwareStrength

    return MotionAwareStrength(
        max_strength=args.strength,
        sensitivity=min(0.2, args.strength),
        initial_strength=args.strength,
    )


def load_v2v_pipeline(args: argparse.Namespace, dtype: torch.dtype):
    """The [`WanCausalVideoToVideoPipeline`] of ``--model``, or, without it, of the tiny random student."""
    from ..pipelines import WanCausalVideoToVideoPipeline

    if args.model is None:
        from ..testing import tiny_components

        return WanCausalVideoToVideoPipeline(**tiny_components())
    return WanCausalVideoToVideoPipeline.from_pretrained(args.model, dtype=dtype)
