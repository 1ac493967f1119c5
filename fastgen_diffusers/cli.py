"""``fastgen-diffusers``: command line front end (``generate``; more subcommands register in :func:`build_parser`)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from .cli_i2v import add_image_arguments, conditioning_kwargs, load_i2v_pipeline, wants_i2v
from .convert import add_convert_subparser
from .parallel import CONTEXT_PARALLEL_MODES, setup_context_parallel

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Defaults for a real model (Wan2.1 480p) and for the built-in tiny random model (a seconds-long CPU smoke test).
REAL_DEFAULTS = {"height": 480, "width": 832, "num_frames": 81}
TINY_DEFAULTS = {"height": 64, "width": 64, "num_frames": 21}


def add_generate_subparser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``generate``: text-to-video with a causal Wan student, written to an mp4."""
    parser = subparsers.add_parser(
        "generate",
        help="generate a video from a prompt with a causal Wan model",
        description="Text-to-video with WanCausalPipeline. Without --model, runs the built-in tiny model with random "
        "weights (offline, a few seconds on a CPU): a smoke test of the whole path, the video is noise.",
    )
    parser.add_argument("--prompt", required=True, help="text prompt")
    parser.add_argument("--output", type=Path, default=Path("output.mp4"), help="mp4 to write (default: output.mp4)")
    parser.add_argument("--model", help="diffusers Wan directory or Hub id (default: the tiny random model)")
    parser.add_argument("--num-frames", type=int, help="pixel frames, 4k+1 (default: 81; 21 for the tiny model)")
    parser.add_argument("--height", type=int, help="multiple of 16 (default: 480; 64 for the tiny model)")
    parser.add_argument("--width", type=int, help="multiple of 16 (default: 832; 64 for the tiny model)")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per chunk (default: 4)")
    parser.add_argument("--guidance-scale", type=float, default=1.0, help="CFG weight; 1 disables CFG (default)")
    parser.add_argument("--negative-prompt", help="negative prompt, used when --guidance-scale > 1")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--fps", type=int, default=16, help="frames per second of the mp4 (default: 16)")
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="model dtype of --model (default: bfloat16 on cuda, float32 otherwise; the tiny model runs in float32)",
    )
    long_videos = parser.add_argument_group("long videos")
    long_videos.add_argument(
        "--attention-window", type=int, help="sliding attention window in latent frames (memory stays flat)"
    )
    long_videos.add_argument("--sink-frames", type=int, default=0, help="first latent frames kept inside the window")
    parser.add_argument(
        "--stream", action="store_true", help="write frames to the mp4 as chunks finish; print time to first frames"
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
    parser.set_defaults(func=run_generate)


def _wants_vace(args: argparse.Namespace) -> bool:
    return any(getattr(args, name) for name in ("control_video", "mask", "reference_image"))


def _load_pipeline(args: argparse.Namespace, dtype: torch.dtype):
    """The pipeline the flags ask for (T2V, image-to-video or VACE), from ``--model`` or the tiny random model."""
    from . import testing
    from .pipelines import WanCausalPipeline, WanCausalVACEPipeline

    if _wants_vace(args) and wants_i2v(args):
        raise ValueError("--control-video/--mask/--reference-image (VACE) cannot be combined with --image/--video.")
    if args.model is None:
        print(
            "No --model given: using the built-in tiny model with RANDOM weights (a smoke test; the video is noise)."
        )
    if wants_i2v(args):
        return load_i2v_pipeline(args, dtype)
    if _wants_vace(args):
        if args.model is None:
            return testing.tiny_vace_pipeline()
        return WanCausalVACEPipeline.from_pretrained(args.model, dtype=dtype)
    if args.model is None:
        return testing.tiny_pipeline()
    return WanCausalPipeline.from_pretrained(args.model, dtype=dtype)


def _vace_kwargs(args: argparse.Namespace) -> dict:
    """``video`` / ``mask`` / ``reference_images`` loaded from the VACE flags (a missing file names the flag)."""
    from diffusers.utils import load_image, load_video

    kwargs = {}
    for flag, name in (("control_video", "video"), ("mask", "mask")):
        path = getattr(args, flag)
        if path is not None:
            if not path.is_file():
                raise ValueError(f"--{flag.replace('_', '-')} {path}: no such file.")
            kwargs[name] = load_video(str(path))
    for path in args.reference_image or ():
        if not path.is_file():
            raise ValueError(f"--reference-image {path}: no such file.")
        kwargs.setdefault("reference_images", []).append(load_image(str(path)))
    return kwargs


def run_generate(args: argparse.Namespace) -> int:
    """Load (or build) the pipeline, generate, write the mp4 and report where, how many frames and how long."""
    from diffusers.utils import export_to_video

    from .pipelines.live import stream_to_video

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    pipe = _load_pipeline(args, dtype)
    defaults = TINY_DEFAULTS if args.model is None else REAL_DEFAULTS
    main_process = True
    if args.context_parallel:
        setup = setup_context_parallel(pipe, args.context_parallel)  # moves the pipeline to cuda:LOCAL_RANK
        device, main_process = setup.device, setup.main
    else:
        pipe.to(device)
    if pipe.vae.dtype != torch.float32:  # the VAE decodes in float32, as diffusers' Wan examples load it
        pipe.vae.to(torch.float32)
    height = args.height or defaults["height"]
    width = args.width or defaults["width"]
    num_frames = args.num_frames or defaults["num_frames"]
    call_kwargs = {
        "prompt": args.prompt,
        "negative_prompt": args.negative_prompt,
        "height": height,
        "width": width,
        "num_frames": num_frames,
        "num_inference_steps": args.steps,
        "guidance_scale": args.guidance_scale,
        "generator": torch.Generator(device="cpu").manual_seed(args.seed),
        **conditioning_kwargs(args),
        **_vace_kwargs(args),
    }
    if args.attention_window is not None:
        call_kwargs.update(attention_window=args.attention_window, sink_frames=args.sink_frames)

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
        f"Wrote {args.output} ({written} frames, {width}x{height}, {args.fps} fps): generation took "
        f"{elapsed:.2f} s ({written / elapsed:.1f} frames/s) on {device}."
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``fastgen-diffusers`` parser: one ``add_<name>_subparser(subparsers)`` per subcommand."""
    parser = argparse.ArgumentParser(
        prog="fastgen-diffusers", description="Causal (chunk-by-chunk, KV-cached) Wan video generation for diffusers."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_subparser in (add_generate_subparser, add_convert_subparser):
        add_subparser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point: parse ``argv`` (default ``sys.argv[1:]``) and run the chosen subcommand."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
