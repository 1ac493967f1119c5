"""Krea's KV recompute: per-chunk time against the plain windowed rollout, V2V time to first frames, flat memory.

One run on the tiny offline components (CPU), printing ratios measured in that run:

* per-chunk time (median over the chunks after the first, timed between the chunks a ``stream()`` yields) of
  ``kv_cache_policy="recompute"`` against the sequential rollout attending to as many frames
  (``attention_window = context_frames + chunk``): both run ``steps + 1`` forwards a chunk (the rebuild over the
  context replaces the windowed rollout's cache pass over the finished chunk), plus the cache clears. The re-encoded
  anchor adds a VAE decode of every chunk and an encode of one frame; with frames as output (``np``) that decode is
  the output's own, so the ``np`` rows are the fair comparison for a live stream;
* time to the first output frames of `WanCausalVideoToVideoPipeline.stream(video=iterator)` against a whole
  ``__call__`` on the same frames, sequential and under recompute;
* memory over ``--memory-chunks`` chunks (50): the KV-cache bytes of the engines and the process RSS after chunk
  ``--memory-first`` (10) and after the last, for a recompute T2V stream (re-encoded anchors) and a recompute V2V
  stream fed by an iterator.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator

import numpy as np
import torch
from diffusers.utils import logging

from fastgen_diffusers import WanCausalVideoToVideoPipeline
from fastgen_diffusers.testing import tiny_pipeline


def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def per_chunk_seconds(stream: Iterator) -> float:
    """Median seconds between the chunks of ``stream`` after the first one."""
    times, last = [], time.perf_counter()
    for index, _ in enumerate(stream):
        now = time.perf_counter()
        if index > 0:
            times.append(now - last)
        last = now
    return statistics.median(times)


def frames(count: int, size: int, seed: int = 0) -> Iterator[np.ndarray]:
    rng = np.random.default_rng(seed)
    for _ in range(count):
        yield rng.integers(0, 256, (size, size, 3), dtype=np.uint8)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=64, help="height = width in pixels")
    parser.add_argument("--chunks", type=int, default=12, help="chunks of the per-chunk timing runs")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per chunk")
    parser.add_argument("--context-frames", type=int, default=3)
    parser.add_argument("--memory-chunks", type=int, default=50, help="chunks of the memory runs")
    parser.add_argument("--memory-first", type=int, default=10, help="chunk after which memory is first read")
    args = parser.parse_args(argv)
    logging.set_verbosity_error()  # `from_pipe`'s dtype notes
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    chunk = pipe.transformer.config.chunk_size
    context = args.context_frames
    base = {"prompt": "a cat", "height": args.size, "width": args.size, "num_inference_steps": args.steps}
    recompute = {"kv_cache_policy": "recompute", "context_frames": context}
    print(
        f"tiny model, {args.size}x{args.size}, chunks of {chunk} latent frames, {args.steps} steps, context "
        f"{context}, {torch.get_num_threads()} threads"
    )

    # 1. per-chunk time
    num_frames = 1 + 4 * (args.chunks * chunk - 1)
    rows = {
        "windowed": {"attention_window": context + chunk},
        "recompute, keep_first_frame": {**recompute, "keep_first_frame": True},
        "recompute, re-encoded anchor": recompute,
    }
    for output_type in ("latent", "np"):
        timed = {}
        for name, options in rows.items():
            stream = pipe.stream(
                **base, **options, num_frames=num_frames, output_type=output_type,
                generator=torch.Generator().manual_seed(0),
            )  # fmt: skip
            timed[name] = per_chunk_seconds(stream)
        reference = timed["windowed"]
        line = ", ".join(
            f"{name} {seconds * 1e3:.1f} ms (x{seconds / reference:.2f})" for name, seconds in timed.items()
        )
        print(f"per-chunk time, output {output_type}: {line}")

    # 2. V2V: time to first frames from an iterator vs the whole call
    v2v = WanCausalVideoToVideoPipeline.from_pipe(pipe)
    v2v.set_progress_bar_config(disable=True)
    clip = list(frames(num_frames, args.size))
    v2v_base = {"prompt": "a cat", "strength": 0.7, "num_inference_steps": args.steps}
    for name, options in (("sequential", {}), ("recompute", recompute)):
        start = time.perf_counter()
        stream = v2v.stream(**v2v_base, **options, video=iter(clip), generator=torch.Generator().manual_seed(0))
        next(stream)
        first = time.perf_counter() - start
        stream.close()
        start = time.perf_counter()
        v2v(**v2v_base, **options, video=clip, generator=torch.Generator().manual_seed(0))
        whole = time.perf_counter() - start
        print(
            f"V2V {name}: first frames from an iterator after {first:.3f} s; whole call {whole:.3f} s "
            f"({len(clip)} frames); ratio {first / whole:.3f}"
        )

    # 3. memory over many chunks
    long_frames = 1 + 4 * (args.memory_chunks * chunk - 1)
    runs = {
        "recompute T2V stream": lambda: pipe.stream(
            **base, **recompute, num_frames=long_frames, output_type="np", generator=torch.Generator().manual_seed(0)
        ),
        "recompute V2V stream": lambda: v2v.stream(
            **v2v_base, **recompute, video=frames(long_frames, args.size), generator=torch.Generator().manual_seed(0)
        ),
    }
    for name, make in runs.items():
        readings = {}
        count = 0
        for count, _ in enumerate(make(), start=1):
            if count in (args.memory_first, args.memory_chunks):
                readings[count] = (pipe.transformer.kv_cache_bytes(), rss_bytes())
        (bytes_a, rss_a), (bytes_b, rss_b) = readings[args.memory_first], readings[args.memory_chunks]
        print(
            f"{name}, {count} chunks: engine bytes after chunk {args.memory_first} {bytes_a}, after chunk "
            f"{args.memory_chunks} {bytes_b} (equal: {bytes_a == bytes_b}); RSS {rss_a / 2**20:.1f} MiB -> "
            f"{rss_b / 2**20:.1f} MiB ({(rss_b - rss_a) / 2**20:+.1f} MiB)"
        )


if __name__ == "__main__":
    main()
