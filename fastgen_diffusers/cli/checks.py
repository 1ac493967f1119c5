"""Checks of ``fastgen-diffusers generate``'s arguments that need no model, run before anything loads.

A multi-GB load must not precede "num_frames must be 4k+1": :func:`check_generate_arguments` refuses every bad number,
missing file, unwritable output, unknown model path and absent device first, with a :class:`UsageError` naming the
flag, which ``cli.main`` prints as one line. Nothing here imports the pipelines (the CLI tests block them while a bad
command line runs); torch is imported only to probe ``--device``.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path

from .common import TEMPORAL_FACTOR, UsageError, flag, stored_settings

# Defaults for a real model (Wan2.1 480p) and for the built-in tiny random model (a seconds-long CPU smoke test).
REAL_DEFAULTS = {"height": 480, "width": 832, "num_frames": 81}
TINY_DEFAULTS = {"height": 64, "width": 64, "num_frames": 21}
# Containers diffusers' `export_to_video` and the streamed writer (both `imageio.get_writer(path, fps=...)`) write as
# a readable video; tests/test_cli_errors.py writes and reads back each. (imageio also "writes" .webm, but ffmpeg
# refuses H.264 in WebM and the file stays empty.)
VIDEO_EXTENSIONS = (".mp4", ".mkv", ".mov", ".avi", ".gif")
SIZE_MULTIPLE = 16  # VAE spatial factor 8 x patch size 2 (Wan2.1)
INPUT_FILES = ("image", "video", "control_video", "mask")


def check_generate_arguments(args: argparse.Namespace) -> None:
    """Raise :class:`UsageError` for anything wrong on the ``generate`` command line that needs no model; fills in the
    size defaults (``height``, ``width``, ``num_frames``: the tiny model's without ``--model``; with ``--input-video``
    they stay unset unless given, and come from the video when it is read) and ``--strength``'s."""
    from .v2v import check_input_video_arguments, wants_v2v

    check_input_video_arguments(args)  # with --input-video the size and frame count are the video's by default
    defaults = TINY_DEFAULTS if args.model is None else REAL_DEFAULTS
    for name, default in defaults.items():
        if getattr(args, name) is None and not wants_v2v(args):
            setattr(args, name, default)
    check_numbers(args)
    check_input_files(args)
    check_output(args.output)
    if args.model is not None:
        check_model(args.model)
    check_conditioned_options(args)
    check_stored_settings(args, stored_settings(args.model))
    if args.context_parallel:
        if wants_vace(args):  # the VACE transformer refuses it once loaded; say so before the load
            raise UsageError(
                "--context-parallel does not support VACE (--control-video, --mask, --reference-image) yet; run it "
                "in one process."
            )
        check_context_parallel_launch()
    else:
        check_device(args.device)


def _at_least(args: argparse.Namespace, name: str, minimum: int) -> None:
    value = getattr(args, name)
    if value < minimum:
        raise UsageError(f"{flag(name)} must be at least {minimum}, got {value}.")


def check_numbers(args: argparse.Namespace) -> None:
    """Frame count 4k+1, size a positive multiple of 16, positive steps and fps, a finite guidance >= 1 or 0, a seed
    torch takes, a positive window with a sink inside it (``0`` is refused, never read as "the default"). ``None``
    frame count or size (``--input-video`` without them) is left to the video."""
    if args.num_frames is not None and (args.num_frames < 1 or (args.num_frames - 1) % TEMPORAL_FACTOR):
        raise UsageError(f"--num-frames must be 4k+1 (1, 5, 9, ..., 81: whole latent frames), got {args.num_frames}.")
    for name in ("height", "width"):
        value = getattr(args, name)
        if value is not None and (value < SIZE_MULTIPLE or value % SIZE_MULTIPLE):
            raise UsageError(f"{flag(name)} must be a positive multiple of {SIZE_MULTIPLE}, got {value}.")
    if args.steps is not None:
        _at_least(args, "steps", 1)
    _at_least(args, "fps", 1)
    guidance = args.guidance_scale
    if not math.isfinite(guidance) or not (guidance == 0 or guidance >= 1):  # the pipelines' `guidance_scale` rule
        raise UsageError(
            f"--guidance-scale must be a finite number >= 1 or 0 (0 and 1 disable classifier-free guidance), got "
            f"{guidance}."
        )
    if not 0 <= args.seed < 2**64:
        raise UsageError(f"--seed must be in [0, 2**64), got {args.seed}.")
    check_kv_cache_policy(args)
    check_kv_cache_positions(args)
    check_kv_cache_dtype(args)
    if args.attention_window is None:
        if args.sink_frames is not None:
            raise UsageError("--sink-frames needs --attention-window (the sink is kept inside the window).")
        return
    _at_least(args, "attention_window", 1)
    sink = args.sink_frames or 0
    if sink < 0 or sink >= args.attention_window:
        raise UsageError(
            f"--sink-frames must be in [0, --attention-window) = [0, {args.attention_window}), got {sink}."
        )


