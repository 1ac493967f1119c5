"""Time-to-first-frames of `pipe.stream(...)` against a whole `pipe(...)`, and the cost of streamed decoding.

Prints, for the tiny offline pipeline (or `--model`), the median over `--repeats` runs of:
* the seconds until the first chunk's frames are out of `stream()`, and the seconds of a whole `__call__`;
* the VAE time of decoding chunk by chunk (`StreamingWanDecoder`) against one `vae.decode` of the whole video.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fastgen_diffusers.pipelines.video_io.streaming_decode import StreamingWanDecoder
from fastgen_diffusers.testing import tiny_pipeline


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-frames", type=int, default=33)
    parser.add_argument("--size", type=int, default=32, help="height = width in pixels")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    call = {"prompt": "a cat", "height": args.size, "width": args.size, "num_frames": args.num_frames}

    def first_frames():
        stream = pipe.stream(**call, generator=torch.Generator().manual_seed(0))
        next(stream)
        stream.close()

    whole = _median_seconds(lambda: pipe(**call, generator=torch.Generator().manual_seed(0)), args.repeats)
    first = _median_seconds(first_frames, args.repeats)
    latents = pipe(**call, generator=torch.Generator().manual_seed(0), output_type="latent").frames
    bounds = pipe.rollout_chunk_bounds(latents.shape[2])

    def streamed_decode():
        with StreamingWanDecoder(pipe.vae) as decoder:
            for start, end in bounds:
                decoder.decode(latents[:, :, start:end])

    vae = pipe.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        one_decode = _median_seconds(lambda: vae.decode(latents * std + mean), args.repeats)
    chunked = _median_seconds(streamed_decode, args.repeats)
    print(
        f"{len(bounds)} chunks, {args.num_frames} frames at {args.size}x{args.size}, {torch.get_num_threads()} threads"
    )
    print(f"time to first frames (stream): {first:.3f} s; whole __call__: {whole:.3f} s; ratio {first / whole:.2f}")
    print(
        f"decode chunk by chunk: {chunked:.3f} s; one vae.decode: {one_decode:.3f} s; "
        f"overhead x{chunked / one_decode:.2f}"
    )


if __name__ == "__main__":
    main()
