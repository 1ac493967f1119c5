"""``fastgen-diffusers``: command line front end (``generate``; more subcommands register in :func:`build_parser`).

Importing this module, building the parser and ``--help`` import neither torch nor diffusers: the heavy stack loads
inside the run path only. :func:`main` prints a user error as one line on stderr and exits non-zero (status 2 for a bad
command line, found before any model loads; 1 for an error the pipeline reports); ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

from .. import __version__
from .checks import (
    UsageError,
    check_generate_arguments,
    check_prompt_switches,
    prompt_switches,
    read_media,
    settings_arguments,
    wants_vace,
)
from .common import DTYPES, add_settings_arguments, device_and_dtype, flag, one_line, vae_in_float32
from .convert import add_convert_subparser
from .decoder import add_decoder_arguments, check_decoder_arguments, use_decoder
from .i2v import add_image_arguments, conditioning_kwargs, load_i2v_pipeline, wants_i2v
from .layout import check_rollout_layout
from .serve import add_serve_subparser
from .v2v import add_input_video_arguments, input_video_kwargs, load_v2v_pipeline, strength_argument, wants_v2v

CONTEXT_PARALLEL_MODES = ("ulysses",)  # fastgen_diffusers.parallel.CONTEXT_PARALLEL_MODES (a test keeps them equal)


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line: ``<prog>: error: <message> (see <prog> --help)``."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def add_generate_subparser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``generate``: text-to-video with a causal Wan student, written to a video file."""
    parser = subparsers.add_parser(
        "generate",
        help="generate a video from a prompt with a causal Wan model",
        description="Text-to-video with WanCausalPipeline. Without --model, runs the built-in tiny model with random "
        "weights (offline, a few seconds on a CPU): a smoke test of the whole path, whose video is a nearly uniform "
        "blue-grey square (random weights draw no picture). Every "
        "argument that needs no model is checked before the model loads.",
    )
    parser.add_argument("--prompt", required=True, help="text prompt")
    parser.add_argument(
        "--output",
        type=Path,
        default=Path("output.mp4"),
        help="video to write: .mp4, .mkv, .mov, .avi or .gif (default: output.mp4)",
    )
    parser.add_argument("--model", help="diffusers Wan directory or Hub id (default: the tiny random model)")
    parser.add_argument("--num-frames", type=int, help="pixel frames, 4k+1 (default: 81; 21 for the tiny model)")
    parser.add_argument("--height", type=int, help="multiple of 16 (default: 480; 64 for the tiny model)")
    parser.add_argument("--width", type=int, help="multiple of 16 (default: 832; 64 for the tiny model)")
    parser.add_argument("--negative-prompt", help="negative prompt, used when --guidance-scale > 1")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--fps", type=int, default=16, help="frames per second of the video (default: 16)")
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        help="model dtype of --model (default: bfloat16 on cuda, float32 otherwise; the tiny model runs in float32)",
    )
    settings = parser.add_argument_group(
        "sampling and cache settings",
        "Each flag left out takes the model's stored setting (`fastgen-diffusers convert` stores the release's), else "
        "the default named below; the help of each is the setting's own documentation (fastgen_diffusers.settings).",
    )
    settings.add_argument(
        "--prompt-switch",
        action="append",
        metavar="FRAME:PROMPT",
        help="switch to PROMPT at pixel frame FRAME (repeatable; --prompt holds from frame 0)",
    )
    add_settings_arguments(settings)
    parser.add_argument(
        "--stream", action="store_true", help="write frames to the video as chunks finish; print time to first frames"
    )
    parser.add_argument(
        "--context-parallel",
        choices=CONTEXT_PARALLEL_MODES,
        help="split the model over the GPUs of a `torchrun --nproc_per_node=N` launch",
    )
    add_image_arguments(parser)
    vace = parser.add_argument_group("VACE control (WanCausalVACEPipeline)")
    vace.add_argument("--control-video", type=Path, help="control video (mp4/gif) at the output size")
    vace.add_argument("--mask", type=Path, help="mask video for --control-video (white = generate)")
    vace.add_argument("--reference-image", type=Path, action="append", help="reference image (repeatable)")
    add_input_video_arguments(parser)
    add_decoder_arguments(parser)
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    parser.set_defaults(func=run_generate)


def _load_pipeline(args: argparse.Namespace, dtype):
    """The pipeline the flags ask for (T2V, image-to-video, VACE or video-to-video), from ``--model`` or the tiny
    random model."""
    from .. import testing
    from ..pipelines import WanCausalPipeline, WanCausalVACEPipeline

    if args.model is None:
        print(
            "No --model given: using the built-in tiny model with RANDOM weights (a smoke test; the video is a nearly "
            "uniform blue-grey square)."
        )
    if wants_i2v(args):
        return load_i2v_pipeline(args, dtype)
    if wants_v2v(args):
        return load_v2v_pipeline(args, dtype)
    if wants_vace(args):
        if args.model is None:
            return testing.tiny_vace_pipeline()
        return WanCausalVACEPipeline.from_pretrained(args.model, dtype=dtype)
    if args.model is None:
        return testing.tiny_pipeline()
    return WanCausalPipeline.from_pretrained(args.model, dtype=dtype)


def _load_or_explain(args: argparse.Namespace, dtype):
    """:func:`_load_pipeline`; a Hub id that cannot be fetched (not cached, no network, say) says how to fetch it."""
    from .checks import hub_missing_message

    try:
        return _load_pipeline(args, dtype)
    except OSError as error:
        if args.model is None or Path(args.model).expanduser().is_dir():
            raise
        why = f"cannot be loaded from the Hub or the local cache ({one_line(error, 300)})"
        raise UsageError(hub_missing_message(args.model, why)) from error


