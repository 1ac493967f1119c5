"""Rolling Forcing's rolling-window rollout against the chunk-by-chunk one: forwards per output chunk, time per frame.

Both rollouts generate the same video on the tiny offline model with Rolling Forcing's 5 warped steps (1000, 952.4,
882.4, 769.2, 555.6), in one run:

* chunk by chunk (``kv_cache_policy="sequential"``): 5 denoising forwards of one chunk each, then its cache pass;
* rolling (``kv_cache_policy="rolling"``): one forward per window of up to 5 chunks at staggered levels, then the
  commit of its first chunk (``K + 4`` windows for ``K`` chunks).

Prints the transformer forwards per output chunk (counted) and the median time per output latent frame, and their
ratios, and the latent frames the forwards carried (queries). A rolling forward carries up to 5 chunks (and attends
to 21 frames), so fewer forwards are not fewer FLOPs: both rollouts carry about as many frames, and on the tiny model
the time ratio mostly measures the per-forward overhead saved. ``--tiny`` is a seconds-long smoke test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fastgen_diffusers.convert.formats import warp_timesteps
from fastgen_diffusers.testing import tiny_pipeline

ROLLING_FORCING_STEPS = warp_timesteps([1000, 800, 600, 400, 200], 5.0)
POLICIES = ("sequential", "rolling")


def measure(pipe, policy: str, call: dict, repeats: int) -> tuple[dict[str, int], float, int]:
    """``(forwards by kind and the latent frames they carried, median seconds, latent frames)`` of ``repeats``
    rollouts under ``policy``."""
    counts = {"denoise": 0, "store": 0, "frames": 0}
    forward = pipe.transformer.forward

    def counting(hidden_states, *args, **kwargs):
        counts["store" if kwargs["store_kv"] else "denoise"] += 1
        counts["frames"] += hidden_states.shape[2]
        return forward(hidden_states, *args, **kwargs)

    times = []
    pipe(**call, kv_cache_policy=policy, generator=torch.Generator().manual_seed(0))  # warm-up, untimed
    pipe.transformer.forward = counting
    try:
        for _ in range(repeats):
            counts.update(denoise=0, store=0, frames=0)
            start = time.perf_counter()
            latents = pipe(**call, kv_cache_policy=policy, generator=torch.Generator().manual_seed(0)).frames
            times.append(time.perf_counter() - start)
    finally:
        del pipe.transformer.forward
    return counts, statistics.median(times), latents.shape[2]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-frames", type=int, default=153, help="pixel frames, 4k+1 (153: 13 chunks of 3)")
    parser.add_argument("--size", type=int, default=64, help="height = width in pixels (a multiple of 16)")
    parser.add_argument("--engine", choices=("static", "vanilla"), default="static")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="57 frames at 16x16, one repeat (smoke test)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.num_frames, args.size, args.repeats = 57, 16, 1
    pipe = tiny_pipeline(0)
    pipe.set_progress_bar_config(disable=True)
    call = {
        "prompt": "a cat",
        "height": args.size,
        "width": args.size,
        "num_frames": args.num_frames,
        "timesteps": list(ROLLING_FORCING_STEPS),
        "kv_cache_engine": args.engine,
        "output_type": "latent",
    }
    chunk_size = pipe.transformer.config.chunk_size
    rows = {}
    for policy in POLICIES:
        counts, seconds, frames = measure(pipe, policy, call, args.repeats)
        rows[policy] = (counts, seconds, frames)
    frames = rows["sequential"][2]
    chunks = len(pipe.rollout_chunk_bounds(frames))
    print(
        f"tiny model, {frames} latent frames ({chunks} chunks of {chunk_size}) at {args.size}x{args.size}, "
        f"{len(ROLLING_FORCING_STEPS)} steps, {args.engine} engine, {torch.get_num_threads()} threads, median of "
        f"{args.repeats}"
    )
    per_chunk, per_frame = {}, {}
    for policy, (counts, seconds, _) in rows.items():
        forwards = counts["denoise"] + counts["store"]
        per_chunk[policy] = forwards / chunks
        per_frame[policy] = seconds / frames
        print(
            f"[{policy}] forwards {forwards} ({counts['denoise']} denoising + {counts['store']} cache, carrying "
            f"{counts['frames']} latent frames), {per_chunk[policy]:.2f} per output chunk; {seconds:.3f} s, "
            f"{1000 * per_frame[policy]:.1f} ms per latent frame"
        )
    print(
        f"rolling vs sequential: forwards per chunk x{per_chunk['rolling'] / per_chunk['sequential']:.2f}, "
        f"time per frame x{per_frame['rolling'] / per_frame['sequential']:.2f}"
    )


if __name__ == "__main__":
    main()