def prompt_switches(args: argparse.Namespace) -> dict[int, str]:
    """``--prompt-switch FRAME:PROMPT`` flags as ``{frame: prompt}`` (``UsageError`` for a malformed one)."""
    switches: dict[int, str] = {}
    for value in getattr(args, "prompt_switch", None) or ():
        frame, sep, prompt = value.partition(":")
        if not sep or not frame.strip().isdigit() or int(frame) < 1 or not prompt.strip():
            raise UsageError(
                f"--prompt-switch must be FRAME:PROMPT with FRAME a pixel frame >= 1 (e.g. 48:a dog), got {value!r}."
            )
        if int(frame) in switches:
            raise UsageError(f"--prompt-switch names pixel frame {int(frame)} twice.")
        switches[int(frame)] = prompt.strip()
    return switches


def check_prompt_switches(args: argparse.Namespace) -> None:
    """``--prompt-switch`` well formed and inside ``--num-frames``; ``--prompt-transition-chunks`` >= 0 and only with a
    ``--prompt-switch``."""
    switches = prompt_switches(args)
    num_frames = getattr(args, "num_frames", None)
    late = [frame for frame in switches if num_frames is not None and frame >= num_frames]
    if late:
        raise UsageError(f"--prompt-switch at pixel frame {late[0]} is past the video's {num_frames} frames.")
    chunks = getattr(args, "prompt_transition_chunks", None)
    if chunks is None:
        return
    if chunks < 0:
        raise UsageError(f"--prompt-transition-chunks must be at least 0 (0 and 1: switch at once), got {chunks}.")
    if not switches:
        raise UsageError("--prompt-transition-chunks needs a --prompt-switch FRAME:PROMPT to blend in.")


def check_kv_cache_policy(args: argparse.Namespace) -> None:
    """``--context-frames`` >= 1, only with ``--kv-cache-policy recompute``, which does not combine with
    ``--attention-window``/``--sink-frames``; ``--kv-cache-attention-bias`` in [0.01, 1] (any policy);
    ``--kv-cache-policy rolling`` is text-to-video only and keeps its first chunk as the sink (no
    ``--sink-frames``)."""
    if getattr(args, "kv_cache_policy", None) == "rolling":
        if args.sink_frames is not None:
            raise UsageError("--kv-cache-policy rolling keeps its first chunk as the sink: pass no --sink-frames.")
        positions = [name for name in POSITION_FLAGS if getattr(args, name, None) is not None]
        if positions:
            raise UsageError(
                f"{flag(positions[0])} cannot be combined with --kv-cache-policy rolling (it positions its keys "
                "itself: absolute, the anchor re-rotated)."
            )
        conditioned = [f"--{name.replace('_', '-')}" for name in ROLLING_REFUSED_INPUTS if getattr(args, name, None)]
        if conditioned:
            raise UsageError(
                f"--kv-cache-policy rolling drives text-to-video only; it cannot be combined with {conditioned[0]}."
            )
    recompute = getattr(args, "kv_cache_policy", None) == "recompute"
    bias = getattr(args, "kv_cache_attention_bias", None)
    if bias is not None and not (math.isfinite(bias) and 0.01 <= bias <= 1):
        raise UsageError(f"--kv-cache-attention-bias must be in [0.01, 1] (1 = off), got {bias}.")
    if getattr(args, "context_frames", None) is not None and not recompute:
        raise UsageError(f"{flag('context_frames')} needs --kv-cache-policy recompute.")
    if getattr(args, "keep_first_frame", False) and not recompute:
        raise UsageError("--keep-first-frame needs --kv-cache-policy recompute (it picks the recompute anchor).")
    check_prompt_switches(args)
    if not recompute:
        return
    if args.attention_window is not None or args.sink_frames is not None:
        raise UsageError(
            "--kv-cache-policy recompute cannot be combined with --attention-window/--sink-frames "
            "(the recompute context already bounds the cache)."
        )
    if args.context_frames is not None:
        _at_least(args, "context_frames", 1)