def _vace_kwargs(args: argparse.Namespace) -> dict:
    """``video`` / ``mask`` / ``reference_images`` read from the VACE flags, before the model loads: a file that does
    not decode, or a control video or mask shorter than ``--num-frames`` or not at the output size, names its flag."""
    kwargs = {}
    for name, key in (("control_video", "video"), ("mask", "mask")):
        path = getattr(args, name)
        if path is None:
            continue
        frames = read_media(name, path, "video")
        option = flag(name)
        if len(frames) < args.num_frames:
            raise UsageError(f"{option} {path}: has {len(frames)} frames, fewer than --num-frames {args.num_frames}.")
        if frames[0].size != (args.width, args.height):
            width, height = frames[0].size
            raise UsageError(
                f"{option} {path}: frames are {width}x{height}, the output is {args.width}x{args.height} (--width x "
                "--height); resize the video or pass its size."
            )
        kwargs[key] = frames
    for path in args.reference_image or ():
        kwargs.setdefault("reference_images", []).append(read_media("reference_image", path, "image"))
    return kwargs


def run_generate(args: argparse.Namespace) -> int:
    """Check the arguments, read the input media, load (or build) the pipeline, generate, write the video and report
    where, how many frames and how long."""
    check_generate_arguments(args)  # before anything heavy loads
    check_decoder_arguments(args, conditioned=wants_i2v(args) or wants_vace(args))
    inputs = {**conditioning_kwargs(args), **_vace_kwargs(args), **input_video_kwargs(args)}
    check_prompt_switches(args)  # again, now that --input-video has set the frame count
    given = 1 if "image" in inputs else len(inputs["video"]) if "video" in inputs and wants_i2v(args) else None
    check_rollout_layout(args, given)  # the chunks are known now: what the pipeline would refuse about them, pre-load

    import torch
    from diffusers.utils import export_to_video

    from ..pipelines.rollout.live import stream_to_video

    device, dtype = device_and_dtype(args.device, args.dtype)
    pipe = _load_or_explain(args, dtype)
    main_process = True
    if args.context_parallel:
        from ..parallel import setup_context_parallel

        setup = setup_context_parallel(pipe, args.context_parallel)  # moves the pipeline to cuda:LOCAL_RANK
        device, main_process = setup.device, setup.main
    else:
        pipe.to(device)
    pipe = use_decoder(vae_in_float32(pipe), args)  # --decoder taehv PATH: the tiny autoencoder as the VAE
    call_kwargs = {
        "prompt": args.prompt,
        "negative_prompt": args.negative_prompt,
        "height": args.height,
        "width": args.width,
        "num_frames": args.num_frames,
        "generator": torch.Generator(device="cpu").manual_seed(args.seed),
        **inputs,
    }
    if wants_v2v(args):  # the output length is the input video's (its whole chunks)
        del call_kwargs["num_frames"]
        call_kwargs["strength"] = strength_argument(args)
    call_kwargs.update(settings_arguments(args))  # the flags given; the model's stored settings fill the rest
    if args.prompt_switch:
        call_kwargs["prompt"] = {0: args.prompt, **prompt_switches(args)}

    args.output.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if args.stream:
        first_frames = lambda count, seconds: print(f"First {count} frames after {seconds:.2f} s.")  # noqa: E731
        written, first, elapsed = stream_to_video(
            pipe, str(args.output), fps=args.fps, on_first_frames=first_frames, **call_kwargs
        )
        print(f"Streamed {written} frames; the first after {first:.2f} s.")
    else:
        frames = pipe(**call_kwargs).frames
        elapsed = time.perf_counter() - start
        if not main_process:
            return 0  # under context parallelism only the main process decodes and writes
        written = len(frames[0])
        export_to_video(list(frames[0]), str(args.output), fps=args.fps)
    print(
        f"Wrote {args.output} ({written} frames, {args.width}x{args.height}, {args.fps} fps): generation took "
        f"{elapsed:.2f} s ({written / elapsed:.1f} frames/s) on {device}."
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``fastgen-diffusers`` parser: one ``add_<name>_subparser(subparsers)`` per subcommand. Building it must
    stay light (no torch/diffusers import at module level of a subcommand's argparse module): ``--help`` is timed."""
    parser = ArgumentParser(
        prog="fastgen-diffusers", description="Causal (chunk-by-chunk, KV-cached) Wan video generation for diffusers."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_subparser in (add_generate_subparser, add_convert_subparser, add_serve_subparser):
        add_subparser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point: parse ``argv`` (default ``sys.argv[1:]``) and run the chosen subcommand.

    A user error (:class:`UsageError`, a pipeline's ``ValueError``, an ``OSError`` such as a full disk) is printed as
    one line on stderr: exit status 2 for a bad command line, 1 otherwise. Any other exception is a bug and keeps its
    traceback; ``--debug`` also prints the traceback of a user error (same exit status).
    """
    args = build_parser().parse_args(argv)
    prog = f"fastgen-diffusers {args.command}"
    try:
        return args.func(args)
    except (UsageError, ValueError, OSError) as error:
        if getattr(args, "debug", False):
            traceback.print_exc()
        hint = (
            "" if getattr(args, "debug", False) or isinstance(error, UsageError) else " (--debug shows the traceback)"
        )
        print(f"{prog}: error: {one_line(error)}{hint}", file=sys.stderr)
        return 2 if isinstance(error, UsageError) else 1
    except KeyboardInterrupt:
        if getattr(args, "debug", False):
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
