"""``fastgen-diffusers``: command line front end (``generate``; more subcommands register in :func:`build_parser`)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

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
    parser.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    """Load (or build) the pipeline, generate, write the mp4 and report where, how many frames and how long."""
    from diffusers.utils import export_to_video

    from .pipelines import WanCausalPipeline

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    if args.model is None:
        from .testing import tiny_pipeline

        print(
            "No --model given: using the built-in tiny model with RANDOM weights (a smoke test; the video is noise)."
        )
        pipe = tiny_pipeline()
        defaults = TINY_DEFAULTS
    else:
        pipe = WanCausalPipeline.from_pretrained(args.model, dtype=dtype)
        defaults = REAL_DEFAULTS
    pipe.to(device)
    if pipe.vae.dtype != torch.float32:  # the VAE decodes in float32, as diffusers' Wan examples load it
        pipe.vae.to(torch.float32)
    height = args.height or defaults["height"]
    width = args.width or defaults["width"]
    num_frames = args.num_frames or defaults["num_frames"]

    start = time.perf_counter()
    frames = pipe(
        prompt=args.prompt,
        negative_prompt=args.negative_prompt,
        height=height,
        width=width,
        num_frames=num_frames,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance_scale,
        generator=torch.Generator(device="cpu").manual_seed(args.seed),
    ).frames[0]
    elapsed = time.perf_counter() - start

    args.output.parent.mkdir(parents=True, exist_ok=True)
    export_to_video(list(frames), str(args.output), fps=args.fps)
    print(
        f"Wrote {args.output} ({len(frames)} frames, {width}x{height}, {args.fps} fps): generation took "
        f"{elapsed:.2f} s ({len(frames) / elapsed:.1f} frames/s) on {device}."
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``fastgen-diffusers`` parser: one ``add_<name>_subparser(subparsers)`` per subcommand."""
    parser = argparse.ArgumentParser(
        prog="fastgen-diffusers", description="Causal (chunk-by-chunk, KV-cached) Wan video generation for diffusers."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_subparser in (add_generate_subparser,):
        add_subparser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point: parse ``argv`` (default ``sys.argv[1:]``) and run the chosen subcommand."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