POSITION_FLAGS = ("rope_positions", "sink_update", "sink_decay")


def check_kv_cache_positions(args: argparse.Namespace) -> None:
    """``--sink-decay`` in (0, 1); ``--sink-update ema`` not with ``--rope-positions absolute`` nor ``--sink-frames
    0``; none of them with ``--kv-cache-policy recompute``. What depends on the model's stored window is checked by
    the pipeline (before any work)."""
    given = [name for name in POSITION_FLAGS if getattr(args, name, None) is not None]
    if given and getattr(args, "kv_cache_policy", None) == "recompute":
        raise UsageError(f"{flag(given[0])} cannot be combined with --kv-cache-policy recompute (no sliding window).")
    decay = getattr(args, "sink_decay", None)
    if decay is not None and not (math.isfinite(decay) and 0 < decay < 1):
        raise UsageError(f"--sink-decay must be in (0, 1) (exclusive), got {decay}.")
    if getattr(args, "sink_update", None) != "ema":
        return
    if getattr(args, "rope_positions", None) == "absolute":
        raise UsageError(
            "--sink-update ema averages keys of frames at different positions: it needs --rope-positions window."
        )
    if args.attention_window is not None and not args.sink_frames:
        raise UsageError("--sink-update ema averages evicted frames into the sink: give --sink-frames > 0.")


def check_kv_cache_dtype(args: argparse.Namespace) -> None:
    """``--kv-cache-dtype float8_e4m3fn`` needs a torch with that dtype (``int8`` always works)."""
    name = getattr(args, "kv_cache_dtype", None)
    if name is None:
        return
    import torch

    if getattr(torch, name, None) is None:
        raise UsageError(f"--kv-cache-dtype {name} needs a torch with {name} (torch {torch.__version__}); use int8.")


# Inputs of the image-to-video and VACE pipelines: their conditioning is read per chunk at the chunk's own frames, so
# they sample chunk by chunk (the attention bias and prompt transitions apply; Krea's recompute, which moves a chunk's
# forwards to the positions after its context, does not). tests/test_cli.py checks this against their signatures.
VACE_INPUTS = ("control_video", "mask", "reference_image")
CONDITIONED_INPUTS = ("image", "video", *VACE_INPUTS)
# conditioning inputs (image-to-video, VACE, video-to-video) that the rolling policy cannot drive
ROLLING_REFUSED_INPUTS = (*CONDITIONED_INPUTS, "input_video")


def check_conditioned_options(args: argparse.Namespace) -> None:
    """No ``--kv-cache-policy recompute`` with ``--image``/``--video`` or a VACE flag (those pipelines refuse it once
    loaded; ``rolling`` is refused by :func:`check_kv_cache_policy`)."""
    inputs = [name for name in CONDITIONED_INPUTS if getattr(args, name, None)]
    if inputs and getattr(args, "kv_cache_policy", None) == "recompute":
        raise UsageError(
            f"--kv-cache-policy recompute cannot be combined with {flag(inputs[0])}: the image-to-video and VACE "
            "pipelines read their conditioning at each chunk's own frames and sample chunk by chunk (the attention "
            "bias and --prompt-transition-chunks still apply)."
        )


