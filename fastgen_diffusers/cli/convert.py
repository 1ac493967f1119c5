"""``fastgen-diffusers convert``: argparse front end of :mod:`fastgen_diffusers.convert`.

User errors (a missing, empty, truncated or foreign file, a wrong format, unsafe pickles, weights that do not fit the
base) print one ``error:`` message on stderr and exit with status 1, without a traceback. Nothing heavy is imported
until the command runs.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from .common import SETTINGS_FLAGS, add_settings_arguments, one_line

__all__ = ["add_convert_subparser", "run_convert"]

# fastgen_diffusers.convert.core.DTYPE_NAMES (a test keeps them equal): what a safetensors shard holds
DTYPES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def stored_settings_flags() -> tuple[str, ...]:
    """The settings flags ``convert`` takes: those whose setting a converted model stores
    ([`StudentSettings`])."""
    from ..convert.formats import StudentSettings

    stored = {f.name for f in fields(StudentSettings)}
    return tuple(dest for dest, name in SETTINGS_FLAGS.items() if name in stored)


def _formats_epilog() -> str:
    from ..convert.formats import STUDENT_FORMATS

    lines = ["formats (--format, default auto: detected from the file's name, container and key layout):"]
    for row in STUDENT_FORMATS:
        lines.append(f"  {row.name:<26} {row.title} ({', '.join(row.files)})")
    return "\n".join(lines)


def add_convert_subparser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``convert`` on a ``fastgen-diffusers`` subparsers object (``func=run_convert``)."""
    from ..convert.formats import FORMATS

    parser = subparsers.add_parser(
        "convert",
        help="convert a released causal Wan student checkpoint into a causal diffusers pipeline",
        description=(
            "Convert a research checkpoint into a WanCausalPipeline directory (safetensors shards, model card, the "
            "project's sampling settings) that WanCausalPipeline.from_pretrained and "
            "DiffusionPipeline.from_pretrained(..., trust_remote_code=True) load. Checkpoints are read with "
            "torch.load(weights_only=True) or safetensors: a pickle holding anything but tensors and plain "
            "containers is refused and nothing in it runs."
        ),
        epilog=_formats_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--checkpoint", required=True, help="the .pt / .pth / .safetensors file")
    parser.add_argument("--format", choices=FORMATS, default="auto", metavar="FORMAT", help="checkpoint family")
    parser.add_argument(
        "--ema",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="convert the EMA copy or, with --no-ema, the regular one (default: what the project's loader takes)",
    )
    parser.add_argument("--ema-key", default=None, help="name of the weight copy when there are several EMA copies")
    parser.add_argument("--base", required=True, help="diffusers Wan directory or Hub id (text encoder, VAE, config)")
    parser.add_argument(
        "--base-model-id",
        default=None,
        help="Hub id of --base for the model card's base_model (default: --base when it is a Hub id; a local --base "
        "without it gets a card without base_model, and a warning)",
    )
    parser.add_argument("--output", required=True, help="directory to write (must not exist, or be empty)")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        metavar="DTYPE",
        help=f"cast the transformer weights to one of {', '.join(DTYPES)} (default: keep the checkpoint's)",
    )
    parser.add_argument("--max-shard-size", default="5GB", help="transformer shard size (default: 5GB)")
    lora = parser.add_argument_group("LoRA (LongLive's lora.pt)")
    lora.add_argument("--lora", default=None, help="PEFT LoRA file to merge (W + alpha/r B A, in float32)")
    lora.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: the format's, or the rank)")
    lora.add_argument(
        "--keep-lora", action="store_true", help="write the LoRA next to the pipeline for pipe.load_lora_weights"
    )
    sampling = parser.add_argument_group(
        "sampling settings",
        "Stored with the pipeline as its default settings (each left out: the format's released inference config); "
        "a setting the converted model could not sample is refused before anything is written.",
    )
    sampling.add_argument("--chunk-size", type=_positive_int, default=None, help="latent frames per causal chunk")
    sampling.add_argument(
        "--independent-first-frame",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the first latent frame is a chunk of its own",
    )
    sampling.add_argument("--shift", type=float, default=None, help="flow-matching shift")
    sampling.add_argument(
        "--warp-shift",
        type=float,
        default=None,
        help="treat the timesteps as Self-Forcing denoising_step_list indices and warp them with this shift",
    )
    add_settings_arguments(sampling, stored_settings_flags())
    parser.add_argument(
        "--allow-non-finite", action="store_true", help="convert weights holding NaN/Inf instead of refusing them"
    )
    parser.set_defaults(func=run_convert)
    return parser


def run_convert(args: argparse.Namespace) -> int:
    """Run ``fastgen-diffusers convert`` from parsed arguments; prints what was found and written."""
    if args.ema_key is not None and args.ema is False:
        raise SystemExit("error: --ema-key names an EMA copy; it cannot be combined with --no-ema.")
    if args.keep_lora and args.lora is None:
        raise SystemExit("error: --keep-lora keeps the adapter given with --lora; pass --lora too.")
    timesteps, first_chunk, shift = args.timesteps, args.first_chunk_timesteps, args.shift
    if args.warp_shift is not None:
        if timesteps is None and first_chunk is None:
            raise SystemExit("error: --warp-shift warps --timesteps / --first-chunk-timesteps; pass them too.")
        from ..convert.formats import warp_timesteps

        timesteps = None if timesteps is None else warp_timesteps(timesteps, args.warp_shift)
        first_chunk = None if first_chunk is None else warp_timesteps(first_chunk, args.warp_shift)
        shift = args.warp_shift if shift is None else shift

    from ..convert import CheckpointConversionError, convert_checkpoint

    settings = {SETTINGS_FLAGS[dest]: getattr(args, dest) for dest in stored_settings_flags()}
    settings.update(timesteps=timesteps, first_chunk_timesteps=first_chunk)  # warped by --warp-shift

    try:
        result = convert_checkpoint(
            args.checkpoint,
            base=args.base,
            output=args.output,
            format=args.format,
            ema=args.ema_key if args.ema_key is not None else args.ema,
            dtype=args.dtype,
            chunk_size=args.chunk_size,
            shift=shift,
            independent_first_frame=args.independent_first_frame,
            base_model_id=args.base_model_id,
            lora=args.lora,
            lora_alpha=args.lora_alpha,
            keep_lora=args.keep_lora,
            allow_non_finite=args.allow_non_finite,
            max_shard_size=args.max_shard_size,
            **settings,
        )
    except (CheckpointConversionError, OSError, ValueError) as error:
        raise SystemExit(f"error: {one_line(error)}") from None
    print(f"Found {result.description}.")
    print(f"Converted {result.copy!r} to {result.output} ({len(result.shards)} transformer shard(s)).")
    print(f"Stored sampling settings ({result.format}): {result.sampling.as_dict()}")
    if result.pending_settings:
        print(f"Recorded in sampling.json for a later policy (not applied yet): {list(result.pending_settings)}")
    return 0
