"""Checks of ``fastgen-diffusers generate``'s arguments that need no model, run before anything loads.

A multi-GB load must not precede "num_frames must be 4k+1": :func:`check_generate_arguments` refuses every bad number,
missing file, unwritable output, unknown model path and absent device first, with a :class:`UsageError` naming the
flag, which ``cli.main`` prints as one line. The sampling and cache settings are checked by the settings values
themselves: :func:`generate_settings` builds the pipeline's [`RolloutSettings`] from the flags and the model's stored
settings, and ``cli.layout`` asks them about the rollout's chunks. Nothing here imports the pipelines (the CLI tests
block them while a bad command line runs); torch is imported only to probe ``--device``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from ..settings import POLICIES, RolloutSettings
from .common import SETTINGS_FLAGS, TEMPORAL_FACTOR, UsageError, flag, one_line, stored_settings, transformer_layout

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
    generate_settings(args)
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
    """What the command line alone says about the video: frame count 4k+1, size a positive multiple of 16, positive
    fps, a seed torch takes, ``--prompt-switch`` well formed, an 8-bit cache dtype this torch has. ``None`` frame
    count or size (``--input-video`` without them) is left to the video. The settings (steps, guidance, window, policy,
    ...) are the settings values' to check: :func:`generate_settings`."""
    if args.num_frames is not None and (args.num_frames < 1 or (args.num_frames - 1) % TEMPORAL_FACTOR):
        raise UsageError(f"--num-frames must be 4k+1 (1, 5, 9, ..., 81: whole latent frames), got {args.num_frames}.")
    for name in ("height", "width"):
        value = getattr(args, name)
        if value is not None and (value < SIZE_MULTIPLE or value % SIZE_MULTIPLE):
            raise UsageError(f"{flag(name)} must be a positive multiple of {SIZE_MULTIPLE}, got {value}.")
    _at_least(args, "fps", 1)
    if not 0 <= args.seed < 2**64:
        raise UsageError(f"--seed must be in [0, 2**64), got {args.seed}.")
    check_prompt_switches(args)
    check_kv_cache_dtype(args)


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
    """``--prompt-switch`` well formed; ``--prompt-transition-chunks`` only with a ``--prompt-switch`` (where each
    switch takes effect is the settings' rule, checked once the chunks are known: ``cli.layout``)."""
    switches = prompt_switches(args)
    if getattr(args, "prompt_transition_chunks", None) is not None and not switches:
        raise UsageError("--prompt-transition-chunks needs a --prompt-switch FRAME:PROMPT to blend in.")


def check_kv_cache_dtype(args: argparse.Namespace) -> None:
    """``--kv-cache-dtype float8_e4m3fn`` needs a torch with that dtype (``int8`` always works)."""
    name = getattr(args, "kv_cache_dtype", None)
    if name is None:
        return
    import torch

    if getattr(torch, name, None) is None:
        raise UsageError(f"--kv-cache-dtype {name} needs a torch with {name} (torch {torch.__version__}); use int8.")


# Inputs of the image-to-video and VACE pipelines, which condition their chunks by frame; with `--input-video` the
# video-to-video pipeline, whose rollout is its own (not chunk by chunk). Which policies a pipeline runs is the
# policy's to say (`PolicySettings.runs_on`).
VACE_INPUTS = ("control_video", "mask", "reference_image")
CONDITIONED_INPUTS = ("image", "video", *VACE_INPUTS)


def settings_arguments(args: argparse.Namespace) -> dict:
    """The settings of the command line: ``{settings argument: value}`` of every settings flag given (a flag left out
    is ``None``: the model's stored value stands). The pipeline call takes them as its keyword arguments."""
    values = {name: getattr(args, dest, None) for dest, name in SETTINGS_FLAGS.items()}
    return {name: value for name, value in values.items() if value is not None}