def check_stored_settings(args: argparse.Namespace, stored: dict | None) -> None:
    """What the pipeline would refuse after loading, found from the flags and the model's ``stored`` settings (as
    ``resolve_options`` combines them): ``--kv-cache-policy recompute`` with no context frames, window positions or
    an EMA sink with no window, an EMA sink over absolute positions or no sink frames, or with an 8-bit cache."""
    if stored is None:
        return
    policy = args.kv_cache_policy or stored.get("kv_cache_policy") or "sequential"
    if policy == "recompute":
        stored_context = stored.get("kv_cache_policy") == "recompute" and stored.get("context_frames")
        if args.context_frames is None and not stored_context:
            raise UsageError("--kv-cache-policy recompute needs --context-frames N (the model stores none).")
        return
    if policy == "rolling":  # it positions its keys itself; check_kv_cache_policy refused the flags it does not take
        stored_rolling = "" if args.kv_cache_policy else " (the model stores --kv-cache-policy rolling)"
        positions = [name for name in POSITION_FLAGS if getattr(args, name, None) is not None]
        if positions or args.sink_frames is not None:
            name = flag(positions[0]) if positions else "--sink-frames"
            raise UsageError(
                f"{name} cannot be combined with --kv-cache-policy rolling{stored_rolling}: it keeps its first chunk "
                "as the sink and positions its keys itself; pass --kv-cache-policy sequential to use it."
            )
        if args.prompt_switch:
            raise UsageError(
                f"--prompt-switch cannot be combined with --kv-cache-policy rolling{stored_rolling}: it denoises "
                "several chunks per forward under one prompt; pass --kv-cache-policy sequential."
            )
        return
    given = args.attention_window is not None
    window = args.attention_window if given else stored.get("attention_window")
    sink = (args.sink_frames or 0) if given else (stored.get("sink_frames") or 0)
    rope = args.rope_positions or stored.get("rope_positions") or "absolute"
    sink_update = args.sink_update or stored.get("sink_update") or "fixed"
    stored_ema = "" if args.sink_update else " (the model stores --sink-update ema)"
    if (rope == "window" or sink_update == "ema") and window is None:
        name = "--rope-positions window" if rope == "window" else "--sink-update ema"
        raise UsageError(f"{name} needs --attention-window (the model stores no window).")
    if sink_update != "ema":
        return
    if rope != "window":
        raise UsageError(
            f"--sink-update ema averages keys of frames at different positions: it needs --rope-positions window"
            f"{stored_ema}."
        )
    if not sink:
        raise UsageError(
            f"--sink-update ema averages evicted frames into the sink: give --sink-frames > 0{stored_ema}."
        )
    if args.kv_cache_dtype is not None:
        raise UsageError(
            f"--kv-cache-dtype cannot be combined with --sink-update ema{stored_ema}: the EMA's updates fall below "
            "8-bit resolution; pass --sink-update fixed or no --kv-cache-dtype."
        )


def wants_vace(args: argparse.Namespace) -> bool:
    """Whether a VACE flag (``--control-video``, ``--mask``, ``--reference-image``) was given."""
    return any(getattr(args, name) for name in VACE_INPUTS)


def check_input_files(args: argparse.Namespace) -> None:
    """Every input flag names an existing file; VACE flags do not mix with ``--image``/``--video``."""
    wants_i2v = args.image is not None or args.video is not None
    if wants_vace(args) and wants_i2v:
        raise UsageError("--control-video/--mask/--reference-image (VACE) cannot be combined with --image/--video.")
    if args.mask is not None and args.control_video is None:
        raise UsageError("--mask needs --control-video (it marks which pixels of the control video to generate).")
    paths = [(name, getattr(args, name)) for name in INPUT_FILES]
    paths += [("reference_image", path) for path in args.reference_image or ()]
    for name, path in paths:
        if path is not None and not Path(path).is_file():
            raise UsageError(f"{flag(name)} {path}: no such file.")


def check_output(output: Path) -> None:
    """``--output`` has a video extension imageio writes and is not a directory; its folder exists or can be created
    (tried: the folders made for the probe are removed again), and a file can be written into it."""
    if output.suffix.lower() not in VIDEO_EXTENSIONS:
        got = f"extension {output.suffix!r}" if output.suffix else "no extension"
        raise UsageError(f"--output {output}: {got}; accepted video formats: {', '.join(VIDEO_EXTENSIONS)}.")
    try:
        _check_output_folder(output)
    except OSError as error:  # a name the file system refuses (too long, say) before any folder is made
        raise UsageError(f"--output {output}: cannot be written ({error.strerror or type(error).__name__}).") from None


def _check_output_folder(output: Path) -> None:
    if output.is_dir():
        raise UsageError(f"--output {output}: is a directory; name a video file, e.g. {output / 'video.mp4'}.")
    folder = output.absolute().parent
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    if not folder.is_dir():
        raise UsageError(f"--output {output}: {folder} is a file, not a folder.")
    made = []
    try:
        for path in reversed(missing):
            path.mkdir()
            made.append(path)
        with tempfile.TemporaryFile(dir=made[-1] if made else folder):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        if len(made) < len(missing):
            where = f"cannot create the folder {missing[len(missing) - 1 - len(made)]}"
        else:
            where = f"cannot write into {made[-1] if made else folder}"
        raise UsageError(f"--output {output}: {where} ({reason}).") from None
    finally:
        for path in reversed(made):
            path.rmdir()


