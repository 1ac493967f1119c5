"""``generate``'s checks of the chunk layout a command line asks for, before any model loads.

The transformer's chunk size, first-chunk rule and RoPE table are in ``transformer/config.json`` and the stored
sampling settings in ``model_index.json``: with the frame count known (after ``--video`` / ``--input-video`` are
read), the chunks of the rollout are known too, and so is everything the pipeline would refuse about them once loaded:
a window smaller than a chunk, an EMA sink whose evictions do not match its size, the rolling policy with fewer
chunks than steps or past the RoPE table, a video past the RoPE table, a prompt switch past the last chunk or two in
one chunk. The window and EMA rules are the engines' own (:class:`~fastgen_diffusers.kv_cache.AttentionWindow`,
``check_ema_chunks``), with the pipeline's messages.
"""

from __future__ import annotations

import argparse

from .common import TEMPORAL_FACTOR, UsageError, latent_frames, stored_settings, transformer_layout
from .i2v import wants_i2v
from .v2v import wants_v2v

DEFAULT_STEPS = 4  # the pipelines' steps when neither the call nor the model names a schedule


def effective_settings(args: argparse.Namespace, stored: dict) -> dict:
    """The settings the pipeline will sample with: each flag given, else the model's ``stored`` one (as the
    pipelines' ``resolve_options`` combines them). A stored ``recompute`` / ``rolling`` policy does not apply to the
    image-to-video and VACE pipelines (they sample sequentially)."""
    from .checks import wants_vace

    conditioned = wants_i2v(args) or wants_vace(args)
    stored_policy = stored.get("kv_cache_policy")
    if conditioned and stored_policy in ("recompute", "rolling"):
        stored_policy = None
    policy = args.kv_cache_policy or stored_policy or "sequential"
    given_window = args.attention_window is not None
    if args.steps is not None:
        steps = args.steps
    else:
        timesteps = stored.get("timesteps")
        steps = len(timesteps) if isinstance(timesteps, list) and timesteps else DEFAULT_STEPS
    return {
        "kv_cache_policy": policy,
        "attention_window": args.attention_window if given_window else stored.get("attention_window"),
        "sink_frames": (args.sink_frames or 0) if given_window else (stored.get("sink_frames") or 0),
        "rope_positions": args.rope_positions or stored.get("rope_positions") or "absolute",
        "sink_update": args.sink_update or stored.get("sink_update") or "fixed",
        "steps": steps,
    }


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
    stored = stored_settings(args.model)
    layout = transformer_layout(args.model, image_to_video=wants_i2v(args))
    if stored is None or layout is None or args.num_frames is None:
        return
    settings = effective_settings(args, stored)
    bounds = rollout_bounds(latent_frames(args.num_frames), layout, whole_chunks=wants_v2v(args))
    try:
        check_windowed_chunks(settings, bounds)
    except ValueError as error:
        raise UsageError(str(error)) from None
    check_rope_table(settings, bounds, layout["rope_max_seq_len"])
    steps = settings["steps"]
    if settings["kv_cache_policy"] == "rolling" and len(bounds) < steps:
        raise UsageError(
            f"`kv_cache_policy='rolling'` needs at least as many chunks as denoising steps: {steps} steps, "
            f"{len(bounds)} chunks of latent frames {bounds}. Ask for more --num-frames or fewer --steps."
        )
    check_switch_chunks(args, bounds)
    if given_frames is not None and layout["t2v_student"] and not stored.get("expand_timesteps"):
        check_given_chunks(args, given_frames, bounds, layout)


def check_given_chunks(args: argparse.Namespace, frames: int, bounds: list[tuple[int, int]], layout: dict) -> None:
    """A T2V student takes ``--image`` / ``--video`` as whole chunks: their latent frames must end a chunk (the
    image-to-video pipeline's rule and message)."""
    ends = [end for _, end in bounds]
    if latent_frames(frames) in ends:
        return
    name = "--image" if args.image is not None else "--video"
    fits = [(end - 1) * TEMPORAL_FACTOR + 1 for end in ends[:-1]]
    hint = (
        " A single image is a chunk of its own only for a student trained with independent_first_frame=True; "
        "otherwise extend a --video clip."
        if frames == 1
        else ""
    )
    raise UsageError(
        f"{name} encodes to {latent_frames(frames)} latent frames, which do not fill whole chunks of this rollout "
        f"(chunks end at latent frames {ends}; chunk_size={layout['chunk_size']}, independent_first_frame="
        f"{layout['independent_first_frame']}). Accepted clip lengths: {fits} frames.{hint}"
    )


def check_windowed_chunks(settings: dict, bounds: list[tuple[int, int]]) -> None:
    """The engines' window rules on the rollout's chunks: each chunk fits the window beside the sink; under an EMA
    sink every eviction removes exactly the sink's frames (``ValueError``, the engines' message)."""
    window = settings["attention_window"]
    if window is None or settings["kv_cache_policy"] == "recompute":
        return
    from ..kv_cache import AttentionWindow

    sink = 0 if settings["kv_cache_policy"] == "rolling" else settings["sink_frames"]
    value = AttentionWindow(window, sink)
    value.check_chunks(bounds)
    if settings["sink_update"] == "ema" and settings["kv_cache_policy"] == "sequential" and sink:
        from ..kv_cache.base import check_ema_chunks

        check_ema_chunks(value, bounds)


def check_rope_table(settings: dict, bounds: list[tuple[int, int]], table: int) -> None:
    """A video past the transformer's RoPE table needs positions that stay within it: window-relative ones, or the
    recompute policy's (the CLI never enables RoPE re-basing)."""
    frames = bounds[-1][1]
    if frames <= table or settings["kv_cache_policy"] == "recompute" or settings["rope_positions"] == "window":
        return
    raise UsageError(
        f"{frames} latent frames run past the transformer's RoPE table of {table} frames (`rope_max_seq_len`); ask "
        "for fewer --num-frames, or use --rope-positions window with --attention-window (positions within the "
        "window) for longer videos."
    )


def check_switch_chunks(args: argparse.Namespace, bounds: list[tuple[int, int]]) -> None:
    """Each ``--prompt-switch`` takes effect at the first chunk starting at or after its pixel frame: one past the last
    chunk's start, or two at one chunk, are refused (the pipeline's rule and message)."""
    from .checks import prompt_switches

    firsts = [0 if start == 0 else TEMPORAL_FACTOR * start - (TEMPORAL_FACTOR - 1) for start, _ in bounds]
    taken: set[int] = set()
    for frame in sorted(prompt_switches(args)):
        index = next((i for i, first in enumerate(firsts) if first >= frame), None)
        if index is None:
            raise UsageError(
                f"--prompt-switch {frame}: past the last chunk, which starts at pixel frame {firsts[-1]}; chunks "
                f"start at pixel frames {firsts}."
            )
        if index in taken:
            raise UsageError(
                f"--prompt-switch {frame}: two prompt switches take effect at the same chunk (starting at pixel "
                f"frame {firsts[index]}); chunks start at pixel frames {firsts}: keep one switch per chunk."
            )
        taken.add(index)