def _pipeline_inputs(args: argparse.Namespace) -> tuple[list[str], bool, bool]:
    """The conditioning flags given, whether the pipeline they pick conditions its chunks by frame, and whether its
    default rollout is chunk by chunk (not video-to-video)."""
    given = [name for name in (*CONDITIONED_INPUTS, "input_video") if getattr(args, name, None)]
    conditions = any(name in CONDITIONED_INPUTS for name in given)
    return given, conditions, getattr(args, "input_video", None) is None


def _pipeline_name(given: list[str]) -> str:
    """The pipeline class the conditioning flags ``given`` pick."""
    if "input_video" in given:
        return "WanCausalVideoToVideoPipeline"
    if any(name in VACE_INPUTS for name in given):
        return "WanCausalVACEPipeline"
    return "WanCausalImageToVideoPipeline" if given else "WanCausalPipeline"


def stored_rollout_settings(args: argparse.Namespace) -> RolloutSettings | None:
    """The settings ``--model`` stores (its ``model_index.json``, as ``from_pretrained`` reads them; the built-in tiny
    model stores none), as the pipeline the flags pick uses them: a stored policy it cannot run is left out (it
    samples chunk by chunk). ``UsageError`` for stored settings the pipeline would refuse to load (the transformer's
    chunking included); ``None`` when the files are not at hand (the pipeline checks then)."""
    from .i2v import wants_i2v

    config = stored_settings(args.model)
    if config is None:
        return None
    try:
        stored = RolloutSettings.from_config(config)
        layout = transformer_layout(args.model, image_to_video=wants_i2v(args))
        if layout is not None:
            stored.cache.check_chunk_size(layout["chunk_size"], layout["independent_first_frame"])
    except ValueError as error:
        raise UsageError(f"--model {args.model}: its stored settings cannot be sampled: {error}") from None
    _, conditions, sequential = _pipeline_inputs(args)
    if stored.policy is not None and not type(stored.policy).runs_on(conditions, sequential):
        stored = stored.without_policy()
    return stored


def generate_settings(args: argparse.Namespace) -> RolloutSettings | None:
    """The [`RolloutSettings`] the pipeline will sample with: the flags over ``--model``'s stored settings, field by
    field ([`RolloutSettings.with_arguments`], as the pipelines' ``resolve_options`` builds them), checked by the
    values themselves. A refusal is a :class:`UsageError` with the settings' message (which names the stored settings
    when they take part). ``None`` when the stored settings are not at hand (the pipeline checks after loading)."""
    arguments = settings_arguments(args)
    policy = arguments.get("kv_cache_policy")
    given, conditions, sequential = _pipeline_inputs(args)
    if policy in POLICIES:
        try:
            POLICIES[policy].check_runs_on(_pipeline_name(given), conditions, sequential)
        except ValueError as error:
            raise UsageError(f"{error} (the pipeline of {flag(given[0])})") from None
    stored = stored_rollout_settings(args)
    if stored is None:
        return None
    switches = sorted(prompt_switches(args))
    try:
        return stored.with_arguments(arguments, switch_frames=switches)
    except ValueError as error:
        message = str(error)
    try:  # the flags alone: the same refusal is theirs; otherwise the stored settings take part
        RolloutSettings().with_arguments(arguments, switch_frames=switches)
    except ValueError as error:
        if str(error) == message:
            raise UsageError(message) from None
    stored_values = ", ".join(f"{k}={v!r}" for k, v in stored.to_config().items() if v is not None)
    raise UsageError(f"{message} (--model {args.model} stores {stored_values})") from None


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
        reason = one_line(error, 200)
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
        reason = one_line(error)
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
        reason = one_line(error, 200)
        raise UsageError(
            f"{flag(name)} {path}: cannot be read as {'an image' if kind == 'image' else 'a video'} ({reason})."
        ) from None
    if kind == "video" and not media:
        raise UsageError(f"{flag(name)} {path}: the video has no frames.")
    return media