def check_model(model: str) -> None:
    """``--model`` is a diffusers pipeline directory, or a Hub id that is cached or can be downloaded (not offline)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "model_index.json").is_file():
            raise UsageError(
                f"--model {model}: not a diffusers pipeline directory (no model_index.json); `fastgen-diffusers "
                "convert` writes one from a research checkpoint."
            )
        return
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        raise UsageError(f"--model {model}: no such directory (and not a Hub id).") from None
    if path.exists():
        raise UsageError(f"--model {model}: is a file; pass the pipeline directory or a Hub id.")
    if isinstance(try_to_load_from_cache(model, "model_index.json"), str):
        return  # in the Hugging Face cache
    if constants.HF_HUB_OFFLINE:
        why = "is not in the Hugging Face cache (offline: HF_HUB_OFFLINE is set)"
        raise UsageError(hub_missing_message(model, why))
    from huggingface_hub import model_info
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    try:  # one quick request (no retries), rather than the loader's retried downloads
        model_info(model, timeout=10)
    except RepositoryNotFoundError:  # also a gated or private repository without access
        raise UsageError(
            f"--model {model}: no such directory, and no Hub repository {model} you can access (a gated or private "
            "one needs `hf auth login`)."
        ) from None
    except HfHubHTTPError:
        return  # the Hub answered; let the loader report what it finds
    except Exception as error:  # noqa: BLE001  (the HTTP client's connection and timeout errors)
        reason = " ".join(str(error).split())[:200] or type(error).__name__
        raise UsageError(
            hub_missing_message(model, f"is not in the Hugging Face cache and the Hub is unreachable ({reason})")
        ) from None


def hub_missing_message(model: str, why: str) -> str:
    """One line: ``--model`` is no local directory, and ``why`` it cannot come from the Hub; how to fetch it."""
    return (
        f"--model {model}: no such directory, and the Hub id {why}; fetch it where there is network "
        f"with `hf download {model}` (older huggingface_hub: `huggingface-cli download {model}`), or pass a local "
        "pipeline directory."
    )


def check_device(device: str | None) -> None:
    """``--device`` parses as a torch device and exists on this machine (a zero-size tensor can live on it)."""
    if device is None:
        return
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device {device}: not a torch device (e.g. cpu, cuda, cuda:1, mps).") from None
    if parsed.type == "meta":
        raise UsageError("--device meta: holds no data; pass a real device (e.g. cpu, cuda).")
    try:
        torch.empty(0, device=parsed)
    except (RuntimeError, AssertionError) as error:  # torch raises AssertionError "Torch not compiled with CUDA"
        reason = " ".join(str(error).split()) or type(error).__name__
        raise UsageError(f"--device {device}: not available on this machine ({reason}).") from None


def check_context_parallel_launch() -> None:
    """``--context-parallel`` runs under ``torchrun`` (one process per GPU) on a machine with CUDA."""
    if "WORLD_SIZE" not in os.environ or "LOCAL_RANK" not in os.environ:
        raise UsageError(
            "--context-parallel runs one process per GPU: launch with `torchrun --nproc_per_node=N "
            "-m fastgen_diffusers generate ...` (torchrun sets WORLD_SIZE and LOCAL_RANK)."
        )
    import torch

    if not torch.cuda.is_available():
        raise UsageError("--context-parallel needs one CUDA GPU per process; CUDA is not available here.")


def read_media(name: str, path: Path, kind: str):
    """``--<name> path`` read with diffusers' loaders: ``kind`` ``"image"`` gives a PIL image, ``"video"`` a list of
    PIL frames; a file they cannot decode is a :class:`UsageError` naming the flag."""
    from diffusers.utils import load_image, load_video

    loader = load_image if kind == "image" else load_video
    if not Path(path).is_file():
        raise UsageError(f"{flag(name)} {path}: no such file.")
    try:
        media = loader(str(path))
    except Exception as error:  # noqa: BLE001  (PIL, imageio and ffmpeg raise many kinds for a bad file)
        reason = " ".join(str(error).split())[:200] or type(error).__name__
        raise UsageError(
            f"{flag(name)} {path}: cannot be read as {'an image' if kind == 'image' else 'a video'} ({reason})."
        ) from None
    if kind == "video" and not media:
        raise UsageError(f"{flag(name)} {path}: the video has no frames.")
    return media
