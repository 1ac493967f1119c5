"""``--decoder taehv PATH`` for ``fastgen-diffusers generate`` and ``serve``: decode (and, for video-to-video, encode)
with the tiny TAEHV autoencoder (``taew2_1.pth`` for Wan2.1's 16 latent channels, ``taew2_2.pth`` for Wan2.2-TI2V's
48) instead of the Wan VAE. Nothing here imports torch at module level (``--help`` is timed)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import UsageError

DECODER_KINDS = ("taehv",)


def add_decoder_arguments(parser: argparse.ArgumentParser, serves: str = "text-to-video and --input-video") -> None:
    parser.add_argument(
        "--decoder",
        nargs=2,
        metavar=("KIND", "PATH"),
        help="decode (and encode video) with a tiny autoencoder instead of the Wan VAE: `taehv PATH` (a released "
        f"taew2_1.pth / taew2_2.pth or its .safetensors copy; {serves})",
    )


def check_decoder_arguments(args: argparse.Namespace, conditioned: bool) -> None:
    """Before any model loads: a known kind and a readable file; ``conditioned``: an image or VACE input, whose
    conditioning needs the Wan VAE's encoder."""
    if args.decoder is None:
        return
    kind, path = args.decoder
    if kind not in DECODER_KINDS:
        raise UsageError(f"--decoder KIND must be one of {', '.join(DECODER_KINDS)}, got {kind!r}.")
    if not Path(path).expanduser().is_file():
        raise UsageError(f"--decoder {kind} {path}: no such file (a taew2_1.pth / taew2_2.pth or .safetensors).")
    if conditioned:
        raise UsageError(
            "--decoder serves text-to-video and --input-video; image and VACE conditioning need the Wan VAE."
        )


def use_decoder(pipe, args: argparse.Namespace):
    """``pipe`` with the tiny autoencoder of ``--decoder`` as its VAE (float32), checked against the transformer's
    latent channels and the Wan VAE's spatial factor."""
    if args.decoder is None:
        return pipe
    from ..models import AutoencoderTinyWan

    kind, path = args.decoder
    try:
        decoder = AutoencoderTinyWan.from_single_file(Path(path).expanduser())
    except ValueError as error:
        raise UsageError(f"--decoder {kind} {path}: {error}") from error
    channels = pipe.transformer.config.out_channels
    if decoder.config.latent_channels != channels:
        raise UsageError(
            f"--decoder {kind} {path}: decodes {decoder.config.latent_channels} latent channels, the model makes "
            f"{channels} (taew2_1 for Wan2.1's 16, taew2_2 for Wan2.2-TI2V's 48)."
        )
    if decoder.config.scale_factor_spatial != pipe.vae_scale_factor_spatial:
        raise UsageError(
            f"--decoder {kind} {path}: upsamples {decoder.config.scale_factor_spatial}x, the model's VAE "
            f"{pipe.vae_scale_factor_spatial}x."
        )
    pipe.register_modules(vae=decoder.to(pipe.device))
    return pipe
