"""``generate``'s checks of the chunk layout a command line asks for, before any model loads.

The transformer's chunk size, first-chunk rule and RoPE table are in ``transformer/config.json`` and the stored
sampling settings in ``model_index.json``: with the frame count known (after ``--video`` / ``--input-video`` are
read), the chunks of the rollout are known too, and so is everything the pipeline would refuse about them once loaded.
Those rules are the settings' own ([`RolloutSettings.check_chunks`]: a window smaller than a chunk, an EMA sink whose
evictions do not match its size, the policy's rule (rolling: fewer chunks than steps, past the RoPE table), a video
past the RoPE table, a prompt switch past the last chunk or two in one chunk), asked here with the same settings the
pipeline builds (``cli.checks.generate_settings``) and given with their messages.
"""

from __future__ import annotations

import argparse

from .common import UsageError, flag, latent_frames, stored_settings, transformer_layout
from .i2v import wants_i2v
from .v2v import wants_v2v


def rollout_bounds(num_latent: int, layout: dict, whole_chunks: bool) -> list[tuple[int, int]]:
    """``[start, end)`` latent ranges of the rollout's chunks: the transformer's partition (the first chunk absorbs
    the remainder, or is one frame under ``independent_first_frame``); ``whole_chunks`` (video-to-video): only the
    whole chunks of the input, the rest dropped."""
    from ..chunking import chunk_bounds, chunk_layout

    chunk, first_alone = layout["chunk_size"], layout["independent_first_frame"]
    if not whole_chunks:
        return chunk_bounds(chunk_layout(num_latent, chunk, first_alone))
    sizes = [1] if first_alone else []
    rest = num_latent - sum(sizes)
    sizes += [chunk] * (rest // chunk)
    return chunk_bounds(tuple(sizes or [num_latent]))


def check_rollout_layout(args: argparse.Namespace, given_frames: int | None = None) -> None:
    """Raise :class:`UsageError` for what the pipeline would refuse about the rollout's chunks (see the module
    docstring); nothing when the frame count or the model's configs are not at hand (the pipeline checks then).
    ``given_frames``: the pixel frames of ``--image`` (1) or ``--video``, which a T2V student takes as its first
    chunks."""
    from .checks import generate_settings

    layout = transformer_layout(args.model, image_to_video=wants_i2v(args))
    settings = generate_settings(args)
    if settings is None or layout is None or args.num_frames is None:
        return
    # VACE's reference images are latent frames of their own before the video's frame 0
    references = len(getattr(args, "reference_image", None) or ())
    num_latent = latent_frames(args.num_frames) + references
    bounds = rollout_bounds(num_latent, layout, whole_chunks=wants_v2v(args))
    try:
        settings.check_chunks(
            bounds, layout["chunk_size"], rope_table=layout["rope_max_seq_len"], leading_frames=references
        )
    except ValueError as error:
        raise UsageError(str(error)) from None
    stored = stored_settings(args.model) or {}
    if given_frames is not None and layout["t2v_student"] and not stored.get("expand_timesteps"):
        from ..chunking import check_given_frames

        name = "image" if getattr(args, "image", None) is not None else "video"
        try:  # the image-to-video pipeline's rule: the given frames fill whole chunks of a T2V student
            check_given_frames(
                name, given_frames, args.num_frames, bounds, layout["chunk_size"], layout["independent_first_frame"]
            )
        except ValueError as error:
            raise UsageError(f"{error} ({flag(name)} {getattr(args, name)})") from None
