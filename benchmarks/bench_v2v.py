"""Live video-to-video: time to the first output frames from an iterator, and the cost of streamed encoding.

Prints, for the tiny offline components, the median over `--repeats` runs of:
* the seconds until the first chunk's frames are out of `WanCausalVideoToVideoPipeline.stream(video=iterator)`,
  against a whole `__call__` on the same frames as a list;
* the VAE time of encoding chunk by chunk (`StreamingWanEncoder`) against one `vae.encode` of the whole clip.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from fastgen_diffusers import WanCausalVideoToVideoPipeline
from fastgen_diffusers.pipelines.video_io.streaming_encode import StreamingWanEncoder
from fastgen_diffusers.testing import tiny_components


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-frames", type=int, default=45, help="input frames (9 + 12k for chunks of 3)")
    parser.add_argument("--size", type=int, default=32, help="height = width in pixels")
    parser.add_argument("--strength", type=float, default=0.75)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    pipe = WanCausalVideoToVideoPipeline(**tiny_components())
    pipe.set_progress_bar_config(disable=True)
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (args.size, args.size, 3), dtype=np.uint8) for _ in range(args.num_frames)]
    call = {"prompt": "a cat", "strength": args.strength}

    def first_frames():
        stream = pipe.stream(**call, video=iter(frames), generator=torch.Generator().manual_seed(0))
        next(stream)
        stream.close()

    whole = _median_seconds(
        lambda: pipe(**call, video=frames, generator=torch.Generator().manual_seed(0)), args.repeats
    )
    first = _median_seconds(first_frames, args.repeats)

    pixels = torch.stack([torch.from_numpy(f).permute(2, 0, 1).float() / 127.5 - 1 for f in frames], dim=1)[None]
    cuts = [(0, 9)] + [(s, s + 12) for s in range(9, args.num_frames - 11, 12)]

    def streamed_encode():
        with StreamingWanEncoder(pipe.vae) as encoder:
            for start, end in cuts:
                encoder.encode(pixels[:, :, start:end])

    used = pixels[:, :, : cuts[-1][1]]
    with torch.no_grad():
        one_encode = _median_seconds(lambda: pipe.vae.encode(used), args.repeats)
    chunked = _median_seconds(streamed_encode, args.repeats)
    print(
        f"{len(cuts)} chunks, {cuts[-1][1]} frames at {args.size}x{args.size}, strength {args.strength}, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        f"time to first frames (stream from an iterator): {first:.3f} s; whole __call__: {whole:.3f} s; "
        f"ratio {first / whole:.2f}"
    )
    print(
        f"encode chunk by chunk: {chunked:.3f} s; one vae.encode: {one_encode:.3f} s; "
        f"overhead x{chunked / one_encode:.2f}"
    )


if __name__ == "__main__":
    main()
