"""One chunk's streamed decode: the tiny TAEHV decoder against the Wan2.1 VAE, both at full architecture size.

Random weights (timing does not depend on them): diffusers' `AutoencoderKLWan()` (the Wan2.1 VAE's default config) and
`AutoencoderTinyWan` in the `taew2_1` layout. Each decodes a first chunk of `--chunk` latent frames, then the median
over `--repeats` of a following chunk (the steady state of a stream: 4 * chunk frames), with
[`StreamingWanDecoder`] / [`StreamingTinyWanDecoder`] as the pipelines use them; float32 on a CPU, `--dtype` on a GPU.
Prints one line per decoder and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import synchronize
from diffusers import AutoencoderKLWan

from fastgen_diffusers.pipelines.video_io.autoencoders import streaming_decoder
from fastgen_diffusers.testing import tiny_taehv


@torch.no_grad()
def chunk_seconds(vae, latents: torch.Tensor, chunk: int, repeats: int) -> float:
    """Median seconds of decoding the chunk after the first (a fresh stream for each repeat)."""
    times = []
    for _ in range(repeats):
        with streaming_decoder(vae) as decoder:
            decoder.decode(latents[:, :, :chunk])
            synchronize(latents.device)
            start = time.perf_counter()
            decoder.decode(latents[:, :, chunk : 2 * chunk])
            synchronize(latents.device)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--height", type=int, default=240, help="pixels, a multiple of 8")
    parser.add_argument("--width", type=int, default=416, help="pixels, a multiple of 8")
    parser.add_argument("--chunk", type=int, default=3, help="latent frames per chunk")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on a CPU, bfloat16 on a GPU")
    parser.add_argument("--small-wan", action="store_true", help="a narrow Wan VAE (smoke tests), not Wan2.1's")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    torch.manual_seed(0)
    wan_config = {"base_dim": 8, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1} if args.small_wan else {}
    wan, tiny = AutoencoderKLWan(**wan_config).eval().to(device), tiny_taehv().to(device)
    if dtype != torch.float32:
        wan, tiny = wan.to(dtype), tiny.to(dtype)
    latents = torch.randn(1, 16, 2 * args.chunk, args.height // 8, args.width // 8, device=device, dtype=dtype)
    frames = 4 * args.chunk
    where = f"{args.height}x{args.width}, {frames} frames, {device.type}, {str(dtype).removeprefix('torch.')}"
    wan_seconds = chunk_seconds(wan, latents, args.chunk, args.repeats)
    tiny_seconds = chunk_seconds(tiny, latents, args.chunk, args.repeats)
    wan_name = "small Wan VAE" if args.small_wan else "Wan2.1 VAE"
    print(
        f"{wan_name} streamed decode of one chunk ({where}): {wan_seconds:.3f} s ({frames / wan_seconds:.1f} frames/s)"
    )
    print(f"TAEHV streamed decode of one chunk ({where}): {tiny_seconds:.3f} s ({frames / tiny_seconds:.1f} frames/s)")
    speedup = wan_seconds / tiny_seconds
    print(f"tiny / Wan VAE time: {tiny_seconds / wan_seconds:.3f} (the tiny decoder {speedup:.1f}x faster)")


if __name__ == "__main__":
    main()
